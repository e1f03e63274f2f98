"""Whole-model GPU decode (issue 12 goal 3): unfused GraphDecoder vs the fused decode, one run.

    python bench/decode.py [--commit SHA] [--json out.json] [--batches 1,8,64,256] [--steps 200]
                           [--tuning '{"bn_in": 8}' | --tuning tuning.json] [--skip-unfused-above B]

Model: gated_deltanet x16, hidden 768, 6 heads of K=V=128, MLP 2048, vocab 32000, tied embeddings,
fp16 weights (147.6M parameters), random init (seed 0). For each batch B and decoder (unfused:
`GraphDecoder`, the model's forward captured in a CUDA graph; fused: `FusedDecoder`):
  GPU time per step: CUDA events around N back-to-back graph replays (the token copy included), / N;
  wall time per step: perf_counter around the same N steps with one synchronize at the end.
Floors: weight-read floor = weight bytes / copy bandwidth (per step, shared by the batch); state floor
= state bytes read + written / copy bandwidth; copy bandwidth = a 2 GiB device-to-device copy (read +
write bytes / time), measured at the start of this run. Kernels per token: torch.profiler over one
eager step (every CUDA kernel and memcpy/memset). Exactness: 64 greedy steps at B=1 of the fused
decode, the unfused fp16 model and the fp32 model, from the same token. --tuning: the fused decode's
launch parameters (edgelin.kernels.fused_decode_gemv.DecodeTuning fields; the defaults otherwise).
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from edgelin.export.torch.fused_decode import DecodeTuning, FusedDecoder  # noqa: E402
from edgelin.export.torch.graph_decode import GraphDecoder  # noqa: E402

DEV = "cuda"
RESULTS: dict = {}


def say(line: str = "") -> None:
    print(line, flush=True)


def copy_bandwidth() -> float:
    """Bytes/s of a 2 GiB device-to-device copy (read + write), median of 10."""
    src = torch.empty(2**30, dtype=torch.float16, device=DEV)
    dst = torch.empty_like(src)
    times = []
    for _ in range(12):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        dst.copy_(src)
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    return 2 * src.numel() * 2 / sorted(times[2:])[5]


def build_model(dtype=torch.float16):
    from edgelin.model.config import ModelConfig
    from edgelin.model.lm import CausalLM

    config = ModelConfig(vocab_size=32000, hidden_size=768, layer_types=("gated_deltanet",) * 16, num_heads=6,
                         head_k_dim=128, head_v_dim=128, intermediate_size=2048)
    torch.manual_seed(0)
    return CausalLM(config).eval().to(DEV).to(dtype)


def time_decoder(decoder, batch: int, steps: int) -> tuple[float, float]:
    """(GPU us per step by events, wall us per step)."""
    token = torch.randint(0, 32000, (batch,), device=DEV)
    for _ in range(10):
        decoder.step(token)
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    began = time.perf_counter()
    a.record()
    for _ in range(steps):
        decoder.step(token)
    b.record()
    torch.cuda.synchronize()
    wall = (time.perf_counter() - began) / steps * 1e6
    return a.elapsed_time(b) * 1e3 / steps, wall


def kernels_per_step(fn, breakdown: bool = False) -> int:
    """CUDA kernels (and memcpy/memset) of one eager step; with breakdown, prints GPU time per kernel name."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    events = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    if breakdown:
        by_name: dict[str, list[float]] = {}
        for e in events:
            by_name.setdefault(e.name[:60], []).append(e.device_time_total if hasattr(e, "device_time_total")
                                                      else e.cuda_time_total)
        total = sum(sum(v) for v in by_name.values())
        say(f"  profile of one eager fused step: {len(events)} kernels, {total:.1f} us of kernel time")
        for name, times in sorted(by_name.items(), key=lambda kv: -sum(kv[1]))[:12]:
            say(f"    {sum(times):8.1f} us  x{len(times):4d}  {name}")
        RESULTS.setdefault("profile", {k: [len(v), sum(v)] for k, v in by_name.items()})
    return len(events)


def role_profile(model, tuning: DecodeTuning, bandwidth: float) -> dict:
    """B=1, one eager fused step without PDL (with PDL a kernel's span includes its wait for the one
    before): GPU time per kernel role (in-proj, mixer, o_proj, gate/up, down, LM head) from
    torch.profiler, and the weight bytes each role reads / its time, against copy bandwidth."""
    from dataclasses import replace

    from torch.profiler import ProfilerActivity, profile

    decoder = FusedDecoder(model, batch=1, graph=False, tuning=replace(tuning, pdl=False))
    token = torch.zeros(1, dtype=torch.long, device=DEV)
    for _ in range(2):
        decoder.step(token)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        decoder.step(token)
        torch.cuda.synchronize()
    kernels = sorted((e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA
                      and "emcpy" not in e.name and "emset" not in e.name), key=lambda e: e.time_range.start)
    roles = ("in-proj (+norm)", "mixer", "o_proj (+gated norm, residual)", "gate/up (+norm, SwiGLU)",
             "down (+residual)")
    layers = decoder.layers
    if len(kernels) != 5 * len(layers) + 1:
        say(f"  role profile: {len(kernels)} kernels, not 5 per layer + 1; skipped")
        return {}
    nbytes = {"in-proj (+norm)": layers[0].w_in, "o_proj (+gated norm, residual)": layers[0].w_o,
              "gate/up (+norm, SwiGLU)": layers[0].w_gu, "down (+residual)": layers[0].w_down}
    out: dict[str, dict] = {}
    for i, event in enumerate(kernels):
        role = "LM head (+final norm)" if i == len(kernels) - 1 else roles[i % 5]
        spent = event.device_time_total if hasattr(event, "device_time_total") else event.cuda_time_total
        entry = out.setdefault(role, {"calls": 0, "us": 0.0})
        entry["calls"] += 1
        entry["us"] += spent
    nbytes["LM head (+final norm)"] = decoder.head
    total = sum(e["us"] for e in out.values())
    say(f"  per-kernel profile (B=1, eager, no PDL, torch.profiler): {len(kernels)} kernels, {total:.1f} us")
    for role, entry in out.items():
        w = nbytes.get(role)
        mean = entry["us"] / entry["calls"]
        entry["us_per_call"] = mean
        if w is not None:
            entry["weight_bytes_per_call"] = w.numel() * w.element_size()
            entry["pct_copy_bw"] = 100 * entry["weight_bytes_per_call"] / (mean * 1e-6) / bandwidth
        pct = f"{entry['pct_copy_bw']:.0f}% of copy bandwidth" if w is not None else ""
        say(f"    {entry['us']:8.1f} us  x{entry['calls']:3d}  {mean:6.2f} us/call  {role}  {pct}")
    return out


def exactness(model, steps: int = 64, tuning: DecodeTuning | None = None) -> dict:
    """Greedy B=1: fused vs unfused fp16 eager vs fp32 eager, each feeding its own argmax."""
    import copy

    ref32 = copy.deepcopy(model).float()
    fused = FusedDecoder(model, batch=1, tuning=tuning)
    first = torch.tensor([17], device=DEV)
    runs = {}
    with torch.no_grad():
        for name, net in (("unfused_fp16", model), ("fp32", ref32)):
            state, tok, toks, logits = None, first, [], []
            for _ in range(steps):
                out, state = net(tok.view(1, 1), state, None, mode="recurrent", last_only=True)
                tok = out.argmax(-1)
                toks.append(int(tok))
                logits.append(out.float())
            runs[name] = (toks, logits)
        tok, toks, logits = first, [], []
        for _ in range(steps):
            out = fused.step(tok).float().clone()
            tok = out.argmax(-1)
            toks.append(int(tok))
            logits.append(out)
        runs["fused_fp16"] = (toks, logits)

    def rel(a: str, b: str) -> float:  # over the steps where both fed the same tokens
        worst = 0.0
        for i, (x, y) in enumerate(zip(runs[a][1], runs[b][1])):
            worst = max(worst, float((x - y).abs().max() / y.abs().max()))
            if runs[a][0][i] != runs[b][0][i]:
                break
        return worst

    same = lambda a, b: sum(x == y for x, y in zip(runs[a][0], runs[b][0]))  # noqa: E731
    return {"steps": steps, "fused_vs_unfused_same_tokens": same("fused_fp16", "unfused_fp16"),
            "fused_vs_fp32_same_tokens": same("fused_fp16", "fp32"),
            "unfused_vs_fp32_same_tokens": same("unfused_fp16", "fp32"),
            "fused_vs_unfused_max_rel": rel("fused_fp16", "unfused_fp16"),
            "fused_vs_fp32_max_rel": rel("fused_fp16", "fp32"), "unfused_vs_fp32_max_rel": rel("unfused_fp16", "fp32")}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--commit", default="working tree")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--batches", default="1,8,64,256")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--skip-unfused-above", type=int, default=256, help="unfused decoders only up to this B")
    parser.add_argument("--tuning", default="{}", help="DecodeTuning fields as JSON, or a JSON file")
    args = parser.parse_args()
    text = Path(args.tuning).read_text() if not args.tuning.lstrip().startswith("{") else args.tuning
    tuning = DecodeTuning(**json.loads(text))
    RESULTS["env"] = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
                      "python": platform.python_version(), "commit": args.commit, "tuning": tuning.__dict__}
    say(f"decode bench: {RESULTS['env']}")
    bw = copy_bandwidth()
    RESULTS["copy_TBps"] = bw / 1e12
    model = build_model()
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    RESULTS["model"] = {"params": model.num_parameters(), "weight_bytes": weight_bytes}
    say(f"copy bandwidth {bw / 1e12:.2f} TB/s; {model.num_parameters() / 1e6:.1f}M params, "
        f"{weight_bytes / 1e6:.0f} MB fp16 weights")
    began = time.time()
    RESULTS["exactness"] = exactness(model, tuning=tuning)
    say(f"exactness (64 greedy steps, B=1): {RESULTS['exactness']}  [{time.time() - began:.0f} s]")
    try:
        RESULTS["role_profile"] = role_profile(model, tuning, bw)
    except Exception as exc:  # a profiler quirk must not cost the table
        say(f"  role profile failed: {exc!r}")
    say("| B | decoder | kernels/step | GPU us/step | wall us/step | tokens/s | weight floor us | state floor us "
        "| x (weights+state) floor |")
    RESULTS["rows"] = []
    for batch in [int(b) for b in args.batches.split(",")]:
        for name, cls in (("unfused", GraphDecoder), ("fused", FusedDecoder)):
            if name == "unfused" and batch > args.skip_unfused_above:
                continue
            began = time.time()
            decoder = cls(model, batch=batch, tuning=tuning) if name == "fused" else cls(model, batch=batch)
            state_bytes = sum(t.numel() * t.element_size() for layer in decoder.state for t in layer.values())
            gpu_us, wall_us = time_decoder(decoder, batch, args.steps)
            token = torch.zeros(batch, dtype=torch.long, device=DEV)
            if name == "fused":
                count = kernels_per_step(lambda d=decoder: (d.ids.copy_(token), d._forward()), breakdown=batch == 1)
            else:
                count = kernels_per_step(lambda d=decoder: d._forward())
            w_floor, s_floor = weight_bytes / bw * 1e6, 2 * state_bytes / bw * 1e6
            row = {"batch": batch, "decoder": name, "kernels_per_step": count, "gpu_us": gpu_us, "wall_us": wall_us,
                   "tokens_per_s": batch / gpu_us * 1e6, "weight_floor_us": w_floor, "state_floor_us": s_floor,
                   "state_bytes": state_bytes, "x_floor": gpu_us / (w_floor + s_floor),
                   "x_weight_floor": gpu_us / w_floor}
            RESULTS["rows"].append(row)
            say(f"| {batch} | {name} | {count} | {gpu_us:.1f} | {wall_us:.1f} | {row['tokens_per_s']:.0f} | "
                f"{w_floor:.1f} | {s_floor:.1f} | {row['x_floor']:.2f} (weights alone {row['x_weight_floor']:.2f}) |"
                f"  [{time.time() - began:.0f} s]")
            del decoder
            torch.cuda.empty_cache()
            if args.json:
                args.json.write_text(json.dumps(RESULTS, indent=1))
    say(f"re-measured copy bandwidth at the end: {copy_bandwidth() / 1e12:.2f} TB/s")
    if args.json:
        args.json.write_text(json.dumps(RESULTS, indent=1))


if __name__ == "__main__":
    main()
