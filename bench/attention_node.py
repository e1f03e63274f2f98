"""One decode-attention node over a KV cache, ONNX Runtime's kernel vs edgelin's, side by side: a benchmark, not a test.

    python bench/attention_node.py [--positions 1,1024,8192,32768] [--threads 1,2] [--caches 4] [--dtypes fp32,fp16]

A one-node graph `GroupQueryAttention` (Qwen3.5 peer shapes: 4 query heads, 2 kv heads of 64, float32 cache of
34,944 rows, one new token, written in place as the runner binds it) in the `com.microsoft` domain (ONNX Runtime's
kernel) and in `ai.edgelin` (edgelin.ortops, which this builds). Each timed call runs the node over --caches
different caches in turn (4 x 2 x 17.9 MB: more than the L3 cache, so every call reads its cache from memory, as
a model with several attention layers does); per position and thread count the median over 15 rounds of 20 calls
each, the two kernels alternating round by round, with the bytes of cache read per second. Also prints a
single-thread read bandwidth reference (numpy sum over 256 MiB) and the max-relative difference of the outputs.
--dtypes fp16 runs the node on float16 tensors (the step graph of --kv-cache static --kv-dtype fp16: half the bytes).
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import onnxruntime as ort
from onnx import TensorProto, helper

from edgelin import ortops

HEADS, KV_HEADS, DIM, CAPACITY = 4, 2, 64, 34944


def node_model(domain: str, half: bool = False):
    node = helper.make_node("GroupQueryAttention", ["q", "k", "v", "pk", "pv", "seqlens", "total"], ["o", "nk", "nv"],
                            domain=domain, num_heads=HEADS, kv_num_heads=KV_HEADS, scale=DIM ** -0.5, do_rotary=0,
                            local_window_size=-1)
    f = helper.make_tensor_value_info
    kv = ["B", KV_HEADS, "P", DIM]
    graph = helper.make_graph([node], "attention", [
        f("q", TensorProto.FLOAT, ["B", 1, HEADS * DIM]), f("k", TensorProto.FLOAT, ["B", 1, KV_HEADS * DIM]),
        f("v", TensorProto.FLOAT, ["B", 1, KV_HEADS * DIM]), f("pk", TensorProto.FLOAT, kv),
        f("pv", TensorProto.FLOAT, kv), f("seqlens", TensorProto.INT32, ["B"]), f("total", TensorProto.INT32, [1])],
        [f("o", TensorProto.FLOAT, ["B", 1, HEADS * DIM]), f("nk", TensorProto.FLOAT, kv), f("nv", TensorProto.FLOAT, kv)])
    if half:
        for value in [*graph.input[:5], *graph.output]:
            value.type.tensor_type.elem_type = TensorProto.FLOAT16
    opsets = [helper.make_opsetid("", 18), helper.make_opsetid("com.microsoft", 1)]
    if domain != "com.microsoft":
        opsets.append(helper.make_opsetid(domain, 1))
    return helper.make_model(graph, opset_imports=opsets)


def session(domain: str, threads: int, library, half: bool) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    if library is not None:
        options.register_custom_ops_library(str(library))
    return ort.InferenceSession(node_model(domain, half).SerializeToString(), options,
                                providers=["CPUExecutionProvider"])


def bindings(sess: ort.InferenceSession, caches: list, position: int, rng, dtype) -> tuple[list, np.ndarray]:
    q = rng.standard_normal((1, 1, HEADS * DIM)).astype(dtype)
    k = rng.standard_normal((1, 1, KV_HEADS * DIM)).astype(dtype)
    out = []
    for keys, values in caches:
        b = sess.io_binding()
        for name, array in (("q", q), ("k", k), ("v", k)):
            b.bind_cpu_input(name, array)
        b.bind_ortvalue_input("pk", keys)
        b.bind_ortvalue_input("pv", values)
        b.bind_cpu_input("seqlens", np.array([position - 1], np.int32))
        b.bind_cpu_input("total", np.array([position], np.int32))
        b.bind_output("o", "cpu")
        b.bind_ortvalue_output("nk", keys)
        b.bind_ortvalue_output("nv", values)
        out.append(b)
    sess.run_with_iobinding(out[0])
    return out, out[0].copy_outputs_to_cpu()[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--positions", default="1,1024,8192,32768")
    parser.add_argument("--threads", default="1,2")
    parser.add_argument("--caches", type=int, default=4)
    parser.add_argument("--dtypes", default="fp32", help="fp32, fp16 or both (fp32,fp16)")
    args = parser.parse_args()
    library = ortops.build()
    big = np.ones(64 << 20, np.float32)
    began = time.perf_counter()
    big.sum()
    print(f"single-thread read bandwidth (numpy sum of 256 MiB): {big.nbytes / (time.perf_counter() - began) / 1e9:.1f} GB/s")
    del big
    rng = np.random.default_rng(0)
    print("| cache | threads | position | ONNX Runtime ms | edgelin ms | edgelin / ONNX Runtime | GB/s (ORT / edgelin) "
          "| max-rel |")
    print("|---|---|---|---|---|---|---|---|")
    for dtype_name in args.dtypes.split(","):
        half = dtype_name == "fp16"
        dtype = np.float16 if half else np.float32
        caches = [[ort.OrtValue.ortvalue_from_numpy(rng.standard_normal((1, KV_HEADS, CAPACITY, DIM)).astype(dtype))
                   for _ in range(2)] for _ in range(args.caches)]
        for threads in (int(t) for t in args.threads.split(",")):
            time_both(dtype_name, threads, caches, library, half, dtype, args.positions)


def time_both(dtype_name: str, threads: int, caches: list, library, half: bool, dtype, positions: str) -> None:
    """One thread count, one cache dtype: both kernels at every position, alternating, as the docstring says."""
    sessions = {"ort": session("com.microsoft", threads, None, half),
                "edgelin": session(ortops.DOMAIN, threads, library, half)}
    for position in (int(p) for p in positions.split(",")):
        bound, outs = {}, {}
        for name, sess in sessions.items():
            bound[name], outs[name] = bindings(sess, caches, position, np.random.default_rng(position), dtype)
        times = {name: [] for name in sessions}
        for r in range(15):
            for name in (("ort", "edgelin") if r % 2 == 0 else ("edgelin", "ort")):
                began = time.perf_counter()
                for _ in range(20 // len(caches) or 1):
                    for b in bound[name]:
                        sessions[name].run_with_iobinding(b)
                calls = (20 // len(caches) or 1) * len(caches)
                times[name].append((time.perf_counter() - began) / calls * 1e3)
        ms = {name: float(np.median(t)) for name, t in times.items()}
        read = 2 * KV_HEADS * position * DIM * (2 if half else 4)
        a, b = (outs[n].astype(np.float32) for n in ("ort", "edgelin"))
        diff = float(np.abs(a - b).max() / np.abs(a).max())
        print(f"| {dtype_name} | {threads} | {position} | {ms['ort']:.3f} | {ms['edgelin']:.3f} | "
              f"{ms['edgelin'] / ms['ort']:.2f} | {read / ms['ort'] / 1e6:.1f} / {read / ms['edgelin'] / 1e6:.1f} | "
              f"{diff:.1e} |", flush=True)


if __name__ == "__main__":
    main()
