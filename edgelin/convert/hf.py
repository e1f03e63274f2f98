"""transformers checkpoints: Qwen3.5's language model (Gated DeltaNet + gated attention) and Mamba2."""

from __future__ import annotations

import math
from typing import Any

import torch

from edgelin.convert.base import ConfigReader, Converter, Weights, as_float, split_rows, token_id
from edgelin.model.config import AttentionConfig, ModelConfig
from edgelin.rules import FLAG, POSITIVE, SIZE, Rule, invalid

Tensor = torch.Tensor


def _plus_one(t: Tensor) -> Tensor:
    """Qwen3.5's zero-centred RMSNorm multiplies by (1 + w); edgelin's by w."""
    return t + 1.0


def _divides(cfg: ConfigReader, small: str, big: str) -> None:
    """Grouped heads: `small` heads shared by equal groups of `big` heads."""
    if cfg.data[big] % cfg.data[small]:
        raise invalid(small, cfg.data[small], f"a divisor of {big}={cfg.data[big]}", cfg.source)


# ---- Qwen3.5 (qwen3_5_text, and the text tower of qwen3_5) ------------------------------------
# transformers remaps legacy layer names (configuration_utils._LEGACY_LAYER_TYPE_REMAP) before the model reads them.
QWEN_LAYERS = {"linear_attention": "gated_deltanet", "full_attention": "softmax", "mamba": "gated_deltanet",
               "attention": "softmax"}


def _qwen_rope(cfg: ConfigReader) -> tuple[float, float]:
    """(rope_theta, partial_rotary_factor) as transformers 5.24 resolves them: rope_scaling, else
    rope_parameters, with the top-level rope_theta / partial_rotary_factor (Qwen3.5: 0.25) as defaults."""
    scaling, parameters = cfg.get("rope_scaling"), cfg.get("rope_parameters")
    rope = scaling or parameters or {}
    if not isinstance(rope, dict) or any(isinstance(v, dict) for v in rope.values()):
        raise invalid("rope_parameters", rope, "an object {rope_type, rope_theta, partial_rotary_factor} "
                      "(one for all layers)", cfg.source)
    if rope.get("rope_type", "default") != "default":
        cfg.expect("rope_type", "default", "scaled rotary embeddings", default=rope.get("rope_type"))
    theta = rope.get("rope_theta", cfg.get("rope_theta", 10000.0))
    factor = rope.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 0.25))
    cfg.check("rope_theta", theta, POSITIVE)
    cfg.check("partial_rotary_factor", factor, Rule("float", above=0, high=1))
    return float(theta), float(factor)


def _qwen_layer_types(cfg: ConfigReader) -> list[str]:
    types = cfg.get("layer_types")
    if types is None:  # Qwen3_5TextConfig.__post_init__: every full_attention_interval-th layer is full attention
        interval = cfg.get("full_attention_interval", 4, SIZE)
        return ["linear_attention" if (i + 1) % interval else "full_attention"
                for i in range(cfg.require("num_hidden_layers", SIZE))]
    if "full_attention_interval" in cfg.data:  # upstream reads it only without layer_types
        cfg.seen.add("full_attention_interval")
        cfg.inert.append("full_attention_interval")
    if not isinstance(types, list) or not types or not all(isinstance(t, str) for t in types):
        raise invalid("layer_types", types, f"a non-empty list of {', '.join(QWEN_LAYERS)}", cfg.source)
    unknown = sorted({t for t in types if t not in QWEN_LAYERS})
    if unknown:
        cfg.expect("layer_types", tuple(QWEN_LAYERS), "layer kinds", default=unknown[0])
    layers = cfg.get("num_hidden_layers", len(types), SIZE)
    if layers != len(types):
        raise invalid("num_hidden_layers", layers, f"len(layer_types) = {len(types)}", cfg.source)
    return types


def qwen35_config(cfg: ConfigReader) -> ModelConfig:
    cfg.expect("hidden_act", ("silu", "swish"), "the short conv and the MLP use this activation", default="silu")
    cfg.expect("attention_bias", False, "biases on q/k/v/o projections", default=False)
    theta, factor = _qwen_rope(cfg)
    layer_types = _qwen_layer_types(cfg)
    for key in ("vocab_size", "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
                "linear_num_value_heads", "linear_num_key_heads", "linear_key_head_dim", "linear_value_head_dim"):
        cfg.require(key, SIZE)
    _divides(cfg, "num_key_value_heads", "num_attention_heads")
    _divides(cfg, "linear_num_key_heads", "linear_num_value_heads")
    head_dim = cfg.get("head_dim", 256, SIZE)  # Qwen3_5TextConfig's default
    # Text-only positions are equal on the three M-RoPE axes, so M-RoPE is the plain rotary here.
    return ModelConfig(
        vocab_size=cfg.require("vocab_size"),
        hidden_size=cfg.require("hidden_size"),
        layer_types=tuple(QWEN_LAYERS[t] for t in layer_types),
        num_heads=cfg.require("linear_num_value_heads"),
        num_k_heads=cfg.require("linear_num_key_heads"),
        head_k_dim=cfg.require("linear_key_head_dim"),
        head_v_dim=cfg.require("linear_value_head_dim"),
        intermediate_size=cfg.require("intermediate_size"),
        conv_size=cfg.get("linear_conv_kernel_dim", 4, SIZE),
        rms_norm_eps=cfg.get("rms_norm_eps", 1e-6, POSITIVE),
        tie_word_embeddings=cfg.get("tie_word_embeddings", False, FLAG),
        attention=AttentionConfig(
            num_heads=cfg.require("num_attention_heads"), num_kv_heads=cfg.require("num_key_value_heads"),
            head_dim=head_dim, window=None, rope_theta=theta, rotary_dim=_rotary_dim(cfg, head_dim, factor),
            qk_norm=True, output_gate=True,
        ),
        bos_token_id=token_id(cfg, "bos_token_id"), eos_token_id=token_id(cfg, "eos_token_id"),
    )


def _rotary_dim(cfg: ConfigReader, head_dim: int, factor: float) -> int:
    dim = int(head_dim * factor)  # transformers' default rope: dim = int(head_dim * partial_rotary_factor)
    if dim < 2 or dim % 2:
        raise invalid("partial_rotary_factor", factor, f"a factor giving an even rotary width >= 2 "
                      f"(head_dim={head_dim} * {factor} = {head_dim * factor:g})", cfg.source)
    return dim


def qwen35_weights(tensors: dict[str, Tensor], config: ModelConfig, raw: dict[str, Any]) -> dict[str, Tensor]:
    prefix = "model.language_model." if any(k.startswith("model.language_model.") for k in tensors) else "model."
    w = Weights(tensors, "qwen3_5 checkpoint")
    w.move(f"{prefix}embed_tokens.weight", "model.embed_tokens.weight")
    w.move(f"{prefix}norm.weight", "model.norm.weight", _plus_one)
    if not config.tie_word_embeddings:
        w.move("lm_head.weight", "lm_head.weight")
    dims, att = config.dims(), config.attention
    for i, kind in enumerate(config.layer_types):
        src, dst = f"{prefix}layers.{i}.", f"model.layers.{i}."
        w.move(f"{src}input_layernorm.weight", f"{dst}input_norm.weight", _plus_one)
        w.move(f"{src}post_attention_layernorm.weight", f"{dst}post_norm.weight", _plus_one)
        for proj in ("gate_proj", "up_proj", "down_proj"):
            w.move(f"{src}mlp.{proj}.weight", f"{dst}mlp.{proj}.weight")
        m = f"{dst}mixer."
        if kind == "softmax":
            a = f"{src}self_attn."
            q_and_gate = w.pop(f"{a}q_proj.weight").view(att.num_heads, 2, att.head_dim, -1)
            w.put(f"{m}q_proj.weight", q_and_gate[:, 0].reshape(att.num_heads * att.head_dim, -1))
            w.put(f"{m}g_proj.weight", q_and_gate[:, 1].reshape(att.num_heads * att.head_dim, -1))
            for name in ("k_proj", "v_proj", "o_proj"):
                w.move(f"{a}{name}.weight", f"{m}{name}.weight")
            w.move(f"{a}q_norm.weight", f"{m}q_norm.weight", _plus_one)
            w.move(f"{a}k_norm.weight", f"{m}k_norm.weight", _plus_one)
            continue
        a = f"{src}linear_attn."
        q, k, v = split_rows(w.pop(f"{a}in_proj_qkv.weight"), [dims.key_width, dims.key_width, dims.value_width],
                             "qwen3_5 checkpoint", f"{a}in_proj_qkv.weight")
        w.put(f"{m}q_proj.weight", q)
        w.put(f"{m}k_proj.weight", k)
        w.put(f"{m}v_proj.weight", v)
        w.move(f"{a}conv1d.weight", f"{m}conv1d", lambda t: t.squeeze(1))
        w.move(f"{a}in_proj_z.weight", f"{m}g_proj.weight")
        w.move(f"{a}in_proj_b.weight", f"{m}b_proj.weight")
        w.move(f"{a}in_proj_a.weight", f"{m}gate_proj.weight")
        w.move(f"{a}A_log", f"{m}A_log")
        w.move(f"{a}dt_bias", f"{m}dt_bias")
        w.move(f"{a}norm.weight", f"{m}o_norm.weight")
        w.move(f"{a}out_proj.weight", f"{m}o_proj.weight")
    # The multimodal checkpoint's vision tower and multi-token-prediction head are not part of the LM.
    return w.finish(drop_prefixes=("model.visual.", "visual.", "mtp."))


def qwen35_multimodal_config(cfg: ConfigReader) -> ModelConfig:
    """qwen3_5: take text_config; the vision tower is left out (inspect says so)."""
    text = cfg.require("text_config")
    if not isinstance(text, dict):
        raise invalid("text_config", text, "an object (the language model's config)", cfg.source)
    from edgelin.convert.reads import upstream_reads

    inner = ConfigReader(text, f"{cfg.source} text_config", reads=upstream_reads("transformers", "qwen3_5_text"))
    config = qwen35_config(inner)
    inner.finish()
    cfg.inert.extend(f"text_config.{k}" for k in inner.inert)
    tied = cfg.get("tie_word_embeddings", rule=Rule("bool", optional=True))
    return config if tied is None else config.replace(tie_word_embeddings=tied)


# ---- Mamba2 ---------------------------------------------------------------------------------------
def _is_fla_mamba2(data: dict[str, Any]) -> bool:
    return "norm_before_gate" in data or "dt_limit" in data  # fla's spelling of the same model


def _dt_limit(cfg: ConfigReader, key: str) -> tuple[float, float] | None:
    """time_step_limit / dt_limit: (low, high) clamp of dt; (0, inf) means no clamp."""
    value = cfg.get(key)
    if value is None:
        return None
    try:
        low, high = (as_float(x) for x in value)
    except (TypeError, ValueError):
        raise invalid(key, value, "a pair [low, high] of numbers", cfg.source) from None
    if not (0.0 <= low <= high) or math.isnan(high):
        raise invalid(key, value, "a pair [low, high] with 0 <= low <= high", cfg.source)
    return None if (low, high) == (0.0, math.inf) else (low, high)


def mamba2_config(cfg: ConfigReader) -> ModelConfig:
    """transformers' Mamba2Config, or fla's (same weights; a few fields named differently)."""
    if _is_fla_mamba2(cfg.data):
        cfg.expect("rmsnorm", True, "the output gate without its RMSNorm", default=True)
        cfg.expect("D_has_hdim", False, "a D skip per channel", default=False)
        eps, clamp = cfg.get("norm_eps", 1e-5, POSITIVE), _dt_limit(cfg, "dt_limit")
        gate = "after_norm" if cfg.get("norm_before_gate", False, FLAG) else None
        default_groups = 1  # fla's Mamba2Config
    else:
        eps, clamp, gate = cfg.get("layer_norm_epsilon", 1e-5, POSITIVE), _dt_limit(cfg, "time_step_limit"), None
        default_groups = 8  # transformers' Mamba2Config
    cfg.expect("hidden_act", ("silu", "swish"), "the short conv activation", default="silu")
    cfg.expect("use_bias", False, "biases on the in/out projections", default=False)
    hidden, heads, head_dim = cfg.require("hidden_size", SIZE), cfg.require("num_heads", SIZE), \
        cfg.require("head_dim", SIZE)
    inner = cfg.get("expand", 2, POSITIVE) * hidden
    if heads * head_dim != inner:
        cfg.expect("num_heads", inner // head_dim, f"num_heads * head_dim must equal expand * hidden_size = {inner}")
    groups = cfg.get("n_groups", default_groups, SIZE)
    if heads % groups:
        raise invalid("n_groups", groups, f"a divisor of num_heads={heads}", cfg.source)
    layers = cfg.require("num_hidden_layers", SIZE)
    types = cfg.get("layer_types") or ["mamba"] * layers  # "mamba" is transformers' legacy "linear_attention"
    if not isinstance(types, list) or not set(types) <= {"mamba", "linear_attention"} or len(types) != layers:
        raise invalid("layer_types", types, f"null or {layers} x 'linear_attention' (only Mamba2 blocks)", cfg.source)
    return ModelConfig(
        vocab_size=cfg.require("vocab_size", SIZE), hidden_size=hidden, layer_types=("mamba2",) * layers,
        num_heads=heads, num_k_heads=groups, head_k_dim=cfg.require("state_size", SIZE),
        head_v_dim=head_dim, intermediate_size=0, conv_size=cfg.get("conv_kernel", 4, SIZE),
        conv_bias=cfg.get("use_conv_bias", True, FLAG), rms_norm_eps=eps,
        tie_word_embeddings=cfg.get("tie_word_embeddings", False, FLAG),
        family_overrides={"mamba2": {k: v for k, v in (("dt_clamp", clamp), ("output_gate", gate)) if v}},
        bos_token_id=token_id(cfg, "bos_token_id"), eos_token_id=token_id(cfg, "eos_token_id"),
    )


def mamba2_weights(tensors: dict[str, Tensor], config: ModelConfig, raw: dict[str, Any]) -> dict[str, Tensor]:
    w = Weights(tensors, "mamba2 checkpoint")
    dims = config.dims()
    w.move("backbone.embeddings.weight", "model.embed_tokens.weight")
    w.move("backbone.norm_f.weight", "model.norm.weight")
    if not config.tie_word_embeddings:
        w.move("lm_head.weight", "lm_head.weight")
    inner, groups_width = dims.value_width, dims.key_width
    for i in range(config.num_layers):
        src, m = f"backbone.layers.{i}.", f"model.layers.{i}.mixer."
        w.move(f"{src}norm.weight", f"model.layers.{i}.input_norm.weight")
        z, x, b, c, dt = split_rows(w.pop(f"{src}mixer.in_proj.weight"),
                                    [inner, inner, groups_width, groups_width, dims.num_heads],
                                    "mamba2 checkpoint", f"{src}mixer.in_proj.weight")
        w.put(f"{m}g_proj.weight", z)
        w.put(f"{m}q_proj.weight", c)  # C reads the state out: the query
        w.put(f"{m}k_proj.weight", b)  # B writes into the state: the key
        w.put(f"{m}v_proj.weight", x)
        w.put(f"{m}gate_proj.weight", dt)
        # The conv runs over (x, B, C) upstream and over (q, k, v) = (C, B, x) here.
        conv_x, conv_b, conv_c = w.pop(f"{src}mixer.conv1d.weight").squeeze(1).split(
            [inner, groups_width, groups_width])
        w.put(f"{m}conv1d", torch.cat([conv_c, conv_b, conv_x]))
        bias = w.maybe(f"{src}mixer.conv1d.bias")
        if bias is not None:
            bx, bb, bc = bias.split([inner, groups_width, groups_width])
            w.put(f"{m}conv1d_bias", torch.cat([bc, bb, bx]))
        for name in ("A_log", "D", "dt_bias"):
            w.move(f"{src}mixer.{name}", f"{m}{name}")
        w.move(f"{src}mixer.norm.weight", f"{m}o_norm.weight")
        w.move(f"{src}mixer.out_proj.weight", f"{m}o_proj.weight")
    return w.finish()


CONVERTERS = [
    Converter("qwen3_5_text", "transformers", qwen35_config, qwen35_weights,
              "Qwen3.5 language model: Gated DeltaNet layers + gated full attention (KV cache grows)"),
    Converter("qwen3_5", "transformers", qwen35_multimodal_config, qwen35_weights,
              "Qwen3.5 multimodal checkpoint: the text model only; the vision tower is left out",
              # the vision tower and its token ids; the text model's own ids are in text_config
              harmless=frozenset({"vision_config", "image_token_id", "video_token_id", "bos_token_id",
                                  "eos_token_id"})),
    Converter("mamba2", "transformers", mamba2_config, mamba2_weights,
              "Mamba2 (SSD); fla's Mamba2 checkpoints share the layout and load the same way",
              source_of=lambda data: "fla" if _is_fla_mamba2(data) else "transformers",
              harmless=frozenset({"A_init_range", "conv_init", "dt_init_floor", "dt_max", "dt_min"})),  # fla: init only
]
