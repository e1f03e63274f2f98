"""GPU kernel benchmarks, each figure printed beside its anchor, all measured in this one run.

    python bench/kernels.py [--commit SHA] [--json out.json] [--skip sweep]

Targets (issue 4; docs/performance.md#gpu-decode records the results with commit and machine):
  1. step, B=256, H=16, K=V=128: >= 90% of the device copy bandwidth, every gate kind x rule,
     Triton and CUDA (anchors: copy bandwidth, fla 0.6.0 fused_recurrent_*, torch eager)
  2. step, B=1: <= 5 us per layer under CUDA-graph replay
  3. chunked prefill, T = 4096 and 32768: tokens/s >= fla's chunk_* for the same family
  (whole-model decode moved to bench/decode.py)
Inputs are random (never zeros), bf16 q/k/v, fp32 state; times are medians (triton do_bench,
which also flushes L2 between calls) or CUDA-event means over graph replays.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
import traceback
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
from triton.testing import do_bench

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from edgelin import kernels  # noqa: E402
from edgelin.kernels.chunk import chunk_config  # noqa: E402
from edgelin.kernels.step import step_config  # noqa: E402
from edgelin.reference import recurrence  # noqa: E402  (pure torch: never routed to a kernel)

DEV = "cuda"
COMBOS = [("none", False), ("scalar", False), ("per_key", False), ("none", True), ("scalar", True), ("per_key", True)]
FLA_NAME = {("none", False): "simple_gla(g=None)", ("scalar", False): "simple_gla", ("per_key", False): "gla",
            ("none", True): "delta_rule", ("scalar", True): "gated_delta_rule", ("per_key", True): "gdr(gk)/kda"}
FLA_CHUNK_FAMILIES = [("scalar", False), ("per_key", False), ("none", True), ("scalar", True)]  # the four
RESULTS: dict = {}
LINES: list[str] = []


def say(line: str = "") -> None:
    print(line, flush=True)
    LINES.append(line)


def ms(fn, rep: int = 100) -> float:
    return do_bench(fn, warmup=25, rep=rep, return_mode="median")


def inputs(b, t, h, k, v, gate, delta, dtype=torch.bfloat16, step=False, seed=0):
    torch.manual_seed(seed)
    shape = (b, h) if step else (b, t, h)
    q = F.normalize(torch.randn(*shape, k, device=DEV), dim=-1).to(dtype)
    kk = F.normalize(torch.randn(*shape, k, device=DEV), dim=-1).to(dtype)
    vv = torch.randn(*shape, v, device=DEV).to(dtype)
    g = None
    if gate == "scalar":
        g = F.logsigmoid(torch.randn(*shape, 1, device=DEV) + 3)
    elif gate == "per_key":
        g = F.logsigmoid(torch.randn(*shape, k, device=DEV)) / 16
    beta = torch.rand(*shape, device=DEV).to(dtype) if delta else None
    return q, kk, vv, g, beta


def fla_recurrent(gate, delta):
    if gate != "per_key" and not delta:
        from fla.ops.simple_gla import fused_recurrent_simple_gla

        return lambda q, k, v, g, beta, s: fused_recurrent_simple_gla(
            q, k, v, None if g is None else g[..., 0], scale=1.0, initial_state=s, output_final_state=True)
    if gate == "per_key" and not delta:
        from fla.ops.gla import fused_recurrent_gla

        return lambda q, k, v, g, beta, s: fused_recurrent_gla(q, k, v, gk=g, scale=1.0, initial_state=s,
                                                               output_final_state=True)
    if gate == "none":
        from fla.ops.delta_rule import fused_recurrent_delta_rule

        return lambda q, k, v, g, beta, s: fused_recurrent_delta_rule(q, k, v, beta, scale=1.0, initial_state=s,
                                                                      output_final_state=True)
    from fla.ops.gated_delta_rule import fused_recurrent_gated_delta_rule

    key = "g" if gate == "scalar" else "gk"
    return lambda q, k, v, g, beta, s: fused_recurrent_gated_delta_rule(
        q, k, v, beta=beta, scale=1.0, initial_state=s, output_final_state=True,
        **{key: g[..., 0] if gate == "scalar" else g})


def fla_chunk(gate, delta):
    if not delta:
        if gate == "per_key":
            from fla.ops.gla import chunk_gla

            return "chunk_gla", lambda q, k, v, g, beta, s: chunk_gla(q, k, v, g, scale=1.0, initial_state=s,
                                                                      output_final_state=True)
        from fla.ops.simple_gla import chunk_simple_gla

        return "chunk_simple_gla", lambda q, k, v, g, beta, s: chunk_simple_gla(
            q, k, v, None if g is None else g[..., 0], scale=1.0, initial_state=s, output_final_state=True)
    if gate == "none":
        from fla.ops.delta_rule import chunk_delta_rule

        return "chunk_delta_rule", lambda q, k, v, g, beta, s: chunk_delta_rule(
            q, k, v, beta, scale=1.0, initial_state=s, output_final_state=True)
    if gate == "scalar":
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule

        return "chunk_gated_delta_rule", lambda q, k, v, g, beta, s: chunk_gated_delta_rule(
            q, k, v, g[..., 0], beta, scale=1.0, initial_state=s, output_final_state=True)
    from fla.ops.kda import chunk_kda

    return "chunk_kda", lambda q, k, v, g, beta, s: chunk_kda(q, k, v, g, beta, scale=1.0, initial_state=s,
                                                              output_final_state=True)


def copy_bandwidth() -> float:
    n = (1 << 30) // 4
    src, dst = torch.randn(n, device=DEV), torch.empty(n, device=DEV)
    t = ms(lambda: dst.copy_(src))
    bw = 2 * n * 4 / (t * 1e-3)
    say(f"device copy (1 GiB, read + write): {bw / 1e12:.2f} TB/s")
    return bw


def bench_step_bandwidth(copy_bw: float, sweep: bool) -> None:
    b, h, k, v = 256, 16, 128, 128
    say(f"\n== step, B={b} H={h} K=V={k}, bf16 q/k/v, fp32 state: TB/s (% of copy {copy_bw / 1e12:.2f}) ==")
    say(f"{'gate/rule':18} {'triton inpl':>13} {'triton pp':>13} {'cuda inpl':>13} {'cuda pp':>13} "
        f"{'fla fused_rec':>14} {'torch eager':>13}")
    for gate, delta in COMBOS:
        q, kk, vv, g, beta = inputs(b, 1, h, k, v, gate, delta, step=True)
        state = torch.randn(b, h, k, v, device=DEV) * 0.1
        other = torch.empty_like(state)
        io = sum(x.numel() * x.element_size() for x in (q, kk, vv, g, beta) if x is not None) + vv.numel() * 2
        nbytes = 2 * state.numel() * 4 + io
        out = torch.empty_like(vv)
        runs = {
            "triton inpl": lambda: kernels.fused_step(q, kk, vv, state, g, beta, out=out, inplace=True),
            "triton pp": lambda: kernels.fused_step(q, kk, vv, state, g, beta, out=out, state_out=other),
            "cuda inpl": lambda: kernels.cuda_step(q, kk, vv, state, g, beta, out=out, inplace=True),
            "cuda pp": lambda: kernels.cuda_step(q, kk, vv, state, g, beta, out=out, state_out=other),
        }
        fla = fla_recurrent(gate, delta)
        q1, k1, v1 = q[:, None], kk[:, None], vv[:, None]
        g1, b1 = (None if g is None else g[:, None]), (None if beta is None else beta[:, None])
        runs["fla"] = lambda: fla(q1, k1, v1, g1, b1, state)
        qf, kf, vf, gf, bf = (None if x is None else x.float() for x in (q, kk, vv, g, beta))

        def torch_step():
            return recurrence.recurrent_step(state, qf, kf, vf, gf, bf)
        runs["torch"] = torch_step
        cells, row = [], {}
        for name, fn in runs.items():
            try:
                t = ms(fn)
                extra = (2 * (qf.numel() + kf.numel() + 2 * vf.numel()) if name == "torch" else 0)  # fp32 io
                bw = (nbytes + extra) / (t * 1e-3)
                row[name] = {"ms": t, "TBps": bw / 1e12, "pct_copy": 100 * bw / copy_bw}
                cells.append(f"{bw / 1e12:5.2f} ({100 * bw / copy_bw:3.0f}%)")
            except Exception as exc:  # a missing fla op must not hide our numbers
                row[name] = {"error": repr(exc)[:200]}
                cells.append(f"{'error':>13}")
        RESULTS.setdefault("step_b256", {})[f"{gate}/{'delta' if delta else 'add'}"] = row
        say(f"{gate + ('/delta' if delta else '/add'):18} " + " ".join(f"{c:>13}" for c in cells)
            + f"   [fla: {FLA_NAME[(gate, delta)]}]")
        if sweep:  # other Triton tile configs, in place: does the default leave bandwidth behind?
            cells = []
            for bv, warps in ((16, 4), (32, 2), (32, 8), (64, 4), (64, 8)):
                t = ms(lambda: kernels.fused_step(q, kk, vv, state, g, beta, out=out, inplace=True, block_v=bv,
                                                  num_warps=warps), rep=50)
                row[f"triton BV{bv}/w{warps}"] = 100 * nbytes / (t * 1e-3) / copy_bw
                cells.append(f"BV{bv}/w{warps}:{100 * nbytes / (t * 1e-3) / copy_bw:.0f}%")
            say("      sweep " + " ".join(cells))
    say(f"(Triton step default BV, warps = {step_config(k, v, b * h)}; bytes = state r + w + q/k/v/o/g/beta)")


def graph_us_per_call(calls, layers: int, replays: int = 200) -> float:
    """Capture `layers` calls in one CUDA graph; return microseconds per call over `replays` replays."""
    for call in calls:
        call()  # compile / autotune outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for call in calls:
            call()
    for _ in range(20):
        graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / (replays * layers)


def bench_step_latency() -> None:
    layers, h, k, v = 32, 16, 128, 128
    say(f"\n== step, B=1 H={h} K=V={k}: us per layer, {layers} layers (distinct states) in one CUDA graph ==")
    say(f"{'gate/rule':18} {'triton':>9} {'cuda':>9} {'fla graph':>10} {'torch graph':>12} {'torch eager':>12}")
    for gate, delta in COMBOS:
        q, kk, vv, g, beta = inputs(1, 1, h, k, v, gate, delta, step=True, seed=1)
        states = [torch.randn(1, h, k, v, device=DEV) * 0.1 for _ in range(layers)]
        outs = [torch.empty_like(vv) for _ in range(layers)]
        fla = fla_recurrent(gate, delta)
        qf, kf, vf, gf, bf = (None if x is None else x.float() for x in (q, kk, vv, g, beta))

        def torch_call(s):
            return recurrence.recurrent_step(s, qf, kf, vf, gf, bf)
        impls = {
            "triton": [lambda s=s, o=o: kernels.fused_step(q, kk, vv, s, g, beta, out=o, inplace=True)
                       for s, o in zip(states, outs)],
            "cuda": [lambda s=s, o=o: kernels.cuda_step(q, kk, vv, s, g, beta, out=o, inplace=True)
                     for s, o in zip(states, outs)],
            "fla": [lambda s=s: fla(q[:, None], kk[:, None], vv[:, None], None if g is None else g[:, None],
                                    None if beta is None else beta[:, None], s) for s in states],
            "torch": [lambda s=s: torch_call(s) for s in states],
        }
        row, cells = {}, []
        for name, calls in impls.items():
            try:
                us = graph_us_per_call(calls, layers)
                row[name] = us
                cells.append(f"{us:9.2f}" if name != "torch" else f"{us:12.2f}")
            except Exception as exc:
                row[name] = repr(exc)[:200]
                cells.append(f"{'error':>9}")
        eager = ms(lambda: torch_call(states[0]), rep=50) * 1e3
        row["torch_eager"] = eager
        RESULTS.setdefault("step_b1_graph_us", {})[f"{gate}/{'delta' if delta else 'add'}"] = row
        say(f"{gate + ('/delta' if delta else '/add'):18} {cells[0]} {cells[1]} {cells[2]:>10} {cells[3]} "
            f"{eager:12.2f}")


def bench_prefill(sweep: bool) -> None:
    h, k, v = 16, 128, 128
    say(f"\n== chunked prefill, H={h} K=V={k}, bf16: million tokens/s (ours vs fla chunk_*), rel. diff ours-fla ==")
    say(f"(default tiles at B=1: {chunk_config(h, k, v, torch.bfloat16, torch.device(DEV))})")
    for b, t in ((1, 4096), (1, 32768), (8, 4096)):
        for gate, delta in COMBOS:
            q, kk, vv, g, beta = inputs(b, t, h, k, v, gate, delta, seed=2)
            s0 = torch.randn(b, h, k, v, device=DEV) * 0.1
            ours = lambda: kernels.chunk_prefill(q, kk, vv, g, beta, s0)  # noqa: E731
            t_ours = ms(ours, rep=50)
            name, fla = fla_chunk(gate, delta)
            line = f"B={b} T={t:6d} {gate + ('/delta' if delta else '/add'):14} ours {b * t / t_ours / 1e3:7.1f}"
            entry = {"ours_ms": t_ours, "ours_Mtok_s": b * t / t_ours / 1e3}
            try:
                t_fla = ms(lambda: fla(q, kk, vv, g, beta, s0), rep=50)
                o_fla, s_fla = fla(q, kk, vv, g, beta, s0)
                o, s = ours()
                diff = ((o.float() - o_fla.float()).norm() / o_fla.float().norm()).item()
                entry.update(fla=name, fla_ms=t_fla, fla_Mtok_s=b * t / t_fla / 1e3, ratio=t_fla / t_ours, diff=diff)
                line += f"  {name:24} {b * t / t_fla / 1e3:7.1f}  ratio {t_fla / t_ours:5.2f}x  diff {diff:.1e}"
            except Exception as exc:
                entry["fla_error"] = repr(exc)[:200]
                line += f"  {name:24} error: {repr(exc)[:60]}"
            RESULTS.setdefault("prefill", {})[f"B{b}-T{t}-{gate}/{'delta' if delta else 'add'}"] = entry
            say(line)
            if sweep and b == 1 and t == 32768 and (gate, delta) in FLA_CHUNK_FAMILIES:
                cells = []
                for bv, warps in ((16, 4), (32, 8), (64, 8)):
                    try:
                        tt = ms(lambda: kernels.chunk_prefill(q, kk, vv, g, beta, s0, block_v=bv, num_warps=warps),
                                rep=50)
                        entry[f"BV{bv}/w{warps}_Mtok_s"] = b * t / tt / 1e3
                        cells.append(f"BV{bv}/w{warps}:{b * t / tt / 1e3:.1f}")
                    except Exception as exc:
                        cells.append(f"BV{bv}/w{warps}:err {type(exc).__name__}")
                say("      sweep " + " ".join(cells))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--commit", default="unknown")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--skip", default="", help="comma list of: step,latency,prefill,sweep")
    args = parser.parse_args()
    skip = set(filter(None, args.skip.split(",")))
    import fla

    RESULTS["env"] = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
                      "fla": getattr(fla, "__version__", "?"), "python": platform.python_version(),
                      "commit": args.commit}
    say(f"edgelin kernel bench: {RESULTS['env']}")
    RESULTS["copy_TBps"] = copy_bandwidth() / 1e12
    sections = [("step", lambda: bench_step_bandwidth(RESULTS["copy_TBps"] * 1e12, "sweep" not in skip)),
                ("latency", bench_step_latency),
                ("prefill", lambda: bench_prefill("sweep" not in skip))]
    for name, fn in sections:
        if name in skip:
            continue
        began = time.time()
        try:
            fn()
        except Exception:
            say(f"!! section {name} failed:\n{traceback.format_exc()[-1500:]}")
        say(f"[section {name}: {time.time() - began:.0f} s]")
        if args.json:
            args.json.write_text(json.dumps(RESULTS, indent=1))
    say(f"\nre-measured copy bandwidth at the end: {copy_bandwidth() / 1e12:.2f} TB/s")


if __name__ == "__main__":
    main()
