"""The I/O contract's tensor description, shared by the exporter (torch) and every runtime (no
torch): a runtime-only install reads it from manifest.json, so this module imports nothing heavy."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class TensorIO:
    name: str
    dims: tuple[int | str, ...]
    dtype: str
    role: str  # input_ids | position_ids | state | logits
    feeds: str | None = None  # a present.* output: the past input it becomes next call
    layer: int | None = None
    state_name: str | None = None
    state_role: str | None = None  # recurrent | normalizer | conv | key | value (StateTensor.role)

    def to_dict(self) -> dict:
        return {k: (list(v) if isinstance(v, tuple) else v) for k, v in self.__dict__.items() if v is not None}

    @classmethod
    def from_dict(cls, data: dict) -> "TensorIO":
        return cls(**{**data, "dims": tuple(data["dims"])})


def grown_dims(dims: tuple, extra: str) -> tuple:
    """A growing KV cache's present length is its past length plus the new tokens ("1" for a step,
    "sequence" for a prefill)."""
    return tuple(f"past_sequence + {extra}" if d == "past_sequence" else d for d in dims)
