"""A prefill piece's 4-bit weight product: ONNX Runtime's MatMulNBits (MLAS, weights prepacked into a private copy)
against edgelin's (edgelin/ortops/q4_gemm.c, the weights read as stored), side by side in one process: a benchmark
(not a test). Each shape is one [M, K] x [K, N] MatMul quantised as `edgelin export --quantize int4` does (ONNX
Runtime's tool: 4 bits, block 32, asymmetric, accuracy level 4) and routed as `--step-ops edgelin` routes a prefill
graph's products; each round times `--reps` runs of one
session, then of the other (the order alternates every round). Printed: median microseconds per product, billions of
multiply-adds per second, and edgelin's speed relative to ONNX Runtime's (> 1: edgelin faster).

    python bench/q4_prefill.py [--shapes 384x1676,768x384,384x2048] [--tokens 256,64] [--threads 1] [--rounds 20]

Shapes are KxN (the Mamba2 peer's in_proj, out_proj and LM head). Needs a C compiler (the library builds as the
runner builds it).
"""

from __future__ import annotations

import argparse
import ctypes
import time

import tempfile
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

from edgelin import ortops
from edgelin.export.onnx.kernels import route_graph
from edgelin.export.quantize import quantize_graph


def quantised(K: int, N: int, folder: Path):
    """One float [m, K] x [K, N] MatMul quantised as `edgelin export --quantize int4` quantises
    (edgelin.export.quantize, ONNX Runtime's tool underneath)."""
    weight = (np.random.default_rng(K + N).standard_normal((K, N)) * 0.05).astype(np.float32)
    graph = helper.make_graph([helper.make_node("MatMul", ["x", "W"], ["y"])], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["m", K])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["m", N])],
                              [numpy_helper.from_array(weight, "W")])
    path = folder / f"{K}x{N}.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)]), str(path))
    quantize_graph(path, "int4", 32, embeddings=False)
    return onnx.load(str(path))


def routed(model):
    """The same model with its 4-bit product in edgelin's domain, as `--step-ops edgelin` routes a prefill graph."""
    copy = type(model)()
    copy.CopyFrom(model)
    if route_graph(copy, products_only=True) != 1:
        raise SystemExit("edgelin's router did not take the quantised product")
    return copy


def session(model, threads: int, library=None) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    if library is not None:
        options.register_custom_ops_library(str(library))
        options.add_session_config_entry("session.disable_prepacking", "1")  # as the runner sets it
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default="384x1676,768x384,384x2048")
    parser.add_argument("--tokens", default="256,64")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--reps", type=int, default=20)
    args = parser.parse_args()
    library = ortops.build()
    path = ctypes.CDLL(str(library)).edgelin_q4_path
    path.restype = ctypes.c_char_p
    print(f"{args.threads} thread(s), {args.rounds} rounds of {args.reps}; edgelin's 4-bit path: {path().decode()}")
    for shape in args.shapes.split(","):
        K, N = (int(v) for v in shape.split("x"))
        with tempfile.TemporaryDirectory() as folder:
            model = quantised(K, N, Path(folder))
        sessions = {"onnxruntime": session(model, args.threads), "edgelin": session(routed(model), args.threads,
                                                                                    library)}
        for M in (int(m) for m in args.tokens.split(",")):
            x = np.random.default_rng(M).standard_normal((M, K)).astype(np.float32)
            outputs = {name: s.run(None, {"x": x})[0] for name, s in sessions.items()}
            error = float(np.abs(outputs["edgelin"] - outputs["onnxruntime"]).max()
                          / np.abs(outputs["onnxruntime"]).max())
            times: dict[str, list[float]] = {name: [] for name in sessions}
            for r in range(args.rounds):
                for name in (list(sessions) if r % 2 == 0 else list(sessions)[::-1]):
                    t0 = time.perf_counter()
                    for _ in range(args.reps):
                        sessions[name].run(None, {"x": x})
                    times[name].append((time.perf_counter() - t0) / args.reps * 1e6)
            mlas, mine = np.median(times["onnxruntime"]), np.median(times["edgelin"])
            print(f"M={M} K={K} N={N}: ONNX Runtime {mlas:.0f} us ({M * K * N / mlas / 1e3:.1f} GMAC/s), edgelin "
                  f"{mine:.0f} us ({M * K * N / mine / 1e3:.1f} GMAC/s), edgelin x{mlas / mine:.2f}; max difference "
                  f"{error:.1e} of the largest output")


if __name__ == "__main__":
    main()
