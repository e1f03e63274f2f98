"""edgelin's 4-bit product (edgelin/ortops/q4_gemv.c) on its AVX-512 VNNI path against its AVX2 path, side by side in
one process: a benchmark (not a test). Each round times `--reps` products on one path, then on the other (the order
alternates every round); it prints the median microseconds per product, the weight bytes per second and the ratio.

    python bench/q4_paths.py [--shapes 384x2048,1024x384,384x4352,1024x8192] [--rounds 30] [--reps 200]

Shapes are KxN (inputs x outputs; the Qwen3.5 peer's products are 384x2048, 1024x384 and 384x768). Needs a C
compiler (the library builds as the runner builds it) and, for the VNNI path, a CPU with AVX-512 VNNI.
"""

from __future__ import annotations

import argparse
import ctypes
import time

import numpy as np

from edgelin import ortops


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default="384x2048,1024x384,384x4352,1024x8192")
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--reps", type=int, default=200)
    args = parser.parse_args()
    lib = ctypes.CDLL(str(ortops.build()))
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    lib.edgelin_q4_scratch_bytes.restype, lib.edgelin_q4_scratch_bytes.argtypes = ctypes.c_size_t, [i64]
    lib.edgelin_q4_quantize.argtypes = [ptr, i64, ptr]
    lib.edgelin_q4_rows.argtypes = [ptr, i64, ptr, ptr, ptr, i64, i64, ptr]
    lib.edgelin_q4_path.restype = ctypes.c_char_p
    lib.edgelin_use_avx512(1)
    if lib.edgelin_q4_path() != b"avx512-vnni":
        raise SystemExit(f"this CPU's 4-bit path is {lib.edgelin_q4_path().decode()}: no AVX-512 VNNI to compare")
    for shape in args.shapes.split(","):
        K, N = (int(v) for v in shape.split("x"))
        rng, nb = np.random.default_rng(0), (K + 31) // 32
        weights = rng.integers(0, 256, (N, nb, 16), dtype=np.uint8)
        scales = rng.uniform(0.01, 0.1, N * nb).astype(np.float32)
        zero_points = rng.integers(0, 256, (N, (nb + 1) // 2), dtype=np.uint8)
        x = rng.standard_normal(K).astype(np.float32)
        scratch, y = np.zeros(lib.edgelin_q4_scratch_bytes(K), np.uint8), np.empty(N, np.float32)
        lib.edgelin_q4_quantize(x.ctypes.data, K, scratch.ctypes.data)
        times: dict[int, list[float]] = {0: [], 1: []}
        for r in range(args.rounds):
            for vnni in ((1, 0) if r % 2 == 0 else (0, 1)):
                lib.edgelin_use_avx512(vnni)
                t0 = time.perf_counter()
                for _ in range(args.reps):
                    lib.edgelin_q4_rows(scratch.ctypes.data, K, weights.ctypes.data, scales.ctypes.data,
                                        zero_points.ctypes.data, 0, N, y.ctypes.data)
                times[vnni].append((time.perf_counter() - t0) / args.reps * 1e6)
        lib.edgelin_use_avx512(1)
        avx2, vnni = np.median(times[0]), np.median(times[1])
        mb = weights.nbytes / 1e6
        print(f"K={K} N={N} ({mb:.2f} MB of 4-bit weights): AVX2 {avx2:.1f} us ({mb / avx2 * 1e3:.1f} GB/s), "
              f"AVX-512 VNNI {vnni:.1f} us ({mb / vnni * 1e3:.1f} GB/s), x{avx2 / vnni:.2f}")


if __name__ == "__main__":
    main()
