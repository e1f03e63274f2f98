"""What every converter shares: reading an upstream config strictly, renaming and splitting weights.

A converter turns an upstream checkpoint (fla, transformers) into edgelin's own `ModelConfig` plus a
state dict in edgelin's names. Its config reader accounts for every field of config.json:
- a field the upstream model never reads (`reads.py`) is *inert*: it cannot change the math, so it is
  accepted and listed (`ConfigReader.inert`), and the converter sees it as absent, as upstream does;
- a field upstream reads is used (type- and range-checked), known to leave inference math unchanged
  (`HARMLESS`), or required to hold the value edgelin implements; anything else is refused by name.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

import torch

from edgelin.errors import EdgelinError
from edgelin.model.config import ModelConfig
from edgelin.rules import Rule, invalid

if TYPE_CHECKING:
    from edgelin.checkpoint import TensorFiles

Tensor = torch.Tensor

# Fields that upstream reads but that do not change inference math (every entry is read by some
# upstream model: tests/model/test_config_validation.py checks it against reads.py).
HARMLESS = {
    # metadata, loading and output plumbing (transformers' PreTrainedConfig / PreTrainedModel)
    "architectures", "model_type", "transformers_version", "dtype", "torch_dtype", "name_or_path",
    "_name_or_path", "_commit_hash", "output_attentions", "output_hidden_states", "return_dict", "id2label",
    "label2id", "problem_type", "num_labels", "chunk_size_feed_forward", "is_encoder_decoder",
    "attn_implementation", "_attn_implementation", "experts_implementation",
    # generation and training only: caches, padding, initialisation, losses
    "use_cache", "pad_token_id", "initializer_range", "rescale_prenorm_residual", "time_step_min",
    "time_step_max", "time_step_floor", "time_step_rank", "attention_dropout", "fuse_cross_entropy",
    "fuse_linear_cross_entropy", "use_l2warp", "max_position_embeddings",
    # kernel choices computing the same math (fused norms/MLPs, chunked vs recurrent, fp32 residual)
    "fuse_norm", "fuse_swiglu", "attn_mode", "chunk_size", "residual_in_fp32",
}


class ConfigReader:
    """Reads an upstream config dict: typed and range-checked values, and an account of every field.

    `reads`: the fields the upstream model reads (None: all of them). The others are inert: reading
    one returns the default, as upstream would, and `finish` lists it in `inert`."""

    def __init__(self, data: dict[str, Any], source: str, harmless: set[str] = frozenset(),
                 reads: frozenset[str] | None = None):
        self.data, self.source, self.seen = data, source, set(HARMLESS) | set(harmless)
        self.reads = reads
        self.inert: list[str] = []

    def _raw(self, key: str) -> Any:
        if self.reads is not None and key not in self.reads:
            return None  # upstream never reads it: as good as absent
        return self.data.get(key)

    def get(self, key: str, default: Any = None, rule: Rule | None = None) -> Any:
        self.seen.add(key)
        value = self._raw(key)
        if value is None:
            return default
        return self.check(key, value, rule)

    def require(self, key: str, rule: Rule | None = None) -> Any:
        self.seen.add(key)
        value = self._raw(key)
        if value is None:
            raise EdgelinError(f"{self.source}: missing field {key!r}", "the architecture is undefined without it",
                               "use the config.json saved with the checkpoint")
        return self.check(key, value, rule)

    def check(self, key: str, value: Any, rule: Rule | None) -> Any:
        if rule is not None and not rule.accepts(value):
            raise invalid(key, value, rule.describe(), self.source, "use the config.json saved with the checkpoint")
        return value

    def expect(self, key: str, supported: Any, why: str, default: Any = None) -> Any:
        """A field whose other values edgelin does not implement."""
        value = self.get(key, default)
        allowed = supported if isinstance(supported, (set, tuple, list)) else (supported,)
        if not any(_same(value, a) for a in allowed):
            raise EdgelinError(
                f"{self.source}: {key}={value!r} is not supported",
                f"{why}; edgelin implements {key} in {list(allowed)}",
                "export a checkpoint with a supported value, or open an issue with the config",
            )
        return value

    def finish(self) -> None:
        """Sort the fields nobody used: inert (upstream never reads them) or refused."""
        unused = sorted(set(self.data) - self.seen)
        if self.reads is not None:
            self.inert = sorted({*self.inert, *(k for k in self.data if k not in self.reads)})
            unused = [k for k in unused if k in self.reads]
        if unused:
            raise EdgelinError(
                f"{self.source}: fields edgelin does not understand: {', '.join(unused)}",
                "the upstream model reads them, so they may change the math, and edgelin does not implement them",
                "export a checkpoint without them, or open an issue with the config",
            )


def _same(value: Any, allowed: Any) -> bool:
    """Equality without Python's True == 1: a JSON flag and a number are different values."""
    return value == allowed and isinstance(value, bool) == isinstance(allowed, bool)


def token_id(cfg: ConfigReader, key: str) -> int | None:
    """bos/eos ids: an int, or a list of them (transformers allows several eos ids; the first is used)."""
    value = cfg.get(key)
    if isinstance(value, list):
        value = value[0] if value else None
    return cfg.check(key, value, Rule("int", low=0, optional=True))


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
    harmless: frozenset[str] = field(default_factory=frozenset)  # read upstream, no effect on the math

    def origin(self, data: dict[str, Any]) -> str:
        return self.source_of(data) if self.source_of else self.source

    def reads(self, data: dict[str, Any]) -> frozenset[str]:
        from edgelin.convert.reads import upstream_reads

        return upstream_reads(self.origin(data), self.model_type)


class Weights:
    """Pops upstream tensors by name so that leftovers can be reported."""

    def __init__(self, tensors: "dict[str, Tensor] | TensorFiles", source: str):
        # a copy of the names (the caller's dict is left whole); TensorFiles reads each tensor when it is popped
        self.tensors, self.source, self.out = tensors.copy(), source, {}

    def pop(self, name: str) -> Tensor:
        if name not in self.tensors:
            raise EdgelinError(f"{self.source}: tensor {name!r} is missing",
                               "config.json promises it for this architecture", "use the complete checkpoint")
        return self._float(name, self.tensors.pop(name))

    def maybe(self, name: str) -> Tensor | None:
        return self._float(name, self.tensors.pop(name)) if name in self.tensors else None

    def _float(self, name: str, t: Tensor) -> Tensor:
        """Every upstream weight is floating point; an int or bool tensor is corrupt, never cast."""
        if not t.is_floating_point():
            raise EdgelinError(f"{self.source}: tensor {name} has dtype {str(t.dtype).removeprefix('torch.')}",
                               "weights must be floating point (float16, bfloat16, float32 or float64)",
                               "re-save the checkpoint with its floating-point weights")
        return t.float()

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
    if not math.isclose(value, round(value)) or round(value) < 1:
        raise EdgelinError(f"{source}: {what} = {value} is not a positive integer", "head sizes must be whole",
                           "fix config.json")
    return int(round(value))
