"""The target plug-in interface, in three phases, and the runner with state handles.

A target declares, each as a `Phase` (ok, why not, where it does work):
  export  can this machine write the target's files (graphs, manifest)?
  build   can it turn them into what the runtime loads (an engine, a compiled model, a plugin
          library)? Optional: `can_build` is None for a target with no build phase (ONNX).
  run     can it open a runner on them?
A TensorRT export writes its ONNX anywhere but builds and runs only on an NVIDIA GPU; a Core ML
model converts on Linux but predicts only on macOS: one "available" flag cannot say that.

A `Runner` keeps the recurrent state where its runtime wants it (ONNX Runtime OrtValues, a Core ML
MLState, device buffers) behind an opaque `StateHandle`; `step` and `prefill` advance a handle in
place and return logits. Only `read_state`/`write_state` copy the state to or from numpy (validation,
tests), and `write_state` is where a state is checked (names, shapes, dtype, finite): a handle's
contents come only from the runtime or from write_state, so a step needs no per-call state scan.

This module imports no torch: a runtime-only install (edgelin[runtime]) uses it.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from edgelin.errors import EdgelinError

if TYPE_CHECKING:
    from edgelin.devices import DeviceProfile, ExportSettings, ServingLimits
    from edgelin.artifact.manifest import Manifest
    from edgelin.export.lowering import Lowering
    from edgelin.families import FamilySpec
    from edgelin.model.lm import CausalLM

State = dict[str, np.ndarray]  # past_key_values.* name -> array: what read_state returns, write_state takes
_FROM_HERE = "start from runner.new_state(batch), or write what runner.read_state returned"


@dataclass(frozen=True)
class Phase:
    """Whether a phase (export, build, run) works on this machine; if not, why, and where it does."""

    ok: bool
    reason: str | None = None
    where: str | None = None  # where it does run, when not here (e.g. "macOS with coremltools")


@dataclass(frozen=True)
class Artifact:
    """An exported (or built) folder: its manifest and the files a phase wrote ({kind: file name})."""

    folder: Path
    manifest: "Manifest"
    files: dict[str, str]


@dataclass(frozen=True)
class Built(Artifact):
    """What a build phase made; `missing`: after a partial build, what was not built and why (the rest runs)."""

    missing: str | None = None


@dataclass(frozen=True)
class TargetFlag:
    """A command-line flag a target owns (`edgelin export <target> --FLAG`, or `edgelin build DIR --FLAG`),
    declared as data: the CLI adds it to the command, the target validates its value (options_from_flags)."""

    flag: str  # e.g. "--kv-cache"
    field: str  # the keyword it is passed as (the target's options field, e.g. "kv_cache")
    help: str
    type: type = str  # str, int, bool (an on/off switch) or Path
    choices: tuple[str, ...] = ()  # the values it takes (checked when parsed), none: any of its type


class StateHandle:
    """A runner's recurrent state for `batch` sequences, kept where the runtime keeps it. Opaque:
    only the runner that made it reads its contents; `runner.read_state(handle)` copies them out."""

    __slots__ = ("_owner", "_batch", "_value")

    def __init__(self, owner: "Runner", batch: int, value: Any):
        self._owner, self._batch, self._value = owner, batch, value

    @property
    def batch(self) -> int:
        return self._batch

    def __repr__(self) -> str:
        return f"<StateHandle batch={self._batch} of {type(self._owner).__name__}>"


class Runner(ABC):
    """Runs an exported folder on state handles.

    `step` and `prefill` check the ids and positions of every call before they reach a runtime (a
    wrong shape or dtype can crash a runtime or be silently broadcast) and refuse a handle that
    another runner made or that holds another batch size. Set `check_inputs = False` to skip the
    id and position checks for inputs already known good; the handle check always runs (it is two
    comparisons). A target implements `_new`, `_run`, `_read`, `_write` and `_copy`."""

    check_inputs: bool = True
    # The longest piece edgelin.runtime.prefill hands this runner for a constant-memory model: 256 tokens
    # suit ONNX Runtime on a CPU, whose arena keeps a piece's activations (runtime.CONSTANT_PIECE says why).
    # A runner that holds no activations between calls and pays per call (a GPU launching kernels from
    # Python) sets a longer one.
    prefill_piece: int = 256

    def __init__(self, manifest: "Manifest"):
        self.manifest = manifest
        # Resolved once: per state input its name, dims, dtype, and the dims after batch when they
        # are all fixed (None for a growing cache).
        self._state_spec = [(t.name, t.dims, np.dtype(t.dtype),
                             tuple(t.dims[1:]) if all(isinstance(d, int) for d in t.dims[1:]) else None)
                            for t in manifest.state_inputs]
        self._state_names = frozenset(spec[0] for spec in self._state_spec)

    # ---- the API -------------------------------------------------------------------------------
    def new_state(self, batch: int) -> StateHandle:
        """A handle on the initial state (zeros, per the manifest's `init`) for `batch` sequences."""
        if isinstance(batch, bool) or not isinstance(batch, (int, np.integer)) or batch < 1:
            raise EdgelinError(f"new_state batch {batch!r}", "a state holds one or more sequences",
                               "pass an integer batch >= 1")
        return StateHandle(self, int(batch), self._new(int(batch)))

    def step(self, input_ids: np.ndarray, state: StateHandle, position: np.ndarray | None = None) -> np.ndarray:
        """input_ids [B] int, position [B] int: advances `state` by one token; returns logits [B, V]."""
        batch = self._ids_batch("step", input_ids)
        self._own(state, batch)
        if self.check_inputs and (position is not None or self.manifest.needs_position):
            check_positions(position, batch, "step")
        return self._run("step", input_ids, state, position)

    def prefill(self, input_ids: np.ndarray, state: StateHandle, start: np.ndarray | None = None) -> np.ndarray:
        """input_ids [B, T] int, start [B] int (the position of the first token): advances `state` by
        T tokens; returns the logits of the last position [B, V]."""
        batch = self._ids_batch("prefill", input_ids)
        self._own(state, batch)
        if self.check_inputs and (start is not None or self.manifest.needs_position):
            check_positions(start, batch, "prefill")
        return self._run("prefill", input_ids, state, start)

    def read_state(self, state: StateHandle) -> State:
        """A copy of the state as numpy arrays, keyed by the graphs' past_key_values.* names."""
        self._own(state)
        return self._read(state)

    def write_state(self, state: StateHandle, values: State) -> None:
        """Replace the handle's contents with `values` (copied), after checking names, shapes, dtype
        and that every value is finite (a NaN in the state poisons every later token)."""
        self._own(state)
        self.check_state(values, state.batch)
        self._write(state, values)

    def fork(self, state: StateHandle) -> StateHandle:
        """An independent copy of the handle (bench from one state, beam search)."""
        self._own(state)
        return StateHandle(self, state.batch, self._copy(state))

    def read_rows(self, state: StateHandle, rows: Sequence[int]) -> State:
        """Copies of batch rows `rows` of a constant-size state (serving: the rows a batched step must leave as
        they were). A target with direct access overrides `_read_rows`; otherwise the whole state is read."""
        self._own(state)
        self._check_rows(state, rows)
        return self._read_rows(state, list(rows))

    def write_rows(self, state: StateHandle, rows: Sequence[int], values: State) -> None:
        """Put back rows read by read_rows (same names, shapes and dtype: values this runner produced)."""
        self._own(state)
        self._check_rows(state, rows)
        self._write_rows(state, list(rows), values)

    def _check_rows(self, state: StateHandle, rows: Sequence[int]) -> None:
        if not self.manifest.constant_memory or any(not 0 <= r < state.batch for r in rows):
            raise EdgelinError(f"rows {list(rows)} of a state of batch {state.batch}", "rows are read and written "
                               "only within the batch, and only for a constant-size state (a KV cache's rows "
                               "share one length)", "pass rows in 0..batch-1 of a constant-memory export's state")

    def _read_rows(self, state: StateHandle, rows: list[int]) -> State:
        return {name: value[rows] for name, value in self._read(state).items()}

    def _write_rows(self, state: StateHandle, rows: list[int], values: State) -> None:
        current = self._read(state)
        for name, value in current.items():
            value[rows] = values[name]
        self._write(state, current)

    # ---- what a target implements ----------------------------------------------------------------
    @abstractmethod
    def _new(self, batch: int) -> Any:
        """The runtime's initial state for `batch` sequences (the handle's contents)."""

    @abstractmethod
    def _run(self, kind: str, input_ids: np.ndarray, state: StateHandle, position: np.ndarray | None) -> np.ndarray:
        """Run graph `kind` on checked inputs, replace `state._value` with the new state, return logits."""

    @abstractmethod
    def _read(self, state: StateHandle) -> State:
        """Copies of the handle's tensors as numpy arrays."""

    @abstractmethod
    def _write(self, state: StateHandle, values: State) -> None:
        """Store copies of checked `values` in the handle."""

    @abstractmethod
    def _copy(self, state: StateHandle) -> Any:
        """Independent contents equal to the handle's (for fork)."""

    # ---- checks ----------------------------------------------------------------------------------
    def _ids_batch(self, kind: str, input_ids: np.ndarray) -> int:
        if not self.check_inputs:
            return len(input_ids)
        ids = _array("input_ids", input_ids)
        rank = 1 if kind == "step" else 2
        if ids.ndim != rank or (rank == 2 and ids.shape[1] == 0) or ids.shape[0] == 0:
            want = "[batch]" if kind == "step" else "[batch, sequence] with sequence >= 1"
            raise EdgelinError(f"{kind} input_ids has shape {list(ids.shape)}", f"the {kind} graph takes {want}",
                               "pass one token per sequence to step, a [batch, tokens] array to prefill")
        check_ids(ids, self.manifest.vocab_size)
        return ids.shape[0]

    def _own(self, state: StateHandle, batch: int | None = None) -> None:
        """Refuse a handle this runner did not make, or one of another batch size than the ids'."""
        if not isinstance(state, StateHandle):
            raise EdgelinError(f"the state is a {type(state).__name__}", "runners take the StateHandle that "
                               "runner.new_state(batch) returns (numpy arrays go through runner.write_state)",
                               "start from runner.new_state(batch)")
        if state._owner is not self:
            raise EdgelinError("the state handle belongs to another runner", "a handle lives in the runtime "
                               "of the runner that made it", "copy it across with other.write_state(new, "
                               "runner.read_state(handle)), or start from this runner's new_state(batch)")
        if batch is not None and batch != state._batch:
            raise EdgelinError(f"the state handle holds batch {state._batch} but the ids have batch {batch}",
                               "each sequence of the batch has its own state", f"pass {state._batch} sequences, "
                               f"or use runner.new_state({batch})")

    def check_state(self, state: State, batch: int) -> None:
        """Refuse a state that does not fit the graphs or holds NaN/Inf, before it reaches a runtime."""
        if not isinstance(state, dict):
            raise EdgelinError(f"the state values are a {type(state).__name__}", "write_state takes a dict of "
                               "past_key_values.* arrays", _FROM_HERE)
        if len(state) != len(self._state_spec) or not self._state_names.issuperset(state):
            missing = [spec[0] for spec in self._state_spec if spec[0] not in state]
            if missing:
                raise EdgelinError(f"state input {missing[0]} is missing", "every past_key_values.* must be fed",
                                   _FROM_HERE)
            raise EdgelinError(f"unknown state input {sorted(set(state) - self._state_names)[0]}",
                               "the graphs take only the manifest's state tensors", _FROM_HERE)
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
                                                 for d, n in past.items()), _FROM_HERE)
                if tail is None:
                    past.update({d: shape[a] for a, d in enumerate(dims) if isinstance(d, str) and d != "batch"})
                if value.dtype != dtype:
                    raise EdgelinError(f"state input {name} has dtype {value.dtype}", f"the graph expects {dtype}",
                                       _FROM_HERE)
                if not all_finite(value):
                    raise EdgelinError(f"state input {name} contains NaN or Inf", "the recurrence would "
                                       "propagate it to every later token", "start from runner.new_state(batch)")


class NumpyRunner(Runner):
    """A runner whose handle holds numpy arrays (a runtime that takes and returns host arrays);
    the target implements `_graph`."""

    def _new(self, batch: int) -> State:
        return self.manifest.initial_state(batch)

    @abstractmethod
    def _graph(self, kind: str, input_ids: np.ndarray, state: State, position: np.ndarray | None
               ) -> tuple[np.ndarray, State]:
        """Run graph `kind`: (logits, the new state)."""

    def _run(self, kind, input_ids, state, position):
        logits, state._value = self._graph(kind, input_ids, state._value, position)
        return logits

    def _read(self, state: StateHandle) -> State:
        return {k: np.array(v, copy=True) for k, v in state._value.items()}

    def _write(self, state: StateHandle, values: State) -> None:
        state._value = {name: np.array(values[name], copy=True) for name in self._state_names}

    def _copy(self, state: StateHandle) -> State:
        return self._read(state)


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


def phase_refusal(target: "Target", phase: str, status: Phase, alternative: str = "") -> EdgelinError:
    """One line for a phase (export, build, run) this machine cannot do: which phase, why, where it works."""
    fix = f"{phase} it on {status.where}" if status.where else f"install edgelin[{target.extra}] here"
    return EdgelinError(f"the {target.name} target cannot {phase} here ({phase} phase)", status.reason or "unavailable",
                        fix + (f", or {alternative}" if alternative else ""))


class Target(ABC):
    """An export target, in phases (module docstring). Subclasses set `name`, `extra` (the pip extra
    that brings the target's dependencies) and `options_type` (a frozen dataclass of the target's own
    export options, e.g. OnnxOptions(opset=18)), and say what they write: the core asks these, it keeps
    no table of targets."""

    name: str
    extra: str
    options_type: type
    # What it writes (a combination outside these is refused, never written as another).
    precisions: tuple[str, ...] = ("fp32", "fp16")  # a subset of the vocabulary (PRECISIONS), in order of preference
    state_dtypes: tuple[str, ...] = ("float32",)
    quantize_modes: tuple[str, ...] = ()
    # Device profiles: whether one may list this target (the torch reference is not a deployment), the profile
    # fields it reads as options (e.g. a CUDA target's "sm"), and the computes it runs on (None: any) and why. A
    # built-in target declares the first and the last two in its package __init__ as well (IN_DEVICE_PROFILES,
    # PROFILE_COMPUTES, COMPUTE_REASON), where edgelin.devices reads them without importing the target.
    in_device_profiles: bool = True
    profile_options: tuple[str, ...] = ()
    profile_computes: tuple[str, ...] | None = None
    compute_reason: str = ""
    # Serving (export --serve triton): the Triton backend that serves its step graph (edgelin.serve.triton's
    # ONNXRUNTIME or TENSORRT_PLAN), None when Triton cannot serve it.
    triton_backend: str | None = None
    # The run side's report: the Python module a runner runs on (runtime_of), the pip distributions that carry
    # each such module (its version), those that use a GPU; and the optional libraries the target needs, each
    # with how to install it (the CLI's one line when one is missing).
    runtime: str = ""
    runtime_distributions: tuple[tuple[str, tuple[str, ...]], ...] = ()
    gpu_runtimes: tuple[str, ...] = ()
    libraries: tuple[tuple[str, str], ...] = ()
    # Its own command-line flags: those of `edgelin export <target>` and of `edgelin build DIR` (the common ones
    # are the CLI's); validated by options_from_flags and build.
    flags: tuple[TargetFlag, ...] = ()
    build_flags: tuple[TargetFlag, ...] = ()
    run_flags: tuple[TargetFlag, ...] = ()  # `edgelin bench DIR`'s, for the runner it opens (apply_run_options)
    erase_gate: bool = False  # its lowering runs Gated DeltaNet-2's erase gate (family_support)
    pads_state_dims: bool = False  # pads the state up to a profile's state_dim_multiple instead of refusing
    saturates_float16: bool = False  # stores float16 weights beyond its range saturated (with --force)

    def export_memory_factor(self, settings: "ExportSettings") -> float:
        """Peak memory of an export, in multiples of the model's float32 bytes, beyond the process's own
        (edgelin.export.resources refuses an export the machine cannot hold). The default is a cautious guess
        for a target not measured at real sizes; measured ones say where their figure comes from."""
        return 4.0

    def export_disk_factor(self, settings: "ExportSettings") -> float:
        """Peak disk an export writes (its temp files included), in multiples of the model's float32 bytes."""
        return 3.0

    @abstractmethod
    def can_export(self) -> Phase:
        """Can this machine write this target's files?"""

    def can_build(self, device: "DeviceProfile | None" = None) -> Phase | None:
        """Can this machine build the exported files for `device`? None: the target has no build phase."""
        return None

    @abstractmethod
    def can_run(self, device: "DeviceProfile | None" = None) -> Phase:
        """Can this machine open a runner on an export (for `device`, when given)?"""

    def device_refusal(self, device: "DeviceProfile | None") -> Phase | None:
        """A refused Phase when `device`'s profile does not list this target; None otherwise."""
        if device is None or self.name in device.targets:
            return None
        return Phase(False, f"device {device.name} does not list target {self.name} (it lists: "
                            f"{', '.join(device.targets)})", f"a device whose profile lists {self.name}")

    def supports(self, model: "CausalLM", device: "DeviceProfile | None" = None) -> str | None:
        """None when the target can take this model on this device; otherwise the reason."""
        refused = self.device_refusal(device)
        if refused is not None:
            return refused.reason
        from edgelin.families import SOFTMAX

        for layer, name in enumerate(model.config.layer_types):  # refused by name, before anything is traced
            reason = None if name == SOFTMAX else self.family_support(model.config.spec(layer))
            if reason:
                return f"layer {layer} ({name}): {reason}"
        return None

    def family_support(self, spec: "FamilySpec") -> str | None:
        """None when every layer of this family can be exported; otherwise why not."""
        from edgelin.families.spec import erase_gate_refusal

        return erase_gate_refusal(spec, self.name, self.erase_gate)

    def default_options(self) -> Any:
        return self.options_type()

    def options_from_flags(self, given: dict[str, Any], settings: "ExportSettings",
                           precision_flag: str | None = None) -> tuple[Any, "ExportSettings"]:
        """The target's options from its flags (`given`: {field: value} of those passed) and the settings the
        export runs with (a target may choose its own defaults where no device profile did, e.g. Core ML's fp16
        compute unless --precision says otherwise). Refuses a bad combination in one line. Default: the flags
        are the options' fields."""
        return (self.options_type(**given) if given else None), settings

    def check_export(self, model: "CausalLM", settings: "ExportSettings", options: Any) -> None:
        """Refuse, before anything is traced or written, what this target cannot export with these options
        (one EdgelinError line); the checks every target shares are the pipeline's."""

    def runtime_of(self, runner_label: str) -> str:
        """The Python module a runner of this target runs on (reports' `runtime`), from its label."""
        return self.runtime or self.name

    def apply_run_options(self, options: dict[str, Any]) -> None:
        """Set its run_flags' values (`options`: {field: value} of those passed) for the runners this process opens."""

    def write_serving_notes(self, root: Path, manifest: "Manifest", model: str, limits: "ServingLimits") -> None:
        """Anything else DIR/triton/ needs for this target (e.g. how to build an engine on the serving GPU)."""

    def lowering(self) -> "Lowering | None":
        """How this target's graphs express the recurrences while traced (edgelin.export.lowering); None for
        a target that traces nothing (it keeps the weights and runs the reference)."""
        return None

    @abstractmethod
    def export(self, model: "CausalLM", device: "DeviceProfile | None", settings: "ExportSettings", options: Any,
               folder: Path) -> dict[str, str]:
        """Write the graphs into `folder` (a temp folder the pipeline renames); return {kind: file name}."""

    def build(self, artifact: Artifact, device: "DeviceProfile | None" = None,
              options: dict[str, Any] | None = None) -> Built:
        """The build phase (engine, compiled model, plugin library). Only for targets whose can_build is not
        None; they override this. `options`: {field: value} of the build_flags passed. A partial build (what
        runs, built; the rest not possible here) says in `missing` what and why."""
        raise EdgelinError(f"the {self.name} target has no build phase", "its exported files run as they are",
                           f"open the folder directly (edgelin bench/generate/validate {artifact.folder})")

    @abstractmethod
    def runner(self, artifact: Artifact, device: "DeviceProfile | None" = None, threads: int | None = None) -> Runner:
        """A runner on the artifact (the run phase; open_runner checks can_run first)."""


def missing_module(modules: tuple[str, ...]) -> str | None:
    """The first module that cannot be imported, without importing any (a phase check: they are heavy)."""
    import importlib.util

    for name in modules:
        try:
            if importlib.util.find_spec(name) is None:
                return name
        except (ImportError, ValueError):
            return name
    return None
