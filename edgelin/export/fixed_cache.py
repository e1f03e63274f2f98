"""A fixed-capacity KV cache held as runtime state (Apple's targets: Core AI model state, Core ML MLState or
explicit state), shared by the exporters that write one and the runners that hold one.

The contract is the ONNX static cache's (manifest extra["kv_cache"], layout "static"; `Manifest.kv_capacity`):
the manifest keeps the growing cache's dims (`past_sequence`), so `read_state` returns the tokens held and
`write_state` takes a cache of any length up to the capacity; inside the runtime each growing tensor is one
buffer of `capacity` rows that the graphs write at the sequence's position (edgelin.model.attention's
`fixed_capacity`). A call must continue the cache (position == tokens held) and fit it (held + new <= capacity);
`FixedCache.check_call` refuses anything else in one line before the runtime sees it.

Torch-free: runners import it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from edgelin.errors import EdgelinError

if TYPE_CHECKING:
    from edgelin.artifact.manifest import Manifest

GROWING = "past_sequence"
DEFAULT_CONTEXT = 4096  # --context when a model has full-attention layers and none is given
OP = "slice-update"  # how the graphs write the cache (extra["kv_cache"]["op"]; ONNX's: GroupQueryAttention)


def kv_cache_entry(capacity: int, dtype: str = "float32") -> dict:
    """manifest extra["kv_cache"] of an export holding a fixed-capacity cache as state (module docstring)."""
    return {"layout": "static", "capacity": capacity, "op": OP, "dtype": dtype, "flag": f"--context {capacity}"}


def capacity_dims(dims: tuple, capacity: int | None) -> tuple:
    """A state tensor's dims inside the runtime: the growing axis at the capacity."""
    return tuple(capacity if d == GROWING else d for d in dims) if capacity is not None else tuple(dims)


def full_attention_layers(model) -> list[int]:  # noqa: ANN001 (a CausalLM; torch stays out of this module)
    """The layers whose KV cache grows with the context (full-attention softmax layers, no window)."""
    from edgelin.families import SOFTMAX

    return [i for i, name in enumerate(model.config.layer_types)
            if name == SOFTMAX and model.config.attention.window is None]


def resolve_context(model, context: int | None) -> int | None:  # noqa: ANN001
    """The capacity an Apple export gives its full-attention layers: --context, DEFAULT_CONTEXT when none is given,
    None for a model without such layers (a --context there is refused: nothing would hold it). Refuses a capacity
    shorter than the export's own checks feed (validate's reference vectors and quality figures) or larger than
    this machine's memory holds, before anything is traced."""
    from edgelin.artifact.reference_vectors import positions_needed
    from edgelin.export.static_cache import check_static_cache_size

    layers = full_attention_layers(model)
    if not layers:
        if context is not None:
            raise EdgelinError(f"--context {context} on a model without full-attention layers",
                               "its state is constant-size already (linear layers, sliding-window attention)",
                               "drop --context")
        return None
    capacity = DEFAULT_CONTEXT if context is None else context
    if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 1:
        raise EdgelinError(f"--context {capacity!r}", "the KV cache's capacity is a number of tokens",
                           f"pass e.g. --context {DEFAULT_CONTEXT}")
    need = positions_needed()
    if capacity < need:
        raise EdgelinError(f"--context {capacity}", f"`edgelin validate DIR` (the reference vectors and quality "
                           f"figures) feeds one sequence up to {need} tokens, more than a {capacity}-token cache "
                           "holds", f"pass --context {need} or more")
    check_static_cache_size(model.config, capacity, rotary_tables=False, least=need)
    return capacity


@dataclass(frozen=True)
class FixedCache:
    """A runner's view of the fixed-capacity cache: which state tensors grow (their axis) and the capacity."""

    capacity: int
    axes: tuple[int | None, ...]  # per manifest state input: the growing axis, None for a fixed-size tensor
    flag: str = "--context {}"  # the export flags that set the capacity (Manifest.kv_flag), {} for the tokens

    @classmethod
    def of(cls, manifest: "Manifest") -> "FixedCache | None":
        if manifest.kv_capacity is None:
            return None
        return cls(manifest.kv_capacity, tuple(t.dims.index(GROWING) if GROWING in t.dims else None
                                               for t in manifest.state_inputs), manifest.kv_flag("{}"))

    def shapes(self, manifest: "Manifest", batch: int) -> list[tuple[int, ...]]:
        """The runtime's state shapes for `batch` sequences (the growing axis at the capacity)."""
        return [tuple(v.shape) for v in manifest.initial_state(batch, self.capacity).values()]

    def held(self, values: list[np.ndarray]) -> int:
        """The tokens a written (growing-shaped) state holds: its growing axis' length (check_state made them agree)."""
        return next((v.shape[axis] for v, axis in zip(values, self.axes) if axis is not None), 0)

    def padded(self, values: list[np.ndarray]) -> list[np.ndarray]:
        """Growing-shaped arrays, each at the capacity (zero rows after the tokens held)."""
        out = []
        for value, axis in zip(values, self.axes):
            if axis is None:
                out.append(np.array(value, copy=True))
                continue
            if value.shape[axis] > self.capacity:
                raise EdgelinError(f"a state of {value.shape[axis]} tokens", f"the export's KV cache holds "
                                   f"{self.capacity} tokens", f"re-export with {self.flag.format(value.shape[axis])} "
                                   "or more")
            pad = [(0, 0)] * value.ndim
            pad[axis] = (0, self.capacity - value.shape[axis])
            out.append(np.pad(value, pad))
        return out

    def valid(self, values: list[np.ndarray], held: int) -> list[np.ndarray]:
        """Copies of the first `held` rows of each growing buffer (fixed-size tensors whole)."""
        return [np.array(v if axis is None else v[(slice(None),) * axis + (slice(0, held),)], copy=True)
                for v, axis in zip(values, self.axes)]

    def check_room(self, kind: str, held: int, tokens: int) -> None:
        """Refuse `tokens` more after `held` (0 more: a written state of `held` tokens) past the capacity."""
        if held + tokens > self.capacity:
            raise EdgelinError(f"{kind} of {tokens} token(s) after {held}" if tokens else f"{kind} of a {held}-token "
                               "cache", f"the export's fixed-capacity KV cache holds {self.capacity} tokens (exported "
                               f"with {self.flag.format(self.capacity)})",
                               f"re-export with a larger --context (at least {held + tokens}), or start a new sequence")

    def check_call(self, kind: str, held: int, tokens: int, position: np.ndarray | None) -> None:
        """Refuse a call that does not continue the cache or does not fit it."""
        self.check_room(kind, held, tokens)
        if position is None or not (np.asarray(position) == held).all():
            what = "position_ids" if kind == "step" else "start"
            raise EdgelinError(f"{kind} {what} {None if position is None else np.asarray(position).tolist()} on a KV "
                               f"cache holding {held} tokens", "a fixed-capacity cache writes each token at its "
                               "position, so the positions must continue the cache",
                               f"pass {what} = {held} (the tokens fed so far) for every sequence")
