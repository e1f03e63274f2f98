"""What every converter shares: reading an upstream config strictly, renaming and splitting weights.

A converter turns an upstream checkpoint (fla, transformers) into edgelin's own `ModelConfig` plus a
state dict in edgelin's names. Its config reader accounts for every field: a field is used, known to
leave inference math unchanged (listed), or required to hold the value edgelin implements; anything
else is refused by name, never silently ignored.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

import torch

from edgelin.errors import EdgelinError
from edgelin.model.config import ModelConfig

Tensor = torch.Tensor

# Fields of Hugging Face / fla configs that do not change inference math.
HARMLESS = {
    "architectures", "model_type", "transformers_version", "dtype", "torch_dtype", "use_cache",
    "initializer_range", "pad_token_id", "bos_token_id", "eos_token_id", "max_position_embeddings",
    "output_attentions", "output_hidden_states", "return_dict", "keys_to_ignore_at_inference",
    "fuse_norm", "fuse_swiglu", "fuse_cross_entropy", "fuse_linear_cross_entropy", "use_l2warp", "attn_mode",
    "mode", "chunk_size", "rescale_prenorm_residual", "residual_in_fp32", "time_step_min", "time_step_max",
    "time_step_floor", "time_step_rank", "attention_dropout", "tie_encoder_decoder", "is_decoder", "_name_or_path",
    "id2label", "label2id", "problem_type",
}


class ConfigReader:
    """Reads an upstream config dict and remembers which fields were accounted for."""

    def __init__(self, data: dict[str, Any], source: str, harmless: set[str] = frozenset()):
        self.data, self.source, self.seen = data, source, set(HARMLESS) | set(harmless)

    def get(self, key: str, default: Any = None) -> Any:
        self.seen.add(key)
        return self.data.get(key, default) if self.data.get(key) is not None else default

    def require(self, key: str) -> Any:
        self.seen.add(key)
        if self.data.get(key) is None:
            raise EdgelinError(f"{self.source}: missing field {key!r}", "the architecture is undefined without it",
                               "use the config.json saved with the checkpoint")
        return self.data[key]

    def expect(self, key: str, supported: Any, why: str, default: Any = None) -> Any:
        """A field whose other values edgelin does not implement."""
        value = self.get(key, default)
        allowed = supported if isinstance(supported, (set, tuple, list)) else (supported,)
        if value not in allowed:
            raise EdgelinError(
                f"{self.source}: {key}={value!r} is not supported",
                f"{why}; edgelin implements {key} in {list(allowed)}",
                "export a checkpoint with a supported value, or open an issue with the config",
            )
        return value

    def finish(self) -> None:
        unknown = sorted(set(self.data) - self.seen)
        if unknown:
            raise EdgelinError(
                f"{self.source}: fields edgelin does not understand: {', '.join(unknown)}",
                "they may change the math, and edgelin never silently ignores such fields",
                "remove them if they are inert, or open an issue with the config",
            )


def as_float(value: Any) -> float:
    """transformers writes inf as {'__float__': 'Infinity'}."""
    if isinstance(value, dict) and "__float__" in value:
        return float(value["__float__"])
    return float(value)


@dataclass(frozen=True)
class Converter:
    model_type: str
    source: str  # "fla" | "transformers"
    to_config: Callable[[ConfigReader], ModelConfig]
    map_weights: Callable[[dict[str, Tensor], ModelConfig, dict[str, Any]], dict[str, Tensor]]
    note: str = ""
    source_of: Callable[[dict[str, Any]], str] | None = None  # when one model_type has several origins

    def origin(self, data: dict[str, Any]) -> str:
        return self.source_of(data) if self.source_of else self.source


class Weights:
    """Pops upstream tensors by name so that leftovers can be reported."""

    def __init__(self, tensors: dict[str, Tensor], source: str):
        self.tensors, self.source, self.out = dict(tensors), source, {}

    def pop(self, name: str) -> Tensor:
        if name not in self.tensors:
            raise EdgelinError(f"{self.source}: tensor {name!r} is missing",
                               "config.json promises it for this architecture", "use the complete checkpoint")
        return self.tensors.pop(name).float()

    def maybe(self, name: str) -> Tensor | None:
        return self.tensors.pop(name).float() if name in self.tensors else None

    def put(self, name: str, value: Tensor) -> None:
        self.out[name] = value.contiguous()

    def move(self, src: str, dst: str, fn: Callable[[Tensor], Tensor] = lambda t: t) -> None:
        self.put(dst, fn(self.pop(src)))

    def finish(self, drop_prefixes: tuple[str, ...] = ()) -> dict[str, Tensor]:
        left = sorted(k for k in self.tensors if not k.startswith(drop_prefixes))
        if left:
            raise EdgelinError(f"{self.source}: unexpected tensors {', '.join(left[:5])}"
                               + (f" (+{len(left) - 5} more)" if len(left) > 5 else ""),
                               "the config does not describe them, so their math would be lost",
                               "check that config.json belongs to these weights")
        return self.out


def split_rows(t: Tensor, sizes: list[int], source: str, name: str) -> list[Tensor]:
    if t.shape[0] != sum(sizes):
        raise EdgelinError(f"{source}: {name} has {t.shape[0]} rows, expected {sum(sizes)} from config.json",
                           "the weights do not match the config", "use the config.json saved with these weights")
    return list(t.split(sizes, dim=0))


def infer_intermediate(weights: dict[str, Tensor], name: str) -> int:
    return int(weights[name].shape[0]) if name in weights else 0


def integral(value: float, what: str, source: str) -> int:
    if not math.isclose(value, round(value)):
        raise EdgelinError(f"{source}: {what} = {value} is not an integer", "head sizes must be whole",
                           "fix config.json")
    return int(round(value))
