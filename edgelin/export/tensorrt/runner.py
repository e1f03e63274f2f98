"""The tensorrt target's run half on TensorRT: the engines `edgelin build` wrote, the state on the GPU.

Mirrors the ONNX Runtime runner (edgelin/export/onnx/runner.py): a handle holds device buffers, two
per state tensor (ping-pong): a step reads the current set and writes the spare one, then they swap,
so no state crosses to the host between calls; only read_state / write_state copy it. With an engine
built from a --trt-inplace export, the step's plugin nodes alias state input and output (TensorRT's
preview feature ALIASED_PLUGIN_IO_10_03): the runner binds both names of each aliased pair to the
handle's one buffer, and the handle has no spare for it. The prefill engine has no aliasing (standard
ops): its aliased outputs go to a runner-level scratch buffer, copied back on the device.

- Engines and plugin: tensorrt/build.json names them; the plugin library is checked
  (edgelin.plugins.tensorrt.check_library: TensorRT major, launcher ABI) and registered with
  `trt.get_plugin_registry().load_library` before any engine is deserialised.
- Optimisation profiles: each (graph, profile) gets its own execution context; a call runs on the
  first profile whose min..max holds its shapes (engines.json lists them narrowest first). A prompt
  longer than the widest profile is prefilled in pieces; a batch beyond it is refused at new_state.
- Streams and CUDA graphs: everything is enqueued on the runner's own stream (`execute_async_v3`).
  Steps at `graph_batch` (1 by default) run on a context of their own whose shapes never change; the
  first one runs normally (TensorRT updates its internal state after a shape change), later ones are
  captured once per handle and direction into a CUDA graph and replayed. When TensorRT refuses the
  capture (execute_async_v3 fails or the capture is invalidated), the runner steps without graphs from
  then on and its label says why.
- A growing KV cache (the KV baseline) changes shape every step: its outputs get new buffers each
  call (sized by the context's output shapes), kept as the next inputs; forks share them.

Device memory and streams go through NVIDIA's cuda-python (`cuda.bindings.runtime`; `cuda.cudart` in
releases before 12.6), imported here only when a runner opens: `pip install 'edgelin[tensorrt]'`.
No torch, no onnx.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from edgelin.errors import EdgelinError
from edgelin.export.base import Runner, State, StateHandle
from edgelin.artifact.manifest import NUMPY_DTYPES, Manifest
from edgelin.artifact.state import outputs_by_input
from edgelin.export.tensorrt.build import BUILD_RECORD, GRAPHS, TRT_DIR

TRT_LABEL = "tensorrt engine"
ORT_LABEL = "onnxruntime (plugin functions)"
_REBUILD = "rebuild the engines here: edgelin build DIR (engines are specific to a GPU and a TensorRT version)"


def cuda_runtime() -> Any:
    """cuda-python's runtime API module (ImportError when cuda-python is not installed)."""
    try:
        from cuda.bindings import runtime
    except ImportError:  # cuda-python < 12.6
        from cuda import cudart as runtime
    return runtime


def read_json(path: Path) -> dict | None:
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def engine_file(graph: str) -> str:
    """The one name an engine has (beside the graphs): build.json's names are checked against it, never followed."""
    return f"{graph}.engine"


def verified_build_file(folder: Path, record: dict, name: str) -> Path:
    """folder/name (a plugin library or an engine that `edgelin build` wrote), refused unless its bytes match the
    sha256 build.json recorded when edgelin built it: loading either runs its code, so a replaced, damaged or
    planted file never loads (a build.json without digests: built by an older edgelin, rebuild)."""
    from edgelin.integrity import sha256_of

    path = Path(folder) / name
    recorded = (record.get("sha256") or {}).get(name) if isinstance(record.get("sha256"), dict) else None
    if not isinstance(recorded, str):
        raise EdgelinError(f"{Path(folder) / TRT_DIR / BUILD_RECORD} records no sha256 for {name}",
                           "it was built by an older edgelin, and a plugin library or engine is code that is loaded "
                           "only once checked", "rebuild it with edgelin build DIR")
    if not path.is_file() or sha256_of(path) != recorded:
        raise EdgelinError(f"{path} is not the file edgelin build made",
                           "its sha256 differs from build.json's (changed, truncated or replaced), so it is not loaded",
                           "rebuild it with edgelin build DIR")
    return path


def engines_unavailable(folder: Path) -> str | None:
    """None when the TensorRT runner can open `folder` here; otherwise why not (one clause)."""
    folder = Path(folder)
    record = read_json(folder / TRT_DIR / BUILD_RECORD)
    built = (record or {}).get("engines") or {}
    if not built:
        return "no engines are built (edgelin build DIR on a machine with TensorRT and a GPU)"
    for graph in GRAPHS:  # edgelin build writes <graph>.engine beside the graphs: no other name is read
        if not isinstance(built, dict) or built.get(graph) != engine_file(graph) or \
                not (folder / engine_file(graph)).is_file():
            return f"the {graph} engine is not built (edgelin build DIR)"
    try:
        import tensorrt  # noqa: F401
    except ImportError:
        return "the tensorrt Python package is not installed here"
    try:
        rt = cuda_runtime()
    except ImportError:
        return "cuda-python is not installed here (pip install 'edgelin[tensorrt]')"
    err, count = rt.cudaGetDeviceCount()
    if err != rt.cudaError_t.cudaSuccess or count < 1:
        return "no CUDA device is visible here"
    return None


class _Cuda:
    """The CUDA runtime calls the runner makes, each checked: an error is one EdgelinError line."""

    def __init__(self) -> None:
        self.rt = cuda_runtime()
        self.ok = self.rt.cudaError_t.cudaSuccess
        kinds = self.rt.cudaMemcpyKind
        self.h2d, self.d2h, self.d2d = (kinds.cudaMemcpyHostToDevice, kinds.cudaMemcpyDeviceToHost,
                                        kinds.cudaMemcpyDeviceToDevice)
        self.stream = self("cudaStreamCreate")

    def __call__(self, name: str, *args: Any) -> Any:
        err, *rest = getattr(self.rt, name)(*args)
        if err != self.ok:
            raise EdgelinError(f"CUDA {name} failed", str(err), "check the GPU (nvidia-smi) and free GPU memory")
        return rest[0] if len(rest) == 1 else (tuple(rest) or None)

    def upload(self, dst: int, array: np.ndarray) -> None:
        array = np.ascontiguousarray(array)
        self("cudaMemcpyAsync", dst, array.ctypes.data, array.nbytes, self.h2d, self.stream)

    def download(self, src: int, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
        out = np.empty(shape, dtype)
        self("cudaMemcpyAsync", out.ctypes.data, src, out.nbytes, self.d2h, self.stream)
        self("cudaStreamSynchronize", self.stream)  # `out` is read by the caller next
        return out


class _Buffer:
    """One device allocation, freed with the object (handles, forks and graphs share them by reference)."""

    __slots__ = ("cuda", "ptr", "nbytes", "__weakref__")

    def __init__(self, cuda: _Cuda, nbytes: int, zero: bool = False):
        self.cuda, self.nbytes = cuda, int(nbytes)
        self.ptr = int(cuda("cudaMalloc", max(self.nbytes, 256)))  # never a null address, even when empty
        if zero:
            cuda("cudaMemsetAsync", self.ptr, 0, max(self.nbytes, 256), cuda.stream)

    def __del__(self) -> None:
        try:
            self.cuda.rt.cudaFree(self.ptr)
        except Exception:  # interpreter shutdown: the process frees device memory anyway
            pass


class _Graph:
    """An instantiated CUDA graph of one step (one handle, one ping-pong direction)."""

    __slots__ = ("cuda", "exec")

    def __init__(self, cuda: _Cuda, graph_exec: Any):
        self.cuda, self.exec = cuda, graph_exec

    def __del__(self) -> None:
        try:
            self.cuda.rt.cudaGraphExecDestroy(self.exec)
        except Exception:
            pass


@dataclass
class _Context:
    """An execution context on one optimisation profile, and the input shapes last set on it."""

    context: Any
    profile: int
    shapes: dict[str, tuple[int, ...]]
    warmed: bool = False  # it has run at its current shapes (a CUDA graph may be captured on it)


class _Engine:
    """A deserialised engine: its I/O names, dtypes and profiles, and its contexts (made on first use)."""

    def __init__(self, trt: Any, runtime: Any, path: Path, kind: str, cuda: _Cuda):
        try:
            data = path.read_bytes()
        except OSError as exc:
            raise EdgelinError(f"cannot read {path}", exc.strerror or str(exc), _REBUILD) from None
        self.engine = runtime.deserialize_cuda_engine(data)
        if self.engine is None:
            raise EdgelinError(f"TensorRT {trt.__version__} cannot load {path.name}", "deserialize_cuda_engine "
                               "failed (TensorRT's log above says why: another TensorRT version or GPU, or a "
                               "truncated file)", _REBUILD)
        self.trt, self.kind, self.cuda = trt, kind, cuda
        engine = self.engine
        names = [engine.get_tensor_name(i) for i in range(engine.num_io_tensors)]
        self.inputs = [n for n in names if engine.get_tensor_mode(n) == trt.TensorIOMode.INPUT]
        self.outputs = [n for n in names if n not in self.inputs]
        self.dtypes = {n: np.dtype(trt.nptype(engine.get_tensor_dtype(n))) for n in names}
        self.profiles = [{n: tuple(tuple(int(d) for d in s) for s in engine.get_tensor_profile_shape(n, p))
                          for n in self.inputs} for p in range(engine.num_optimization_profiles)]
        self.contexts: dict[tuple[int, bool], _Context] = {}

    def profile_for(self, shapes: dict[str, tuple[int, ...]]) -> int | None:
        """The first profile whose min..max holds every input shape."""
        for index, bounds in enumerate(self.profiles):
            if all(all(lo <= d <= hi for d, lo, hi in zip(shape, bounds[name][0], bounds[name][2]))
                   for name, shape in shapes.items()):
                return index
        return None

    def max_dim(self, name: str, axis: int) -> int:
        return max(bounds[name][2][axis] for bounds in self.profiles)

    def context(self, profile: int, pinned: bool = False) -> _Context:
        """The context for `profile`; `pinned`: the CUDA-graph context, whose shapes never change."""
        key = (profile, pinned)
        if key not in self.contexts:
            context = self.engine.create_execution_context()
            if context is None or not context.set_optimization_profile_async(profile, int(self.cuda.stream)):
                raise EdgelinError(f"TensorRT cannot make a {self.kind} context on profile {profile}",
                                   "create_execution_context or set_optimization_profile_async failed (the log "
                                   "above says why; often GPU memory)", "free GPU memory, or " + _REBUILD)
            self.contexts[key] = _Context(context, profile, {})
        return self.contexts[key]

    def set_shapes(self, ctx: _Context, shapes: dict[str, tuple[int, ...]]) -> None:
        for name, shape in shapes.items():
            if ctx.shapes.get(name) != shape:
                if not ctx.context.set_input_shape(name, shape):
                    raise EdgelinError(f"TensorRT refused {name} of shape {list(shape)} for the {self.kind} engine",
                                       "it is outside the engine's optimisation profile", _REBUILD)
                ctx.shapes[name] = shape
                ctx.warmed = False

    def execute(self, ctx: _Context, addresses: dict[str, int]) -> bool:
        for name, ptr in addresses.items():
            ctx.context.set_tensor_address(name, ptr)
        return bool(ctx.context.execute_async_v3(int(self.cuda.stream)))


class _DeviceState:
    """A handle's contents: per state tensor (runner order) the current buffer, the spare one the next
    call writes (None: aliased in place, or a growing cache), the shapes, and the handle's step graphs."""

    __slots__ = ("current", "spare", "shapes", "graphs", "parity")

    def __init__(self, current: list[_Buffer], spare: list[_Buffer | None], shapes: list[tuple[int, ...]]):
        self.current, self.spare, self.shapes = current, spare, shapes
        self.graphs: dict[int, _Graph] = {}  # parity -> the captured step (addresses of that direction)
        self.parity = 0

    def swap(self) -> None:
        for i, spare in enumerate(self.spare):
            if spare is not None:
                self.current[i], self.spare[i] = spare, self.current[i]
        self.parity ^= 1


class TensorrtRunner(Runner):
    """Runs the engines of a built tensorrt export (module docstring). `graph_batch`: the batch whose
    steps are captured into CUDA graphs (None: never)."""

    def __init__(self, folder: Path, manifest: Manifest, graph_batch: int | None = 1):
        super().__init__(manifest)
        import tensorrt as trt

        from edgelin.plugins.tensorrt import SUPPORTED_MAJORS, check_library, library_name

        folder = Path(folder)
        root = folder / TRT_DIR
        record = read_json(root / BUILD_RECORD) or {}
        self.cuda = _Cuda()
        self.trt = trt
        self.logger = trt.Logger(trt.Logger.WARNING)
        major = int(str(trt.__version__).split(".")[0])
        plugin = record.get("plugin")
        if plugin not in {library_name(m) for m in SUPPORTED_MAJORS}:  # a name in tensorrt/, never a path elsewhere
            raise EdgelinError(f"{root / BUILD_RECORD} names the plugin library {str(plugin)[:80]!r}",
                               "edgelin build records libedgelin_trt_plugin_trt<major>.so in tensorrt/",
                               "rebuild it with edgelin build DIR")
        verified_build_file(folder, record, f"{TRT_DIR}/{plugin}")  # the bytes edgelin built, before reading more
        library = check_library(root / plugin, major)  # major, ABI: before loading it
        trt.init_libnvinfer_plugins(self.logger, "")
        if trt.get_plugin_registry().load_library(str(library.path)) is None:
            raise EdgelinError(f"TensorRT could not load {library.path.name}", "load_library returned nothing "
                               "(the log above says why)", "rebuild it with edgelin build DIR")
        runtime = trt.Runtime(self.logger)
        self.engines = {g: _Engine(trt, runtime, verified_build_file(folder, record, engine_file(g)), g, self.cuda)
                        for g in GRAPHS}
        self.state_names = [t.name for t in manifest.state_inputs]
        self._dtypes = [NUMPY_DTYPES[t.dtype] for t in manifest.state_inputs]
        feeds = outputs_by_input(manifest.graphs["step"].outputs)
        self.present_names = [feeds[name] for name in self.state_names]
        self._fixed = manifest.constant_memory
        self._check_io()
        # State pairs the step engine aliases: what the build recorded (an export with --trt-inplace, built
        # with aliasing), and what the engine says where TensorRT can say it (getAliasedInputTensor, 11.x).
        pairs = dict(record.get("aliased") or {})
        ask = getattr(self.engines["step"].engine, "get_aliased_input_tensor", None)
        if ask is not None:
            pairs.update({name: out for out in self.present_names if (name := ask(out))})
        self.aliased = [self._fixed and pairs.get(name) == out
                        for name, out in zip(self.state_names, self.present_names)]
        self.graph_batch = graph_batch if self._fixed else None
        self.graph_note: str | None = None  # why CUDA graphs are off, once TensorRT refused a capture
        self._scratch: dict[str, _Buffer] = {}
        self._pinned: dict[str, _Buffer] = {}  # the CUDA-graph steps' ids/position/logits (fixed addresses)

    @property
    def label(self) -> str:
        notes = []
        if any(self.aliased):
            notes.append("state updated in place")
        if self.graph_batch is None:
            notes.append("no CUDA graph")
        elif self.graph_note:
            notes.append(f"no CUDA graph: {self.graph_note}")
        else:
            notes.append(f"CUDA graph for batch-{self.graph_batch} steps")
        return f"{TRT_LABEL} ({'; '.join(notes)})"

    def _check_io(self) -> None:
        """The engines must have the manifest's inputs and outputs, with its dtypes (ids: any integer)."""
        for kind, entry in self.manifest.graphs.items():
            engine = self.engines[kind]
            for direction, names, expected in (("input", engine.inputs, entry.inputs),
                                               ("output", engine.outputs, entry.outputs)):
                want = {t.name: t for t in expected}
                if set(names) != set(want):
                    odd = sorted(set(names) ^ set(want))[0]
                    raise EdgelinError(f"the {kind} engine and the manifest disagree on {direction} {odd}",
                                       "the engine was built from another export", _REBUILD)
                for name in names:
                    got, dtype = engine.dtypes[name], np.dtype(NUMPY_DTYPES[want[name].dtype])
                    if got != dtype and not (got.kind == dtype.kind == "i"):
                        raise EdgelinError(f"the {kind} engine's {name} is {got}, the manifest's {dtype}",
                                           "the engine was built from another export", _REBUILD)

    # ---- handles ---------------------------------------------------------------------------------
    def _buffer(self, shape: tuple[int, ...], dtype: np.dtype, zero: bool = False) -> _Buffer:
        return _Buffer(self.cuda, int(np.prod(shape)) * np.dtype(dtype).itemsize, zero)

    def _new(self, batch: int) -> _DeviceState:
        for kind, engine in self.engines.items():
            most = engine.max_dim("input_ids", 0)
            if batch > most:
                raise EdgelinError(f"batch {batch} for the TensorRT engines", f"the {kind} engine's profiles take "
                                   f"batch <= {most}", f"use batch <= {most}, or export with a device profile of "
                                   f"a larger max batch and rebuild")
        shapes = [tuple(a.shape) for a in self.manifest.initial_state(batch).values()]
        current = [self._buffer(s, d, zero=True) for s, d in zip(shapes, self._dtypes)]
        spare = [self._buffer(s, d) if self._fixed and not aliased else None
                 for s, d, aliased in zip(shapes, self._dtypes, self.aliased)]
        return _DeviceState(current, spare, shapes)

    def _read(self, state: StateHandle) -> State:
        value: _DeviceState = state._value
        return {name: self.cuda.download(buf.ptr, shape, dtype) for name, buf, shape, dtype
                in zip(self.state_names, value.current, value.shapes, self._dtypes)}

    def _write(self, state: StateHandle, values: State) -> None:
        value: _DeviceState = state._value
        arrays = [np.ascontiguousarray(values[name], dtype) for name, dtype in zip(self.state_names, self._dtypes)]
        if not self._fixed:  # a growing cache: new buffers of the written length (forks may share the old)
            value.current = [self._buffer(a.shape, a.dtype) for a in arrays]
            value.shapes = [tuple(a.shape) for a in arrays]
        for buf, array in zip(value.current, arrays):  # same shapes (write_state checked them)
            self.cuda.upload(buf.ptr, array)
        self.cuda("cudaStreamSynchronize", self.cuda.stream)  # the host arrays may go away after this

    def _copy(self, state: StateHandle) -> _DeviceState:
        value: _DeviceState = state._value
        if not self._fixed:  # nothing writes into a growing cache's buffers (each call makes new ones)
            return _DeviceState(list(value.current), [None] * len(value.current), list(value.shapes))
        fork = _DeviceState([self._buffer(s, d) for s, d in zip(value.shapes, self._dtypes)],
                            [self._buffer(s, d) if spare is not None else None
                             for s, d, spare in zip(value.shapes, self._dtypes, value.spare)], list(value.shapes))
        for dst, src in zip(fork.current, value.current):
            self.cuda("cudaMemcpyAsync", dst.ptr, src.ptr, src.nbytes, self.cuda.d2d, self.cuda.stream)
        return fork

    # ---- calls -----------------------------------------------------------------------------------
    def _io(self, name: str, array_or_nbytes: np.ndarray | int) -> _Buffer:
        """A runner-level scratch buffer of at least that many bytes (grown when needed)."""
        nbytes = array_or_nbytes if isinstance(array_or_nbytes, int) else array_or_nbytes.nbytes
        buf = self._scratch.get(name)
        if buf is None or buf.nbytes < nbytes:
            buf = self._scratch[name] = _Buffer(self.cuda, nbytes)
        return buf

    def _run(self, kind: str, input_ids: np.ndarray, state: StateHandle, position: np.ndarray | None) -> np.ndarray:
        if kind == "prefill":  # a prompt longer than the widest profile: in pieces, carrying the state
            most = self.engines["prefill"].max_dim("input_ids", 1)
            logits = None
            for lo in range(0, input_ids.shape[1], most):
                start = None if position is None else np.asarray(position, np.int64) + lo
                logits = self._call("prefill", input_ids[:, lo:lo + most], state._value, start)
            return logits  # type: ignore[return-value]
        if self._fixed and len(input_ids) == self.graph_batch and self.graph_note is None:
            return self._graph_step(input_ids, state._value, position)
        return self._call("step", input_ids, state._value, position)

    def _inputs(self, engine: _Engine, ids: np.ndarray, position: np.ndarray | None, value: _DeviceState
                ) -> tuple[dict[str, tuple[int, ...]], np.ndarray, np.ndarray | None]:
        ids = np.ascontiguousarray(ids, engine.dtypes["input_ids"])
        shapes = {"input_ids": ids.shape}
        if "position_ids" in engine.inputs:
            position = np.ascontiguousarray(position, engine.dtypes["position_ids"])
            shapes["position_ids"] = position.shape
        shapes.update(zip(self.state_names, value.shapes))
        return shapes, ids, position

    def _profile(self, engine: _Engine, shapes: dict[str, tuple[int, ...]]) -> int:
        profile = engine.profile_for(shapes)
        if profile is None:
            raise EdgelinError(f"no optimisation profile of the {engine.kind} engine takes input_ids of shape "
                               f"{list(shapes['input_ids'])}", "TensorRT runs only the shapes an engine was built for",
                               "use a smaller batch or prompt piece, or export for a device with larger ranges "
                               "and rebuild")
        return profile

    def _call(self, kind: str, ids: np.ndarray, value: _DeviceState, position: np.ndarray | None) -> np.ndarray:
        engine = self.engines[kind]
        shapes, ids, position = self._inputs(engine, ids, position, value)
        ctx = engine.context(self._profile(engine, shapes))
        engine.set_shapes(ctx, shapes)
        addresses = {"input_ids": self._io("ids", ids).ptr}
        self.cuda.upload(addresses["input_ids"], ids)
        if position is not None and "position_ids" in engine.inputs:
            addresses["position_ids"] = self._io("position", position).ptr
            self.cuda.upload(addresses["position_ids"], position)
        batch = ids.shape[0]
        logits = self._io("logits", batch * self.manifest.vocab_size * engine.dtypes["logits"].itemsize)
        addresses["logits"] = logits.ptr
        outputs: list[_Buffer] = []
        for i, (past, present) in enumerate(zip(self.state_names, self.present_names)):
            addresses[past] = value.current[i].ptr
            if not self._fixed:  # a growing cache: a new buffer of the output's length
                shape = tuple(int(d) for d in ctx.context.get_tensor_shape(present))
                outputs.append(self._buffer(shape, self._dtypes[i]))
                value.shapes[i] = shape
            elif self.aliased[i]:  # the step writes in place; prefill (no aliasing) into scratch
                outputs.append(value.current[i] if kind == "step" else self._io(f"alias{i}", value.current[i].nbytes))
            else:
                outputs.append(value.spare[i])  # type: ignore[arg-type]
            addresses[present] = outputs[-1].ptr
        if not engine.execute(ctx, addresses):
            raise EdgelinError(f"TensorRT could not run the {kind} engine", "execute_async_v3 failed (TensorRT's "
                               "log above says why)", "check the GPU and the engine; " + _REBUILD)
        ctx.warmed = True
        if not self._fixed:
            value.current = outputs
        else:
            if kind == "prefill":
                for i, aliased in enumerate(self.aliased):
                    if aliased:
                        self.cuda("cudaMemcpyAsync", value.current[i].ptr, outputs[i].ptr, value.current[i].nbytes,
                                  self.cuda.d2d, self.cuda.stream)
            value.swap()
        return self.cuda.download(logits.ptr, (batch, self.manifest.vocab_size), engine.dtypes["logits"])

    def _graph_step(self, ids: np.ndarray, value: _DeviceState, position: np.ndarray | None) -> np.ndarray:
        """A step at graph_batch: its own context (fixed shapes), replayed from a CUDA graph per handle
        and direction once that context has run once at its shapes (module docstring)."""
        engine = self.engines["step"]
        shapes, ids, position = self._inputs(engine, ids, position, value)
        ctx = engine.context(self._profile(engine, shapes), pinned=True)
        engine.set_shapes(ctx, shapes)  # sets them once: nothing else runs on this context
        pinned = self._pinned
        if not pinned:
            pinned["ids"] = _Buffer(self.cuda, ids.nbytes)
            pinned["logits"] = _Buffer(self.cuda, ids.shape[0] * self.manifest.vocab_size
                                       * engine.dtypes["logits"].itemsize)
            if position is not None and "position_ids" in engine.inputs:
                pinned["position"] = _Buffer(self.cuda, position.nbytes)
        self.cuda.upload(pinned["ids"].ptr, ids)
        addresses = {"input_ids": pinned["ids"].ptr, "logits": pinned["logits"].ptr}
        if "position" in pinned:
            self.cuda.upload(pinned["position"].ptr, position)  # type: ignore[arg-type]
            addresses["position_ids"] = pinned["position"].ptr
        for i, (past, present) in enumerate(zip(self.state_names, self.present_names)):
            addresses[past] = value.current[i].ptr
            written = value.current[i] if self.aliased[i] else value.spare[i]
            addresses[present] = written.ptr  # type: ignore[union-attr]
        graph = value.graphs.get(value.parity)
        if graph is None and ctx.warmed:
            graph = self._capture(engine, ctx, addresses)
            if graph is not None:
                value.graphs[value.parity] = graph
        if graph is not None:
            self.cuda("cudaGraphLaunch", graph.exec, self.cuda.stream)
        elif not engine.execute(ctx, addresses):
            raise EdgelinError("TensorRT could not run the step engine", "execute_async_v3 failed (TensorRT's log "
                               "above says why)", "check the GPU and the engine; " + _REBUILD)
        ctx.warmed = True
        value.swap()
        return self.cuda.download(pinned["logits"].ptr, (ids.shape[0], self.manifest.vocab_size),
                                  engine.dtypes["logits"])

    def _capture(self, engine: _Engine, ctx: _Context, addresses: dict[str, int]) -> _Graph | None:
        """Capture one step into a CUDA graph; None (and graph_note says why) when TensorRT refuses it."""
        rt, stream = self.cuda.rt, self.cuda.stream
        self.cuda("cudaStreamBeginCapture", stream, rt.cudaStreamCaptureMode.cudaStreamCaptureModeGlobal)
        enqueued = engine.execute(ctx, addresses)
        err, graph = rt.cudaStreamEndCapture(stream)  # always ends the capture, even after a failure
        if not enqueued or err != self.cuda.ok or graph is None:
            self.graph_note = ("TensorRT refused to enqueue during stream capture" if not enqueued
                               else f"the capture was invalidated ({err})")
            if graph is not None and err == self.cuda.ok:
                rt.cudaGraphDestroy(graph)
            return None
        try:
            graph_exec = self.cuda("cudaGraphInstantiate", graph, 0)
        except EdgelinError as exc:
            self.graph_note = f"the captured graph could not be instantiated ({exc.why})"
            return None
        finally:
            rt.cudaGraphDestroy(graph)
        return _Graph(self.cuda, graph_exec)
