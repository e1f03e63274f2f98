"""edgelin.ortops' 4-bit product for several tokens at once (q4_gemm.c: a prefill piece, or a batch), against the
one-token path on the portable C code and against float64 sums of the dequantised weights."""

from __future__ import annotations

import numpy as np
import pytest

from helpers import assert_close
from ortops_fixtures import activations, c_kernel, library  # noqa: F401

# K: whole groups of 8 blocks (384 = 8 + 4 blocks: a last group of four), 16 blocks, an odd block count (448: no
# four-block steps, the one-token path per token), K not a multiple of 32; M: fours, fours and a remainder, one
SHAPES = [(384, 9), (512, 4), (448, 6), (100, 3), (384, 1)]


@pytest.mark.parametrize("K,M", SHAPES, ids=[f"K{k}-M{m}" for k, m in SHAPES])
@pytest.mark.parametrize("zero_points", [True, False], ids=["zero-points", "default-8"])
@pytest.mark.parametrize("path", ["avx512-vnni", "avx2"])
def test_the_token_path_gives_the_one_token_products(library, K, M, zero_points, path):
    lib = c_kernel(library)
    if lib.edgelin_kernel_path() != b"avx2":
        pytest.skip("this CPU has no AVX2: only the portable path runs here")
    lib.edgelin_use_avx512(int(path == "avx512-vnni"))
    try:
        if lib.edgelin_q4_path().decode() != path:
            pytest.skip("this CPU has no AVX-512 VNNI (the -avx2 tests cover its path)")
        rng = np.random.default_rng(K + M)
        N, nb = 23, (K + 31) // 32  # rows in fours and a remainder of 3
        weights = rng.integers(0, 256, (N, nb, 16), dtype=np.uint8)
        scales = rng.uniform(0.01, 0.1, N * nb).astype(np.float32)
        points = rng.integers(0, 16, (N, nb + nb % 2), dtype=np.uint8) if zero_points else \
            np.full((N, nb + nb % 2), 8, np.uint8)
        packed = (points[:, 0::2] | points[:, 1::2] << 4).astype(np.uint8)
        zp = packed.ctypes.data if zero_points else None
        x = rng.standard_normal((M, K)).astype(np.float32)
        size = lib.edgelin_q4_scratch_bytes(K)
        scratch, got = np.full(size * M, 0xAB, np.uint8), np.full((M, N + 5), np.nan, np.float32)  # garbage; wider y
        lib.edgelin_q4_quantize_tokens(x.ctypes.data, M, K, scratch.ctypes.data)
        # rows 2..N in two slices (as two tasks would), into a y of N + 5 columns: the columns left alone stay NaN
        for n0, n1 in ((2, 11), (11, N)):
            lib.edgelin_q4_rows_tokens(scratch.ctypes.data, M, K, weights.ctypes.data, scales.ctypes.data, zp,
                                       n0, n1, got.ctypes.data, N + 5)
        assert np.isnan(got[:, :2]).all() and np.isnan(got[:, N:]).all()
        lib.edgelin_use_portable(1)  # the one-token path, token by token
        want = np.empty((M, N), np.float32)
        one = np.empty(size, np.uint8)
        q = np.stack([weights & 15, weights >> 4], -1).reshape(N, nb, 32).astype(np.float64)
        dequantised = (q - points[:, :nb, None]) * scales.reshape(N, nb, 1).astype(np.float64)
        for m in range(M):
            lib.edgelin_q4_quantize(x[m].ctypes.data, K, one.ctypes.data)
            lib.edgelin_q4_rows(one.ctypes.data, K, weights.ctypes.data, scales.ctypes.data, zp, 0, N,
                                want[m].ctypes.data)
            assert_close(want[m], np.einsum("nbj,bj->n", dequantised, activations(one, K)), 1e-6,
                         f"portable token {m} vs float64")
    finally:
        lib.edgelin_use_portable(0)
        lib.edgelin_use_avx512(1)
    assert_close(got[:, 2:N], want[:, 2:], 1e-6, f"{path} tokens vs portable, K={K} M={M}")
