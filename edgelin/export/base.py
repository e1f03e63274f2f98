"""The target plug-in interface. A target says whether it is available here, whether it supports a
model on a device (and why not), exports the graphs into a folder, and gives a runner for them."""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from edgelin.errors import EdgelinError

if TYPE_CHECKING:
    from edgelin.devices import DeviceProfile
    from edgelin.export.manifest import Manifest
    from edgelin.families import FamilySpec
    from edgelin.model.lm import CausalLM

State = dict[str, np.ndarray]


@dataclass(frozen=True)
class ExportOptions:
    precision: str = "fp32"
    opset: int = 18
    state_dtype: str = "float32"  # storage dtype of the state tensors (a device profile's state_dtype)


class Runner(ABC):
    """Runs an exported folder. State is a dict keyed by the graphs' past_key_values.* names.

    `step` and `prefill` refuse bad input before it reaches a runtime (a wrong shape or dtype can
    crash a runtime or be silently broadcast; a NaN in the state poisons every later token); the
    target implements `_step` and `_prefill`. Set `check_inputs = False` to skip the checks for
    inputs already known good (the check costs a few µs per step: see README)."""

    check_inputs: bool = True

    def __init__(self, manifest: "Manifest"):
        self.manifest = manifest
        # Resolved once, since the check runs on every call: per state input its name, dims, dtype,
        # and the dims after batch when they are all fixed (None for a growing cache).
        self._state_spec = [(t.name, t.dims, np.dtype(t.dtype),
                             tuple(t.dims[1:]) if all(isinstance(d, int) for d in t.dims[1:]) else None)
                            for t in manifest.state_inputs]
        self._state_names = frozenset(spec[0] for spec in self._state_spec)

    def initial_state(self, batch: int) -> State:
        return self.manifest.initial_state(batch)

    def step(self, input_ids: np.ndarray, state: State, position: np.ndarray | None = None
             ) -> tuple[np.ndarray, State]:
        """input_ids [B] int, position [B] int -> (logits [B, V], new state)."""
        if self.check_inputs:
            self.check_call("step", input_ids, state, position)
        return self._step(input_ids, state, position)

    def prefill(self, input_ids: np.ndarray, state: State, start: np.ndarray | None = None
                ) -> tuple[np.ndarray, State]:
        """input_ids [B, T] int, start [B] int -> (logits of the last position [B, V], new state)."""
        if self.check_inputs:
            self.check_call("prefill", input_ids, state, start)
        return self._prefill(input_ids, state, start)

    @abstractmethod
    def _step(self, input_ids: np.ndarray, state: State, position: np.ndarray | None) -> tuple[np.ndarray, State]:
        """The target's step, on inputs already checked."""

    @abstractmethod
    def _prefill(self, input_ids: np.ndarray, state: State, start: np.ndarray | None) -> tuple[np.ndarray, State]:
        """The target's prefill, on inputs already checked."""

    # ---- input checks --------------------------------------------------------------------------
    def check_call(self, kind: str, input_ids: np.ndarray, state: State, position: np.ndarray | None) -> None:
        ids = _array("input_ids", input_ids)
        rank = 1 if kind == "step" else 2
        if ids.ndim != rank or (rank == 2 and ids.shape[1] == 0) or ids.shape[0] == 0:
            want = "[batch]" if kind == "step" else "[batch, sequence] with sequence >= 1"
            raise EdgelinError(f"{kind} input_ids has shape {list(ids.shape)}", f"the {kind} graph takes {want}",
                               "pass one token per sequence to step, a [batch, tokens] array to prefill")
        check_ids(ids, self.manifest.vocab_size)
        batch = ids.shape[0]
        if position is not None or self.manifest.needs_position:
            check_positions(position, batch, kind)
        self.check_state(state, batch)

    def check_state(self, state: State, batch: int) -> None:
        """Refuse a state that does not fit the graphs or holds NaN/Inf, before it reaches a runtime."""
        if not isinstance(state, dict):
            raise EdgelinError(f"the state is a {type(state).__name__}", "it must be a dict of past_key_values.* "
                               "arrays", "start from runner.initial_state(batch)")
        if len(state) != len(self._state_spec) or not self._state_names.issuperset(state):
            missing = [spec[0] for spec in self._state_spec if spec[0] not in state]
            if missing:
                raise EdgelinError(f"state input {missing[0]} is missing", "every past_key_values.* must be fed",
                                   "start from runner.initial_state(batch)")
            raise EdgelinError(f"unknown state input {sorted(set(state) - self._state_names)[0]}",
                               "the graphs take only the manifest's state tensors",
                               "feed the state the graphs returned, or runner.initial_state(batch)")
        past: dict[str, int] = {}  # a growing cache's length must agree across its tensors
        with np.errstate(over="ignore"):  # entered once: all_finite's x·x may overflow (then re-checked)
            for name, dims, dtype, tail in self._state_spec:
                value = _array(name, state[name])
                shape = value.shape
                if tail is not None:  # the common case, one tuple comparison: [batch, fixed...]
                    fits = shape[:1] == (batch,) and shape[1:] == tail
                else:  # a growing cache: a symbolic dim seen first (past_sequence) takes any size
                    sizes = {"batch": batch, **past}
                    fits = len(shape) == len(dims) and all(shape[a] == sizes.get(d, shape[a]) if isinstance(d, str)
                                                           else shape[a] == d for a, d in enumerate(dims))
                if not fits:
                    raise EdgelinError(f"state input {name} has shape {list(shape)}",
                                       f"the graph expects {list(dims)} with batch {batch}"
                                       + "".join(f" and {d} {n} (as in the tensors before it)"
                                                 for d, n in past.items()),
                                       "feed the state the graphs returned, or runner.initial_state(batch)")
                if tail is None:
                    past.update({d: shape[a] for a, d in enumerate(dims) if isinstance(d, str) and d != "batch"})
                if value.dtype != dtype:
                    raise EdgelinError(f"state input {name} has dtype {value.dtype}", f"the graph expects {dtype}",
                                       "feed the state the graphs returned, or runner.initial_state(batch)")
                if not all_finite(value):
                    raise EdgelinError(f"state input {name} contains NaN or Inf", "the recurrence would "
                                       "propagate it to every later token", "start from runner.initial_state(batch)")


def _array(name: str, value) -> np.ndarray:
    if not isinstance(value, np.ndarray):
        raise EdgelinError(f"{name} is a {type(value).__name__}", "runners take numpy arrays",
                           f"pass {name} as a numpy array")
    return value


def check_ids(ids: np.ndarray, vocab_size: int) -> None:
    if ids.dtype.kind not in "iu":
        raise EdgelinError(f"input_ids has dtype {ids.dtype}", "token ids are integers",
                           "pass np.int64 ids from the tokenizer shipped with the export")
    # One pass: seen as unsigned, a negative id is >= 2**63, so max() >= vocab catches both ends.
    if ids.size and ids.view(f"u{ids.dtype.itemsize}").max() >= vocab_size:
        raise EdgelinError("token id out of range", f"ids must be in [0, {vocab_size}), got "
                           f"{int(ids.min())}..{int(ids.max())}", "use the tokenizer shipped with the export")


def check_positions(position: np.ndarray | None, batch: int, kind: str) -> None:
    what = "position_ids" if kind == "step" else "start"
    if position is None:
        raise EdgelinError(f"{kind} needs {what}", "a layer of this model uses positions (softmax attention "
                           "or rotary)", f"pass {what} as an int64 array of shape [{batch}]")
    position = _array(what, position)
    if position.dtype.kind not in "iu" or position.shape != (batch,):
        raise EdgelinError(f"{what} has shape {list(position.shape)} and dtype {position.dtype}",
                           f"the {kind} graph takes int64 [{batch}] (one position per sequence)",
                           f"pass np.full({batch}, position, np.int64)")
    if position.size and position.min() < 0:
        raise EdgelinError(f"{what} holds {int(position.min())}", "positions count tokens from 0",
                           "pass positions >= 0")


def all_finite(value: np.ndarray) -> bool:
    """Exact, and cheaper than np.isfinite(value).all() on large arrays (one BLAS pass, no boolean
    temporary): x·x is a sum of squares, NaN if any element is NaN and +Inf if any is ±Inf; the
    squares are >= 0, so no Inf - Inf can cancel them. A finite x·x proves every element finite. A
    non-finite x·x can also be an overflow of large finite values: only then does the exact test run.
    Call it under np.errstate(over="ignore") (check_state does, once for all tensors)."""
    if value.dtype.kind != "f":
        return True
    if value.dtype == np.float32 or value.dtype == np.float64:  # float16 has no BLAS dot
        flat = value.reshape(-1)  # a view for the contiguous arrays a runtime returns
        if math.isfinite(np.dot(flat, flat)):
            return True
    return bool(np.isfinite(value).all())


class Target(ABC):
    name: str
    extra: str  # the pip extra that brings this target's dependencies
    graph_suffix: str

    @abstractmethod
    def unavailable_reason(self) -> str | None:
        """None when this machine can export and run this target; otherwise why not."""

    def supports(self, model: "CausalLM", device: "DeviceProfile | None" = None) -> str | None:
        """None when the target can take this model on this device; otherwise the reason."""
        if device is not None and self.name not in device.targets:
            return f"device {device.name} does not list target {self.name} (it lists: {', '.join(device.targets)})"
        return None

    def family_support(self, spec: "FamilySpec") -> str | None:
        """None when every layer of this family can be exported; otherwise why not."""
        return None

    @abstractmethod
    def export(self, model: "CausalLM", folder: Path, options: ExportOptions) -> dict[str, str]:
        """Write the step and prefill graphs into folder; return {graph kind: file name}."""

    @abstractmethod
    def runner(self, folder: Path, manifest: "Manifest") -> Runner: ...
