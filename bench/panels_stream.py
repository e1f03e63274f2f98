"""Why edgelin stores weight products' weights in column panels: one decoding token's products over a whole model's
weights, in ONNX's [K, N] layout (rows_kernel.h: slices of eight rows, edgelin's product before the panels) against
packed panels [ceil(N / 16), K, 16] (panels.c), float32 and float16 weights, side by side in one process,
alternating. One thread, no ONNX Runtime: the kernels through ctypes. Weights shaped as the Mamba2 peer's (12 layers
of the fused input projection 384 x 1676 and the output projection 768 x 384, the head 384 x 2048; --layers scales
the count, so that the set outgrows the last-level cache), each matrix its own buffer, all of them once per
"token"; prints ms per token, GB/s of weights read and the ratio panels / rows. Also checks that both layouts give
the same product. Not a test.

    python bench/panels_stream.py [--layers 12,24] [--repeats 15]
"""

from __future__ import annotations

import argparse
import ctypes
import time

import numpy as np

from edgelin import ortops
from edgelin.export.panels import pack_panels


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", default="12,24")
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args()
    lib = ctypes.CDLL(str(ortops.build()))
    f32 = ctypes.POINTER(ctypes.c_float)
    i64 = ctypes.c_int64
    for name in ("edgelin_f32_rows", "edgelin_f16_rows"):
        getattr(lib, name).argtypes = [f32, i64, i64, i64, ctypes.c_void_p, i64, i64, f32]
    lib.edgelin_weight_panels.argtypes = [f32, i64, i64, i64, ctypes.c_void_p, ctypes.c_int, i64, i64, f32]
    lib.edgelin_kernel_path.restype = ctypes.c_char_p
    print(f"kernel path: {lib.edgelin_kernel_path().decode()}", flush=True)
    rng = np.random.default_rng(0)
    for layers in (int(n) for n in args.layers.split(",")):
        shapes = [(384, 1676), (768, 384)] * layers + [(384, 2048)]
        for dtype, kind in ((np.float32, "f32"), (np.float16, "f16")):
            rows = [(rng.standard_normal(s) * 0.05).astype(dtype) for s in shapes]
            panels = [pack_panels(w) for w in rows]
            xs = [rng.standard_normal((1, s[0])).astype(np.float32) for s in shapes]
            ys = [np.empty((1, s[1]), np.float32) for s in shapes]
            by_rows, half = getattr(lib, f"edgelin_{kind}_rows"), int(kind == "f16")

            def token(use_panels: bool) -> None:
                for w, p, x, y in zip(rows, panels, xs, ys):
                    K, N = w.shape
                    if use_panels:
                        lib.edgelin_weight_panels(x.ctypes.data_as(f32), 1, K, N, p.ctypes.data, half, 0, p.shape[0],
                                                  y.ctypes.data_as(f32))
                    else:
                        by_rows(x.ctypes.data_as(f32), 1, K, N, w.ctypes.data, 0, K, y.ctypes.data_as(f32))

            token(False)
            expected = [y.copy() for y in ys]
            token(True)
            worst = max(float(np.abs(y - e).max() / np.abs(e).max()) for y, e in zip(ys, expected))
            assert worst < 1e-5, f"panels and rows disagree: {worst:.2e} of the largest output"
            times: dict[bool, list[float]] = {False: [], True: []}
            for r in range(args.repeats):
                for use in ((False, True) if r % 2 == 0 else (True, False)):
                    began = time.perf_counter()
                    token(use)
                    times[use].append(time.perf_counter() - began)
            size = sum(w.nbytes for w in rows)
            old, new = np.median(times[False]), np.median(times[True])
            print(f"{layers} layers, {kind} weights {size / 2**20:.1f} MiB: rows [K, N] {old * 1e3:.3f} ms "
                  f"({size / old / 1e9:.1f} GB/s), panels {new * 1e3:.3f} ms ({size / new / 1e9:.1f} GB/s), "
                  f"panels / rows x{new / old:.2f} (medians of {args.repeats}, alternating)", flush=True)


if __name__ == "__main__":
    main()
