"""The decode step, side by side in one run: CUDA C++ step vs Triton step vs torch eager (issue 12).

    python3 bench/step_kernel.py [--commit SHA] [--json out.json] [--batches 1,8,64,256]
                                 [--dtypes fp16,fp32] [--rounds 3] [--heads 16] [--dim 128]
                                 [--baseline-cuda DIR]   (DIR: an older edgelin/kernels/cuda, column cuda-base)

For every input dtype, gate kind x update rule and batch (H=16, K=V=128 by default; fp32 state;
g and beta in float32, the launcher's default aux dtype, so no cast kernel runs beside the step):

  graph us   GPU time per call: N calls captured in one CUDA graph, replayed; elapsed / (replays * N)
  events us  GPU time per call: CUDA events around N eager calls issued back to back; elapsed / N
  wall us    host clock around the same N eager calls plus one synchronize, / N: what a Python
             caller waits per call (launch overhead included)
  bytes      state read + written (fp32) + q, k, v, o, g, beta: the least a step must move
  % copy     bytes / graph time, against the device-to-device copy bandwidth measured in this run

Each call updates its state in place (the decode case); consecutive calls use distinct states
that together span >= 2x the L2, so small batches are not timed out of the cache. Order: the
implementations rotate within each round and rounds repeat; figures are medians over rounds.
torch eager is edgelin.reference.recurrence.recurrent_step on float32 copies of the inputs
(made outside the timed region); it allocates its new state instead of updating in place.
The first call of each implementation is checked against the float64 torch step (max relative
error of o).
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from edgelin import kernels  # noqa: E402
from edgelin.reference import recurrence  # noqa: E402  (pure torch: never routed to a kernel)

DEV = "cuda"
COMBOS = [("none", "add"), ("scalar", "add"), ("per_key", "add"), ("none", "delta"), ("scalar", "delta"),
          ("per_key", "delta"), ("scalar", "erase")]  # erase: the delta rule + Gated DeltaNet-2's erase gate
DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}
IMPLS = ("cuda", "triton", "torch")
Step = Callable[[torch.Tensor], object]  # one call on the given state


@dataclass(frozen=True)
class Case:
    dtype: torch.dtype
    gate: str
    rule: str  # "add", "delta" or "erase" (delta rule + erase gate)
    batch: int
    heads: int
    dim: int

    @property
    def delta(self) -> bool:
        return self.rule != "add"

    @property
    def label(self) -> str:
        return f"{self.gate}/{self.rule}"

    @property
    def state_bytes(self) -> int:
        return self.batch * self.heads * self.dim * self.dim * 4


def copy_bandwidth(gib: float = 1.0, reps: int = 20) -> float:
    """Device-to-device copy, bytes read + written per second (median of `reps` events-timed copies)."""
    n = int(gib * (1 << 30)) // 4
    src, dst = torch.randn(n, device=DEV), torch.empty(n, device=DEV)
    for _ in range(3):
        dst.copy_(src)
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e-3)
    del src, dst
    return 2 * n * 4 / statistics.median(times)


def make_inputs(case: Case, seed: int = 0) -> dict[str, torch.Tensor | None]:
    gen = torch.Generator(device=DEV).manual_seed(seed)
    b, h, d = case.batch, case.heads, case.dim
    q = F.normalize(torch.randn(b, h, d, device=DEV, generator=gen), dim=-1).to(case.dtype)
    k = F.normalize(torch.randn(b, h, d, device=DEV, generator=gen), dim=-1).to(case.dtype)
    v = torch.randn(b, h, d, device=DEV, generator=gen).to(case.dtype)
    width = {"none": 0, "scalar": 1, "per_key": d}[case.gate]
    g = F.logsigmoid(torch.randn(b, h, width, device=DEV, generator=gen) + 3) / (16 if width > 1 else 1) \
        if width else None
    beta = torch.rand(b, h, device=DEV, generator=gen) if case.delta else None
    erase = torch.rand(b, h, d, device=DEV, generator=gen) if case.rule == "erase" else None
    return {"q": q, "k": k, "v": v, "g": g, "beta": beta, "erase": erase}


def io_bytes(x: dict[str, torch.Tensor | None]) -> int:
    """q, k, v, g, beta, erase read and o (v's shape and dtype) written."""
    read = sum(t.numel() * t.element_size() for t in x.values() if t is not None)
    return read + x["v"].numel() * x["v"].element_size()


def steps(x: dict[str, torch.Tensor | None]) -> dict[str, Step]:
    """One callable per implementation: call(state) updates `state` (torch: returns a new one)."""
    q, k, v, g, beta, e = x["q"], x["k"], x["v"], x["g"], x["beta"], x["erase"]
    out = torch.empty_like(v)
    f32 = {n: None if t is None else t.float() for n, t in x.items()}  # torch's matmuls need one dtype
    return {
        "cuda": lambda s: kernels.cuda_step(q, k, v, s, g, beta, e, out=out, inplace=True)[0],
        "triton": lambda s: kernels.fused_step(q, k, v, s, g, beta, e, out=out, inplace=True)[0],
        "torch": lambda s: recurrence.recurrent_step(s, f32["q"], f32["k"], f32["v"], f32["g"], f32["beta"],
                                                     f32["erase"])[0],
    }


def baseline_steps(src: Path) -> Callable[[dict[str, torch.Tensor | None]], Step]:
    """The CUDA step built from another copy of edgelin/kernels/cuda (an older commit's sources, for a
    before/after table measured in one run). Inputs here always carry float32 g/beta, as cuda_step passes."""
    from torch.utils import cpp_extension

    src = src.resolve()  # torch keys its build cache on these strings: one spelling, one build
    major, minor = torch.cuda.get_device_capability()
    arch = f"-gencode=arch=compute_{major}{minor},code=sm_{major}{minor}"
    ext = cpp_extension.load(name="edgelin_cuda_step_baseline",
                             sources=[str(src / "torch_ext.cpp"), str(src / "step.cu")],
                             extra_include_paths=[str(src)], extra_cflags=["-O3"],
                             extra_cuda_cflags=["-O3", "-std=c++17", arch])

    def make(x: dict[str, torch.Tensor | None]) -> Step:
        out = torch.empty_like(x["v"])

        def call(s: torch.Tensor) -> torch.Tensor:
            ext.step(x["q"], x["k"], x["v"], x["g"], x["beta"], s, s, out)
            return out
        return call
    return make


def rel_err(fn: Step, x: dict[str, torch.Tensor | None], state: torch.Tensor) -> float:
    """Max-norm relative error of one call's output against the float64 torch step."""
    ref, _ = recurrence.recurrent_step(*(t.double() if t is not None else None for t in
                                         (state, x["q"], x["k"], x["v"], x["g"], x["beta"], x["erase"])))
    got = fn(state.clone()).double()
    return ((got - ref).abs().max() / ref.abs().max().clamp_min(1e-30)).item()


def time_impl(fn: Step, states: list[torch.Tensor], calls: int, replays: int) -> dict[str, float]:
    """graph_us, events_us, wall_us per call (see the module docstring)."""
    order = [states[i % len(states)] for i in range(calls)]
    for s in order[:2]:
        fn(s)  # JIT compile / extension load / allocator warm-up outside every timed region
    torch.cuda.synchronize()
    # eager: events and host clock around the same back-to-back calls
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    began = time.perf_counter()
    for s in order:
        fn(s)
    end.record()
    end.synchronize()
    wall = (time.perf_counter() - began) / calls
    events = start.elapsed_time(end) * 1e-3 / calls
    # graph: the same calls captured once, replayed
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for s in order:
            fn(s)
    graph.replay()
    torch.cuda.synchronize()
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    end.synchronize()
    gpu = start.elapsed_time(end) * 1e-3 / (replays * calls)
    del graph
    return {"graph_us": gpu * 1e6, "events_us": events * 1e6, "wall_us": wall * 1e6}


def plan(case: Case, l2_bytes: int) -> tuple[int, int, int]:
    """(distinct states, calls per timed region, graph replays): states span >= 2x the L2."""
    n_states = max(2, math.ceil(2 * l2_bytes / case.state_bytes))
    calls = max(n_states, 8)
    replays = max(3, min(50, int(20e-3 / max(case.state_bytes * 2 / 4e12 * calls, 1e-7))))
    return n_states, calls, replays


def run_case(case: Case, x: dict[str, torch.Tensor | None], impls: dict[str, Step], copy_bw: float, l2_bytes: int,
             rounds: int, rotate: int) -> dict:
    n_states, calls, replays = plan(case, l2_bytes)
    gen = torch.Generator(device=DEV).manual_seed(1)
    states = [torch.randn(case.batch, case.heads, case.dim, case.dim, device=DEV, generator=gen) * 0.1
              for _ in range(n_states)]
    nbytes = 2 * case.state_bytes + io_bytes(x)
    row: dict = {"bytes": nbytes, "states": n_states, "calls": calls, "replays": replays}
    samples: dict[str, list[dict[str, float]]] = {name: [] for name in impls}
    for name, fn in impls.items():
        try:
            row.setdefault(name, {})["rel_err_vs_fp64"] = rel_err(fn, x, states[0])
        except Exception as exc:  # an implementation that cannot run this case must not hide the others
            row.setdefault(name, {})["error"] = repr(exc)[:300]
    names = [n for n in impls if "error" not in row[n]]
    for r in range(rounds):
        shift = (r + rotate) % max(len(names), 1)
        for name in names[shift:] + names[:shift]:  # alternate who goes first
            if "error" in row[name]:
                continue
            try:
                samples[name].append(time_impl(impls[name], states, calls, replays))
            except Exception as exc:  # e.g. a capture that fails: report it, keep the others
                row[name]["error"] = repr(exc)[:300]
    for name in (n for n in names if "error" not in row[n]):
        med = {key: statistics.median(s[key] for s in samples[name]) for key in samples[name][0]}
        med["graph_us_spread"] = max(s["graph_us"] for s in samples[name]) - min(s["graph_us"] for s in samples[name])
        med["pct_copy"] = 100 * nbytes / (med["graph_us"] * 1e-6) / copy_bw
        row[name].update(med)
    del states
    torch.cuda.empty_cache()
    return row


def fmt_cell(cell: dict) -> str:
    if "error" in cell:
        return f"{'error: ' + cell['error'][:34]:>41}"
    return f"{cell['graph_us']:16.2f} {cell['events_us']:8.2f} {cell['wall_us']:8.1f} {cell['pct_copy']:5.1f}%"


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--commit", default="unknown", help="what the figures are of (a SHA, 'working tree ...')")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--batches", default="1,8,64,256")
    parser.add_argument("--dtypes", default="fp16,fp32")
    parser.add_argument("--combos", default="all", help="comma list like none/add,per_key/delta, or all")
    parser.add_argument("--impls", default=",".join(IMPLS))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--baseline-cuda", type=Path, help="also time the CUDA step built from this copy of "
                        "edgelin/kernels/cuda (column 'cuda-base'), e.g. `git archive HEAD~1 edgelin/kernels/cuda`")
    args = parser.parse_args(argv)
    baseline = baseline_steps(args.baseline_cuda) if args.baseline_cuda else None
    props = torch.cuda.get_device_properties(0)
    l2 = getattr(props, "L2_cache_size", 50 << 20)
    import triton

    results: dict = {"env": {"gpu": props.name, "sms": props.multi_processor_count, "l2_bytes": l2,
                             "torch": torch.__version__, "triton": triton.__version__,
                             "python": platform.python_version(), "commit": args.commit,
                             "date": time.strftime("%Y-%m-%d %H:%M:%S")}, "rows": []}
    print(f"edgelin step bench: {results['env']}", flush=True)
    copy_bw = copy_bandwidth()
    results["copy_TBps"] = copy_bw / 1e12
    print(f"device copy (1 GiB, read + write, median of 20): {copy_bw / 1e12:.3f} TB/s", flush=True)
    wanted = set(args.impls.split(","))
    combos = COMBOS if args.combos == "all" else [tuple(c.split("/")) for c in args.combos.split(",")]
    index = 0
    for dname in args.dtypes.split(","):
        print(f"\n== {dname} q/k/v/o, fp32 state, fp32 g/beta, H={args.heads} K=V={args.dim}: us per call "
              f"(graph, events, wall) and graph bytes / copy bandwidth ==", flush=True)
        header = None
        for gate, rule in combos:
            for batch in (int(b) for b in args.batches.split(",")):
                case = Case(DTYPES[dname], gate, rule, batch, args.heads, args.dim)
                x = make_inputs(case)
                impls = {n: f for n, f in steps(x).items() if n in wanted}
                if baseline is not None and rule != "erase":  # an older kernel has no erase gate
                    impls = {"cuda-base": baseline(x), **impls}
                if header != list(impls):
                    header = list(impls)
                    print(f"{'gate/rule':15} {'B':>4} {'MB':>7} |" + " |".join(
                        f" {name[:10] + ' graph':>16} {'events':>8} {'wall':>8} {'%copy':>6}" for name in impls))
                row = run_case(case, x, impls, copy_bw, l2, args.rounds, index)
                index += 1
                row.update(dtype=dname, combo=case.label, batch=batch)
                results["rows"].append(row)
                cells = " |".join(" " + fmt_cell(row[n]) for n in impls)
                print(f"{case.label:15} {batch:4d} {row['bytes'] / 1e6:7.1f} |{cells}", flush=True)
                if args.json:
                    args.json.write_text(json.dumps(results, indent=1))
        errs: dict[str, float] = {}
        for r in (r for r in results["rows"] if r["dtype"] == dname):
            for n, cell in r.items():
                if isinstance(cell, dict) and "rel_err_vs_fp64" in cell:
                    errs[n] = max(errs.get(n, 0.0), cell["rel_err_vs_fp64"])
        print("max rel err of o vs the float64 torch step: " + ", ".join(f"{n} {e:.1e}" for n, e in errs.items()))
    end_bw = copy_bandwidth()
    results["copy_TBps_end"] = end_bw / 1e12
    print(f"\ndevice copy again at the end: {end_bw / 1e12:.3f} TB/s", flush=True)
    if "cuda" in wanted:
        for dname in args.dtypes.split(","):
            rows = [r for r in results["rows"] if r["dtype"] == dname and "pct_copy" in r.get("cuda", {})]
            big = [r["cuda"]["pct_copy"] for r in rows if r["batch"] == max(int(b) for b in args.batches.split(","))]
            one = [r["cuda"]["graph_us"] for r in rows if r["batch"] == 1]
            if big and one:
                print(f"cuda {dname}: largest batch {min(big):.1f}-{max(big):.1f}% of copy (target >= 90); "
                      f"B=1 {min(one):.2f}-{max(one):.2f} us per layer under graph replay (target <= 3)")
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    return results


if __name__ == "__main__":
    main()
