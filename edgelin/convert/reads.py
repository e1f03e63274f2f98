"""Which config.json fields each upstream library actually reads, per converter.

`PretrainedConfig` keeps any extra key of config.json as an attribute, so checkpoints carry leftovers
that the upstream model never looks at. Such a field cannot change the math: edgelin accepts it and
lists it as *inert* (`inspect`, `export --json`) instead of refusing it. A field the upstream model
does read is either used by the converter, known not to change inference math (`base.HARMLESS`), or
refused by name.

The sets are data, taken from the installed sources (fla 0.6.0, transformers 5.24.0):
`MODELING_READS` is every `config.X` (and `getattr(config, "X")`) in the modeling files named in the
comments; tests/model/test_config_validation.py re-derives them from the installed files, so an upgrade that
reads a new field fails a test instead of going stale. `CONFIG_READS` are fields that the
configuration classes themselves consume, and `TRANSFORMERS_GENERIC` those every `PreTrainedConfig` /
`PreTrainedModel` reads (fla's configs are `PreTrainedConfig`s too).
"""

from __future__ import annotations

# transformers 5.24.0 configuration_utils.PreTrainedConfig (its declared fields and the kwargs its
# __post_init__ pops), modeling_utils.PreTrainedModel (tied embeddings, special token ids,
# _init_weights' initializer_range) and generation/utils.py (use_cache).
TRANSFORMERS_GENERIC = frozenset({
    "model_type", "transformers_version", "architectures", "output_hidden_states", "return_dict", "dtype",
    "torch_dtype", "chunk_size_feed_forward", "is_encoder_decoder", "id2label", "label2id", "problem_type",
    "num_labels", "name_or_path", "_name_or_path", "_commit_hash", "output_attentions", "attn_implementation",
    "experts_implementation", "per_layer_config", "tie_word_embeddings", "pad_token_id", "bos_token_id",
    "eos_token_id", "initializer_range", "use_cache",
})

# fla 0.6.0 fla/models/modeling_utils.py (FLAPreTrainedModel, FLAModel, get_attention): shared by every model.
_FLA_SHARED = frozenset({
    "attn", "fuse_cross_entropy", "fuse_linear_cross_entropy", "hidden_size", "initializer_range",
    "max_position_embeddings", "num_hidden_layers", "output_attentions", "output_hidden_states", "return_dict",
    "use_cache", "use_l2warp",
})

# (library, model_type) -> config fields read by the modeling code.
MODELING_READS: dict[tuple[str, str], frozenset[str]] = {
    # fla 0.6.0 fla/models/linear_attn/modeling_linear_attn.py
    ("fla", "linear_attn"): frozenset({
        "attn_mode", "attnres_block_size", "elementwise_affine", "expand_k", "expand_v", "feature_map", "fuse_norm",
        "fuse_swiglu", "hidden_act", "hidden_ratio", "hidden_size", "intermediate_size", "norm_eps",
        "norm_feature_map", "norm_k", "norm_q", "num_heads", "num_hidden_layers", "num_kv_heads",
        "output_attentions", "output_hidden_states", "pad_token_id", "return_dict", "tie_feature_map_qk",
        "use_cache", "vocab_size"}),
    # fla 0.6.0 fla/models/retnet/modeling_retnet.py (use_short_conv, conv_size: RetNetConfig only)
    ("fla", "retnet"): frozenset({
        "attn_mode", "attnres_block_size", "elementwise_affine", "expand_k", "expand_v", "feature_map", "fuse_norm",
        "fuse_swiglu", "hidden_act", "hidden_ratio", "hidden_size", "intermediate_size", "norm_eps", "num_heads",
        "num_hidden_layers", "num_kv_heads", "output_attentions", "output_hidden_states", "pad_token_id",
        "return_dict", "use_cache", "use_output_gate", "vocab_size"}),
    # fla 0.6.0 fla/models/gla/modeling_gla.py (use_gk, use_gv: GLAConfig only)
    ("fla", "gla"): frozenset({
        "attn_mode", "attnres_block_size", "clamp_min", "conv_size", "elementwise_affine", "expand_k", "expand_v",
        "feature_map", "fuse_norm", "fuse_swiglu", "hidden_act", "hidden_ratio", "hidden_size",
        "intermediate_size", "norm_eps", "num_heads", "num_hidden_layers", "num_kv_heads", "pad_token_id",
        "use_output_gate", "use_short_conv", "vocab_size"}),
    # fla 0.6.0 fla/models/delta_net/modeling_delta_net.py (no num_kv_heads: DeltaNet has no MQA)
    ("fla", "delta_net"): frozenset({
        "allow_neg_eigval", "attn_mode", "attnres_block_size", "conv_size", "expand_k", "expand_v", "fuse_norm",
        "fuse_swiglu", "hidden_act", "hidden_ratio", "hidden_size", "intermediate_size", "norm_eps", "num_heads",
        "num_hidden_layers", "pad_token_id", "qk_activation", "qk_norm", "use_beta", "use_gate", "use_output_norm",
        "use_short_conv", "vocab_size"}),
    # fla 0.6.0 fla/models/gated_deltanet/modeling_gated_deltanet.py
    ("fla", "gated_deltanet"): frozenset({
        "allow_neg_eigval", "attn_mode", "attnres_block_size", "conv_size", "expand_v", "fuse_norm", "fuse_swiglu",
        "head_dim", "hidden_act", "hidden_ratio", "hidden_size", "initializer_range", "intermediate_size",
        "norm_eps", "num_heads", "num_hidden_layers", "num_v_heads", "output_gate_activation", "pad_token_id",
        "use_gate", "use_short_conv", "vocab_size"}),
    # fla 0.6.0 fla/models/kda/modeling_kda.py
    ("fla", "kda"): frozenset({
        "allow_neg_eigval", "attn_mode", "attnres_block_size", "conv_size", "expand_v", "fuse_cross_entropy",
        "fuse_norm", "fuse_swiglu", "head_dim", "hidden_act", "hidden_ratio", "hidden_size", "initializer_range",
        "intermediate_size", "lower_bound", "norm_eps", "num_heads", "num_hidden_layers", "num_v_heads",
        "output_attentions", "output_hidden_states", "pad_token_id", "return_dict", "safe_gate", "use_short_conv",
        "vocab_size"}),
    # fla 0.6.0 fla/models/mamba2/modeling_mamba2.py
    ("fla", "mamba2"): frozenset({
        "A_init_range", "D_has_hdim", "chunk_size", "conv_init", "conv_kernel", "dt_init_floor", "dt_limit",
        "dt_max", "dt_min", "expand", "head_dim", "hidden_act", "hidden_size", "initializer_range", "n_groups",
        "norm_before_gate", "norm_eps", "num_heads", "num_hidden_layers", "output_hidden_states",
        "rescale_prenorm_residual", "residual_in_fp32", "return_dict", "rmsnorm", "state_size", "use_bias",
        "use_cache", "use_conv_bias", "vocab_size"}),
    # transformers 5.24.0 models/qwen3_5/modeling_qwen3_5.py, the text classes (not Qwen3_5Vision*,
    # Qwen3_5Model, Qwen3_5ForConditionalGeneration)
    ("transformers", "qwen3_5_text"): frozenset({
        "_attn_implementation", "attention_bias", "attention_dropout", "head_dim", "hidden_act", "hidden_size",
        "intermediate_size", "layer_types", "linear_conv_kernel_dim", "linear_key_head_dim",
        "linear_num_key_heads", "linear_num_value_heads", "linear_value_head_dim", "max_position_embeddings",
        "num_attention_heads", "num_hidden_layers", "num_key_value_heads", "pad_token_id", "rms_norm_eps",
        "rope_parameters", "vocab_size"}),
    # transformers 5.24.0 models/qwen3_5/modeling_qwen3_5.py: Qwen3_5Model, Qwen3_5ForConditionalGeneration
    ("transformers", "qwen3_5"): frozenset({"image_token_id", "text_config", "video_token_id", "vision_config"}),
    # transformers 5.24.0 models/mamba2/modeling_mamba2.py
    ("transformers", "mamba2"): frozenset({
        "chunk_size", "conv_kernel", "expand", "head_dim", "hidden_act", "hidden_size", "layer_norm_epsilon",
        "layer_types", "n_groups", "num_heads", "num_hidden_layers", "output_hidden_states",
        "rescale_prenorm_residual", "residual_in_fp32", "return_dict", "state_size", "time_step_floor",
        "time_step_limit", "time_step_max", "time_step_min", "time_step_rank", "use_bias", "use_cache",
        "use_conv_bias", "vocab_size"}),
}

# Fields consumed by configuration code rather than read by the modeling files.
CONFIG_READS: dict[tuple[str, str], frozenset[str]] = {
    # PreTrainedConfig.convert_rope_params_to_dict (modeling_rope_utils) folds these into rope_parameters;
    # Qwen3_5TextConfig.__post_init__ builds layer_types from full_attention_interval when it is absent.
    ("transformers", "qwen3_5_text"): frozenset({"rope_scaling", "rope_theta", "partial_rotary_factor",
                                                 "full_attention_interval"}),
}


def upstream_reads(library: str, model_type: str) -> frozenset[str]:
    """Every field of config.json that the upstream model reads (a KeyError for an unknown pair)."""
    key = (library, model_type)
    if key not in MODELING_READS:
        raise KeyError(f"no upstream read set for {key}")
    shared = _FLA_SHARED if library == "fla" else frozenset()
    return MODELING_READS[key] | CONFIG_READS.get(key, frozenset()) | shared | TRANSFORMERS_GENERIC
