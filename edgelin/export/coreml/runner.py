"""Running a Core ML export: the run phase on macOS (CoremlRunner), and on any machine the
conversion check (MilRunner: the package's MIL program evaluated in numpy, edgelin.export.coreml.mil).

Both share the package's layout (coreml.json, see edgelin.export.coreml.target): batch 1 functions,
so a batch runs row by row, each row with its own state; a prompt of T tokens is fed as pieces of
the enumerated prefill lengths (largest first) and its tail by `step`; state tensors are padded to
the profile's multiple inside the package and read back unpadded, in the manifest's names.

A row's state: explicit style, a dict of padded arrays by Core ML feature name (passed in, read
back from the outputs); MLState style, a Core ML `MLState` on macOS (held by the runner, updated by
Core ML in place) or the same dict for the numpy check.

A fixed-capacity KV cache (full-attention layers, manifest.kv_capacity; edgelin.export.fixed_cache):
each growing state tensor is one buffer of `capacity` rows inside the package, which the functions
write at the position. The handle counts the tokens it holds: a call must continue them (position ==
held) and fit (held + new <= capacity), else it is refused in one line before Core ML sees it;
read_state returns the rows held, write_state pads a cache of any length up to the capacity.
"""

from __future__ import annotations

import contextlib
import weakref
from abc import abstractmethod
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from edgelin.errors import EdgelinError
from edgelin.export.base import Runner, State, StateHandle
from edgelin.export.coreml.contract import feature_name
from edgelin.export.prefill_lengths import pieces
from edgelin.export.fixed_cache import FixedCache

if TYPE_CHECKING:
    from edgelin.devices import DeviceProfile
    from edgelin.artifact.manifest import Manifest

_DTYPES = {"float16": np.float16, "float32": np.float32}


@dataclass
class Rows:
    """A handle's contents: one state per sequence of the batch (the package runs batch 1), and the tokens
    each sequence's fixed-capacity KV cache holds (0 without one: nothing to count)."""

    rows: list[Any]
    held: int = 0


class ContractRunner(Runner):
    """What both Core ML runners share: rows, prompt pieces, padding (module docstring). A subclass
    implements `_call(function, feeds, row) -> (logits [1, V], row)` and `_row_new`."""

    def __init__(self, folder: Path, manifest: "Manifest"):
        from edgelin.export.coreml.contract import load_contract

        super().__init__(manifest)
        self.folder = Path(folder)
        self.contract = load_contract(folder)
        self.style = self.contract["style"]
        self._states = self.contract["states"]
        self._prefill = {f["length"]: name for name, f in self.contract["functions"].items() if f["kind"] == "prefill"}
        self._cache = FixedCache.of(manifest)  # None: every state has a fixed size

    # ---- rows -------------------------------------------------------------------------------------
    def _zeros(self) -> dict[str, np.ndarray]:
        return {s["feature"]: np.zeros(s["dims"], _DTYPES[s["dtype"]]) for s in self._states}

    def _row_new(self) -> Any:
        return self._zeros()

    def _row_arrays(self, row: Any) -> dict[str, np.ndarray]:
        """The row's padded arrays by feature name (a subclass with MLState rows reads them out)."""
        return row

    def _row_from(self, arrays: dict[str, np.ndarray]) -> Any:
        return arrays

    @abstractmethod
    def _call(self, function: str, feeds: dict[str, np.ndarray], row: Any) -> tuple[np.ndarray, Any]:
        """Run one function on one row: (logits [1, V], the row's new state)."""

    # ---- Runner ------------------------------------------------------------------------------------
    def _new(self, batch: int) -> Rows:
        return Rows([self._row_new() for _ in range(batch)])

    def _run(self, kind: str, input_ids: np.ndarray, state: StateHandle, position: np.ndarray | None) -> np.ndarray:
        handle: Rows = state._value
        rows, logits = handle.rows, []
        tokens = 1 if kind == "step" else input_ids.shape[1]
        if self._cache is not None:  # before any row runs: a refused call leaves the handle as it was
            self._cache.check_call(kind, handle.held, tokens, position)
        for b in range(len(rows)):
            start = 0 if position is None else int(position[b])
            sizes = [1] if kind == "step" else pieces(input_ids.shape[1], list(self._prefill))
            ids = input_ids[b:b + 1].reshape(1, -1)
            offset = 0
            for size in sizes:
                feeds = {"input_ids": ids[:, offset:offset + size].astype(np.int32)}
                if size == 1:
                    feeds["input_ids"] = feeds["input_ids"].reshape(1)
                if self.contract["position_ids"]:
                    feeds["position_ids"] = np.array([start + offset], np.int32)
                out, rows[b] = self._call("step" if size == 1 else self._prefill[size], feeds, rows[b])
                offset += size
            logits.append(np.asarray(out, np.float32).reshape(1, -1))
        handle.held += tokens if self._cache is not None else 0
        return np.concatenate(logits, 0)

    def _read(self, state: StateHandle) -> State:
        handle: Rows = state._value
        rows = [self._row_arrays(row) for row in handle.rows]
        values = [np.concatenate([r[s["feature"]][..., :s["true_dims"][-1]] for r in rows], 0)
                  .astype(_DTYPES[s["dtype"]]) for s in self._states]
        if self._cache is not None:  # the rows the KV cache holds, not its capacity
            values = self._cache.valid(values, handle.held)
        return {s["input"]: value for s, value in zip(self._states, values)}

    def _write(self, state: StateHandle, values: State) -> None:
        given = [values[s["input"]] for s in self._states]
        held = 0
        if self._cache is not None:  # a cache of `held` tokens, padded to the package's capacity
            held = self._cache.held(given)
            given = self._cache.padded(given)
        rows = []
        for b in range(state.batch):
            arrays = self._zeros()
            for s, value in zip(self._states, given):
                arrays[s["feature"]][..., :s["true_dims"][-1]] = value[b:b + 1]
            rows.append(self._row_from(arrays))
        state._value = Rows(rows, held)

    def _copy(self, state: StateHandle) -> Rows:
        handle: Rows = state._value
        return Rows([self._row_from({k: v.copy() for k, v in self._row_arrays(row).items()}) for row in handle.rows],
                    handle.held)


class MilRunner(ContractRunner):
    """The conversion check: the package's MIL functions evaluated in numpy (not Apple's runtime)."""

    label = "coreml MIL program in numpy (a check of the conversion, not Apple's runtime)"

    def __init__(self, folder: Path, manifest: "Manifest"):
        from edgelin.export.coreml.mil import load_program

        super().__init__(folder, manifest)
        self._programs = {p: load_program(self.folder / p) for p in {f["package"] for f in
                                                                     self.contract["functions"].values()}}

    def _function(self, name: str) -> Any:
        program = self._programs[self.contract["functions"][name]["package"]]
        return program.functions[name if self.contract["multifunction"] else "main"]

    def _call(self, function: str, feeds: dict[str, np.ndarray], row: Any) -> tuple[np.ndarray, Any]:
        from edgelin.export.coreml.mil import run_function

        if self.style == "mlstate":
            outputs, row = run_function(self._function(function), feeds, row)
            return outputs["logits"], row
        outputs, _ = run_function(self._function(function), {**feeds, **row})
        return outputs["logits"], {s["feature"]: outputs[feature_name(s["output"])] for s in self._states}


class CoremlRunner(ContractRunner):
    """Core ML predictions (macOS 13+; MLState: macOS 15+). One MLModel per function, loaded with the
    device profile's compute units; an MLState row is made by the step function and fed to every
    function (they declare the same states)."""

    label = "coreml (Apple's runtime)"

    def __init__(self, folder: Path, manifest: "Manifest", device: "DeviceProfile | None" = None):
        from edgelin.export.coreml.contract import coremltools_module, package_view

        ct = coremltools_module()
        if getattr(ct.models.model, "_MLModelProxy", None) is None:
            raise EdgelinError("Core ML cannot run predictions here", "coremltools' native module "
                               "(libcoremlpython) did not load", "install a coremltools build for this Python and "
                               "macOS (pip install --force-reinstall coremltools)")
        super().__init__(folder, manifest)
        units = {"cpuAndNeuralEngine": ct.ComputeUnit.CPU_AND_NE, "cpuAndGPU": ct.ComputeUnit.CPU_AND_GPU,
                 "cpuOnly": ct.ComputeUnit.CPU_ONLY}.get(self.contract["compute_units"], ct.ComputeUnit.ALL)
        # Each package through a private view (coremltools writes into a package it opens), kept for the runner's life
        self._views = contextlib.ExitStack()
        weakref.finalize(self, self._views.close)
        views = {p: self._views.enter_context(package_view(self.folder / p))
                 for p in {f["package"] for f in self.contract["functions"].values()}}
        self._models = {}
        for name, entry in self.contract["functions"].items():
            path = str(views[entry["package"]])
            self._models[name] = ct.models.MLModel(path, compute_units=units, function_name=name) \
                if self.contract["multifunction"] else ct.models.MLModel(path, compute_units=units)

    def _row_new(self) -> Any:
        if self.style != "mlstate":
            return self._zeros()
        return self._row_from(self._zeros())

    def _row_arrays(self, row: Any) -> dict[str, np.ndarray]:
        if self.style != "mlstate":
            return row
        return {s["feature"]: np.array(row.read_state(s["feature"])) for s in self._states}

    def _row_from(self, arrays: dict[str, np.ndarray]) -> Any:
        if self.style != "mlstate":
            return arrays
        state = self._models["step"].make_state()
        for name, value in arrays.items():
            state.write_state(name, value)
        return state

    def _call(self, function: str, feeds: dict[str, np.ndarray], row: Any) -> tuple[np.ndarray, Any]:
        model = self._models[function]
        if self.style == "mlstate":
            return model.predict(feeds, state=row)["logits"], row
        outputs = model.predict({**feeds, **row})
        return outputs["logits"], {s["feature"]: np.asarray(outputs[feature_name(s["output"])]) for s in self._states}
