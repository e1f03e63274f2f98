"""Chunked prefill: edgelin's Triton kernels against fla 0.6.0's chunk_* on one GPU (issue 12 goal 2).

Method (issue 12 goal 1), per family and shape, in one run: --rounds samples (7) of each library, interleaved,
the order reversed every other sample; each figure is the median over samples, the ratio the median of the
per-sample ratios (its range beside it). Per sample:
  graph  GPU time: N calls captured in one CUDA graph, replayed R times, elapsed (events) / (N R)
  events GPU time: events around N back-to-back eager calls / N (launch overhead included where
         the GPU outruns the host)
  wall   host wall time per call: N eager calls then a synchronize, / N
plus million tokens/s (from graph time), the edgelin/fla ratio (> 1: edgelin faster), the max
abs error of ours vs fla and of both vs the fp32 torch reference (`recurrence.chunked` on fp32
copies of the same bf16 inputs; B=1, T=4096 only: it is a Python loop over chunks).
A watchdog kills a ptxas that runs past --ptxas-limit (a stuck one stalled two runs on the H200), and a
cell whose compile fails is retried once, then recorded as an error while the run goes on.
gated_deltanet2 (erase gate) has no fla peer: it is timed against fla's gated_delta_rule on the same
q, k, v, g, beta (the erase gate is extra work) and checked against the reference.

    python bench/prefill.py [--json out.json] [--shapes 1x4096,1x32768,8x4096,8x32768] [--rounds 7] [--profile]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import threading
import time
from pathlib import Path

import torch
import torch.nn.functional as F

DEV = "cuda"
FAMILIES = {  # name: (gate, delta, erase)
    "simple_gla": ("scalar", False, False), "gla": ("per_key", False, False), "delta_rule": ("none", True, False),
    "gated_delta_rule": ("scalar", True, False), "kda": ("per_key", True, False),
    "gated_deltanet2": ("scalar", True, True),
}


def make(b, t, h, k, v, gate, delta, erase, dtype=torch.bfloat16, seed=2):
    torch.manual_seed(seed)
    q = F.normalize(torch.randn(b, t, h, k, device=DEV), dim=-1).to(dtype)
    kk = F.normalize(torch.randn(b, t, h, k, device=DEV), dim=-1).to(dtype)
    vv = torch.randn(b, t, h, v, device=DEV).to(dtype)
    g = {"none": None, "scalar": lambda: F.logsigmoid(torch.randn(b, t, h, 1, device=DEV) + 3),
         "per_key": lambda: F.logsigmoid(torch.randn(b, t, h, k, device=DEV)) / 16}[gate]
    g = g() if g else None
    beta = torch.rand(b, t, h, device=DEV) if delta else None
    e = torch.sigmoid(torch.randn(b, t, h, k, device=DEV) + 1) if erase else None
    s0 = torch.randn(b, h, k, v, device=DEV) * 0.1
    return q, kk, vv, g, beta, e, s0


def fla_call(family):
    if family == "simple_gla":
        from fla.ops.simple_gla import chunk_simple_gla
        return lambda q, k, v, g, b, s: chunk_simple_gla(q, k, v, g[..., 0], scale=1.0, initial_state=s,
                                                         output_final_state=True)
    if family == "gla":
        from fla.ops.gla import chunk_gla
        return lambda q, k, v, g, b, s: chunk_gla(q, k, v, g, scale=1.0, initial_state=s, output_final_state=True)
    if family == "delta_rule":
        from fla.ops.delta_rule import chunk_delta_rule
        return lambda q, k, v, g, b, s: chunk_delta_rule(q, k, v, b.to(q.dtype), scale=1.0, initial_state=s,
                                                         output_final_state=True)
    if family in ("gated_delta_rule", "gated_deltanet2"):
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule
        return lambda q, k, v, g, b, s: chunk_gated_delta_rule(q, k, v, g[..., 0], b.to(q.dtype), scale=1.0,
                                                               initial_state=s, output_final_state=True)
    from fla.ops.kda import chunk_kda
    return lambda q, k, v, g, b, s: chunk_kda(q, k, v, g, b.to(q.dtype), scale=1.0, initial_state=s,
                                              output_final_state=True)


def cells(families: str, shapes: str):
    """(family, shape, b, t, calls per graph, (q, k, v, g, beta, e, s0), fla's call) per family and 'BxT' shape,
    H=16, K=V=128: the sweep's and the A/B's cells (bench/prefill_sweep.py, prefill_ab.py)."""
    for family in families.split(","):
        gate, delta, erase = FAMILIES[family]
        for shape in shapes.split(","):
            b, t = map(int, shape.split("x"))
            yield (family, shape, b, t, max(2, min(20, 2 ** 17 // (b * t))),
                   make(b, t, 16, 128, 128, gate, delta, erase), fla_call(family))


def timings(fn, n: int, replays: int) -> dict:
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(n):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    a, z = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(replays):
        graph.replay()
    z.record()
    torch.cuda.synchronize()
    graph_us = a.elapsed_time(z) * 1e3 / (n * replays)
    del graph
    began = time.perf_counter()
    a.record()
    for _ in range(n):
        fn()
    z.record()
    torch.cuda.synchronize()
    wall_us = (time.perf_counter() - began) * 1e6 / n
    return {"graph_us": graph_us, "events_us": a.elapsed_time(z) * 1e3 / n, "wall_us": wall_us}


def ptxas_watchdog(limit_s: float) -> threading.Thread:
    """Kill any ptxas child of this process that has run longer than limit_s. On the H200 machines a
    ptxas (Triton's make_cubin, ours or fla's autotuner) twice never returned and stalled a whole run;
    killed, Triton raises (the autotuner drops that config) and main() retries the cell once."""
    tick = os.sysconf("SC_CLK_TCK")

    def watch() -> None:
        while True:
            with open("/proc/uptime") as fh:
                now = float(fh.read().split()[0])
            for stat in Path("/proc").glob("[0-9]*/stat"):
                try:
                    fields = stat.read_text().rsplit(")", 1)
                    name, rest = fields[0].split("(", 1)[1], fields[1].split()
                except (OSError, IndexError):
                    continue
                # rest[1] is the parent pid, rest[19] the start time in clock ticks since boot
                if name == "ptxas" and int(rest[1]) == os.getpid() and now - int(rest[19]) / tick > limit_s:
                    print(f"    (watchdog: killed ptxas pid {stat.parent.name} after {limit_s:.0f} s)", flush=True)
                    os.kill(int(stat.parent.name), signal.SIGKILL)
            time.sleep(2)

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    return thread


def reference(q, k, v, g, beta, e, s0):
    from edgelin.reference.recurrence import chunked

    f = [None if x is None else x.float() for x in (s0, q, k, v, g, beta)]
    return chunked(*f, erase=None if e is None else e.float())


def retried(run):
    """run(), once more if it raises (a ptxas the watchdog killed fails that compile only)."""
    try:
        return run()
    except Exception as exc:  # noqa: BLE001
        print(f"    (retrying after {type(exc).__name__}: {str(exc)[:120]})", flush=True)
        return run()


def main() -> None:
    from edgelin import kernels

    parser = argparse.ArgumentParser()
    parser.add_argument("--json", type=Path)
    parser.add_argument("--shapes", default="1x4096,1x32768,8x4096,8x32768")
    parser.add_argument("--families", default=",".join(FAMILIES))
    parser.add_argument("--profile", action="store_true", help="per-kernel CUDA time at the first shape")
    parser.add_argument("--ptxas-limit", type=float, default=120, help="kill a ptxas running longer (s)")
    parser.add_argument("--rounds", type=int, default=7, help="interleaved samples per cell (medians reported)")
    args = parser.parse_args()
    ptxas_watchdog(args.ptxas_limit)
    h, dk, dv = 16, 128, 128
    results = {"env": {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__}, "cells": {}}
    print(f"{'family':17} {'shape':9} {'edgelin graph/events/wall us':>30} {'fla graph/events/wall us':>28} "
          f"{'Mtok/s ours':>11} {'fla':>7} {'ratio':>6} {'|ours-fla|':>10} {'ours-ref':>9} {'fla-ref':>9}", flush=True)
    cell = 0
    for shape in args.shapes.split(","):
        b, t = map(int, shape.split("x"))
        n = max(2, min(20, 2 ** 17 // (b * t)))
        for family in args.families.split(","):
            gate, delta, erase = FAMILIES[family]
            q, k, v, g, beta, e, s0 = make(b, t, h, dk, dv, gate, delta, erase)
            ours = lambda: kernels.chunk_prefill(q, k, v, g, beta, s0, erase=e)  # noqa: E731
            fla = fla_call(family)
            theirs = lambda: fla(q, k, v, g, beta, s0)  # noqa: E731
            order = [("ours", ours), ("fla", theirs)]
            samples: dict[str, list[dict]] = {"ours": [], "fla": []}
            try:
                for sample in range(args.rounds):  # interleaved, the order reversed every other sample
                    for name, fn in (order if (cell + sample) % 2 == 0 else order[::-1]):
                        samples[name].append(retried(lambda: timings(fn, n, 5)))
            except Exception as exc:  # noqa: BLE001  (a compile that failed twice: record it, go on)
                results["cells"][f"{family}/B{b}xT{t}"] = {"error": f"{type(exc).__name__}: {str(exc)[:300]}"}
                print(f"{family:17} {shape:9} failed twice: {type(exc).__name__}", flush=True)
                if args.json:
                    args.json.write_text(json.dumps(results, indent=1))
                continue
            cell += 1
            o, s = ours()
            o_f, _ = theirs()
            res = {name: {key: statistics.median(r[key] for r in runs) for key in runs[0]}
                   for name, runs in samples.items()}
            ratios = [f["graph_us"] / o["graph_us"] for o, f in zip(samples["ours"], samples["fla"])]
            entry = {"ours": res["ours"], "fla": res["fla"], "ratio": statistics.median(ratios),
                     "ratio_range": [min(ratios), max(ratios)], "samples": args.rounds, "tokens": b * t}
            if not erase:
                entry["max_err_vs_fla"] = (o.float() - o_f.float()).abs().max().item()
            if b == 1 and t == 4096:
                o_r, s_r = reference(q, k, v, g, beta, e, s0)
                entry["max_err_vs_ref"] = (o.float() - o_r).abs().max().item()
                entry["state_err_vs_ref"] = (s - s_r).abs().max().item()
                if not erase:
                    entry["fla_max_err_vs_ref"] = (o_f.float() - o_r).abs().max().item()
            results["cells"][f"{family}/B{b}xT{t}"] = entry
            fmt = lambda r: f"{r['graph_us']:9.1f}/{r['events_us']:9.1f}/{r['wall_us']:8.1f}"  # noqa: E731
            print(f"{family:17} {shape:9} {fmt(res['ours']):>30} {fmt(res['fla']):>28} "
                  f"{b * t / res['ours']['graph_us']:11.1f} {b * t / res['fla']['graph_us']:7.1f} "
                  f"{entry['ratio']:6.2f} ({min(ratios):.2f}-{max(ratios):.2f}) "
                  f"{entry.get('max_err_vs_fla', float('nan')):10.2e} "
                  f"{entry.get('max_err_vs_ref', float('nan')):9.2e} {entry.get('fla_max_err_vs_ref', float('nan')):9.2e}",
                  flush=True)
            if args.profile and shape == args.shapes.split(",")[0]:
                from torch.profiler import ProfilerActivity, profile

                for name, fn in order:
                    with profile(activities=[ProfilerActivity.CUDA]) as prof:
                        for _ in range(5):
                            fn()
                        torch.cuda.synchronize()
                    rows = sorted(((ev.key, ev.device_time_total / 5) for ev in prof.key_averages()),
                                  key=lambda r: -r[1])[:6]
                    print(f"    {name} kernels (us/call): " + ", ".join(f"{key[:34]} {us:.0f}" for key, us in rows),
                          flush=True)
            q = k = v = g = beta = e = s0 = o = s = o_f = None  # free the cell before the next
            torch.cuda.empty_cache()
            if args.json:
                args.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
