"""TEST STAND-IN FOR TENSORRT AND CUDA-PYTHON. Not TensorRT: nothing here runs on a GPU.

TensorRT cannot be installed on the CI machines (platform notes), so the TensorRT runner's bookkeeping
(edgelin/export/tensorrt/runner.py) is tested against these fakes, installed into sys.modules by
`install(monkeypatch)` for one test at a time:

- `tensorrt`: just the calls build_engine and the runner make. A "serialized engine" is JSON naming
  the ONNX file, the optimisation profiles and the flags; a deserialized engine runs that ONNX through
  ONNX Runtime (the plugin nodes through their ONNX functions). Its execution contexts check what real
  TensorRT would refuse or leave undefined: shapes outside the context's profile, unset addresses,
  buffers too small or outside device memory, an output bound over an input (standard layers do not
  compute in place) and, for the step's aliased state pairs, different addresses for input and output
  (the contract TensorRT 11 states for aliased I/O; with plugin aliasing on 10.3 TensorRT may insert a
  copy instead, so one shared buffer is right either way).
- `cuda.bindings.runtime`: "device" memory is host memory owned here (pointers are real addresses, so
  memcpy is ctypes.memmove), with stream capture into replayable graphs: what a captured graph replays
  is the work and addresses of capture time, as on a GPU.

What only a real TensorRT can show (the requires_tensorrt tests): that the ONNX parser maps the plugin
nodes to the EdgelinStep creator, that the engines build and the kernel matches, that TensorRT accepts
the capture and the aliasing.
"""

from __future__ import annotations

import ctypes
import enum
import json
import subprocess
import sys
import types
from pathlib import Path
from typing import Any

import numpy as np

STANDIN = "edgelin test stand-in, not TensorRT"


class Counters:
    """What the fakes saw (tests assert on these)."""

    def __init__(self) -> None:
        self.executes = 0  # context executions that ran (not captured)
        self.captures = 0  # executions recorded into a graph
        self.launches = 0  # graph launches
        self.refuse_capture = False  # make execute_async_v3 fail during capture (as for an engine with loops)
        self.bindings: list[dict[str, int]] = []  # addresses of every run (step and prefill)
        self.contexts: list[tuple[str, int]] = []  # (graph file, profile) of every context made
        self.loaded: list[str] = []  # plugin libraries loaded into the registry


# ---- cuda.bindings.runtime ---------------------------------------------------------------------------
class cudaError_t(enum.IntEnum):  # noqa: N801 (cuda-python's names)
    cudaSuccess = 0
    cudaErrorInvalidValue = 1
    cudaErrorStreamCaptureInvalidated = 901


class cudaMemcpyKind(enum.IntEnum):  # noqa: N801
    cudaMemcpyHostToHost = 0
    cudaMemcpyHostToDevice = 1
    cudaMemcpyDeviceToHost = 2
    cudaMemcpyDeviceToDevice = 3


class cudaStreamCaptureMode(enum.IntEnum):  # noqa: N801
    cudaStreamCaptureModeGlobal = 0


class FakeCuda:
    def __init__(self, counters: Counters):
        self.counters = counters
        self.memory: dict[int, np.ndarray] = {}  # pointer -> its bytes
        self.capturing: dict[int, list] = {}  # stream -> recorded work
        self.invalidated: set[int] = set()
        self.streams = 0

    def device_view(self, ptr: int, nbytes: int) -> np.ndarray:
        """The device bytes [ptr, ptr + nbytes): inside one live allocation, or AssertionError (a GPU fault)."""
        for base, block in self.memory.items():
            if base <= ptr and ptr + nbytes <= base + block.nbytes:
                return block[ptr - base:ptr - base + nbytes]
        raise AssertionError(f"{nbytes} bytes at {ptr:#x} are not inside device memory")

    def is_device(self, ptr: int) -> bool:
        return any(base <= ptr < base + block.nbytes for base, block in self.memory.items())

    def module(self) -> types.ModuleType:
        cuda = self
        rt = types.ModuleType("cuda.bindings.runtime")
        rt.__doc__ = STANDIN
        rt.cudaError_t, rt.cudaMemcpyKind, rt.cudaStreamCaptureMode = cudaError_t, cudaMemcpyKind, cudaStreamCaptureMode
        ok = cudaError_t.cudaSuccess

        def enqueue(stream: int, work) -> None:
            if stream in cuda.capturing:
                cuda.capturing[stream].append(work)
            else:
                work()

        def cudaMalloc(nbytes: int):  # noqa: N802
            block = np.zeros(int(nbytes), np.uint8)
            cuda.memory[block.ctypes.data] = block
            return ok, block.ctypes.data

        def cudaFree(ptr: int):  # noqa: N802
            return (ok,) if cuda.memory.pop(int(ptr), None) is not None else (cudaError_t.cudaErrorInvalidValue,)

        def cudaMemcpyAsync(dst: int, src: int, nbytes: int, kind, stream: int):  # noqa: N802
            dst_dev = kind in (cudaMemcpyKind.cudaMemcpyHostToDevice, cudaMemcpyKind.cudaMemcpyDeviceToDevice)
            src_dev = kind in (cudaMemcpyKind.cudaMemcpyDeviceToHost, cudaMemcpyKind.cudaMemcpyDeviceToDevice)
            for ptr, dev in ((dst, dst_dev), (src, src_dev)):
                if dev:
                    cuda.device_view(ptr, nbytes)
                else:
                    assert not cuda.is_device(ptr), f"{ptr:#x} is device memory, the copy says host"
            enqueue(stream, lambda: ctypes.memmove(dst, src, nbytes))
            return (ok,)

        def cudaMemsetAsync(ptr: int, value: int, nbytes: int, stream: int):  # noqa: N802
            cuda.device_view(ptr, nbytes)
            enqueue(stream, lambda: ctypes.memset(ptr, value, nbytes))
            return (ok,)

        def cudaStreamCreate():  # noqa: N802
            cuda.streams += 1
            return ok, 1000 + cuda.streams

        def cudaStreamBeginCapture(stream: int, mode):  # noqa: N802
            assert stream not in cuda.capturing, "capture begun twice"
            cuda.capturing[stream] = []
            return (ok,)

        def cudaStreamEndCapture(stream: int):  # noqa: N802
            work = cuda.capturing.pop(stream)
            if stream in cuda.invalidated:
                cuda.invalidated.discard(stream)
                return cudaError_t.cudaErrorStreamCaptureInvalidated, None
            return ok, ("graph", work)

        def cudaGraphInstantiate(graph, flags: int):  # noqa: N802
            return ok, ("exec", list(graph[1]))

        def cudaGraphLaunch(graph_exec, stream: int):  # noqa: N802
            cuda.counters.launches += 1
            for work in graph_exec[1]:
                work()
            return (ok,)

        rt.cudaMalloc, rt.cudaFree = cudaMalloc, cudaFree
        rt.cudaMemcpyAsync, rt.cudaMemsetAsync = cudaMemcpyAsync, cudaMemsetAsync
        rt.cudaStreamCreate, rt.cudaStreamBeginCapture, rt.cudaStreamEndCapture = (
            cudaStreamCreate, cudaStreamBeginCapture, cudaStreamEndCapture)
        rt.cudaGraphInstantiate, rt.cudaGraphLaunch = cudaGraphInstantiate, cudaGraphLaunch
        rt.cudaStreamSynchronize = lambda stream: (ok,)
        rt.cudaGraphDestroy = rt.cudaGraphExecDestroy = lambda graph: (ok,)
        rt.cudaGetDeviceCount = lambda: (ok, 1)
        return rt


# ---- tensorrt ------------------------------------------------------------------------------------------
class DataType(enum.Enum):
    FLOAT = np.float32
    HALF = np.float16
    INT32 = np.int32
    INT64 = np.int64


_ORT_TYPES = {"tensor(float)": DataType.FLOAT, "tensor(float16)": DataType.HALF, "tensor(int32)": DataType.INT32,
              "tensor(int64)": DataType.INT64}


class TensorIOMode(enum.Enum):
    INPUT = 1
    OUTPUT = 2


class FakeEngine:
    def __init__(self, spec: dict, trt: "FakeTensorrt"):
        import onnx
        import onnxruntime as ort

        self.spec, self.trt = spec, trt
        options = ort.SessionOptions()
        options.log_severity_level = 3
        self.session = ort.InferenceSession(spec["onnx"], options, providers=["CPUExecutionProvider"])
        self.io = {i.name: (TensorIOMode.INPUT, i) for i in self.session.get_inputs()}
        self.io.update({o.name: (TensorIOMode.OUTPUT, o) for o in self.session.get_outputs()})
        self.names = list(self.io)
        graph = onnx.load(spec["onnx"]).graph
        outputs = {o.name for o in graph.output}
        self.aliased: dict[str, str] = {}  # output -> input, as getAliasedInput declares them
        for node in graph.node:
            attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
            if node.op_type == "EdgelinStep" and attrs.get("inplace") == 1 and spec["aliasing"]:
                assert node.output[1] in outputs and node.input[-1] in self.io, "aliased state must be graph I/O here"
                self.aliased[node.output[1]] = node.input[-1]
        self.num_io_tensors = len(self.names)
        self.num_optimization_profiles = len(spec["profiles"])

    def get_tensor_name(self, index: int) -> str:
        return self.names[index]

    def get_tensor_mode(self, name: str) -> TensorIOMode:
        return self.io[name][0]

    def get_tensor_dtype(self, name: str) -> DataType:
        return _ORT_TYPES[self.io[name][1].type]

    def get_tensor_profile_shape(self, name: str, profile: int) -> list[tuple[int, ...]]:
        return [tuple(s) for s in self.spec["profiles"][profile][name]]

    def create_execution_context(self) -> "FakeContext":
        return FakeContext(self)


class FakeContext:
    def __init__(self, engine: FakeEngine):
        self.engine, self.profile = engine, 0
        self.shapes: dict[str, tuple[int, ...]] = {}
        self.addresses: dict[str, int] = {}

    def set_optimization_profile_async(self, index: int, stream: int) -> bool:
        self.profile = index
        self.engine.trt.counters.contexts.append((Path(self.engine.spec["onnx"]).name, index))
        return 0 <= index < self.engine.num_optimization_profiles

    def set_input_shape(self, name: str, shape) -> bool:
        lo, _, hi = self.engine.get_tensor_profile_shape(name, self.profile)
        shape = tuple(int(d) for d in shape)
        if len(shape) != len(lo) or not all(a <= d <= b for d, a, b in zip(shape, lo, hi)):
            return False
        self.shapes[name] = shape
        return True

    def get_tensor_shape(self, name: str) -> tuple[int, ...]:
        sizes: dict[str, int] = {}
        for input_name, shape in self.shapes.items():
            for dim, size in zip(self.engine.io[input_name][1].shape, shape):
                if isinstance(dim, str):
                    sizes[dim] = size
        return tuple(d if isinstance(d, int) else sizes.get(d, -1) for d in self.engine.io[name][1].shape)

    def set_tensor_address(self, name: str, ptr: int) -> bool:
        assert name in self.engine.io, f"no tensor {name}"
        self.addresses[name] = int(ptr)
        return True

    def execute_async_v3(self, stream: int) -> bool:
        trt, cuda = self.engine.trt, self.engine.trt.cuda
        if stream in cuda.capturing and trt.counters.refuse_capture:
            cuda.invalidated.add(stream)
            return False
        engine = self.engine
        inputs = [n for n in engine.names if engine.io[n][0] is TensorIOMode.INPUT]
        outputs = [n for n in engine.names if n not in inputs]
        assert set(self.shapes) == set(inputs), f"input shapes not set: {sorted(set(inputs) - set(self.shapes))}"
        unset = sorted(set(engine.names) - set(self.addresses))
        assert not unset, f"addresses not set: {unset}"
        shapes = {n: self.shapes[n] if n in self.shapes else self.get_tensor_shape(n) for n in engine.names}
        spans = {}
        for name in engine.names:
            nbytes = int(np.prod(shapes[name])) * np.dtype(engine.get_tensor_dtype(name).value).itemsize
            cuda.device_view(self.addresses[name], nbytes)  # bound, and large enough
            spans[name] = (self.addresses[name], self.addresses[name] + nbytes)
        for out in outputs:
            for inp in inputs:
                same = spans[out] == spans[inp]
                if engine.aliased.get(out) == inp:
                    assert same, f"aliased {out} must be bound to {inp}'s buffer"
                else:
                    overlap = spans[out][0] < spans[inp][1] and spans[inp][0] < spans[out][1]
                    assert not overlap, f"output {out} is bound over input {inp}"
        addresses = dict(self.addresses)  # what a captured graph replays: capture-time addresses
        trt.counters.bindings.append(addresses)

        def run() -> None:
            feeds = {}
            for name in inputs:
                dtype = np.dtype(engine.get_tensor_dtype(name).value)
                view = cuda.device_view(addresses[name], int(np.prod(shapes[name])) * dtype.itemsize)
                feeds[name] = view.view(dtype).reshape(shapes[name]).copy()  # read every input before writing
            results = engine.session.run(outputs, feeds)
            for name, value in zip(outputs, results):
                value = np.ascontiguousarray(value)
                assert tuple(value.shape) == tuple(shapes[name]), f"{name}: {value.shape} != {shapes[name]}"
                ctypes.memmove(addresses[name], value.ctypes.data, value.nbytes)

        if stream in cuda.capturing:
            trt.counters.captures += 1
            cuda.capturing[stream].append(run)
        else:
            trt.counters.executes += 1
            run()
        return True


class FakeTensorrt:
    def __init__(self, counters: Counters, cuda: FakeCuda):
        self.counters, self.cuda = counters, cuda
        self.registry_libraries: list[str] = []

    def module(self, version: str = "10.3.0") -> types.ModuleType:
        fake = self
        trt = types.ModuleType("tensorrt")
        trt.__doc__ = STANDIN
        trt.__version__ = version
        trt.DataType, trt.TensorIOMode = DataType, TensorIOMode
        trt.nptype = lambda dtype: dtype.value
        trt.BuilderFlag = types.SimpleNamespace(FP16="FP16")
        trt.PreviewFeature = types.SimpleNamespace(ALIASED_PLUGIN_IO_10_03="ALIASED_PLUGIN_IO_10_03")

        class Logger:
            WARNING = 2

            def __init__(self, severity: int = 2):
                self.severity = severity

        class Registry:
            def load_library(self, path: str):
                if not Path(path).is_file():
                    return None
                fake.registry_libraries.append(path)
                fake.counters.loaded.append(path)
                return object()

        registry = Registry()

        class Network:
            onnx: str | None = None

        class Parser:
            num_errors = 0

            def __init__(self, network: Network, logger: Logger):
                self.network = network

            def parse_from_file(self, path: str) -> bool:
                self.network.onnx = str(Path(path).resolve())
                return Path(path).is_file()

        class Profile:
            def __init__(self) -> None:
                self.shapes: dict[str, list] = {}

            def set_shape(self, name: str, lo, opt, hi) -> None:
                self.shapes[name] = [list(lo), list(opt), list(hi)]

        class Config:
            def __init__(self) -> None:
                self.profiles: list[Profile] = []
                self.flags: set[str] = set()
                self.preview: set[str] = set()

            def add_optimization_profile(self, profile: Profile) -> int:
                self.profiles.append(profile)
                return len(self.profiles) - 1

            def set_flag(self, flag: str) -> None:
                self.flags.add(flag)

            def set_preview_feature(self, feature: str, enable: bool) -> None:
                (self.preview.add if enable else self.preview.discard)(feature)

        class Builder:
            def __init__(self, logger: Logger):
                pass

            def get_plugin_registry(self) -> Registry:
                return registry

            def create_network(self, flags: int) -> Network:
                return Network()

            def create_builder_config(self) -> Config:
                return Config()

            def create_optimization_profile(self) -> Profile:
                return Profile()

            def build_serialized_network(self, network: Network, config: Config) -> bytes:
                spec = {"standin": STANDIN, "onnx": network.onnx, "profiles": [p.shapes for p in config.profiles],
                        "fp16": "FP16" in config.flags, "aliasing": "ALIASED_PLUGIN_IO_10_03" in config.preview}
                return json.dumps(spec).encode()

        class Runtime:
            def __init__(self, logger: Logger):
                pass

            def deserialize_cuda_engine(self, data: bytes) -> FakeEngine | None:
                try:
                    spec = json.loads(data)
                except ValueError:
                    return None
                if spec.get("standin") != STANDIN:
                    return None
                if "EdgelinStep" in Path(spec["onnx"]).read_text(errors="ignore") and not fake.registry_libraries:
                    return None  # a plugin engine deserialises only once its creator is registered
                return FakeEngine(spec, fake)

        trt.Logger, trt.Builder, trt.OnnxParser, trt.Runtime = Logger, Builder, Parser, Runtime
        trt.get_plugin_registry = lambda: registry
        trt.init_libnvinfer_plugins = lambda logger, namespace: True
        return trt


def install(monkeypatch, version: str = "10.3.0") -> Counters:
    """Put the stand-in `tensorrt` and `cuda.bindings.runtime` into sys.modules (undone after the test)."""
    counters = Counters()
    cuda = FakeCuda(counters)
    runtime = cuda.module()
    bindings = types.ModuleType("cuda.bindings")
    bindings.runtime = runtime
    package = types.ModuleType("cuda")
    package.bindings = bindings
    for name, module in (("cuda", package), ("cuda.bindings", bindings), ("cuda.bindings.runtime", runtime),
                         ("tensorrt", FakeTensorrt(counters, cuda).module(version))):
        monkeypatch.setitem(sys.modules, name, module)
    counters.cuda = cuda  # type: ignore[attr-defined]
    return counters


def fake_plugin_library(folder: Path, trt_major: int = 10, extra: str = "") -> Path:
    """A shared object that passes check_library (marker, the two exports, no libnvinfer) but holds no
    plugin: the stand-in registry only records that it was loaded. Built with the system C compiler; `extra`: more
    C source (another exported symbol, which check_library refuses)."""
    from edgelin.kernels.abi import header_abi_version

    source = folder / "fake_plugin.c"
    source.write_text(f'__attribute__((used)) const char edgelin_trt_plugin_marker[] = '
                      f'"edgelin-trt-plugin:trt_major={trt_major};abi={header_abi_version()};";\n'
                      'void* getCreators(int* n) { *n = 0; return 0; }\nvoid setLoggerFinder(void* finder) { }\n' + extra)
    library = folder / f"libedgelin_trt_plugin_trt{trt_major}.so"
    subprocess.run(["cc", "-shared", "-fPIC", "-o", str(library), str(source)], check=True)
    source.unlink()
    return library


def build_with_standin(folder: Path, trt_major: int = 10, fp16: bool = False, inplace: bool = True) -> dict:
    """What `edgelin build` does where TensorRT is (nvcc and cmake aside, and in this process): edgelin's
    own engine builder (edgelin.plugins.tensorrt.build_engine, never the folder's copy) on the checked
    tensorrt/engines.json, against the stand-in, then the build record. `inplace=False`: as
    build_engine --no-inplace. Call after install()."""
    from edgelin.artifact.manifest import Manifest
    from edgelin.export.tensorrt.build import GRAPHS, TRT_DIR, read_engine_spec, record_build
    from edgelin.plugins.tensorrt import build_engine

    root = Path(folder) / TRT_DIR
    library = fake_plugin_library(root, trt_major)
    spec = read_engine_spec(Path(folder), Manifest.load(Path(folder)))
    engines = {}
    for graph in GRAPHS:
        built = build_engine.build(str(folder), graph, spec["graphs"][graph], str(library), fp16,
                                   spec["inplace"] and inplace, spec["strongly_typed"])
        engines[graph] = Path(built).name
    aliased = spec["graphs"]["step"]["aliased"] if spec["inplace"] and inplace else {}
    return record_build(Path(folder), library.name, trt_major, ["90"], engines, None, aliased)


def engine_spec(path: Path) -> dict[str, Any]:
    """What the stand-in builder wrote into an engine file (its profiles and flags)."""
    return json.loads(Path(path).read_bytes())
