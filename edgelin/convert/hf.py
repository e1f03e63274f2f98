"""transformers checkpoints: Qwen3.5's language model (Gated DeltaNet + gated attention) and Mamba2."""

from __future__ import annotations

import math
from typing import Any

import torch

from edgelin.convert.base import ConfigReader, Converter, Weights, as_float, split_rows
from edgelin.model.config import AttentionConfig, ModelConfig

Tensor = torch.Tensor


def _plus_one(t: Tensor) -> Tensor:
    """Qwen3.5's zero-centred RMSNorm multiplies by (1 + w); edgelin's by w."""
    return t + 1.0


# ---- Qwen3.5 (qwen3_5_text, and the text tower of qwen3_5) ------------------------------------
def qwen35_config(cfg: ConfigReader) -> ModelConfig:
    cfg.expect("hidden_act", ("silu", "swish"), "the short conv and the MLP use this activation")
    cfg.expect("attention_bias", False, "biases on q/k/v/o projections", default=False)
    rope = cfg.get("rope_parameters") or {"rope_type": "default", "rope_theta": cfg.get("rope_theta", 10000.0),
                                            "partial_rotary_factor": cfg.get("partial_rotary_factor", 1.0)}
    cfg.seen.update({"rope_theta", "partial_rotary_factor"})
    if rope.get("rope_type", "default") != "default":
        cfg.expect("rope_type", "default", "scaled rotary embeddings", default=rope.get("rope_type"))
    kinds = {"linear_attention": "gated_deltanet", "full_attention": "softmax"}
    layer_types = cfg.require("layer_types")
    unknown = sorted({t for t in layer_types if t not in kinds})
    if unknown:
        cfg.expect("layer_types", tuple(kinds), "layer kinds", default=unknown[0])
    layers = len(layer_types)
    if cfg.get("num_hidden_layers", layers) != layers:
        cfg.expect("num_hidden_layers", layers, "it must equal len(layer_types)")
    head_dim = cfg.get("head_dim") or cfg.require("hidden_size") // cfg.require("num_attention_heads")
    # Text-only positions are equal on the three M-RoPE axes, so M-RoPE is the plain rotary here.
    return ModelConfig(
        vocab_size=cfg.require("vocab_size"),
        hidden_size=cfg.require("hidden_size"),
        layer_types=tuple(kinds[t] for t in layer_types),
        num_heads=cfg.require("linear_num_value_heads"),
        num_k_heads=cfg.require("linear_num_key_heads"),
        head_k_dim=cfg.require("linear_key_head_dim"),
        head_v_dim=cfg.require("linear_value_head_dim"),
        intermediate_size=cfg.require("intermediate_size"),
        conv_size=cfg.get("linear_conv_kernel_dim", 4),
        rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
        tie_word_embeddings=cfg.get("tie_word_embeddings", False),
        attention=AttentionConfig(
            num_heads=cfg.require("num_attention_heads"), num_kv_heads=cfg.require("num_key_value_heads"),
            head_dim=head_dim, window=None, rope_theta=float(rope.get("rope_theta", 10000.0)),
            rotary_dim=int(head_dim * float(rope.get("partial_rotary_factor", 1.0))),
            qk_norm=True, output_gate=True,
        ),
        bos_token_id=_first(cfg.get("bos_token_id")), eos_token_id=_first(cfg.get("eos_token_id")),
    )


def _first(token: Any) -> int | None:
    return token[0] if isinstance(token, list) and token else token


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
    text = dict(cfg.require("text_config"))
    cfg.seen.update(set(cfg.data) - {"text_config"})  # vision and token-id fields: not the LM's math
    inner = ConfigReader(text, f"{cfg.source} text_config")
    config = qwen35_config(inner)
    inner.finish()
    if cfg.data.get("tie_word_embeddings") is not None:
        config = config.replace(tie_word_embeddings=bool(cfg.data["tie_word_embeddings"]))
    return config


# ---- Mamba2 ---------------------------------------------------------------------------------------
def mamba2_config(cfg: ConfigReader) -> ModelConfig:
    """transformers' Mamba2Config, or fla's (same weights; a few fields named differently)."""
    if "norm_before_gate" in cfg.data or "dt_limit" in cfg.data:  # fla's spelling
        cfg.expect("rmsnorm", True, "the output gate without its RMSNorm", default=True)
        cfg.expect("D_has_hdim", False, "a D skip per channel", default=False)
        cfg.seen.update({"A_init_range", "conv_init", "dt_init_floor", "dt_max", "dt_min", "norm_eps", "dt_limit"})
        cfg.data = {**cfg.data, "layer_norm_epsilon": cfg.data.get("norm_eps", 1e-5),
                    "time_step_limit": cfg.data.get("dt_limit", (0.0, math.inf))}
    gate = "after_norm" if cfg.get("norm_before_gate", False) else None
    cfg.expect("hidden_act", ("silu", "swish"), "the short conv activation")
    cfg.expect("use_bias", False, "biases on the in/out projections", default=False)
    hidden, heads, head_dim = cfg.require("hidden_size"), cfg.require("num_heads"), cfg.require("head_dim")
    inner = int(cfg.get("expand", 2) * hidden)
    if heads * head_dim != inner:
        cfg.expect("num_heads", inner // head_dim, f"num_heads * head_dim must equal expand * hidden_size = {inner}")
    low, high = (as_float(x) for x in cfg.get("time_step_limit", (0.0, math.inf)))
    clamp = None if (low, high) == (0.0, math.inf) else (low, high)
    layers = cfg.require("num_hidden_layers")
    types = cfg.get("layer_types") or ["mamba"] * layers
    if set(types) != {"mamba"}:
        cfg.expect("layer_types", "mamba", "only Mamba2 blocks", default=sorted(set(types) - {"mamba"})[0])
    return ModelConfig(
        vocab_size=cfg.require("vocab_size"), hidden_size=hidden, layer_types=("mamba2",) * layers,
        num_heads=heads, num_k_heads=cfg.get("n_groups", 1), head_k_dim=cfg.require("state_size"),
        head_v_dim=head_dim, intermediate_size=0, conv_size=cfg.get("conv_kernel", 4),
        conv_bias=bool(cfg.get("use_conv_bias", True)), rms_norm_eps=cfg.get("layer_norm_epsilon", 1e-5),
        tie_word_embeddings=cfg.get("tie_word_embeddings", False),
        family_overrides={"mamba2": {k: v for k, v in (("dt_clamp", clamp), ("output_gate", gate)) if v}},
        bos_token_id=_first(cfg.get("bos_token_id")), eos_token_id=_first(cfg.get("eos_token_id")),
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
              "Qwen3.5 multimodal checkpoint: the text model only; the vision tower is left out"),
    Converter("mamba2", "transformers", mamba2_config, mamba2_weights,
              "Mamba2 (SSD); fla's Mamba2 checkpoints share the layout and load the same way",
              source_of=lambda data: "fla" if "norm_before_gate" in data or "dt_limit" in data else "transformers"),
]
