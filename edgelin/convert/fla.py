"""flash-linear-attention (fla 0.6) checkpoints: linear_attn, retnet, gla, delta_net, gated_deltanet,
kda (Mamba2 lives in hf.py: fla writes the same layout), and their hybrids with fla's softmax attention layers (`attn` in config.json).

Every fla model shares the block layout (attn_norm -> attn -> mlp_norm -> GatedMLP); what differs is
the `attn` mixer, whose fields map onto the family spec's knobs here.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from edgelin.convert.base import ConfigReader, Converter, Weights, integral, token_id
from edgelin.model.config import AttentionConfig, ModelConfig
from edgelin.rules import FLAG, OPT_POSITIVE, OPT_SIZE, POSITIVE, SIZE, Rule, invalid

Tensor = torch.Tensor
# fla's own feature-map names -> edgelin's (linear_attn's list, and the ACT2FN names of gla/retnet)
FEATURE_MAPS = {None: "identity", "identity": "identity", "elu": "elu1", "relu": "relu",
                "elementwise_product": "hadamard", "hedgehog": "hedgehog", "t2r": "t2r", "dpfp": "dpfp"}
ACT_MAPS = {None: "identity", "relu": "relu", "swish": "silu", "silu": "silu", "elu": "elu"}
# The keys of an `attn` spec that fla's get_attention reads (fla/models/modeling_utils.py); others are inert.
ATTN_RULES = {"layers": None, "num_heads": SIZE, "num_kv_heads": OPT_SIZE, "qkv_bias": Rule("bool", optional=True),
              "window_size": OPT_SIZE, "rope_theta": OPT_POSITIVE}


def _intermediate(cfg: ConfigReader, hidden: int) -> int:
    size = cfg.get("intermediate_size", rule=OPT_SIZE)
    ratio = cfg.get("hidden_ratio", rule=OPT_POSITIVE)
    if size is None:  # fla's GatedMLP: 2/3 * ratio * hidden, rounded up to a multiple of 256
        size = int(hidden * (ratio or 4) * 2 / 3)
        size = 256 * ((size + 255) // 256)
    return size


def _attention(cfg: ConfigReader, hidden: int, layers: int, types: list[str]) -> AttentionConfig | None:
    """fla's hybrid softmax layers (flash-attn upstream): q/k/v/o projections, rotary, optional window."""
    attn = cfg.get("attn")
    if not attn:
        return None
    if not isinstance(attn, (dict, list)) or not all(isinstance(a, dict) for a in ([attn] if isinstance(attn, dict)
                                                                                   else attn)):
        raise invalid("attn", attn, "null, an attention spec {layers, num_heads, ...} or a list of them", cfg.source)
    specs = [attn] if isinstance(attn, dict) else list(attn)
    read = [{k: v for k, v in spec.items() if k in ATTN_RULES} for spec in specs]
    cfg.inert.extend(sorted({f"attn.{k}" for spec in specs for k in spec if k not in ATTN_RULES}))
    shared = {k: v for k, v in read[0].items() if k != "layers"}
    for spec in read:
        for key, rule in ATTN_RULES.items():
            if rule is not None and key in spec:
                cfg.check(f"attn.{key}", spec[key], rule)
        if {k: v for k, v in spec.items() if k != "layers"} != shared:
            cfg.expect("attn", "one shared spec", "attention layers with different settings", default="several")
        if "layers" not in spec or "num_heads" not in spec:
            cfg.require("attn.layers" if "layers" not in spec else "attn.num_heads")
        if not isinstance(spec["layers"], list):
            raise invalid("attn.layers", spec["layers"], "a list of layer indices", cfg.source)
        for layer in spec["layers"]:
            cfg.check("attn.layers", layer, Rule("int", low=0, high=layers - 1))
            types[layer] = "softmax"
    heads = shared["num_heads"]
    if hidden % heads:  # fla's Attention: head_dim = hidden_size // num_heads, q_proj is hidden x hidden
        raise invalid("attn.num_heads", heads, f"a divisor of hidden_size={hidden}", cfg.source)
    return AttentionConfig(num_heads=heads, num_kv_heads=shared.get("num_kv_heads") or heads,
                           head_dim=hidden // heads, window=shared.get("window_size"),
                           rope_theta=float(shared.get("rope_theta") or 10000.0),
                           qkv_bias=bool(shared.get("qkv_bias")), qk_norm_eps=1e-5)


def _common(cfg: ConfigReader, family: str, dims: dict[str, Any], overrides: dict[str, Any]) -> ModelConfig:
    cfg.expect("hidden_act", ("swish", "silu"), "the MLP (and output gate) activation", default="swish")
    cfg.expect("attnres_block_size", None, "attention residuals replace the residual stream")
    hidden, layers = cfg.require("hidden_size", SIZE), cfg.require("num_hidden_layers", SIZE)
    types = [family] * layers
    attention = _attention(cfg, hidden, layers, types)
    return ModelConfig(
        vocab_size=cfg.require("vocab_size", SIZE), hidden_size=hidden, layer_types=tuple(types),
        intermediate_size=_intermediate(cfg, hidden), rms_norm_eps=cfg.get("norm_eps", 1e-6, POSITIVE),
        tie_word_embeddings=cfg.get("tie_word_embeddings", False, FLAG), attention=attention,
        family_overrides={family: overrides} if overrides else {},
        bos_token_id=token_id(cfg, "bos_token_id"), eos_token_id=token_id(cfg, "eos_token_id"), **dims,
    )


def _heads(cfg: ConfigReader, width: int, heads: int, what: str) -> int:
    """Per-head width of a projection fla splits into `heads` equal heads."""
    if width % heads:
        raise invalid(what, width, f"a multiple of num_heads={heads}", cfg.source)
    return width // heads


def _expand_dims(cfg: ConfigReader, default_k: float, default_v: float) -> dict[str, int]:
    """Sizes of the expand_k / expand_v families (linear_attn, retnet, gla, delta_net)."""
    hidden, heads = cfg.require("hidden_size", SIZE), cfg.require("num_heads", SIZE)
    if cfg.get("num_kv_heads", rule=OPT_SIZE) not in (None, heads):
        cfg.expect("num_kv_heads", (None, heads), "shared key/value heads (MQA) across query heads")
    key = integral(hidden * cfg.get("expand_k", default_k, POSITIVE), "hidden_size * expand_k", cfg.source)
    value = integral(hidden * cfg.get("expand_v", default_v, POSITIVE), "hidden_size * expand_v", cfg.source)
    return {"num_heads": heads, "num_k_heads": heads, "head_k_dim": _heads(cfg, key, heads, "hidden_size * expand_k"),
            "head_v_dim": _heads(cfg, value, heads, "hidden_size * expand_v")}


def _head_dims(cfg: ConfigReader, default_expand_v: float) -> dict[str, int]:
    """Sizes of the head_dim families (gated_deltanet, kda): value heads may outnumber key heads."""
    heads, head_dim = cfg.require("num_heads", SIZE), cfg.require("head_dim", SIZE)
    v_heads = cfg.get("num_v_heads", rule=OPT_SIZE) or heads
    expand = cfg.get("expand_v", default_expand_v, POSITIVE)
    return {"num_heads": v_heads, "num_k_heads": heads, "head_k_dim": head_dim,
            "head_v_dim": integral(head_dim * expand, "head_dim * expand_v", cfg.source)}


def _gate_and_norm(cfg: ConfigReader, flag: str, default: bool) -> dict[str, Any]:
    """`flag` (use_output_gate / use_gate) with fla's default for this layer."""
    if cfg.get(flag, default, FLAG):
        return {"output_norm": True, "output_gate": "after_norm"}
    return {"output_norm": True, "output_gate": "none"}


def _neg_eigval(cfg: ConfigReader) -> float:
    return 2.0 if cfg.get("allow_neg_eigval", False, FLAG) else 1.0


def linear_attn_config(cfg: ConfigReader) -> ModelConfig:
    fmap = cfg.expect("feature_map", tuple(k for k in FEATURE_MAPS if k), "feature maps",
                      default="elementwise_product")
    cfg.expect("norm_q", False, "q / sum(q) normalisation", default=False)
    cfg.expect("norm_k", False, "k / sum(k) normalisation", default=False)
    cfg.get("tie_feature_map_qk", rule=Rule("bool", optional=True))  # the weights say whether k has its own map
    cfg.get("elementwise_affine", rule=Rule("bool", optional=True))  # the weights say whether o_norm has a weight
    overrides = {"feature_map": FEATURE_MAPS[fmap], "normalizer": cfg.get("norm_feature_map", False, FLAG),
                 "normalizer_eps": 1e-10, "scale_queries": True, "output_norm": True}
    return _common(cfg, "linear_attn", _expand_dims(cfg, 1.0, 1.0), overrides)


def retnet_config(cfg: ConfigReader) -> ModelConfig:
    fmap = cfg.expect("feature_map", tuple(ACT_MAPS), "feature maps")
    cfg.get("elementwise_affine", rule=Rule("bool", optional=True))
    overrides = {"feature_map": ACT_MAPS[fmap], **_gate_and_norm(cfg, "use_output_gate", True)}
    return _common(cfg, "retnet", _expand_dims(cfg, 1.0, 2.0), overrides)


def gla_config(cfg: ConfigReader) -> ModelConfig:
    fmap = cfg.expect("feature_map", tuple(ACT_MAPS), "feature maps")
    cfg.get("elementwise_affine", rule=Rule("bool", optional=True))
    overrides = {"feature_map": ACT_MAPS[fmap], "short_conv": cfg.get("use_short_conv", False, FLAG),
                 "gate_clamp_min": cfg.get("clamp_min", rule=Rule("float", optional=True)),
                 **_gate_and_norm(cfg, "use_output_gate", True)}
    dims = {**_expand_dims(cfg, 0.5, 1.0), "conv_size": cfg.get("conv_size", 4, SIZE)}
    return _common(cfg, "gla", dims, {k: v for k, v in overrides.items() if v is not None})


def delta_net_config(cfg: ConfigReader) -> ModelConfig:
    cfg.expect("qk_activation", "silu", "q/k activations other than the conv's SiLU", default="silu")
    cfg.expect("use_short_conv", True, "DeltaNet without its short convolution", default=True)
    cfg.seen.add("use_output_norm")  # read by fla 0.6's modeling file, then accepted and ignored by its layer
    overrides = {"qk_norm": cfg.expect("qk_norm", ("l2", "sum"), "q/k normalisation", default="l2"),
                 "use_beta": cfg.get("use_beta", True, FLAG), "beta_scale": _neg_eigval(cfg),
                 **_gate_and_norm(cfg, "use_gate", False)}
    dims = {**_expand_dims(cfg, 1.0, 1.0), "conv_size": cfg.get("conv_size", 4, SIZE)}
    return _common(cfg, "deltanet", dims, overrides)


def gated_deltanet_config(cfg: ConfigReader) -> ModelConfig:
    cfg.expect("use_short_conv", True, "Gated DeltaNet without its short convolution", default=True)
    activation = cfg.expect("output_gate_activation", ("swish", "silu", "sigmoid"), "output gate", default="swish")
    overrides = {"beta_scale": _neg_eigval(cfg), **_gate_and_norm(cfg, "use_gate", True),
                 "output_gate_activation": "sigmoid" if activation == "sigmoid" else "silu"}
    dims = {**_head_dims(cfg, 2.0), "conv_size": cfg.get("conv_size", 4, SIZE)}
    return _common(cfg, "gated_deltanet", dims, overrides)


def kda_config(cfg: ConfigReader) -> ModelConfig:
    cfg.expect("use_short_conv", True, "KDA without its short convolution", default=True)
    cfg.expect("safe_gate", False, "the bounded sigmoid gate", default=False)
    cfg.expect("lower_bound", None, "the bounded sigmoid gate", default=None)
    dims = {**_head_dims(cfg, 1.0), "conv_size": cfg.get("conv_size", 4, SIZE)}  # KDA's expand_v defaults to 1
    rank = dims["head_v_dim"]
    overrides = {"beta_scale": _neg_eigval(cfg), "gate_low_rank": rank,
                 "gate_low_rank_bias": False, "output_gate_low_rank": rank, "output_gate_activation": "sigmoid"}
    return _common(cfg, "kda", dims, overrides)


# ---- weights ---------------------------------------------------------------------------------------
def _conv(w: Weights, src: str, dst: str) -> None:
    w.put(f"{dst}conv1d", torch.cat([w.pop(f"{src}{n}_conv1d.weight").squeeze(1) for n in "qkv"]))
    biases = [w.maybe(f"{src}{n}_conv1d.bias") for n in "qkv"]
    if all(b is not None for b in biases):
        w.put(f"{dst}conv1d_bias", torch.cat(biases))


def _mixer(w: Weights, src: str, dst: str, config: ModelConfig, layer: int) -> None:
    spec = config.spec(layer)
    for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
        w.move(f"{src}{name}.weight", f"{dst}{name}.weight")
    if spec.short_conv:
        _conv(w, src, dst)
    for prefix in ("feature_map_q", "feature_map_k"):
        for key in [k for k in list(w.tensors) if k.startswith(f"{src}{prefix}.")]:
            w.move(key, dst + key[len(src):])
    if spec.feature.module is not None and not any(k.startswith(f"{dst}feature_map_k.") for k in w.out):
        for key in [k for k in list(w.out) if k.startswith(f"{dst}feature_map_q.")]:  # tie_feature_map_qk
            w.put(key.replace("feature_map_q.", "feature_map_k."), w.out[key])
    for src_name, dst_name in (("a_proj.weight", "gate_proj.weight"), ("A_log", "A_log"), ("dt_bias", "dt_bias"),
                               ("b_proj.weight", "b_proj.weight"), ("g_proj.weight", "g_proj.weight")):
        if f"{src}{src_name}" in w.tensors:
            w.move(f"{src}{src_name}", f"{dst}{dst_name}")
    for low_rank_src, low_rank_dst in (("gk_proj", "gate_proj"), ("f_proj", "gate_proj"), ("g_proj", "g_proj")):
        for key in [k for k in list(w.tensors) if k.startswith(f"{src}{low_rank_src}.")]:
            w.move(key, f"{dst}{low_rank_dst}." + key[len(f"{src}{low_rank_src}."):])
    norm = next((n for n in ("o_norm", "g_norm_swish_gate", "g_norm", "norm") if f"{src}{n}.weight" in w.tensors), None)
    if norm:
        w.move(f"{src}{norm}.weight", f"{dst}o_norm.weight")
    elif spec.output_norm:  # elementwise_affine=False: a unit weight
        w.put(f"{dst}o_norm.weight", torch.ones(config.head_v_dim))


def fla_weights(tensors: dict[str, Tensor], config: ModelConfig, raw: dict[str, Any]) -> dict[str, Tensor]:
    w = Weights(tensors, f"fla {raw.get('model_type')} checkpoint")
    w.move("model.embeddings.weight", "model.embed_tokens.weight")
    w.move("model.norm.weight", "model.norm.weight")
    if not config.tie_word_embeddings:
        w.move("lm_head.weight", "lm_head.weight")
    for i, kind in enumerate(config.layer_types):
        src, dst = f"model.layers.{i}.", f"model.layers.{i}."
        w.move(f"{src}attn_norm.weight", f"{dst}input_norm.weight")
        w.move(f"{src}mlp_norm.weight", f"{dst}post_norm.weight")
        for proj in ("gate_proj", "up_proj", "down_proj"):
            w.move(f"{src}mlp.{proj}.weight", f"{dst}mlp.{proj}.weight")
        if kind == "softmax":
            for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
                w.move(f"{src}attn.{name}.weight", f"{dst}mixer.{name}.weight")
                bias = w.maybe(f"{src}attn.{name}.bias")
                if bias is not None:
                    w.put(f"{dst}mixer.{name}.bias", bias)
        else:
            _mixer(w, f"{src}attn.", f"{dst}mixer.", config, i)
    return w.finish()


def _fla(model_type: str, to_config: Callable, note: str) -> Converter:
    return Converter(model_type, "fla", to_config, fla_weights, note)


CONVERTERS = [
    _fla("linear_attn", linear_attn_config, "fla linear attention (feature map per config)"),
    _fla("retnet", retnet_config, "fla RetNet (multi-scale retention)"),
    _fla("gla", gla_config, "fla Gated Linear Attention"),
    _fla("delta_net", delta_net_config, "fla DeltaNet"),
    _fla("gated_deltanet", gated_deltanet_config, "fla Gated DeltaNet"),
    _fla("kda", kda_config, "fla Kimi Delta Attention"),
]
