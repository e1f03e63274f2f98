"""Decode latency vs context position for ONNX exports, side by side (issue 13: e.g. a growing vs a static KV cache).

    python bench/positions.py EXPORT [EXPORT ...] [--positions 1,1024,8192,32768] [--iters 32] [--threads 1]
                              [--json out.json]

Each export runs in its own fresh process (its peak RSS is its own), one after another, on the same seeded
random tokens: the position is reached by `edgelin.runtime.prefill` (in the runner's pieces), then 3
warm-up steps and `--iters` timed steps (perf_counter around `runner.step`); p50 and p99 in ms. Peak RSS is
the process's VmHWM at the end. Prints one markdown table and each export's p50 over the first export's.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def worker(folder: str, positions: list[int], iters: int, threads: int) -> dict:
    import time

    import numpy as np

    sys.path[:0] = [str(ROOT), str(ROOT / "bench")]
    from peers import _rss_mib  # this process's VmHWM, as peers.py reads it

    from edgelin.runtime import open_runner, prefill

    runner = open_runner(Path(folder), threads=threads)
    state, pos = runner.new_state(1), 0
    ids = np.random.default_rng(0).integers(0, runner.manifest.vocab_size, max(positions) + 4 * (iters + 3) + 1)
    out: dict = {"latency": {}}
    for p in positions:
        if p > pos:
            prefill(runner, ids[None, pos:p], state, start=pos)
            pos = p
        ms = []
        for i in range(iters + 3):
            t = time.perf_counter()
            runner.step(ids[pos:pos + 1], state, np.array([pos], np.int64))
            ms.append((time.perf_counter() - t) * 1e3)
            pos += 1
        out["latency"][str(p)] = {"p50": round(float(np.percentile(ms[3:], 50)), 3),
                                  "p99": round(float(np.percentile(ms[3:], 99)), 3)}
    out["peak_rss_mib"] = round(_rss_mib(), 1)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("exports", nargs="+")
    parser.add_argument("--positions", default="1,1024,8192,32768")
    parser.add_argument("--iters", type=int, default=32)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    positions = [int(p) for p in args.positions.split(",")]
    if args.worker:
        print(json.dumps(worker(args.worker, positions, args.iters, args.threads)))
        return
    results = {}
    for folder in args.exports:
        cmd = [sys.executable, __file__, folder, "--worker", folder, "--positions", args.positions,
               "--iters", str(args.iters), "--threads", str(args.threads)]
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0:
            results[folder] = {"error": (done.stderr.strip().splitlines() or ["?"])[-1]}
        else:
            results[folder] = json.loads(done.stdout.strip().splitlines()[-1])
        print(f"{folder}: {json.dumps(results[folder])}", file=sys.stderr, flush=True)
    head = " | ".join(f"@{p}" for p in positions)
    print(f"\n| export | peak RSS MiB | {head} |\n|---|---|{'---|' * len(positions)}")
    for folder, res in results.items():
        if "error" in res:
            print(f"| {folder} | {res['error']} |")
            continue
        cells = " | ".join(f"{res['latency'][str(p)]['p50']:.2f} / {res['latency'][str(p)]['p99']:.2f}"
                           for p in positions)
        print(f"| {folder} | {res['peak_rss_mib']:,.0f} | {cells} |")
    first = next(iter(results.values()))
    if "error" not in first:
        print(f"\np50 over the first export's ({args.exports[0]}):")
        for folder, res in list(results.items())[1:]:
            if "error" not in res:
                ratios = ", ".join(f"@{p} {res['latency'][str(p)]['p50'] / first['latency'][str(p)]['p50']:.2f}"
                                   for p in positions)
                print(f"  {folder}: {ratios}; peak RSS {res['peak_rss_mib'] / first['peak_rss_mib']:.2f}")
    if args.json:
        args.json.write_text(json.dumps({"positions": positions, "iters": args.iters, "threads": args.threads,
                                         "results": results}, indent=1))


if __name__ == "__main__":
    main()
