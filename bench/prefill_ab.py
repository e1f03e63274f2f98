"""Chunked prefill A/B on one GPU: `chunk_config`'s defaults against the same with overrides, and fla, in one
process, rotating the order every round (issue 12 goal 2: how a candidate change is kept or rejected).

Per family and shape, R rounds; each round times the three (default, override, fla) by CUDA-graph replay
(`bench/prefill.py`'s `timings`: N calls captured, 5 replays, events / 5N), starting one later each round.
Prints every round's graph µs, then per side the median and the ratio fla / side (> 1: faster than fla),
the max abs error vs fla, and at B=1 x T <= 4096 the max abs error vs the fp32 reference beside fla's.
The same inputs as `bench/prefill.py` (H=16, K=V=128, bf16 q/k/v, fp32 g/beta/state).

    python bench/prefill_ab.py --override '{"t_in_state": true}' [--families kda] [--shapes 1x4096,8x4096]
        [--rounds 3] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
import prefill as P  # noqa: E402  (bench/prefill.py: inputs, fla calls, timing, reference)


def main() -> None:
    import edgelin.kernels.chunk as chunk
    from edgelin import kernels

    parser = argparse.ArgumentParser()
    parser.add_argument("--override", required=True, help="JSON dict merged over chunk_config's result")
    parser.add_argument("--families", default="kda")
    parser.add_argument("--shapes", default="1x4096,8x4096,1x32768")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    P.ptxas_watchdog(120)
    default, active = chunk.chunk_config, {}
    chunk.chunk_config = lambda *a, **kw: {**default(*a, **kw), **active}
    override = json.loads(args.override)
    out = {"override": override, "gpu": torch.cuda.get_device_name(), "cells": {}}
    for family, shape, b, t, n, inputs, fla in P.cells(args.families, args.shapes):
        q, k, v, g, beta, e, s0 = inputs

        def ours(cfg: dict):
            def call():
                active.clear()
                active.update(cfg)
                return kernels.chunk_prefill(q, k, v, g, beta, s0, erase=e)
            return call

        sides = {"default": ours({}), "override": ours(override), "fla": lambda: fla(q, k, v, g, beta, s0)}
        times = {name: [] for name in sides}
        names = list(sides)
        for r in range(args.rounds):
            for name in names[r % 3:] + names[:r % 3]:
                times[name].append(P.retried(lambda: P.timings(sides[name], n, 5)["graph_us"]))
            print(f"{family} {shape} round {r}: " + ", ".join(f"{m} {times[m][-1]:.1f}" for m in names), flush=True)
        outs = {name: fn() for name, fn in sides.items()}
        ref = P.reference(q, k, v, g, beta, e, s0)[0] if b == 1 and t <= 4096 else None
        cell = {}
        for name in names:
            o = outs[name][0].float()
            med = statistics.median(times[name])
            cell[name] = {"graph_us": times[name], "median_us": med, "ratio_vs_fla": statistics.median(
                times["fla"]) / med, "err_fla": (o - outs["fla"][0].float()).abs().max().item(),
                "err_ref": None if ref is None else (o - ref).abs().max().item(),
                "finite": bool(torch.isfinite(o).all())}
            print(f"  {name:8} median {med:8.1f} us  fla/this {cell[name]['ratio_vs_fla']:.3f}  "
                  f"|this-fla| {cell[name]['err_fla']:.2e}  |this-ref| {cell[name]['err_ref']}", flush=True)
        out["cells"][f"{family}/{shape}"] = cell
        if args.json:
            args.json.write_text(json.dumps(out, indent=1))
        q = k = v = g = beta = e = s0 = outs = ref = None
        torch.cuda.empty_cache()
    chunk.chunk_config = default


if __name__ == "__main__":
    main()
