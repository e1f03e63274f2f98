"""Every kernel path of edgelin's CPU library against float64, on whatever CPU runs the test: AVX2 and the portable
C paths on x86-64; NEON, NEON + dotprod, NEON + i8mm and portable on aarch64 (the ARM tier, .ci/arm/run, runs this
file under qemu with -cpu cortex-a72 / cortex-a76 / max). Each path the CPU has is forced in turn (cpu.h's test
switches) and must give the float64 product of the same numbers: the float32 and float16 weight products (packed
panels for decoding and prefill tiles, ONNX's [K, N] rows), the 4- and 8-bit products of one token and of several
(the int8 activation blocks read back from the scratch, each path's own quantisation checked equal to the portable
one's bytes).

Self-contained on purpose: numpy, ctypes and edgelin.ortops only (no torch, no onnx, no conftest), so that an arm64
userland with the runtime's wheels runs it. It tests the library the runner loads: EDGELIN_ORT_OPS=PATH, the one an
installed wheel carries (the ARM tier's cross-built aarch64 wheel), else the first-use build. EDGELIN_EXPECT_KERNEL_PATH names the path the CPU must report (the ARM tier sets it, so a library
that fell back to its portable paths fails instead of passing on them)."""

from __future__ import annotations

import ctypes
import os
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
import pytest

from edgelin import ortops

ARM_LEVELS = {"neon-i8mm": 3, "neon-dotprod": 2, "neon": 1}
# float32 sums (in any order, FMA or not) of products that are exact in float64, relative to sum |x| |w|: measured
# <= 2e-7 on these shapes on every path; bound ~50x.
RTOL = 1e-5

I64, P = ctypes.c_int64, ctypes.c_void_p


@pytest.fixture(scope="module")
def lib() -> ctypes.CDLL:
    """The library the runner would load (ortops.locate(): EDGELIN_ORT_OPS=PATH, an installed wheel's, else the
    first-use build)."""
    found = ortops.locate()
    if not found.loaded:
        if os.environ.get("EDGELIN_EXPECT_KERNEL_PATH"):  # the ARM tier: a missing library fails, never skips
            pytest.fail(f"no edgelin CPU library: {found.reason}")
        pytest.skip(f"no edgelin CPU library here: {found.reason}")
    library = ctypes.CDLL(str(found.path))
    library.edgelin_kernel_path.restype = ctypes.c_char_p
    library.edgelin_q4_scratch_bytes.restype = ctypes.c_size_t
    library.edgelin_q4_scratch_bytes.argtypes = [I64]
    library.edgelin_weight_panels.argtypes = [P, I64, I64, I64, P, ctypes.c_int, I64, I64, P]
    for name in ("edgelin_f32_rows", "edgelin_f16_rows"):
        getattr(library, name).argtypes = [P, I64, I64, I64, P, I64, I64, P]
    for bits in ("q4", "q8"):
        getattr(library, f"edgelin_{bits}_quantize").argtypes = [P, I64, P]
        getattr(library, f"edgelin_{bits}_rows").argtypes = [P, I64, P, P, P, I64, I64, P]
        getattr(library, f"edgelin_{bits}_quantize_tokens").argtypes = [P, I64, I64, P]
        getattr(library, f"edgelin_{bits}_rows_tokens").argtypes = [P, I64, I64, P, P, P, I64, I64, P, I64]
        getattr(library, f"edgelin_{bits}_tokens_scratch_bytes").restype = ctypes.c_size_t
        getattr(library, f"edgelin_{bits}_tokens_scratch_bytes").argtypes = [I64, I64]
    yield library
    library.edgelin_use_portable(0)


def paths(lib: ctypes.CDLL) -> list[str]:
    """The paths this CPU can take, best first, "portable" last."""
    top = lib.edgelin_kernel_path().decode()
    if top in ARM_LEVELS:
        return [name for name, level in ARM_LEVELS.items() if level <= ARM_LEVELS[top]] + ["portable"]
    return ["avx2", "portable"] if top == "avx2" else ["portable"]


@contextmanager
def taking(lib: ctypes.CDLL, path: str) -> Iterator[None]:
    if path in ARM_LEVELS:
        lib.edgelin_arm_limit(ARM_LEVELS[path])
    else:
        lib.edgelin_use_portable(int(path == "portable"))
    try:
        assert lib.edgelin_kernel_path().decode() == path
        yield
    finally:
        lib.edgelin_use_portable(0)  # back to the CPU's paths (both switches)


def _ptr(array: np.ndarray | None) -> int | None:
    return None if array is None else array.ctypes.data


def assert_product(got: np.ndarray, x: np.ndarray, w: np.ndarray, what: str) -> None:
    """got == x @ w in float64, to RTOL of sum |x| |w| per output (a scale no cancellation can shrink)."""
    want = x.astype(np.float64) @ w.astype(np.float64)
    scale = np.abs(x.astype(np.float64)) @ np.abs(w.astype(np.float64))
    error = float(np.max(np.abs(got - want) / np.maximum(scale, 1e-30)))
    assert error <= RTOL, f"{what}: {error:.2e} of sum |x| |w| (bound {RTOL:.0e})"


def test_the_cpu_reports_the_expected_path(lib):
    """The ARM tier names the path each emulated CPU must take (cortex-a76: neon-dotprod; max: neon-i8mm)."""
    expected = os.environ.get("EDGELIN_EXPECT_KERNEL_PATH")
    got = lib.edgelin_kernel_path().decode()
    if expected:
        assert got == expected
    assert got in (*ARM_LEVELS, "avx2", "none"), got  # never "portable" unless a test forced it
    if got in ARM_LEVELS:  # a limit above the CPU's level takes the CPU's path, never an instruction it lacks
        for level in range(4):
            lib.edgelin_arm_limit(level)
            want = [name for name, rank in ARM_LEVELS.items() if rank == min(level, ARM_LEVELS[got])]
            assert lib.edgelin_kernel_path().decode() == (want[0] if want else "portable")
        lib.edgelin_use_portable(0)
        assert lib.edgelin_kernel_path().decode() == got


def _panels(w: np.ndarray) -> np.ndarray:
    """W [K, N] as the exports store it: column panels [ceil(N / 16), K, 16], zeros past N."""
    K, N = w.shape
    padded = np.zeros((K, -(-N // 16) * 16), w.dtype)
    padded[:, :N] = w
    return np.ascontiguousarray(padded.reshape(K, -1, 16).transpose(1, 0, 2))


# (M tokens, K, N): one token and a few (decoding: a stream per panel), 6 and more (prefill tiles: whole tiles and a
# remainder of 1 / 5), K past one 256-row pass (300), not a multiple of 4 (37), N a partial last panel (45), below 16
PANEL_SHAPES = [(1, 37, 45), (3, 300, 32), (6, 64, 16), (7, 300, 45), (17, 37, 5)]


@pytest.mark.parametrize("half", [False, True], ids=["float32", "float16"])
@pytest.mark.parametrize("M,K,N", PANEL_SHAPES, ids=[f"M{m}-K{k}-N{n}" for m, k, n in PANEL_SHAPES])
def test_weight_panels_match_float64_on_every_path(lib, M, K, N, half):
    rng = np.random.default_rng(M * K + N)
    x = rng.standard_normal((M, K)).astype(np.float32)
    w = (rng.standard_normal((K, N)) * 0.1).astype(np.float16 if half else np.float32)
    packed = _panels(w)
    count = packed.shape[0]
    for path in paths(lib):
        y = np.full((M, N), np.nan, np.float32)
        with taking(lib, path):
            lib.edgelin_weight_panels(_ptr(x), M, K, N, _ptr(packed), int(half), 0, count, _ptr(y))
        assert_product(y, x, w, f"{path} panels")
        if count > 1:  # a task's slice of the panels writes its columns only
            y = np.full((M, N), np.nan, np.float32)
            with taking(lib, path):
                lib.edgelin_weight_panels(_ptr(x), M, K, N, _ptr(packed), int(half), 1, count, _ptr(y))
            assert np.isnan(y[:, :16]).all()
            assert_product(y[:, 16:], x, w[:, 16:], f"{path} panels 1..")


# (M, K, N, k0, k1): a slice of W's rows (a task's), whole passes of 8 and a remainder, N not a multiple of 8
ROW_SHAPES = [(1, 40, 21, 0, 40), (2, 40, 64, 3, 36), (1, 9, 5, 1, 8)]


@pytest.mark.parametrize("half", [False, True], ids=["float32", "float16"])
@pytest.mark.parametrize("M,K,N,k0,k1", ROW_SHAPES, ids=[f"M{s[0]}-K{s[1]}-N{s[2]}-k{s[3]}:{s[4]}" for s in ROW_SHAPES])
def test_weight_rows_match_float64_on_every_path(lib, M, K, N, k0, k1, half):
    """ONNX's [K, N] layout (exports made before the panels): y = x[:, k0:k1] W[k0:k1], written."""
    rng = np.random.default_rng(K * N + k0)
    x = rng.standard_normal((M, K)).astype(np.float32)
    w = (rng.standard_normal((K, N)) * 0.1).astype(np.float16 if half else np.float32)
    entry = lib.edgelin_f16_rows if half else lib.edgelin_f32_rows
    for path in paths(lib):
        y = np.full((M, N), np.nan, np.float32)
        with taking(lib, path):
            entry(_ptr(x), M, K, N, _ptr(w), k0, k1, _ptr(y))
        assert_product(y, x[:, k0:k1], w[k0:k1], f"{path} rows")


def _codes(rng: np.random.Generator, N: int, K: int, bits: int, zero_points: bool):
    """MatMulNBits' stored inputs, random (weights, scales, zero points as stored or None), and the float64 weights
    they stand for [N, nb, 32], unpacked here as the op's definition says."""
    nb = -(-K // 32)
    weights = rng.integers(0, 256, (N, nb, 32 if bits == 8 else 16), dtype=np.uint8)
    scales = rng.uniform(0.01, 0.1, N * nb).astype(np.float32)
    if bits == 8:
        points = rng.integers(0, 256, (N, nb), dtype=np.uint8) if zero_points else np.full((N, nb), 128, np.uint8)
        stored, q = points, weights.astype(np.float64)
    else:  # two codes per byte, low nibble first; zero points the same, ceil(nb / 2) bytes per row (default 8)
        points = rng.integers(0, 16, (N, nb + nb % 2), dtype=np.uint8) if zero_points else \
            np.full((N, nb + nb % 2), 8, np.uint8)
        stored = np.ascontiguousarray(points[:, 0::2] | points[:, 1::2] << 4).astype(np.uint8)
        q = np.stack([weights & 15, weights >> 4], -1).reshape(N, nb, 32).astype(np.float64)
    dequantised = (q - points[:, :nb, None]) * scales.reshape(N, nb, 1).astype(np.float64)
    return weights, scales, stored if zero_points else None, dequantised


def _activations(scratch: np.ndarray, K: int, bits: int) -> np.ndarray:
    """The int8 blocks x their scales [nb, 32] (float64) read back from one token's scratch: block b at 32 b (8-bit
    layout), or per pair of blocks 32 even-position values then 32 odd ones (4-bit)."""
    nb = -(-K // 32)
    nb8 = -(-nb // 8) * 8
    scales = scratch[: 4 * nb8].view(np.float32)[:nb].astype(np.float64)
    values = scratch[8 * nb8:].view(np.int8)
    if bits == 8:
        return values[:nb * 32].reshape(nb, 32).astype(np.float64) * scales[:, None]
    acts = np.zeros((nb, 32))
    for b in range(nb):
        base = (b // 2) * 64 + (b % 2) * 16
        acts[b, 0::2], acts[b, 1::2] = values[base:base + 16], values[base + 32:base + 48]
    return acts * scales[:, None]


def assert_quantized(got: np.ndarray, dequantised: np.ndarray, acts: np.ndarray, what: str) -> None:
    want = np.einsum("nbj,bj->n", dequantised, acts)
    scale = np.einsum("nbj,bj->n", np.abs(dequantised), np.abs(acts))
    error = float(np.max(np.abs(got - want) / scale))
    assert error <= RTOL, f"{what}: {error:.2e} of sum |x| |w| (bound {RTOL:.0e})"


QUANT_K = [384, 448, 352, 100]  # 12 blocks, 14 (not a multiple of 4 or 8), 11 (odd), 4 with the last one padded


@pytest.mark.parametrize("zero_points", [True, False], ids=["zero-points", "default"])
@pytest.mark.parametrize("K", QUANT_K, ids=[f"K{k}" for k in QUANT_K])
@pytest.mark.parametrize("bits", [4, 8], ids=["int4", "int8"])
def test_quantized_rows_match_float64_on_every_path(lib, bits, K, zero_points):
    """One token: N = 45 rows (groups of four and a remainder of 1), the whole product and a slice of rows."""
    quantize, rows = getattr(lib, f"edgelin_q{bits}_quantize"), getattr(lib, f"edgelin_q{bits}_rows")
    rng = np.random.default_rng(K + bits + zero_points)
    N = 45
    weights, scales, points, dequantised = _codes(rng, N, K, bits, zero_points)
    x = rng.standard_normal(K).astype(np.float32)
    size = lib.edgelin_q4_scratch_bytes(K)
    scratches = {}
    for path in paths(lib):
        scratch, y = np.full(size, 0xAB, np.uint8), np.full(N, np.nan, np.float32)  # garbage in the scratch
        with taking(lib, path):
            quantize(_ptr(x), K, _ptr(scratch))
            rows(_ptr(scratch), K, _ptr(weights), _ptr(scales), _ptr(points), 0, N, _ptr(y))
            part = np.full(N, np.nan, np.float32)
            rows(_ptr(scratch), K, _ptr(weights), _ptr(scales), _ptr(points), 6, 13, _ptr(part))
        scratches[path] = scratch
        acts = _activations(scratch, K, bits)
        assert_quantized(y, dequantised, acts, f"{path} int{bits}")
        assert np.isnan(part[:6]).all() and np.isnan(part[13:]).all()
        assert_quantized(part[6:13], dequantised[6:13], acts, f"{path} int{bits} rows 6:13")
    for path, scratch in scratches.items():  # every path rounds the activations to the same int8 bytes
        assert np.array_equal(scratch, scratches["portable"]), path


@pytest.mark.parametrize("M", [2, 7, 17])
@pytest.mark.parametrize("bits", [4, 8], ids=["int4", "int8"])
def test_quantized_tokens_match_float64_on_every_path(lib, bits, M):
    """Several tokens (a prefill piece or a batch): y [M, N] from one scratch, rows 3 <= n < N of each (an odd
    count: the i8mm path's lone last row, as an odd M is its lone last token)."""
    quantize = getattr(lib, f"edgelin_q{bits}_quantize_tokens")
    rows, size = getattr(lib, f"edgelin_q{bits}_rows_tokens"), getattr(lib, f"edgelin_q{bits}_tokens_scratch_bytes")
    K, N = 352, 38
    rng = np.random.default_rng(M * bits)
    weights, scales, points, dequantised = _codes(rng, N, K, bits, True)
    x = rng.standard_normal((M, K)).astype(np.float32)
    one = lib.edgelin_q4_scratch_bytes(K)
    for path in paths(lib):
        with taking(lib, path):
            scratch, y = np.zeros(size(M, K), np.uint8), np.full((M, N), np.nan, np.float32)
            quantize(_ptr(x), M, K, _ptr(scratch))
            assert rows(_ptr(scratch), M, K, _ptr(weights), _ptr(scales), _ptr(points), 3, N, _ptr(y), N) == 0
        assert np.isnan(y[:, :3]).all()
        for m in range(M):  # each token's activations as its one-token quantisation gives them
            single = np.zeros(one, np.uint8)
            with taking(lib, "portable"):
                getattr(lib, f"edgelin_q{bits}_quantize")(_ptr(x[m]), K, _ptr(single))
            assert_quantized(y[m, 3:], dequantised[3:], _activations(single, K, bits), f"{path} int{bits} token {m}")


# ---- the step's fused ops ------------------------------------------------------------------------------------
def _assert_close(got: np.ndarray, want: np.ndarray, rtol: float, what: str) -> None:
    error = float(np.max(np.abs(got - want)) / max(float(np.max(np.abs(want))), 1e-30))
    assert error <= rtol, f"{what}: {error:.2e} of max |want| (bound {rtol:.0e})"


@pytest.mark.parametrize("B,C,T,W", [(1, 37, 1, 4), (2, 9, 1, 3), (1, 10, 70, 4)],
                         ids=["B1-C37-T1-W4", "B2-C9-T1-W3", "B1-C10-T70-W4"])
def test_conv_silu_matches_float64_on_every_path(lib, B, C, T, W):
    """The short conv's step with its state, SiLU fused (its e^x: a polynomial on the vector paths)."""
    rng = np.random.default_rng(C * T)
    x = (rng.standard_normal((B, C, T)) * 3).astype(np.float32)
    weight, bias = rng.standard_normal((C, W)).astype(np.float32), rng.standard_normal(C).astype(np.float32)
    state = rng.standard_normal((B, C, W - 1)).astype(np.float32)
    window = np.concatenate([state, x], -1).astype(np.float64)
    z = bias[None, :, None] + sum(weight[None, :, j, None] * window[..., j:j + T] for j in range(W))
    want_y, want_state = z / (1 + np.exp(-z)), window[..., T:]
    lib.edgelin_conv_silu.argtypes = [P, P, P, P, I64, I64, I64, I64, P, P]
    for path in paths(lib):
        y, new_state = np.full((B, C, T), np.nan, np.float32), np.full((B, C, W - 1), np.nan, np.float32)
        with taking(lib, path):
            lib.edgelin_conv_silu(_ptr(x), _ptr(weight), _ptr(bias), _ptr(state), B, C, T, W, _ptr(y), _ptr(new_state))
        assert np.array_equal(new_state, want_state.astype(np.float32)), path  # copied values
        _assert_close(y, want_y, 1e-6, f"{path} conv")


RULES = {"linear": 0, "gated": 1, "delta": 2, "gated_delta": 3}


def _linear_attention_reference(rule, q, k, v, decay, beta, state, group, scale):
    """float64, token by token, as linear_attention.h defines it."""
    B, T, H = v.shape[0], v.shape[1], state.shape[1]
    S, out = state.astype(np.float64).copy(), np.zeros(v.shape)
    for b in range(B):
        for t in range(T):
            for h in range(H):
                if rule in ("gated", "gated_delta"):
                    S[b, h] *= np.exp(decay[b, t, h])[:, None] if decay.shape[-1] > 1 else np.exp(decay[b, t, h, 0])
                kk, qq = k[b, t, h].astype(np.float64), q[b, t, h // group].astype(np.float64)
                u = beta[b, t, h] * (v[b, t, h] - S[b, h].T @ kk) if rule in ("delta", "gated_delta") else v[b, t, h]
                S[b, h] += np.outer(kk, u)
                out[b, t, h] = scale * S[b, h].T @ qq
    return out, S


@pytest.mark.parametrize("dk,dv", [(8, 12), (10, 20)], ids=["dk8-dv12", "dk10-dv20"])
@pytest.mark.parametrize("rule", list(RULES))
@pytest.mark.parametrize("per_key", [False, True], ids=["per-head", "per-key"])
def test_linear_attention_matches_float64_on_every_path(lib, rule, per_key, dk, dv):
    """Every update rule, decay per head or per key, 2 query heads over 4 value heads, 2 tokens, batch 2; value
    widths of 3 and 5 column quads (the NEON path's line of 4 quads and its remainder), keys not a multiple of 4."""
    B, T, Hq, H = 2, 2, 2, 4
    gw = dk if per_key else 1
    rng = np.random.default_rng(RULES[rule] * 10 + gw + dv)
    q = rng.standard_normal((B, T, Hq, dk)).astype(np.float32)
    k = (rng.standard_normal((B, T, H, dk)) / np.sqrt(dk)).astype(np.float32)
    v = rng.standard_normal((B, T, H, dv)).astype(np.float32)
    decay = -rng.uniform(0.01, 1.0, (B, T, H, gw)).astype(np.float32)
    beta = rng.uniform(0.1, 0.9, (B, T, H)).astype(np.float32)
    state = rng.standard_normal((B, H, dk, dv)).astype(np.float32)
    want_out, want_state = _linear_attention_reference(rule, q, k, v, decay, beta, state, H // Hq, 0.5)
    gated, delta = rule in ("gated", "gated_delta"), rule in ("delta", "gated_delta")
    lib.edgelin_linear_attention.argtypes = [ctypes.c_int, P, P, P, P, I64, P, P, I64, I64, I64, I64, I64, I64,
                                             ctypes.c_float, P, P, I64, I64]
    for path in paths(lib):
        out, new_state = np.full((B, T, H, dv), np.nan, np.float32), np.full_like(state, np.nan)
        with taking(lib, path):
            lib.edgelin_linear_attention(RULES[rule], _ptr(q), _ptr(k), _ptr(v), _ptr(decay) if gated else None, gw,
                                         _ptr(beta) if delta else None, _ptr(state), B, T, Hq, H, dk, dv, 0.5,
                                         _ptr(out), _ptr(new_state), 0, B * H)
        _assert_close(out, want_out, 1e-5, f"{path} {rule} out")
        _assert_close(new_state, want_state, 1e-5, f"{path} {rule} state")


class _Attention(ctypes.Structure):
    _fields_ = [("q", P), ("keys", P), ("values", P), ("seqlens", P), ("B", I64), ("S", I64), ("Hq", I64),
                ("Hkv", I64), ("D", I64), ("capacity", I64), ("splits", I64), ("scale", ctypes.c_float),
                ("half", ctypes.c_int), ("partial", P), ("scratch", P), ("out", P)]


@pytest.mark.parametrize("half", [False, True], ids=["float32", "float16"])
@pytest.mark.parametrize("D,splits", [(64, 1), (20, 3)], ids=["D64", "D20-3-pieces"])
def test_decode_attention_matches_float64_on_every_path(lib, D, splits, half):
    """The static cache's decode attention: 2 sequences of other lengths (one past a chunk of keys), 2 kv heads of
    3 query heads each, the new token's row already in the cache; split into pieces merged at the end."""
    B, S, Hkv, G, capacity = 2, 1, 2, 3, 400
    Hq, lengths = Hkv * G, np.array([300, 37], np.int32)  # seqlens: rows before this token
    rng = np.random.default_rng(D + splits + half)
    dtype = np.float16 if half else np.float32
    q = rng.standard_normal((B, S, Hq, D)).astype(dtype)
    keys = rng.standard_normal((B, Hkv, capacity, D)).astype(dtype)
    values = rng.standard_normal((B, Hkv, capacity, D)).astype(dtype)
    scale = 1 / np.sqrt(D)
    want = np.zeros((B, S, Hq, D))
    for b in range(B):
        rows = lengths[b] + 1
        for h in range(Hq):
            kk, vv = keys[b, h // G, :rows].astype(np.float64), values[b, h // G, :rows].astype(np.float64)
            s = kk @ q[b, 0, h].astype(np.float64) * scale
            p = np.exp(s - s.max())
            want[b, 0, h] = p @ vv / p.sum()
    for name in ("edgelin_attention_tasks", "edgelin_attention_scratch_floats"):
        getattr(lib, name).restype = I64
    lib.edgelin_attention_scratch_floats.argtypes = [I64, I64]
    for path in paths(lib):
        out = np.full((B, S, Hq, D), np.nan, dtype)
        call = _Attention(q.ctypes.data, keys.ctypes.data, values.ctypes.data, lengths.ctypes.data, B, S, Hq, Hkv, D,
                          capacity, splits, scale, int(half), None, None, out.ctypes.data)
        tasks = lib.edgelin_attention_tasks(ctypes.byref(call))
        partial = np.zeros(tasks * G * (D + 2), np.float32)
        scratch = np.zeros(tasks * lib.edgelin_attention_scratch_floats(G, D), np.float32)
        call.partial, call.scratch = partial.ctypes.data, scratch.ctypes.data
        with taking(lib, path):
            for task in range(tasks):
                lib.edgelin_attention_task(ctypes.byref(call), task)
            assert lib.edgelin_attention_merge(ctypes.byref(call)) == 0
        _assert_close(out.astype(np.float64), want, 2e-3 if half else 1e-5, f"{path} attention")
