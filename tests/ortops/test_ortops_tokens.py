"""edgelin.ortops' 4-bit and 8-bit products for several tokens at once (q4_gemm.c, q8_gemm.c, nbits_grouped.c: a
prefill piece, or a batch; on AVX2 the grouped path from 6 tokens), against the one-token path on the portable C code
and against float64 sums of the dequantised weights."""

from __future__ import annotations

import numpy as np
import pytest

from helpers import assert_close
from ortops_fixtures import activations, c_kernel, library, random_codes  # noqa: F401

# K: whole groups of 8 blocks (384 = 8 + 4 blocks: a last group of four), 16 blocks, an odd block count (448: no
# four-block steps, the one-token path per token), K not a multiple of 32; M: fours, fours and a remainder, one;
# and for the 8-bit tiles of 16 tokens, two tiles and a part of one (37), one and a part (17)
SHAPES = [(384, 9), (512, 4), (448, 6), (100, 3), (384, 1), (96, 37), (768, 17)]


@pytest.mark.parametrize("K,M", SHAPES, ids=[f"K{k}-M{m}" for k, m in SHAPES])
@pytest.mark.parametrize("zero_points", [True, False], ids=["zero-points", "default"])
@pytest.mark.parametrize("path", ["avx512-vnni", "avx2"])
@pytest.mark.parametrize("bits", [4, 8], ids=["int4", "int8"])
def test_the_token_path_gives_the_one_token_products(library, K, M, zero_points, path, bits):
    lib = c_kernel(library)
    if lib.edgelin_kernel_path() != b"avx2":
        pytest.skip("this CPU has no AVX2: only the portable path runs here")
    lib.edgelin_use_avx512(int(path == "avx512-vnni"))
    try:
        if lib.edgelin_q4_path().decode() != path:
            pytest.skip("this CPU has no AVX-512 VNNI (the -avx2 tests cover its path)")
        name = f"q{bits}"
        quantize, rows = getattr(lib, f"edgelin_{name}_quantize"), getattr(lib, f"edgelin_{name}_rows")
        quantize_tokens = getattr(lib, f"edgelin_{name}_quantize_tokens")
        rows_tokens = getattr(lib, f"edgelin_{name}_rows_tokens")
        rng = np.random.default_rng(K + M + bits)
        N = 23  # rows in fours and a remainder of 3
        weights, scales, points, dequantised = random_codes(rng, N, K, bits, zero_points)
        zp = points.ctypes.data if zero_points else None
        x = rng.standard_normal((M, K)).astype(np.float32)
        size = lib.edgelin_q4_scratch_bytes(K)  # one token's
        total = getattr(lib, f"edgelin_{name}_tokens_scratch_bytes")(M, K)
        scratch, got = np.full(total, 0xAB, np.uint8), np.full((M, N + 5), np.nan, np.float32)  # garbage; wider y
        quantize_tokens(x.ctypes.data, M, K, scratch.ctypes.data)
        # rows 2..N in two slices (as two tasks would), into a y of N + 5 columns: the columns left alone stay NaN
        for n0, n1 in ((2, 11), (11, N)):
            done = rows_tokens(scratch.ctypes.data, M, K, weights.ctypes.data, scales.ctypes.data, zp, n0, n1,
                               got.ctypes.data, N + 5)
            assert done == 0  # 0: any buffer of unpacked or packed codes was allocated
        assert np.isnan(got[:, :2]).all() and np.isnan(got[:, N:]).all()
        lib.edgelin_use_portable(1)  # the one-token path, token by token
        want = np.empty((M, N), np.float32)
        one = np.empty(size, np.uint8)
        for m in range(M):
            quantize(x[m].ctypes.data, K, one.ctypes.data)
            rows(one.ctypes.data, K, weights.ctypes.data, scales.ctypes.data, zp, 0, N, want[m].ctypes.data)
            assert_close(want[m], np.einsum("nbj,bj->n", dequantised, activations(one, K, bits)), 1e-6,
                         f"portable token {m} vs float64")
    finally:
        lib.edgelin_use_portable(0)
        lib.edgelin_use_avx512(1)
    assert_close(got[:, 2:N], want[:, 2:], 1e-6, f"{bits} bits, {path} tokens vs portable, K={K} M={M}")
