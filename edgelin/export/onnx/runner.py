"""The ONNX target's run half: an ONNX Runtime runner whose state stays in OrtValues between calls.

Imports onnxruntime and numpy only (no torch, no onnx): a runtime-only install runs exported folders
with it. The export half is edgelin.export.onnx.target.

State handles: a constant-memory model's state lives in two sets of preallocated OrtValues per handle,
and each step binds one set as the past inputs and the other as the present outputs, then swaps them
(ping-pong), so no state tensor is copied or allocated per step; the step's two IO bindings are built
once per handle, and a step only writes the token and position into their bound buffers. A state the
step graph's metadata lists as safe to update in place (edgelin.export.onnx.in_place: every state of
every family edgelin exports) is bound to one buffer as both its past and its present instead, and
stays there across steps: half the state's cache footprint. A prefill still ping-pongs every state
(its Scan reads the past while it writes), after which the step bindings are rebuilt. A growing KV
cache changes shape every call: its outputs are allocated by ONNX Runtime and kept as the next
inputs (still no numpy round trip). Only read_state / write_state copy state to or from numpy.

A static KV cache (`export --kv-cache static --context N`, manifest.kv_capacity): each growing state
tensor lives in one buffer of N positions, bound as both its past input and its present output, which
the graphs' GroupQueryAttention updates in place; the handle counts the tokens the cache holds (a
position must continue it), read_state returns the valid part, and a call past N is refused.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from edgelin.errors import EdgelinError
from edgelin.export.base import Runner, State, StateHandle
from edgelin.export.fixed_cache import FixedCache
from edgelin.artifact.manifest import NUMPY_DTYPES, GraphEntry, Manifest
from edgelin.artifact.state import outputs_by_input

if TYPE_CHECKING:
    from edgelin.ortops import OpsLibrary
    import onnxruntime as ort

# ONNX Runtime's weight prepacking for exports whose graphs share a weights file: None (default) leaves
# it off for float exports (one mapped copy of the weights; docs/performance.md#precision-and-size has
# the cost, ~9% on fp32 steps with ONNX Runtime's MatMul; a --step-ops edgelin step's products are edgelin's
# kernel, which reads the mapped weights and never prepacks) and on for quantised ones (MatMulNBits needs it).
# The runner's `prepack` argument, or this environment variable ("1" on, "0" off; `edgelin bench --prepack` sets
# it), overrides.
PREPACK_ENV = "EDGELIN_ORT_PREPACK"


def prepack_choice(manifest: Manifest, prepack: bool | None = None, library: bool = False) -> bool:
    """Whether the runner lets ONNX Runtime prepack weights (see PREPACK_ENV). `library`: edgelin's operator
    library loads here; then a quantised export whose every weight product is the library's (both graphs: the
    manifest's ort_ops entry says none is left to ONNX Runtime) is not prepacked either, and its two graphs read
    one mapping of the weights."""
    import os

    if prepack is None and os.environ.get(PREPACK_ENV, "") in ("0", "1"):
        prepack = os.environ[PREPACK_ENV] == "1"
    if prepack is not None:
        return prepack
    ops = manifest.extra.get("ort_ops") or {}
    if library and ops.get("prefill_nodes") and ops.get("packed_products") == 0:
        return not manifest.extra.get("weights")
    return not manifest.extra.get("weights") or bool(manifest.extra.get("quantization"))


# Prefill pieces on a float16 static KV cache (--kv-dtype fp16). ONNX Runtime's CPU GroupQueryAttention has no
# flash path for float16: per call it fills a float32 [heads, piece, capacity] score buffer and float32 copies of
# each head's cached keys and values, and its arena keeps growing with the position. Qwen3.5 peer, int4, 34,944
# rows: peak RSS after a 32k prompt 442 MiB in pieces of 256, 257 in 128, 191 in 64 (the float32 cache: 193),
# prefill at 8k-12k 1,152 -> 1,006 tok/s (the float32 cache's 1,083); issue 13, docs/performance.md#cpu-step-latency.
HALF_CACHE_PREFILL_PIECE = 64
# Prefill pieces of a constant-memory model (no KV cache): ONNX Runtime's arena keeps the largest piece's
# activations. Mamba2 peer, 2,048-token prompt, 1 thread: 256 -> 128 tokens cost no speed and cut peak RSS
# 125.0 -> 116.2 MiB (float16 weights), 108.3 -> 100.1 (int4); 128 -> 64 cut another ~5 MiB at every precision
# (int8 106.0 -> 100.9, int4 100.2 -> 95.1, f16w 116.4 -> 111.6, fp32 138.3 -> 133.5) for 3-10% of the prefill
# speed, which stays ahead of llama.cpp's; 32 saves 1.2 MiB more for 29% (docs/performance.md#cpu-step-latency).
CONSTANT_MEMORY_PREFILL_PIECE = 64

# "0" turns off the one shared mapping of weights.bin (each session then maps the file itself; for A/B runs).
SHARED_ENV = "EDGELIN_ORT_SHARED_WEIGHTS"


def _options(ort: Any, threads: int | None, prepack: bool, kind: str = "step") -> "ort.SessionOptions":
    options = ort.SessionOptions()
    options.log_severity_level = 3
    if kind == "prefill":
        options.enable_mem_pattern = False
        # ORT's default node order kept tensors of every layer alive to the end of a prefill run (RSS rose
        # layer by layer); the priority-based order frees them as it goes: Mamba2 12 M, 2,048-token prefill,
        # peak RSS 160.4 -> 152.7 MiB at the same speed (issue 13; docs/performance.md#cpu-step-latency).
        options.execution_order = ort.ExecutionOrder.PRIORITY_BASED
        # Each session has its own intra-op pool, and an idle pool's workers keep spinning for a while after
        # Run(): the prefill's spun on the cores the decode steps right after it need (Mamba2 int4, 2 threads:
        # steps after a prefill p50 1.0-1.16 -> 0.84 ms, p99 4.3-5.2 -> 1.0-1.1 ms). Its workers stop as
        # Run() returns; the step session keeps spinning between steps (its next call comes right away).
        options.add_session_config_entry("session.force_spinning_stop", "1")
    if threads:
        options.intra_op_num_threads = threads
    if not prepack:
        options.add_session_config_entry("session.disable_prepacking", "1")
    return options


def shared_initializers(folder: Path, manifest: Manifest) -> tuple[np.ndarray | None, dict[str, list[tuple[str, Any]]]]:
    """One read-only mapping of the folder's weights file and, per graph kind, (initializer name, OrtValue over
    its bytes in that mapping) for every external initializer the manifest records for that graph
    (extra.weights.tensors_by_graph): the graphs' tensors that hold the same bytes are views of the same pages.
    A graph with no record (an older export) or an entry that is not what edgelin writes gets none (ONNX
    Runtime then loads it itself). Call after _check_weights (the file has its recorded size)."""
    import onnxruntime as ort

    entry = manifest.extra["weights"]
    recorded = entry.get("tensors_by_graph") or {}
    if entry["bytes"] == 0 or not recorded:
        return None, {}
    weights = np.memmap(folder / entry["file"], np.uint8, mode="r")
    shared: dict[str, list[tuple[str, Any]]] = {}
    for kind, graph in manifest.graphs.items():
        values = []
        for name, offset, length, dtype, dims in recorded.get(graph.file, []):
            try:
                itemsize = np.dtype(dtype).itemsize
            except TypeError:
                values = []
                break
            if offset < 0 or offset + length > len(weights) or offset % itemsize or length != itemsize * int(
                    np.prod(dims, dtype=np.int64)) or any(d < 0 for d in dims):
                values = []  # not what edgelin writes: leave this graph to ONNX Runtime
                break
            values.append((name, ort.OrtValue.ortvalue_from_numpy(weights[offset:offset + length].view(dtype)
                                                                 .reshape(dims))))
        shared[kind] = values
    return weights, shared


def _takes_ops(library: "OpsLibrary | None") -> bool:
    """The library loads here and registers its kernels (a CPU without AVX2 gets none: kernel_path "none")."""
    from edgelin.ortops import kernel_path

    return library is not None and library.loaded and kernel_path(library.path) != "none"


def _routed(manifest: Manifest, kind: str) -> bool:
    """Whether graph `kind` has nodes for edgelin's operator library (an export before the prefill's were routed
    records step_nodes only)."""
    return bool((manifest.extra.get("ort_ops") or {}).get(f"{kind}_nodes", kind == "step"))


def _filled(shape: tuple[int, ...], dtype: Any) -> np.ndarray:
    """Zeros whose pages are already touched: a buffer first written inside a timed step would pay
    its page faults there."""
    out = np.empty(shape, dtype)
    out.fill(0)
    return out


class _Buffers:
    """A handle's contents: the current state (OrtValues in the runner's state order) and, for a
    constant-memory model, the spare set the next call writes into plus that handle's step bindings."""

    __slots__ = ("current", "spare", "ids", "position", "logits", "bindings", "arrays", "length")

    def __init__(self, current: list, spare: list | None, arrays: list | None = None):
        self.current, self.spare = current, spare
        self.ids = self.position = self.logits = None  # the step's bound input/output buffers
        self.bindings: list | None = None  # [current -> spare, spare -> current], built on the first step
        # A static KV cache: the numpy arrays behind [current, spare] (a KV buffer is in both) and the
        # number of tokens its cache holds.
        self.arrays, self.length = arrays, 0

    def swap(self, keep: frozenset[int] = frozenset()) -> None:
        """The present just written is the next past; the next call writes over the old past. The states in
        `keep` were written in place (their one buffer stays current)."""
        if len(keep) == len(self.current):  # every state in place: nothing moves, both bindings are the same
            return
        self.current, self.spare = self.spare, self.current
        for index in keep:
            self.current[index], self.spare[index] = self.spare[index], self.current[index]
        if self.bindings is not None:
            self.bindings.reverse()
        if self.arrays is not None:
            self.arrays.reverse()
            current, spare = self.arrays
            for index in keep:
                current[index], spare[index] = spare[index], current[index]


class OnnxRunner(Runner):
    def __init__(self, folder: Path, manifest: Manifest, threads: int | None = None, prepack: bool | None = None):
        super().__init__(manifest)
        import onnxruntime as ort

        self._ort = ort
        if manifest.extra.get("weights"):  # step and prefill read one weights file (edgelin.export.weights)
            _check_weights(Path(folder), manifest.extra["weights"])
        # One copy of the weights in memory, read by both sessions (below). Prepacking gives each session a
        # private copy of every float matmul weight (+25 MiB for the shipped fp32 model) for ~9% faster fp32
        # steps (docs/performance.md#precision-and-size): off by default for float exports. MatMulNBits
        # (int8/int4) is another matter: unpacked it runs ~100x slower, so quantised exports keep it, unless every
        # weight product of both graphs is edgelin's (an int4 or int8 export's, block 32), which reads the mapped
        # weights.
        # edgelin's operator library for a --step-ops edgelin export (the step's kernels, and the prefill's 4-/8-bit
        # products): found or built here, or why not (None: the export names none of its ops). Without it the
        # graphs' function bodies run ONNX Runtime's own kernels.
        self.ort_ops: "OpsLibrary | None" = None
        if manifest.extra.get("ort_ops"):
            from edgelin.ortops import locate

            self.ort_ops = locate()
        self.prepack = prepack_choice(manifest, prepack, library=_takes_ops(self.ort_ops))
        # Left to itself, each session maps weights.bin on its own (one mapping per tensor), so each resident
        # weight page counts twice in RSS (Pss = Rss / 2): +47 MiB of peak RSS for the fp32 Mamba2 peer. Instead
        # (prepacking off, the float default): one read-only mapping of the file, and each session gets OrtValues
        # over its slices through add_initializer, which ONNX Runtime uses in place (add_external_initializers
        # and add_external_initializers_from_files_in_memory copy them: measured on 1.32). With prepacking on
        # (quantised exports) ONNX Runtime's own loading is kept. `weights` is the mapping (None if not shared),
        # `shared` the OrtValues per graph kind; EDGELIN_ORT_SHARED_WEIGHTS=0 turns this off.
        self.weights: np.ndarray | None = None
        self.shared: dict[str, list[tuple[str, Any]]] = {}
        if manifest.extra.get("weights") and not self.prepack and os.environ.get(SHARED_ENV, "1") != "0":
            self.weights, self.shared = shared_initializers(Path(folder), manifest)
        self.sessions: dict[str, ort.InferenceSession] = {}
        for kind, entry in manifest.graphs.items():
            path = Path(folder) / entry.file
            if not path.is_file():
                raise EdgelinError(f"{path} is missing", "the manifest lists it", "re-run `edgelin export`")
            graph_options = _options(ort, threads, self.prepack, kind)
            if self.ort_ops is not None and self.ort_ops.loaded and _routed(manifest, kind):
                from edgelin.ortops import register

                self.ort_ops = register(graph_options, self.ort_ops)
            if self.shared.get(kind):
                for name, value in self.shared[kind]:
                    graph_options.add_initializer(name, value)
            try:
                session = ort.InferenceSession(str(path), graph_options, providers=["CPUExecutionProvider"])
            except _ort_errors() as exc:  # a truncated, corrupt or moved file is the folder's fault, not edgelin's
                reason = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
                raise EdgelinError(f"{path} cannot be loaded by ONNX Runtime", f"{type(exc).__name__}: {reason}",
                                   _load_fix(reason)) from exc
            _check_contract(kind, session, entry)
            self.sessions[kind] = session
        self.label = _label(self.ort_ops)  # `runner: ...` in reports (the tensorrt target's fallback sets its own)
        self.state_names = [t.name for t in manifest.state_inputs]
        self._dtypes = [NUMPY_DTYPES[t.dtype] for t in manifest.state_inputs]
        feeds = outputs_by_input(manifest.graphs["step"].outputs)  # the manifest checked prefill's agree
        self.present_names = [feeds[name] for name in self.state_names]
        self.capacity = manifest.kv_capacity  # a static KV cache: its buffers' length (None: none)
        self._cache = FixedCache.of(manifest)  # its checks (edgelin.export.fixed_cache)
        if manifest.constant_memory:
            self.prefill_piece = CONSTANT_MEMORY_PREFILL_PIECE
        if self.capacity is not None:
            _check_capacity(self.sessions, self.capacity)
            if manifest.kv_dtype == "float16":
                self.prefill_piece = HALF_CACHE_PREFILL_PIECE
        # The growing tensors' past_sequence axis (a static cache keeps them at the capacity), else None.
        self._kv_axis = [t.dims.index("past_sequence") if "past_sequence" in t.dims else None
                         for t in manifest.state_inputs]
        # fixed shapes: preallocated ping-pong buffers (a static cache's KV buffers: one, bound both ways)
        self._fixed = manifest.constant_memory or self.capacity is not None
        # the states the step graph updates in place (one buffer bound both ways; edgelin.export.onnx.in_place)
        self._in_place = _in_place_states(self.sessions["step"], self.state_names) if self._fixed else frozenset()

    # ---- handles ---------------------------------------------------------------------------------
    def _ortvalue(self, array: np.ndarray):
        # The OrtValue wraps the array's memory (and keeps a reference to it): pass arrays it may own.
        return self._ort.OrtValue.ortvalue_from_numpy(array)

    def _new(self, batch: int) -> _Buffers:
        if self.capacity is not None:
            return self._static([_filled(s.shape, s.dtype) for s in self.manifest.initial_state(batch, self.capacity)
                                 .values()], 0, batch)
        return self._buffers([_filled(tuple(v.shape), v.dtype) for v in self.manifest.initial_state(batch).values()])

    def _buffers(self, arrays: list[np.ndarray]) -> _Buffers:
        current = [self._ortvalue(a) for a in arrays]
        spare = [self._ortvalue(_filled(a.shape, a.dtype)) for a in arrays] if self._fixed else None
        return _Buffers(current, spare)

    def _static(self, arrays: list[np.ndarray], length: int, batch: int) -> _Buffers:
        """A static-cache handle on `arrays` (owned): each KV buffer is its own past and present; the other
        state tensors ping-pong. Its step bindings are built here, outside any timed step."""
        spare = [a if axis is not None else _filled(a.shape, a.dtype) for a, axis in zip(arrays, self._kv_axis)]
        buffers = _Buffers([self._ortvalue(a) for a in arrays], None, [arrays, spare])
        buffers.spare = [c if axis is not None else self._ortvalue(a)
                         for c, a, axis in zip(buffers.current, spare, self._kv_axis)]
        buffers.length = length
        self._bind_step(buffers, batch)
        return buffers

    def _valid(self, array: np.ndarray, axis: int | None, length: int) -> np.ndarray:
        """A static KV buffer's first `length` positions (the whole array for any other state tensor)."""
        return array if axis is None else array[(slice(None),) * axis + (slice(0, length),)]

    def _read(self, state: StateHandle) -> State:
        buffers: _Buffers = state._value
        if self.capacity is not None:
            return {name: np.array(self._valid(a, axis, buffers.length), copy=True)
                    for name, a, axis in zip(self.state_names, buffers.arrays[0], self._kv_axis)}
        return {name: np.array(value.numpy(), copy=True) for name, value in zip(self.state_names, buffers.current)}

    def _write(self, state: StateHandle, values: State) -> None:
        buffers: _Buffers = state._value
        if self.capacity is not None:  # check_state made the growing tensors' lengths agree
            lengths = {values[n].shape[axis] for n, axis in zip(self.state_names, self._kv_axis) if axis is not None}
            length = lengths.pop()
            self._cache.check_room("write_state", length, 0)
            for name, array, axis in zip(self.state_names, buffers.arrays[0], self._kv_axis):
                self._valid(array, axis, length)[...] = values[name]
            buffers.length = length
            return
        if self._fixed:  # same shapes (write_state checked them): copy into the bound buffers
            for value, name, dtype in zip(buffers.current, self.state_names, self._dtypes):
                value.update_inplace(np.ascontiguousarray(values[name], dtype))
        else:
            buffers.current = [self._ortvalue(np.array(values[name], dtype, copy=True))
                               for name, dtype in zip(self.state_names, self._dtypes)]

    def _read_rows(self, state: StateHandle, rows: list[int]) -> State:
        if self.capacity is not None:
            return super()._read_rows(state, rows)
        # a CPU OrtValue's numpy() is a view of its buffer: only the rows are copied
        return {name: value.numpy()[rows] for name, value in zip(self.state_names, state._value.current)}

    def _write_rows(self, state: StateHandle, rows: list[int], values: State) -> None:
        if self.capacity is not None:
            return super()._write_rows(state, rows, values)
        for name, value in zip(self.state_names, state._value.current):
            value.numpy()[rows] = values[name]

    def _copy(self, state: StateHandle) -> _Buffers:
        if self.capacity is not None:
            buffers: _Buffers = state._value
            return self._static([np.array(a, copy=True) for a in buffers.arrays[0]], buffers.length, state.batch)
        if not self._fixed:  # nothing writes into a growing cache's OrtValues (each call allocates new
            return _Buffers(list(state._value.current), None)  # ones; write_state replaces them): share them
        return self._buffers([np.array(v.numpy(), copy=True) for v in state._value.current])

    # ---- calls -----------------------------------------------------------------------------------
    def _run(self, kind: str, input_ids: np.ndarray, state: StateHandle, position: np.ndarray | None) -> np.ndarray:
        buffers: _Buffers = state._value
        ids = np.ascontiguousarray(input_ids, np.int64)
        if position is not None:
            position = np.ascontiguousarray(position, np.int64)
        if self.capacity is not None:
            return self._static_run(kind, buffers, ids, position)
        if kind == "step" and self._fixed:
            return self._fixed_step(buffers, ids, position)
        return self._bound_run(kind, buffers, ids, position)

    def _bound_call(self, kind: str, ids: np.ndarray, position: np.ndarray | None, pasts: list,
                    presents: list) -> list:
        """One call with the state bound: pasts as inputs, presents as outputs (None: ONNX Runtime allocates
        it, a growing cache's longer present); returns the outputs, logits first."""
        session = self.sessions[kind]
        binding = session.io_binding()
        binding.bind_cpu_input("input_ids", ids)
        if self.manifest.needs_position:
            binding.bind_cpu_input("position_ids", position)
        for name, value in zip(self.state_names, pasts):
            binding.bind_ortvalue_input(name, value)
        binding.bind_output("logits", "cpu")
        for name, value in zip(self.present_names, presents):
            if value is None:
                binding.bind_output(name, "cpu")
            else:
                binding.bind_ortvalue_output(name, value)
        session.run_with_iobinding(binding)
        return binding.get_outputs()

    def _bound_run(self, kind: str, buffers: _Buffers, ids: np.ndarray, position: np.ndarray | None) -> np.ndarray:
        presents = buffers.spare if self._fixed else [None] * len(self.present_names)
        outputs = self._bound_call(kind, ids, position, buffers.current, presents)
        if self._fixed:
            buffers.swap()
            self._rebind(buffers, len(ids))
        else:
            buffers.current = list(outputs[1:])
        return np.array(outputs[0].numpy(), copy=True)

    def _static_run(self, kind: str, buffers: _Buffers, ids: np.ndarray, position: np.ndarray) -> np.ndarray:
        """A call on a static cache: the new tokens go to rows length .. length + n - 1 of each KV buffer."""
        n = 1 if kind == "step" else ids.shape[1]
        self._cache.check_call(kind, buffers.length, n, position)
        if kind == "step":
            logits = self._fixed_step(buffers, ids, position)
        elif len(ids) > 1 and buffers.length > 0:  # GroupQueryAttention takes a prompt after a past at batch 1 only
            logits = self._prefill_rows(buffers, ids, position)
        else:
            logits = self._bound_run(kind, buffers, ids, position)
        buffers.length += n
        return logits

    def _prefill_rows(self, buffers: _Buffers, ids: np.ndarray, position: np.ndarray) -> np.ndarray:
        """One prefill call per sequence, each on its rows of the buffers (views: still in place)."""
        logits, (current, spare) = [], buffers.arrays
        for row in range(len(ids)):
            views = [[self._ortvalue(a[row:row + 1]) for a in arrays] for arrays in (current, spare)]
            outputs = self._bound_call("prefill", ids[row:row + 1], position[row:row + 1], *views)
            logits.append(np.array(outputs[0].numpy(), copy=True))
        buffers.swap()
        self._rebind(buffers, len(ids))
        return np.concatenate(logits)

    def _fixed_step(self, buffers: _Buffers, ids: np.ndarray, position: np.ndarray | None) -> np.ndarray:
        if buffers.bindings is None:
            self._bind_step(buffers, len(ids))
        buffers.ids.update_inplace(ids)
        if buffers.position is not None:
            buffers.position.update_inplace(position)
        self.sessions["step"].run_with_iobinding(buffers.bindings[0])
        buffers.swap(self._in_place)
        return np.array(buffers.logits.numpy(), copy=True)  # the bound logits buffer is reused next step

    def _rebind(self, buffers: _Buffers, batch: int) -> None:
        """After a call that ping-ponged every state (prefill): the states the step updates in place now live
        in the other buffer, so step bindings built before point at the old one: build them again."""
        if self._in_place and buffers.bindings is not None:
            self._bind_step(buffers, batch)

    def _bind_step(self, buffers: _Buffers, batch: int) -> None:
        session = self.sessions["step"]
        buffers.ids = self._ortvalue(np.zeros(batch, np.int64))
        if self.manifest.needs_position:
            buffers.position = self._ortvalue(np.zeros(batch, np.int64))
        buffers.logits = self._ortvalue(_filled((batch, self.manifest.vocab_size), np.float32))
        bindings = []
        for past, present in ((buffers.current, buffers.spare), (buffers.spare, buffers.current)):
            # a state updated in place keeps one buffer (the current one) as its past and present
            past = [buffers.current[i] if i in self._in_place else value for i, value in enumerate(past)]
            present = [buffers.current[i] if i in self._in_place else value for i, value in enumerate(present)]
            binding = session.io_binding()
            binding.bind_ortvalue_input("input_ids", buffers.ids)
            if buffers.position is not None:
                binding.bind_ortvalue_input("position_ids", buffers.position)
            for name, value in zip(self.state_names, past):
                binding.bind_ortvalue_input(name, value)
            binding.bind_ortvalue_output("logits", buffers.logits)
            for name, value in zip(self.present_names, present):
                binding.bind_ortvalue_output(name, value)
            bindings.append(binding)
        buffers.bindings = bindings


def _label(ort_ops: "OpsLibrary | None") -> str:
    """Whether a --step-ops edgelin export runs edgelin's kernels (and on which path), or why not."""
    if ort_ops is None:
        return "onnxruntime"
    if ort_ops.path is None:
        return f"onnxruntime (edgelin ops not loaded: {ort_ops.reason}; ONNX Runtime's own kernels ran)"
    from edgelin.ortops import kernel_path

    path = kernel_path(ort_ops.path)
    if path == "none":  # an x86 CPU without AVX2: the library registers nothing (edgelin/ortops/ops.c)
        return "onnxruntime (edgelin ops not used: this CPU has no AVX2; ONNX Runtime's own kernels ran)"
    return f"onnxruntime + edgelin ops ({path})"


def _check_weights(folder: Path, entry: dict) -> None:
    """The weights file the manifest lists is there, at its recorded size (a cheap stat, no hash: ONNX
    Runtime reads it by offsets, so a truncated or swapped file must be caught before it does)."""
    name, size = entry.get("file"), entry.get("bytes")
    bad_name = not isinstance(name, str) or Path(name).name != name or name in (".", "..")
    if bad_name or not isinstance(size, int):
        shown = (f"file {name!r}" if bad_name else f"bytes {size!r}")[:80]  # never the whole entry: one line
        raise EdgelinError(f"{folder}/manifest.json has a malformed weights entry", f"extra.weights {shown}: "
                           "expected a file name in the folder and its size in bytes", "re-run `edgelin export`")
    path = folder / name
    if not path.is_file():
        raise EdgelinError(f"{path} is missing", "the manifest lists it: the step and prefill graphs read their "
                           "weights from it", "copy the whole export folder, or re-run `edgelin export`")
    actual = path.stat().st_size
    if actual != size:
        raise EdgelinError(f"{path} has {actual} bytes, the manifest says {size}",
                           "the file is truncated or belongs to another export", "re-run `edgelin export`")


def _in_place_states(session: "ort.InferenceSession", state_names: list[str]) -> frozenset[int]:
    """The indices (in the runner's state order) of the states the step graph's metadata lists as updated
    in place (edgelin.export.onnx.in_place; an export from before it lists none)."""
    from edgelin.export.onnx.metadata import IN_PLACE_KEY

    recorded = session.get_modelmeta().custom_metadata_map.get(IN_PLACE_KEY, "")
    names = [name for name in recorded.split(",") if name]
    unknown = sorted(set(names) - set(state_names))
    if unknown:
        raise EdgelinError(f"the step graph's {IN_PLACE_KEY} names {unknown[0]}, which is not a state input",
                           "the folder was edited or mixed with another export", "re-run `edgelin export`")
    return frozenset(state_names.index(name) for name in names)


def _check_capacity(sessions: dict, capacity: int) -> None:
    """A static-cache manifest needs graphs exported for it (GroupQueryAttention at that capacity)."""
    from edgelin.export.onnx.metadata import KV_CAPACITY_KEY

    for kind, session in sessions.items():
        recorded = session.get_modelmeta().custom_metadata_map.get(KV_CAPACITY_KEY)
        if recorded != str(capacity):
            raise EdgelinError(f"manifest and {kind} graph disagree: the KV cache capacity is {capacity} in the "
                               f"manifest but {recorded or 'none (a growing cache)'} in the graph",
                               "the folder was edited or mixed with another export", "re-run `edgelin export`")


def _load_fix(reason: str) -> str:
    """The fix for ONNX Runtime's refusal to load a graph of the folder, from its message."""
    if "escapes model directory" in reason:  # e.g. weights.bin is a link to a file elsewhere: ORT refuses it
        named = re.search(r'External data path: "([^"]+)"', reason)
        return (f"replace the link {named[1] if named else 'weights.bin'} with a copy of the file it points to "
                "(the export folder's files must be real files inside it), or re-run `edgelin export`")
    if "does not exist" in reason:
        return "put back the missing file from the export, or re-run `edgelin export`"
    return "re-run `edgelin export` (the file is truncated or corrupt)"


def _ort_errors() -> tuple[type[BaseException], ...]:
    """ONNX Runtime's exception classes (they share no base class but Exception)."""
    from onnxruntime.capi import onnxruntime_pybind11_state as ort_state

    found = tuple(c for c in vars(ort_state).values() if isinstance(c, type) and issubclass(c, Exception))
    return (*found, RuntimeError)


_ONNX_TYPES = {"float32": "tensor(float)", "float16": "tensor(float16)", "int64": "tensor(int64)",
               "int32": "tensor(int32)"}


def _check_contract(kind: str, session: "ort.InferenceSession", entry: GraphEntry) -> None:
    """The manifest and the graph file must agree on every input's and output's name, rank, fixed
    sizes and dtype, and the graph must have no input or output the manifest does not list."""
    for direction, actual_list, expected in (("input", session.get_inputs(), entry.inputs),
                                             ("output", session.get_outputs(), entry.outputs)):
        actual = {i.name: i for i in actual_list}
        for t in expected:
            got = actual.get(t.name)
            problem = None
            if got is None:
                problem = f"is not an {direction} of the graph"
            elif len(got.shape) != len(t.dims) or any(
                    isinstance(w, int) and g != w for g, w in zip(got.shape, t.dims)):
                problem = f"has shape {got.shape} in the graph but {list(t.dims)} in the manifest"
            elif got.type != _ONNX_TYPES.get(t.dtype, t.dtype):
                problem = f"has type {got.type} in the graph but {t.dtype} in the manifest"
            if problem:
                raise EdgelinError(f"manifest and {kind} graph disagree: {direction} {t.name} {problem}",
                                   "the folder was edited or mixed with another export", "re-run `edgelin export`")
        unlisted = sorted(set(actual) - {t.name for t in expected})
        if unlisted:
            raise EdgelinError(f"manifest and {kind} graph disagree: the graph has {direction} {unlisted[0]}",
                               "the manifest does not list it", "re-run `edgelin export`")
