"""CPU performance targets of the foundation, measured side by side in one run.

    python bench/cpu_targets.py [CHECKPOINT] [--json]

Targets (docs/performance.md#constant-memory records the results with commit and machine):
  1. ONNX Runtime step >= 2x faster than the torch eager step, batch 1
  2. step latency at position 32768 within 10% of position 1 (the KV-cache baseline grows)
  3. RSS growth < 1 MiB over 10,000 generated tokens
  4. chunked prefill of 2048 tokens >= 10x faster than 2048 steps
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from edgelin.bench import prefill_throughput, time_steps
from edgelin.checkpoint import load_model
from edgelin.export.graphs import StepModel
from edgelin.export.pipeline import export_checkpoint
from edgelin.generate import Sampling, generate
from edgelin.runtime import open_runner, prefill

DEFAULT = Path(__file__).resolve().parents[1] / "recipes" / "tiny-gdn-hybrid"


def torch_eager_step_ms(checkpoint: Path, iters: int) -> float:
    model, _ = load_model(checkpoint)
    step = StepModel(model).eval()
    state = [t for layer in model.initial_state(1) for t in layer.values()]
    token, pos = torch.zeros(1, dtype=torch.long), torch.zeros(1, dtype=torch.long)
    args = (token, pos, *state) if model.needs_position else (token, *state)
    with torch.inference_mode():
        for _ in range(20):
            step(*args)
        times = []
        for _ in range(iters):
            t0 = time.perf_counter()
            step(*args)
            times.append(time.perf_counter() - t0)
    return float(np.median(times) * 1e3)


def latency_at(runner, positions: list[int], iters: int, chunk: int) -> dict[int, float]:
    rng, state, reached, out = np.random.default_rng(0), runner.new_state(1), 0, {}
    for p in positions:
        ids = rng.integers(0, runner.manifest.vocab_size, (1, p - reached), dtype=np.int64)
        prefill(runner, ids, state, start=reached, chunk=chunk)  # advances the handle in place
        reached = p
        out[p] = float(np.median(time_steps(runner, state, p, 1, 20, iters)))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkpoint", nargs="?", type=Path, default=DEFAULT)
    parser.add_argument("--iters", type=int, default=300)
    parser.add_argument("--tokens", type=int, default=10_000, help="generated tokens for the RSS check")
    parser.add_argument("--far", type=int, default=32768, help="the far position of target 2")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(2)
    results = []

    def record(name, value, target, ok, detail):
        results.append({"target": name, "value": value, "goal": target, "passed": bool(ok), "detail": detail})

    with tempfile.TemporaryDirectory() as tmp:
        folder = export_checkpoint(args.checkpoint, Path(tmp) / "model", baselines=("kv",)).folder
        runner = open_runner(folder)
        ort_ms = latency_at(runner, [1], args.iters, 2048)[1]
        eager_ms = torch_eager_step_ms(args.checkpoint, args.iters)
        record("ORT step vs torch eager (B=1)", eager_ms / ort_ms, ">= 2x", eager_ms / ort_ms >= 2,
               f"ORT {ort_ms:.3f} ms, torch eager {eager_ms:.3f} ms")

        runner = open_runner(folder)  # fresh sessions: positions measured in one sweep
        lat = latency_at(runner, [1, args.far], args.iters, 2048)
        kv = latency_at(open_runner(folder / "baseline-kv"), [1, args.far], args.iters, 1024)
        ratio = lat[args.far] / lat[1]
        record(f"step at {args.far} / step at 1", ratio, "<= 1.10", ratio <= 1.10,
               f"edgelin {lat[1]:.3f} -> {lat[args.far]:.3f} ms; KV baseline {kv[1]:.3f} -> {kv[args.far]:.3f} ms "
               f"({kv[args.far] / kv[1]:.1f}x)")

        gen = generate(folder, "def main(", args.tokens, Sampling(seed=0), keep_ids=False, stop_at_eos=False)
        growth = gen.rss_end_bytes - gen.rss_start_bytes
        record(f"RSS growth over {gen.new_tokens} tokens", growth / 2**20, "< 1 MiB", growth < 2**20,
               f"{gen.rss_start_bytes / 2**20:.1f} -> {gen.rss_end_bytes / 2**20:.1f} MiB, "
               f"{gen.tokens_per_second:,.0f} tok/s")

        pf, st = prefill_throughput(open_runner(folder), 2048, 1, 2048, 0)
        record("prefill 2048 vs 2048 steps", pf / st, ">= 10x", pf / st >= 10,
               f"prefill {pf:,.0f} tok/s, steps {st:,.0f} tok/s")

    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    meta = {"commit": commit, "machine": f"{platform.machine()} {platform.processor() or ''}".strip(),
            "cpus": len(__import__("os").sched_getaffinity(0)), "torch": torch.__version__,
            "onnxruntime": __import__("onnxruntime").__version__, "checkpoint": str(args.checkpoint)}
    if args.json:
        print(json.dumps({"meta": meta, "results": results}, indent=2))
    else:
        print(f"commit {meta['commit']} on {meta['machine']}, {meta['cpus']} CPUs, torch {meta['torch']}, "
              f"onnxruntime {meta['onnxruntime']}")
        for r in results:
            mark = "PASS" if r["passed"] else "MISS"
            print(f"{mark}  {r['target']:<36} {r['value']:>10.3f}  (goal {r['goal']})  {r['detail']}")
    sys.exit(0)


if __name__ == "__main__":
    main()
