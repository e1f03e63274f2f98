"""What the edgelin.ortops tests share: the library built once per module, its kernel paths, a session."""

from __future__ import annotations

import ctypes
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from edgelin import ortops


@pytest.fixture(scope="module")
def library(tmp_path_factory) -> Path:
    return ortops.build(tmp_path_factory.mktemp("ortops") / ortops.LIBRARY)


def session(model: onnx.ModelProto, library: Path | None = None, threads: int = 1) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    if library is not None:
        options.register_custom_ops_library(str(library))
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])


def c_kernel(library: Path) -> ctypes.CDLL:
    lib = ctypes.CDLL(str(library))
    lib.edgelin_q4_scratch_bytes.restype = ctypes.c_size_t
    lib.edgelin_q4_scratch_bytes.argtypes = [ctypes.c_int64]
    lib.edgelin_q4_quantize.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p]
    lib.edgelin_q4_rows.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p,
                                    ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p]
    lib.edgelin_kernel_path.restype = ctypes.c_char_p
    return lib


@pytest.fixture(params=["avx2", "portable"])
def kernel_path(request, library):
    """The library's AVX2 paths, then its portable ones (forced in the loaded library: ONNX Runtime's sessions
    dlopen the same file, so they run what this sets)."""
    lib = c_kernel(library)
    if request.param == "avx2" and lib.edgelin_kernel_path() != b"avx2":
        pytest.skip("this CPU has no AVX2: only the portable path runs here")
    lib.edgelin_use_portable(int(request.param == "portable"))
    yield request.param
    lib.edgelin_use_portable(0)


def rollouts(exports: dict[str, Path], library: Path, batch: int, threads: int, monkeypatch) -> dict[str, np.ndarray]:
    """Logits of 30 teacher-forced steps after an 11-token prefill (random ids < 97), per way of running the step:
    "library" (exports["edgelin"] with the library), "fallback" (the same export without it: the function bodies)
    and "contrib" (exports["contrib"], ONNX Runtime's ops)."""
    from edgelin.runtime import open_runner

    ids = np.random.default_rng(batch).integers(0, 97, (batch, 41))
    logits = {}
    for name, folder, setting in (("library", "edgelin", str(library)), ("fallback", "edgelin", "0"),
                                  ("contrib", "contrib", "0")):
        monkeypatch.setenv(ortops.ENV, setting)
        runner = open_runner(exports[folder], threads=threads)
        state = runner.new_state(batch)
        runner.prefill(ids[:, :11], state, np.zeros(batch, np.int64))
        logits[name] = np.stack([runner.step(ids[:, t], state, np.full(batch, t)) for t in range(11, 41)])
    return logits
