"""Model configuration: the `config.json` of an edgelin checkpoint (Hugging Face conventions)."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from edgelin.errors import EdgelinError
from edgelin.families import FAMILIES, SOFTMAX, FamilySpec, LayerDims, get_family

MODEL_TYPE = "edgelin"


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
    bos_token_id: int | None = None
    eos_token_id: int | None = None

    def __post_init__(self) -> None:
        for name in self.layer_types:
            if name != SOFTMAX:
                get_family(name)
        if SOFTMAX in self.layer_types and self.attention is None:
            raise EdgelinError(
                "config has softmax layers but no 'attention' section",
                "their head counts and window are undefined",
                "add attention: {num_heads, num_kv_heads, head_dim, window}",
            )
        heads_k = self.num_k_heads or self.num_heads
        if self.num_heads % heads_k:
            raise EdgelinError(
                f"num_heads={self.num_heads} is not a multiple of num_k_heads={heads_k}",
                "value heads share key heads in equal groups",
                "pick num_k_heads dividing num_heads",
            )
        for fam in self.family_overrides:
            get_family(fam).with_overrides(self.family_overrides[fam])

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
        for key in ("architectures", "num_hidden_layers", "edgelin_version", "torch_dtype", "dtype"):
            data.pop(key, None)
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise EdgelinError(
                f"{source}: unknown fields {', '.join(unknown)}",
                "edgelin refuses fields it does not understand rather than silently ignore math",
                f"remove them; known fields: {', '.join(sorted(known))}",
            )
        missing = sorted(f.name for f in dataclasses.fields(cls)
                         if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
                         and f.name not in data)
        if missing:
            raise EdgelinError(f"{source}: missing fields {', '.join(missing)}", "the model is undefined without them",
                               "add them to config.json")
        if data.get("attention") is not None:
            try:
                data["attention"] = AttentionConfig(**data["attention"])
            except TypeError as exc:
                raise EdgelinError(f"{source}: bad 'attention' section", str(exc), "fix config.json") from exc
        data["layer_types"] = tuple(data["layer_types"])
        try:
            return cls(**data)
        except TypeError as exc:
            raise EdgelinError(f"{source}: invalid config", str(exc), "fix config.json") from exc

    @classmethod
    def load(cls, path: Path) -> "ModelConfig":
        try:
            data = json.loads(Path(path).read_text())
        except FileNotFoundError as exc:
            raise EdgelinError(f"no config.json in {Path(path).parent}", "a checkpoint is a directory with "
                               "config.json and safetensors weights", "pass a checkpoint directory") from exc
        except json.JSONDecodeError as exc:
            raise EdgelinError(f"{path} is not valid JSON", str(exc), "repair or re-save the checkpoint") from exc
        if not isinstance(data, dict):
            raise EdgelinError(f"{path} is not a JSON object", "config.json must map field names to values",
                               "repair or re-save the checkpoint")
        return cls.from_dict(data, source=str(path))
