"""ONNX Runtime's quantised weight products at one decode step's shapes, variants side by side in one process.

    python bench/matmul_nbits.py [--variants 4:32:asym:4,4:32:sym:4,...] [--rounds 400] [--threads 1] [--tokens 1]

The model: --layers x (a [d, n_in] product, a nonlinearity, a [d_inner, d] product, a residual add) and a
[d, vocab] head, at M = --tokens (1: a decode step; 128: a prefill piece), float32 weights N(0, 0.05) quantised by ONNX Runtime's own
MatMulNBitsQuantizer for every variant `bits:block:sym|asym:accuracy_level[:edgelin]` (`:edgelin`: the products on
edgelin's operator library, edgelin.ortops, reading the weights as stored; else ONNX Runtime's, prepacked), plus
`dynamic` (ONNX Runtime's
quantize_dynamic: per-channel int8 weights, int8 activations quantised at run time) and `fp32` (the float
MatMuls). The defaults are the Mamba2 peer checkpoint's step (bench/peer_checkpoints.py: 12 layers, d 384,
the fused in-projection 384 -> 1676, the out-projection 768 -> 384, vocab 2048). Every variant is one session;
each round runs them all, in alternating order; printed: the median time per run and the median over rounds
of the per-round ratio to the first variant (host drift cannot bias a ratio taken within a round).
Not a test; nothing here checks the numbers each variant computes (their weights differ by quantisation).
"""

from __future__ import annotations

import argparse
import logging
import tempfile
import time
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper


def float_model(layers: int, d: int, n_in: int, d_inner: int, vocab: int) -> onnx.ModelProto:
    rng = np.random.default_rng(0)

    def weight(name: str, *shape: int) -> onnx.TensorProto:
        return numpy_helper.from_array((rng.standard_normal(shape) * 0.05).astype(np.float32), name)

    def ints(name: str, value: int) -> onnx.TensorProto:
        return numpy_helper.from_array(np.array([value], np.int64), name)

    nodes, inits, x = [], [ints("zero", 0), ints("inner", d_inner), ints("last", 1)], "x"
    for i in range(layers):
        inits += [weight(f"w_in{i}", d, n_in), weight(f"w_out{i}", d_inner, d)]
        nodes += [helper.make_node("MatMul", [x, f"w_in{i}"], [f"h{i}"]),
                  helper.make_node("Slice", [f"h{i}", "zero", "inner", "last"], [f"s{i}"]),
                  helper.make_node("Tanh", [f"s{i}"], [f"a{i}"]),
                  helper.make_node("MatMul", [f"a{i}", f"w_out{i}"], [f"o{i}"]),
                  helper.make_node("Add", [x, f"o{i}"], [f"r{i}"])]
        x = f"r{i}"
    inits.append(weight("head", d, vocab))
    nodes.append(helper.make_node("MatMul", [x, "head"], ["logits"]))
    graph = helper.make_graph(nodes, "step_products", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["m", d])],
                              [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["m", vocab])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])


def variant(spec: str, fp32: onnx.ModelProto, scratch: Path) -> onnx.ModelProto:
    if spec == "fp32":
        return fp32
    if spec == "dynamic":
        from onnxruntime.quantization import QuantType, quantize_dynamic

        onnx.save(fp32, scratch / "fp32.onnx")
        quantize_dynamic(scratch / "fp32.onnx", scratch / "dynamic.onnx", per_channel=True, weight_type=QuantType.QInt8)
        return onnx.load(str(scratch / "dynamic.onnx"))
    from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

    bits, block, symmetric, level, *library = spec.split(":")
    quantizer = MatMulNBitsQuantizer(onnx.ModelProto.FromString(fp32.SerializeToString()), bits=int(bits),
                                     block_size=int(block), is_symmetric=symmetric == "sym", accuracy_level=int(level))
    quantizer.process()
    model = quantizer.model.model
    if library == ["edgelin"]:
        from edgelin.export.onnx.kernels import route_graph

        if not route_graph(model, products_only=True):
            raise SystemExit(f"{spec}: edgelin's library takes none of these products (bits 4 or 8, block 32)")
    return model


def options_for(spec: str, threads: int) -> ort.SessionOptions:
    options = ort.SessionOptions()
    options.intra_op_num_threads, options.log_severity_level = threads, 3
    if spec.endswith(":edgelin"):
        from edgelin.ortops import register

        register(options)
    return options


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--variants", default="4:32:asym:4,4:32:sym:4,4:128:asym:4,4:32:asym:0,8:32:asym:4,"
                                               "8:128:asym:4,dynamic,fp32")
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--shape", default="384,1676,768,2048", help="d, n_in, d_inner, vocab")
    parser.add_argument("--rounds", type=int, default=400)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--tokens", type=int, default=1, help="rows of x: 1 (a decode step), 128 (a prefill piece)")
    args = parser.parse_args()
    logging.disable(logging.WARNING)  # the quantiser's per-node log lines
    d, n_in, d_inner, vocab = (int(v) for v in args.shape.split(","))
    fp32 = float_model(args.layers, d, n_in, d_inner, vocab)
    specs = args.variants.split(",")
    with tempfile.TemporaryDirectory() as scratch:
        sessions = [ort.InferenceSession(variant(s, fp32, Path(scratch)).SerializeToString(),
                                         options_for(s, args.threads), providers=["CPUExecutionProvider"])
                    for s in specs]
    feed = {"x": np.random.default_rng(1).standard_normal((args.tokens, d)).astype(np.float32)}
    for session in sessions:
        for _ in range(50):
            session.run(None, feed)
    times = np.zeros((args.rounds, len(specs)))
    for r in range(args.rounds):
        for i in (range(len(specs)) if r % 2 == 0 else reversed(range(len(specs)))):
            began = time.perf_counter()
            sessions[i].run(None, feed)
            times[r, i] = time.perf_counter() - began
    print(f"{args.layers} layers, d {d}, n_in {n_in}, d_inner {d_inner}, vocab {vocab}; {args.tokens} token(s), "
          f"{args.threads} thread(s), "
          f"{args.rounds} rounds; ratio = median over rounds of variant / {specs[0]}")
    for i, spec in enumerate(specs):
        print(f"{spec:14s} {np.median(times[:, i]) * 1e3:7.3f} ms  x{np.median(times[:, i] / times[:, 0]):.3f}")


if __name__ == "__main__":
    main()
