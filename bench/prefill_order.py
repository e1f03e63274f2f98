"""Prefill node order, A/B (issue 13): ONNX Runtime's default order against the priority-based one the
runner uses for prefill sessions, on one exported folder, in alternating fresh processes.

Each process: load, the best of 3 prefills of 2,048 tokens (`edgelin.runtime.prefill`, 256-token pieces
for a constant-memory model), then 100 steps; it prints prefill tokens/s, the step p50 (ms) and its
peak RSS (VmHWM, MiB). The parent prints every process's line and the medians per side.

    python bench/prefill_order.py EXPORT_DIR [--rounds 3] [--threads 1]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np


def child(folder: Path, order: str, threads: int) -> None:
    import onnxruntime as ort

    import edgelin.export.onnx.runner as onnx_runtime
    from edgelin.runtime import open_runner, prefill

    options = onnx_runtime._options

    def with_order(*args, **kwargs):
        opts = options(*args, **kwargs)
        if kwargs.get("kind", args[3] if len(args) > 3 else "step") == "prefill" and order == "default":
            opts.execution_order = ort.ExecutionOrder.DEFAULT
        return opts

    onnx_runtime._options = with_order
    runner = open_runner(folder, threads=threads)
    ids = np.random.default_rng(0).integers(0, runner.manifest.vocab_size, 2048, dtype=np.int64)
    rates = []
    for _ in range(3):
        state, began = runner.new_state(1), time.perf_counter()
        prefill(runner, ids[None], state, start=0, chunk=2048)
        rates.append(2048 / (time.perf_counter() - began))
    ms = []
    for i in range(100):
        began = time.perf_counter()
        runner.step(np.array([5], np.int64), state, np.array([2048 + i], np.int64))
        ms.append((time.perf_counter() - began) * 1e3)
    with open("/proc/self/status") as fh:
        peak = next(int(line.split()[1]) / 1024 for line in fh if line.startswith("VmHWM"))
    print(f"{order} {max(rates):.0f} {statistics.median(ms):.3f} {peak:.1f}")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("folder", type=Path)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--child", choices=("default", "priority"))
    args = parser.parse_args()
    if args.child:
        return child(args.folder, args.child, args.threads)
    rows: dict[str, list[list[float]]] = {"default": [], "priority": []}
    for _ in range(args.rounds):
        for order in rows:
            out = subprocess.run([sys.executable, __file__, str(args.folder), "--child", order, "--threads",
                                  str(args.threads)], capture_output=True, text=True, check=True).stdout.split()
            print(" ".join(out), flush=True)
            rows[order].append([float(x) for x in out[1:]])
    for order, values in rows.items():
        tok_s, step, peak = (statistics.median(col) for col in zip(*values))
        print(f"{order:8}: prefill {tok_s:,.0f} tok/s, step p50 {step:.3f} ms, peak RSS {peak:.1f} MiB (medians)")


if __name__ == "__main__":
    main()
