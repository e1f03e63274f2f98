"""What the edgelin.ortops tests share: the library (built once a run), its kernel paths, a session."""

from __future__ import annotations

import ctypes
import os
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from edgelin import ortops


@pytest.fixture(scope="module")
def library() -> Path:
    """The build the runner loads (the per-user cache, keyed by the sources and the compiler): compiled once a run,
    not once per test file (~5 s of CI's cores each); test_ortops.py builds it afresh where that is the point.
    EDGELIN_ORT_OPS=PATH tests that library instead (one built by CMake, e.g. against onnxruntime_c_api.h)."""
    given = os.environ.get(ortops.ENV, "").strip()
    return Path(given) if given not in ("", "0") else ortops.build()


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
    for bits in ("q4", "q8"):
        getattr(lib, f"edgelin_{bits}_quantize").argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p]
        getattr(lib, f"edgelin_{bits}_rows").argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p,
                                                         ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64,
                                                         ctypes.c_int64, ctypes.c_void_p]
        getattr(lib, f"edgelin_{bits}_quantize_tokens").argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64,
                                                                    ctypes.c_void_p]
        getattr(lib, f"edgelin_{bits}_rows_tokens").argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64,
                                                                ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
                                                                ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p,
                                                                ctypes.c_int64]
        getattr(lib, f"edgelin_{bits}_tokens_scratch_bytes").restype = ctypes.c_size_t
        getattr(lib, f"edgelin_{bits}_tokens_scratch_bytes").argtypes = [ctypes.c_int64, ctypes.c_int64]
    lib.edgelin_kernel_path.restype = ctypes.c_char_p
    lib.edgelin_q4_path.restype = ctypes.c_char_p
    return lib


def activations(scratch: np.ndarray, K: int, bits: int = 4) -> np.ndarray:
    """The int8 activation blocks times their scales, [nb, 32] in float64, read back from the scratch bytes (the
    4-bit product's layout, or the 8-bit one's: blocks in natural order)."""
    nb = (K + 31) // 32
    nb8 = (nb + 7) // 8 * 8
    scales = scratch[: 4 * nb8].view(np.float32)[:nb].astype(np.float64)
    values = scratch[8 * nb8:].view(np.int8)
    if bits == 8:
        return values[:nb * 32].reshape(nb, 32).astype(np.float64) * scales[:, None]
    acts = np.zeros((nb, 32))
    for b in range(nb):  # pairs of blocks: 32 even-position values (16 per block), then 32 odd ones
        base = (b // 2) * 64 + (b % 2) * 16
        acts[b, 0::2], acts[b, 1::2] = values[base:base + 16], values[base + 32:base + 48]
    return acts * scales[:, None]


def random_codes(rng: np.random.Generator, N: int, K: int, bits: int, zero_points: bool):
    """MatMulNBits' stored inputs for N rows of K weights in 32-blocks, random: (weights [N, nb, 16 or 32] uint8,
    scales [N * nb], zero points as stored (None: the op's default), and the float64 weights they stand for,
    (q - zero point) x scale [N, nb, 32], unpacked here from the codes as the op's definition says)."""
    nb = (K + 31) // 32
    weights = rng.integers(0, 256, (N, nb, 32 if bits == 8 else 16), dtype=np.uint8)
    scales = rng.uniform(0.01, 0.1, N * nb).astype(np.float32)
    if bits == 8:
        points = rng.integers(0, 256, (N, nb), dtype=np.uint8) if zero_points else np.full((N, nb), 128, np.uint8)
        stored, q = points, weights.astype(np.float64)
    else:  # two codes per byte, low nibble first; zero points packed the same way, ceil(nb / 2) bytes per row
        points = rng.integers(0, 16, (N, nb + nb % 2), dtype=np.uint8) if zero_points else \
            np.full((N, nb + nb % 2), 8, np.uint8)
        stored = (points[:, 0::2] | points[:, 1::2] << 4).astype(np.uint8)
        q = np.stack([weights & 15, weights >> 4], -1).reshape(N, nb, 32).astype(np.float64)
    dequantised = (q - points[:, :nb, None]) * scales.reshape(N, nb, 1).astype(np.float64)
    return weights, scales, stored if zero_points else None, dequantised



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


def assert_matches_float64_and_function(model: onnx.ModelProto, feeds: dict, want: tuple, library: Path,
                                        threads: int, rtol: float, what: str) -> None:
    """A fused op's outputs with the library (its kernel) and without (its ONNX function): each against `want` (a
    float64 computation from the formulas) and against each other."""
    from helpers import assert_close

    got, fallback = session(model, library, threads).run(None, feeds), session(model).run(None, feeds)
    for name, kernel, function, expected in zip((o.name for o in model.graph.output), got, fallback, want):
        assert_close(kernel, expected, rtol, f"{what} {name} vs float64")
        assert_close(function, expected, rtol, f"{what} the function's {name} vs float64")
        assert_close(kernel, function, rtol, f"{what} {name} vs the function")


def assert_state_in_place(model: onnx.ModelProto, feeds: dict, library: Path, output: str) -> None:
    """The op run with its past_state and present bound to one buffer gives what it gives with two."""
    from helpers import run_state_in_place

    want_out, want_state = session(model, library).run(None, feeds)
    out, state = run_state_in_place(session(model, library), feeds, output, past="past_state")
    assert np.array_equal(out, want_out) and np.array_equal(state, want_state)


def gdn_checkpoint(root: Path) -> Path:
    """A tiny Gated DeltaNet + attention + Gated DeltaNet model (hidden 96: three 32-blocks per row; 4 value heads
    over 2 key heads, as Qwen3.5's). One config for every ortops file that exports such a model, so the test run's
    graph cache (tests/graph_cache.py) traces its graphs once (the 4- and 8-bit exports trace the float graph)."""
    from edgelin.families import SOFTMAX
    from helpers import make_checkpoint

    return make_checkpoint(root / "ckpt", tokenizer=False, layers=("gated_deltanet", SOFTMAX, "gated_deltanet"),
                           hidden_size=96, intermediate_size=160, num_heads=4, num_k_heads=2)


def gdn_exports(root: Path, kinds: dict[str, tuple]) -> dict[str, Path]:
    """`gdn_checkpoint` exported per kind: name -> (--step-ops, --quantize or None[, more OnnxOptions fields]),
    block 32."""
    from edgelin.devices import export_settings
    from edgelin.export.onnx.options import OnnxOptions
    from edgelin.export.pipeline import export_checkpoint

    ckpt = gdn_checkpoint(root)
    return {name: export_checkpoint(ckpt, root / name, settings=export_settings(None, "onnx", "fp32", kind[1], 32),
                                    options=OnnxOptions(step_ops=kind[0], **(kind[2] if len(kind) > 2 else {}))).folder
            for name, kind in kinds.items()}


def float_gdn_exports(root: Path) -> dict[str, Path]:
    """`gdn_checkpoint` in float32, --step-ops edgelin and contrib."""
    return gdn_exports(root, {"edgelin": ("edgelin", None), "contrib": ("contrib", None)})
