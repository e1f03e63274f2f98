"""edgelin's float16-weight products (--quantize fp16; edgelin/ortops/f16_gemm.c) against their float32 peers, side
by side in one process, alternating: a prefill piece (M tokens) against numpy's float32 matmul (OpenBLAS; run with
OPENBLAS_NUM_THREADS=1 for one core) on the float32 copy of the same weights, and a decoding row (M = 1) against
edgelin's own float32 product (f32_gemv.c) on that copy. Weights as the Mamba2 peer's (d_model 384: the fused input
projection 384 x 1676 and the output projection 768 x 384) and as a 768-wide model's MLP (768 x 2048). One thread,
the best of --repeats per side; prints GFLOP/s (prefill) and GB/s of weights read (decoding) and the ratios.
Not a test.

    OPENBLAS_NUM_THREADS=1 python bench/f16_products.py [--tokens 256] [--repeats 15]
"""

from __future__ import annotations

import argparse
import ctypes
import time

import numpy as np

from edgelin import ortops

SHAPES = [(384, 1676), (768, 384), (768, 2048)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args()
    lib = ctypes.CDLL(str(ortops.build()))
    f32, u16 = ctypes.POINTER(ctypes.c_float), ctypes.POINTER(ctypes.c_uint16)
    signature = [f32, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, None, ctypes.c_int64, ctypes.c_int64, f32]
    for name, weight in (("edgelin_f16_rows", u16), ("edgelin_f16_cols", u16), ("edgelin_f32_rows", f32)):
        getattr(lib, name).argtypes = [w or weight for w in signature]
    lib.edgelin_kernel_path.restype = ctypes.c_char_p
    print(f"kernel path: {lib.edgelin_kernel_path().decode()}", flush=True)
    rng = np.random.default_rng(0)

    def best(fn) -> float:
        times = []
        for _ in range(args.repeats):
            began = time.perf_counter()
            fn()
            times.append(time.perf_counter() - began)
        return min(times)

    for K, N in SHAPES:
        half = (rng.standard_normal((K, N)) * 0.05).astype(np.float16)
        full = half.astype(np.float32)
        for M in (args.tokens, 1):
            x = rng.standard_normal((M, K)).astype(np.float32)
            y = np.empty((M, N), np.float32)
            ours = (lambda: lib.edgelin_f16_cols(x.ctypes.data_as(f32), M, K, N, half.ctypes.data_as(u16), 0, N,
                                                 y.ctypes.data_as(f32))) if M > 1 else \
                (lambda: lib.edgelin_f16_rows(x.ctypes.data_as(f32), M, K, N, half.ctypes.data_as(u16), 0, K,
                                              y.ctypes.data_as(f32)))
            peer = (lambda: x @ full) if M > 1 else \
                (lambda: lib.edgelin_f32_rows(x.ctypes.data_as(f32), M, K, N, full.ctypes.data_as(f32), 0, K,
                                              y.ctypes.data_as(f32)))
            a, b = [], []
            for _ in range(3):  # alternating rounds
                a.append(best(ours))
                b.append(best(peer))
            t_ours, t_peer = min(a), min(b)
            if M > 1:
                flops = 2 * M * K * N
                print(f"{K}x{N}, {M} tokens: float16 tiles {flops / t_ours / 1e9:6.1f} GFLOP/s, numpy float32 "
                      f"{flops / t_peer / 1e9:6.1f} GFLOP/s, time ratio ours / numpy {t_ours / t_peer:.2f}", flush=True)
            else:
                print(f"{K}x{N}, 1 token: float16 rows {half.nbytes / t_ours / 1e9:5.1f} GB/s ({t_ours * 1e6:.1f} us), "
                      f"float32 rows {full.nbytes / t_peer / 1e9:5.1f} GB/s ({t_peer * 1e6:.1f} us), time ratio "
                      f"{t_ours / t_peer:.2f}", flush=True)


if __name__ == "__main__":
    main()
