"""How much of an ONNX export's decode step its weight matmuls take, measured side by side in one process.

    python bench/step_share.py EXPORT_DIR [--threads 1] [--prefill 256] [--steps 600] [--runs 3]

Builds, from the export's step.onnx, a graph holding only its weight products (every MatMulNBits, and
every MatMul, MatMulF16, MatMulF32 or Gemm whose second input is an initializer), each fed a random activation of
its own shape [1, K], with the step's own weights, in the runner's step session options (prepacked or not).
Then alternates one runner step (B=1, after a prefill) and one run of that graph, and prints both medians
and the median over pairs of matmuls / step: the weight products' share of the step, the part a faster
quantised or float matmul kernel could cut. Not a test; a step after a prefill of --prefill tokens.
At --threads above 1 the two sessions' thread pools spin against each other for the same cores (measured:
the Mamba2 int4 step 1.2-1.4x slower than at 1 thread here, 1.35x faster in a process of its own): read
only 1-thread figures; bench/step_threads.py times threads.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper

from edgelin import ortops
from edgelin.runtime import open_runner

WARMUP = 50


def weights_only(step: Path) -> tuple[onnx.ModelProto, dict[str, np.ndarray]]:
    """(a model of the step's weight products alone, its random inputs)."""
    model = onnx.load(str(step))  # with its external data: the new graph holds the weights itself
    graph, inits = model.graph, {t.name: t for t in model.graph.initializer}
    nodes, inputs, outputs, feeds, used = [], [], [], {}, set()
    rng = np.random.default_rng(0)
    for node in graph.node:
        attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        if node.op_type == "MatMulNBits":
            k = attrs["K"]
        elif node.op_type in ("MatMul", "MatMulF16", "MatMulF32", "Gemm") and len(node.input) > 1 \
                and node.input[1] in inits:
            dims = inits[node.input[1]].dims  # [K, N]; packed panels [P, K, 16]; Gemm transB [N, K]
            k = dims[1] if (node.op_type == "Gemm" and attrs.get("transB")) or len(dims) == 3 else dims[0]
        else:
            continue
        name = f"x{len(nodes)}"
        inputs.append(helper.make_tensor_value_info(name, TensorProto.FLOAT, [1, k]))
        outputs.append(helper.make_tensor_value_info(f"y{len(nodes)}", TensorProto.FLOAT, None))
        feeds[name] = rng.standard_normal((1, k)).astype(np.float32)
        nodes.append(helper.make_node(node.op_type, [name, *node.input[1:]], [f"y{len(nodes)}"], domain=node.domain,
                                      **attrs))
        used.update(node.input[1:])
    new = helper.make_graph(nodes, "weights_only", inputs, outputs, [t for n, t in inits.items() if n in used])
    return helper.make_model(new, opset_imports=list(model.opset_import), functions=list(model.functions)), feeds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("folder", type=Path)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--prefill", type=int, default=256)
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    model, feeds = weights_only(args.folder / "step.onnx")
    counts: dict[str, int] = {}
    for node in model.graph.node:
        counts[node.op_type] = counts.get(node.op_type, 0) + 1
    print(f"{args.folder}: weight products {counts}, {args.threads} thread(s)", flush=True)
    if args.threads > 1:
        print("note: two thread pools in one process contend for the cores: these figures are not the step's "
              "(bench/step_threads.py times threads)", flush=True)
    runner = open_runner(args.folder, threads=args.threads)
    # the step session's own options: threads, prepacking (quantised exports only, by default), and the
    # OrtValues over the shared weights mapping where the runner uses one
    options = runner.sessions["step"].get_session_options()
    if any(node.domain == ortops.DOMAIN for node in model.graph.node):  # (the options do not carry the library)
        print(f"edgelin ops: {ortops.register(options).reason}", flush=True)
    session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    for run in range(args.runs):
        state = runner.new_state(1)
        prompt = np.random.default_rng(run).integers(0, runner.manifest.vocab_size, (1, args.prefill))
        token = int(runner.prefill(prompt, state, np.zeros(1, np.int64)).argmax())
        steps, products = [], []
        for t in range(args.steps):
            for which in ("step", "products") if t % 2 == 0 else ("products", "step"):
                began = time.perf_counter()
                if which == "step":
                    token = int(runner.step(np.array([token]), state, np.array([args.prefill + t])).argmax())
                    steps.append(time.perf_counter() - began)
                else:
                    session.run(None, feeds)
                    products.append(time.perf_counter() - began)
        step, prod = np.array(steps[WARMUP:]), np.array(products[WARMUP:])
        print(f"run {run + 1}: step {np.median(step) * 1e3:.3f} ms, weight products {np.median(prod) * 1e3:.3f} ms, "
              f"median(products / step) {np.median(prod / step):.3f}", flush=True)


if __name__ == "__main__":
    main()
