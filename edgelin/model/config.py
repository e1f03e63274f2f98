"""Model configuration: the `config.json` of an edgelin checkpoint (Hugging Face conventions).

Every field is checked by type and range (`MODEL_RULES`, `ATTENTION_RULES`, then the relations between
fields in `_check_relations`) when a config is built, from config.json, a recipe, a converter or code,
so a bad value is one line naming the field and its allowed range, never a crash deep in torch.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from edgelin.errors import EdgelinError
from edgelin.families import FAMILIES, LAYER_TYPES, SOFTMAX, FamilySpec, LayerDims, get_family
from edgelin.rules import COUNT, FLAG, OPT_POSITIVE, OPT_SIZE, POSITIVE, SIZE, Rule, check_fields, invalid

MODEL_TYPE = "edgelin"
WHERE = "model config"  # names configs built in code or from a recipe; config.json errors name the file


@dataclass(frozen=True)
class AttentionConfig:
    """Softmax attention layers of a hybrid (and of the KV-cache baseline)."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    # None: full context, the KV cache grows with the sequence (the baseline).
    # An int: sliding window; the cache is a ring buffer of that many slots, so memory is constant.
    window: int | None = 256
    rope_theta: float = 10000.0
    rotary_dim: int | None = None  # partial rotary: only the first rotary_dim channels (None: all)
    qkv_bias: bool = False
    qk_norm: bool = False  # RMSNorm over each head's q and k before rotary (Qwen3.5)
    qk_norm_eps: float | None = None  # None: the model's rms_norm_eps
    output_gate: bool = False  # o * sigmoid(W_g x) before o_proj (Qwen3.5's gated attention)

    def __post_init__(self) -> None:
        check_attention(dataclasses.asdict(self), WHERE)


ATTENTION_RULES: dict[str, Rule] = {
    "num_heads": SIZE, "num_kv_heads": SIZE, "head_dim": SIZE, "window": OPT_SIZE, "rope_theta": POSITIVE,
    "rotary_dim": Rule("int", low=2, optional=True), "qkv_bias": FLAG, "qk_norm": FLAG,
    "qk_norm_eps": OPT_POSITIVE, "output_gate": FLAG,
}


def check_attention(values: dict[str, Any], where: str) -> None:
    check_fields(ATTENTION_RULES, values, where, prefix="attention.")
    heads, kv_heads, head_dim = values["num_heads"], values["num_kv_heads"], values["head_dim"]
    if heads % kv_heads:  # grouped-query attention: equal groups of query heads per kv head
        raise invalid("attention.num_kv_heads", kv_heads, f"a divisor of attention.num_heads={heads}", where)
    rotary = values.get("rotary_dim")
    if rotary is None and head_dim % 2:  # rotary over the whole head rotates channel pairs
        raise invalid("attention.head_dim", head_dim, "an even integer (rotary embeddings rotate pairs), or set "
                      "attention.rotary_dim", where)
    if rotary is not None and (rotary % 2 or rotary > head_dim):
        raise invalid("attention.rotary_dim", rotary, f"null or an even integer in [2, {head_dim}] "
                      f"(attention.head_dim={head_dim})", where)


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    layer_types: tuple[str, ...]
    num_heads: int
    head_k_dim: int
    head_v_dim: int
    intermediate_size: int  # SwiGLU MLP width; 0: blocks have no MLP (Mamba2)
    num_k_heads: int | None = None  # defaults to num_heads
    conv_size: int = 4
    conv_bias: bool = False
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = True
    rope_theta: float = 10000.0  # rotary families (RetNet)
    chunk_size: int | None = None  # overrides the family's default chunk size
    attention: AttentionConfig | None = None
    family_overrides: dict[str, dict[str, Any]] = field(default_factory=dict)
    feature_seed: int = 0  # seeds fixed random features (Performer)
    # CLVR (cross-layer value routing): every linear layer adds W_r u_t to the residual stream, u_t the
    # value it writes into its memory, W_r zero-initialised (edgelin.model.mixer). No new state.
    clvr: bool = False
    bos_token_id: int | None = None
    eos_token_id: int | None = None

    def __post_init__(self) -> None:
        if isinstance(self.layer_types, list):  # programmatic configs: the tuple the dataclass promises
            object.__setattr__(self, "layer_types", tuple(self.layer_types))
        values = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        check_model(values, WHERE)

    @property
    def num_layers(self) -> int:
        return len(self.layer_types)

    def spec(self, layer: int) -> FamilySpec:
        name = self.layer_types[layer]
        spec = FAMILIES[name].with_overrides(self.family_overrides.get(name, {}))
        return dataclasses.replace(spec, chunk_size=self.chunk_size) if self.chunk_size else spec

    def dims(self) -> LayerDims:
        return LayerDims(
            self.hidden_size, self.num_heads, self.num_k_heads or self.num_heads,
            self.head_k_dim, self.head_v_dim, self.conv_size, self.conv_bias,
        )

    def replace(self, **changes: Any) -> "ModelConfig":
        return dataclasses.replace(self, **changes)

    # ---- config.json --------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        data["layer_types"] = list(self.layer_types)
        return {
            "model_type": MODEL_TYPE,
            "architectures": ["EdgelinForCausalLM"],
            "num_hidden_layers": self.num_layers,
            **data,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any], source: str = "config.json") -> "ModelConfig":
        data = dict(data)
        model_type = data.pop("model_type", None)
        if model_type != MODEL_TYPE:
            raise EdgelinError(
                f"{source}: model_type {model_type!r} is not an edgelin checkpoint",
                "native checkpoints have model_type 'edgelin'",
                "export an edgelin checkpoint, or use a supported upstream format",
            )
        num_layers = data.pop("num_hidden_layers", None)
        for key in ("architectures", "edgelin_version", "torch_dtype", "dtype"):
            data.pop(key, None)
        _check_names(data, {f.name: f for f in dataclasses.fields(cls)}, source, "")
        attention = data.get("attention")
        if attention is not None:
            if not isinstance(attention, dict):
                raise invalid("attention", attention, "null or an object {num_heads, num_kv_heads, head_dim, ...}",
                              source)
            _check_names(attention, {f.name: f for f in dataclasses.fields(AttentionConfig)}, source, "attention.")
        check_model(data, source)  # here, so that errors name the file
        if num_layers is not None and (isinstance(num_layers, bool) or num_layers != len(data["layer_types"])):
            raise invalid("num_hidden_layers", num_layers, f"len(layer_types) = {len(data['layer_types'])}", source)
        if attention is not None:
            data["attention"] = AttentionConfig(**attention)
        data["layer_types"] = tuple(data["layer_types"])
        return cls(**data)

    @classmethod
    def load(cls, path: Path) -> "ModelConfig":
        try:
            data = json.loads(Path(path).read_text())
        except FileNotFoundError as exc:
            raise EdgelinError(f"no config.json in {Path(path).parent}", "a checkpoint is a directory with "
                               "config.json and safetensors weights", "pass a checkpoint directory") from exc
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise EdgelinError(f"{path} is not valid JSON", str(exc), "repair or re-save the checkpoint") from exc
        except RecursionError as exc:  # json's parser recurses once per nesting level
            raise EdgelinError(f"{path} is malformed", "its JSON is nested too deeply to parse",
                               "repair or re-save the checkpoint") from exc
        if not isinstance(data, dict):
            raise EdgelinError(f"{path} is not a JSON object", "config.json must map field names to values",
                               "repair or re-save the checkpoint")
        return cls.from_dict(data, source=str(path))


MODEL_RULES: dict[str, Rule] = {
    "vocab_size": SIZE, "hidden_size": SIZE, "num_heads": SIZE, "head_k_dim": SIZE, "head_v_dim": SIZE,
    "intermediate_size": COUNT, "num_k_heads": OPT_SIZE, "conv_size": SIZE, "conv_bias": FLAG,
    "rms_norm_eps": POSITIVE, "tie_word_embeddings": FLAG, "rope_theta": POSITIVE, "chunk_size": OPT_SIZE,
    "feature_seed": Rule("int", low=0, high=2**63 - 1),  # torch.Generator's seed range
    "bos_token_id": Rule("int", low=0, optional=True), "eos_token_id": Rule("int", low=0, optional=True),
    "clvr": FLAG,
}


def _check_names(data: dict[str, Any], fields: dict[str, dataclasses.Field], source: str, prefix: str) -> None:
    unknown = sorted(set(data) - set(fields))
    if unknown:
        raise EdgelinError(
            f"{source}: unknown fields {', '.join(prefix + u for u in unknown)}",
            "edgelin refuses fields it does not understand rather than silently ignore math",
            f"remove them; known fields: {', '.join(sorted(fields))}",
        )
    missing = sorted(n for n, f in fields.items() if n not in data
                     and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING)
    if missing:
        raise EdgelinError(f"{source}: missing fields {', '.join(prefix + m for m in missing)}",
                           "the model is undefined without them", "add them to config.json")


def check_model(values: dict[str, Any], where: str) -> None:
    """Every field by type and range, then the relations between them (one error line each)."""
    types = values.get("layer_types")
    if not isinstance(types, (list, tuple)) or not types or not all(isinstance(t, str) for t in types):
        raise invalid("layer_types", types, f"a non-empty list of layer types ({', '.join(LAYER_TYPES)})", where)
    for name in types:
        if name != SOFTMAX:
            get_family(name)
    check_fields(MODEL_RULES, values, where)
    attention = values.get("attention")
    if isinstance(attention, dict):
        check_attention(attention, where)
    elif attention is not None and not isinstance(attention, AttentionConfig):
        raise invalid("attention", attention, "null or an attention section", where)
    if SOFTMAX in types and attention is None:
        raise EdgelinError(
            f"{where}: config has softmax layers but no 'attention' section",
            "their head counts and window are undefined",
            "add attention: {num_heads, num_kv_heads, head_dim, window}",
        )
    _check_relations(values, types, where)


def _check_relations(values: dict[str, Any], types: list[str] | tuple[str, ...], where: str) -> None:
    heads = values["num_heads"]
    heads_k = values.get("num_k_heads") or heads
    if heads % heads_k:  # value heads share key heads in equal groups
        raise invalid("num_k_heads", heads_k, f"null or a divisor of num_heads={heads}", where)
    vocab = values["vocab_size"]
    for key in ("bos_token_id", "eos_token_id"):
        if values.get(key) is not None and values[key] >= vocab:
            raise invalid(key, values[key], f"null or an integer in [0, {vocab - 1}] (vocab_size={vocab})", where)
    overrides = values.get("family_overrides", {})
    if not isinstance(overrides, dict) or not all(isinstance(k, str) and isinstance(v, dict)
                                                  for k, v in overrides.items()):
        raise invalid("family_overrides", overrides, "an object mapping family names to {knob: value}", where)
    specs = {fam: get_family(fam).with_overrides(knobs, where) for fam, knobs in overrides.items()}
    if values.get("clvr") and all(t == SOFTMAX for t in types):  # it routes linear layers' written values
        raise invalid("clvr", True, "false for a model without linear-attention layers (CLVR routes the value "
                      "each linear layer writes)", where)
    for name in sorted(set(types) - {SOFTMAX}):
        spec = specs.get(name, FAMILIES[name])
        if spec.rotary and spec.feature.out_dim(values["head_k_dim"]) % 2:  # RetNet rotates channel pairs
            raise invalid("head_k_dim", values["head_k_dim"], f"an integer whose {spec.feature_map} feature width is "
                          f"even ({name} applies rotary embeddings)", where)
        if spec.short_conv and values.get("conv_size", 4) < 2:  # the conv state keeps conv_size - 1 taps
            raise invalid("conv_size", values["conv_size"], f"an integer >= 2 ({name} layers have a short "
                          "convolution)", where)
