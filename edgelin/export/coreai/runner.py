"""Running a Core AI export through Apple's Core AI runtime: on Linux the CPU runtime the coreai-core wheel
carries, on macOS the OS's (which picks CPU, GPU or Neural Engine itself).

A state handle holds the model state as the runtime's arrays (coreai.runtime.NDArray), one per state tensor and
group of rows: the whole batch where the entry points take any batch (--dynamic-batch), else one group per row (a
batch-1 export runs a batch row by row). The runtime updates them in place on every call, so a step copies
nothing but the ids in and the logits out. A full-attention KV cache lives in those
arrays at the export's capacity (edgelin.export.fixed_cache): read_state returns the rows the sequence holds.
A prompt of T tokens runs as pieces of the enumerated prefill lengths (largest first) and its tail by step.

Where the export compiled the asset for this platform (coreai.json `compiled`), the runner loads that folder
(milliseconds); otherwise Apple's runtime compiles the asset first (what `AIModelAsset.executable()` does: seconds
to minutes, into a temporary folder). Torch-free.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import threading
import time
import weakref
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from edgelin.environment import module_version
from edgelin.errors import EdgelinError
from edgelin.export.base import Runner, State, StateHandle
from edgelin.export.coreai.contract import ASSET, load_contract, native_stderr_quiet, this_platform
from edgelin.export.fixed_cache import FixedCache
from edgelin.export.prefill_lengths import pieces

if TYPE_CHECKING:
    from edgelin.artifact.manifest import Manifest

_DTYPES = {"float16": np.float16, "float32": np.float32}


@dataclass
class _Held:
    """A handle's contents: per group of rows the runtime's state arrays by state name (module docstring), and
    the tokens a KV cache holds (every row of a handle holds as many)."""

    groups: list[dict[str, Any]]
    held: int = 0
    numpy: list[dict[str, np.ndarray]] = field(default_factory=list)  # the arrays behind `groups` (kept alive)


class _RuntimeLoop(asyncio.SelectorEventLoop):
    """The event loop the runtime's calls complete on, counting the runtime's threads inside
    `call_soon_threadsafe`. Apple's runtime completes each call from one of its dispatch threads, which wakes
    this loop through its self-pipe: a socket write that releases the GIL and takes it back after the loop has
    already seen the result. A process that exits while such a thread waits for the GIL aborts (coreai-core
    1.0.0b3: Python ends the thread with pthread_exit, whose unwinding Swift's runtime refuses: "C++ exception
    handling detected ...", SIGABRT, exit status 134, after a correct run). So before the interpreter finalises,
    `_drain` waits until no runtime thread is inside the call."""

    def __init__(self) -> None:
        super().__init__()
        self._inside = 0
        self._count_lock = threading.Lock()

    def call_soon_threadsafe(self, callback, *args, context=None):  # noqa: ANN001, ANN201 (asyncio's signature)
        with self._count_lock:
            self._inside += 1
        try:
            return super().call_soon_threadsafe(callback, *args, context=context)
        finally:
            with self._count_lock:
                self._inside -= 1

    def drain(self, timeout: float = 2.0) -> None:
        deadline = time.monotonic() + timeout
        while self._inside and time.monotonic() < deadline:
            time.sleep(0.001)  # releases the GIL: the runtime's thread finishes its call


_LOOP: _RuntimeLoop | None = None


def _runtime_loop() -> _RuntimeLoop:
    """One loop for every runner of the process (runners call it from one thread at a time)."""
    global _LOOP
    if _LOOP is None:
        _LOOP = _RuntimeLoop()
        atexit.register(_drain)
    return _LOOP


def _drain() -> None:
    """At exit (atexit runs before the interpreter starts finalising): let the runtime's threads leave Python."""
    if _LOOP is not None:
        _LOOP.drain()


class CoreaiRunner(Runner):
    """Core AI runtime predictions on state handles (module docstring)."""

    label = "coreai (Apple's Core AI runtime)"

    def __init__(self, folder: Path, manifest: "Manifest"):
        super().__init__(manifest)
        from coreai.runtime import NDArray

        self.folder = Path(folder)
        self.contract = load_contract(folder)
        self._ndarray = NDArray
        self._states = self.contract["states"]
        self._prefill = {f["length"]: name for name, f in self.contract["functions"].items() if f["kind"] == "prefill"}
        self._cache = FixedCache.of(manifest)
        self._whole_batch = self.contract.get("batch") == "dynamic"
        self._loop = _runtime_loop()
        self._exit = contextlib.AsyncExitStack()
        weakref.finalize(self, _close, self._loop, self._exit)
        model, self.loaded_files = self._loop.run_until_complete(self._open())
        with native_stderr_quiet():
            self._functions = {name: model.load_function(name) for name in self.contract["functions"]}
        if len(self._states) != len(manifest.state_inputs) or any(
                s["input"] != t.name for s, t in zip(self._states, manifest.state_inputs)):
            raise EdgelinError(f"{self.folder / 'coreai.json'} and manifest.json disagree on the state",
                               "each lists the state tensors in the graphs' order", "re-export the folder")

    async def _open(self) -> tuple[Any, tuple[str, ...]]:
        """The loaded model and the folder's files it read: the compiled folder where it was compiled for this
        platform, else the asset compiled now by Apple's runtime (kept open for the runner's life)."""
        from coreai.authoring import AIModelAsset
        from coreai.runtime import AIModel

        compiled = self.contract.get("compiled")
        if compiled and compiled.get("platform") == this_platform() and compiled.get("coreai_core") == module_version("coreai-core"):
            return await AIModel.load(self.folder / compiled["file"]), (compiled["file"],)
        asset = AIModelAsset.load(self.folder / self.contract.get("asset", ASSET))
        return await self._exit.enter_async_context(asset.executable()), (self.contract.get("asset", ASSET),)

    # ---- handles ---------------------------------------------------------------------------------
    def _wrap(self, values: list[np.ndarray], held: int) -> _Held:
        """A handle on whole-batch arrays (one per state tensor), split into the runtime's groups of rows."""
        rows = [slice(None)] if self._whole_batch else [slice(b, b + 1) for b in range(len(values[0]))]
        numpy = [{s["feature"]: np.ascontiguousarray(v[part], dtype=_DTYPES[s["dtype"]])
                  for s, v in zip(self._states, values)} for part in rows]
        groups = [{name: self._ndarray(a) for name, a in arrays.items()} for arrays in numpy]
        return _Held(groups, held, numpy)

    def _new(self, batch: int) -> _Held:
        shapes = self._cache.shapes(self.manifest, batch) if self._cache else [
            tuple(v.shape) for v in self.manifest.initial_state(batch).values()]
        return self._wrap([np.zeros(shape, _DTYPES[s["dtype"]]) for shape, s in zip(shapes, self._states)], 0)

    def _arrays(self, held: _Held) -> list[np.ndarray]:
        """Whole-batch copies of the state, one per state tensor."""
        return [np.concatenate([np.asarray(group[s["feature"]].numpy()) for group in held.groups], 0)
                for s in self._states]

    def _read(self, state: StateHandle) -> State:
        held: _Held = state._value
        arrays = self._arrays(held)
        if self._cache:
            arrays = self._cache.valid(arrays, held.held)
        return {s["input"]: a for s, a in zip(self._states, arrays)}

    def _write(self, state: StateHandle, values: State) -> None:
        arrays = [values[s["input"]] for s in self._states]
        held = self._cache.held(arrays) if self._cache else 0
        state._value = self._wrap(self._cache.padded(arrays) if self._cache else arrays, held)

    def _copy(self, state: StateHandle) -> _Held:
        held: _Held = state._value
        return self._wrap(self._arrays(held), held.held)

    # ---- calls -----------------------------------------------------------------------------------
    def _run(self, kind: str, input_ids: np.ndarray, state: StateHandle, position: np.ndarray | None) -> np.ndarray:
        held: _Held = state._value
        ids = input_ids.reshape(len(input_ids), -1)
        sizes = [1] if kind == "step" else pieces(ids.shape[1], list(self._prefill))
        if self._cache:
            self._cache.check_call(kind, held.held, ids.shape[1], position)
        start = np.zeros(len(ids), np.int64) if position is None else np.asarray(position, np.int64)
        rows = [slice(None)] if self._whole_batch else [slice(b, b + 1) for b in range(len(ids))]
        logits = [self._feed(ids[part], start[part], sizes, group) for part, group in zip(rows, held.groups)]
        held.held += ids.shape[1]
        return np.concatenate(logits, 0)

    def _feed(self, ids: np.ndarray, start: np.ndarray, sizes: list[int], group: dict[str, Any]) -> np.ndarray:
        """One group of rows through its pieces (prefill lengths, then steps): the last piece's logits."""
        offset, logits = 0, None
        for size in sizes:
            piece = ids[:, offset:offset + size].astype(np.int32)
            feeds = {"input_ids": self._ndarray(piece.reshape(-1) if size == 1 else np.ascontiguousarray(piece))}
            if self.contract["position_ids"]:
                feeds["position_ids"] = self._ndarray((start + offset).astype(np.int32))
            function = self._functions["step" if size == 1 else self._prefill[size]]
            logits = self._loop.run_until_complete(function(inputs=feeds, state=group))["logits"]
            offset += size
        return np.array(logits.numpy(), dtype=np.float32, copy=True).reshape(len(ids), -1)


def _close(loop: _RuntimeLoop, exit_stack: contextlib.AsyncExitStack) -> None:
    """Leave the runtime's context (a temporary compiled folder is removed); the loop stays for other runners."""
    with contextlib.suppress(Exception):
        if not loop.is_closed() and not loop.is_running():
            loop.run_until_complete(exit_stack.aclose())
