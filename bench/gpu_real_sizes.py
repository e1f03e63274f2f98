"""GPU decode at real size (issue 46 item 5): Qwen3.5-0.8B and -2B through the torch target on one GPU, against
the card's weight-read floor.

    python bench/gpu_real_sizes.py --out DIR [--models qwen3.5-0.8b,qwen3.5-2b] [--batches 1,8,64]
                                   [--position 1024] [--steps 24] [--rounds 3] [--commit SHA] [--json]
    python bench/gpu_real_sizes.py --tiny --out DIR        # the same run at toy sizes (CPU: no graph, no events)
    python bench/gpu_real_sizes.py --render RUN.json [--date YYYY-MM-DD]   # -> bench/results/gpu-real-sizes.json
                                                           # (then python bench/performance_doc.py)

Model: edgelin's CausalLM built from the published config (bench/real_shapes.py's SHAPES, through edgelin's
Qwen3.5 converter) with RANDOM weights (seed 0, edgelin's init: matrices N(0, 0.02), norms at identity), exported
with the torch target's library API (edgelin.export.pipeline.export_model, --precision fp16: the same folder
`edgelin export --target torch --precision fp16` writes; no checkpoint on disk) and opened with its runner.
Each batch B is prefilled to --position with random ids (the runner's chunked prefill), then decoded:
  runner  TorchRunner.step as `edgelin bench` calls it: a Qwen3.5 hybrid keeps a growing KV cache, so the
          runner steps eagerly (no CUDA graph) and returns float32 logits to the host (numpy) every step;
  eager   the same forward (the runner's model and state) without the host copy;
  graph   the same model step with the full-attention layers' cache held at a fixed capacity
          (edgelin.model.attention.fixed_capacity, as the Apple targets hold it) captured in one CUDA graph
          and replayed: what a graph-captured hybrid decode would cost. Checked against the runner's logits
          at the same position from the same state (max |diff| / max |ref|) before it is timed.
Timing: per sample, `steps` back-to-back steps, GPU time by CUDA events around them and wall time by
perf_counter (one synchronize at the end); samples interleaved over rounds (every B and form once per round),
the median over rounds reported. The steps advance the sequence: position .. position + rounds x steps.
Floor: every weight read once per step (the tied embedding once, as the LM head) at its stored precision
(fp16; the decay parameters float32) over the card's copy bandwidth (a 1 GiB device-to-device copy, bytes
read + written / time, median of 20, measured before every model in this run); the state floor adds the
recurrent state read + written and the KV cache read at the position. % of floor = floor / GPU time.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import numpy as np  # noqa: E402
import torch  # noqa: E402

FORMS = ("runner", "eager", "graph")


def say(line: str = "") -> None:
    print(line, flush=True)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def copy_bandwidth(device: torch.device, nbytes: int = 1 << 30, repeats: int = 20) -> float:
    """Bytes/s of a device-to-device copy of `nbytes` (bytes read + written / time), median of `repeats`."""
    src = torch.randn(nbytes // 2, dtype=torch.float16, device=device)
    dst = torch.empty_like(src)
    times = []
    for _ in range(repeats + 2):
        began = time.perf_counter()
        if device.type == "cuda":
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            dst.copy_(src)
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b) / 1e3)
        else:
            dst.copy_(src)
            times.append(time.perf_counter() - began)
    del src, dst
    return 2 * nbytes / statistics.median(times[2:])


def build_model(name: str, tiny: bool, device: torch.device):
    """edgelin's model of the published config (random weights, seed 0) and the config dict it came from."""
    from real_shapes import shape

    from edgelin.convert import convert
    from edgelin.model.lm import CausalLM

    s = shape(name).tiny() if tiny else shape(name)
    fields = {"model_type": s.model_type, "architectures": [s.architecture], **s.fields}
    config = convert(fields, f"{s.source} (bench/real_shapes.py)").config
    torch.manual_seed(0)
    with torch.device(device):
        model = CausalLM(config)
    return model.eval().requires_grad_(False), s


def export(model, folder: Path, name: str) -> float:
    """The torch target's fp16 export of `model` into `folder` (what `edgelin export --target torch
    --precision fp16` writes); returns seconds."""
    from edgelin.devices import ExportSettings
    from edgelin.export.pipeline import export_model

    began = time.time()
    export_model(model, folder, "torch", {"format": "random", "path": f"random weights: {name}, seed 0"},
                 settings=ExportSettings(precision="fp16", force=True),  # random weights: no quality to gate
                 on_progress=lambda done, total, what: say(f"    export {done + 1}/{total}: {what} [{time.time() - began:.0f} s]"))
    return time.time() - began


class FixedGraphStep:
    """The model's recurrent step over static buffers (ids, positions, state with the KV cache at a fixed
    capacity), captured in one CUDA graph on CUDA (run eagerly on a CPU: the toy check)."""

    def __init__(self, model, layers: list[dict], position: int, capacity: int, device: torch.device):
        from edgelin.model.attention import fixed_capacity

        self.model, self.device, self.position, self.capacity = model, device, position, capacity
        batch = next(iter(layers[0].values())).shape[0]
        self.ids = torch.zeros(batch, 1, dtype=torch.long, device=device)
        self.start = torch.full((batch,), position, dtype=torch.long, device=device)
        self.state = []
        for layer in layers:  # a growing cache [B, Hkv, P, D] goes into rows 0 .. P-1 of [B, Hkv, capacity, D]
            buffers = {}
            for key, tensor in layer.items():
                if key in ("key", "value"):
                    held = torch.zeros(*tensor.shape[:2], capacity, tensor.shape[3], dtype=tensor.dtype, device=device)
                    held[:, :, :tensor.shape[2]] = tensor
                    buffers[key] = held
                else:
                    buffers[key] = tensor.clone()
            self.state.append(buffers)
        self.graph = None
        if device.type == "cuda":  # the flag only matters while capturing: the runner's own calls stay growing
            with fixed_capacity(model, capacity):
                self._capture()
        self.rewind()

    def _capture(self) -> None:
        """Warm up on a side stream (kernels compiled, cuBLAS plans picked, memory allocated), then capture."""
        device = self.device
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side), torch.no_grad():
            for _ in range(2):
                self._forward()
        torch.cuda.current_stream(device).wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph), torch.no_grad():
            self.logits = self._step()

    def _forward(self):
        return self.model(self.ids, self.state, self.start, mode="recurrent", last_only=True)

    def _step(self):
        logits, new = self._forward()
        for mine, fresh in zip(self.state, new):
            for key, tensor in mine.items():
                tensor.copy_(fresh[key])
        self.start.add_(1)
        return logits

    def rewind(self) -> None:
        """Back to the prefilled position (rows past it are rewritten: the timing, not the text, matters)."""
        self.start.fill_(self.position)

    def step(self, ids: torch.Tensor) -> torch.Tensor:
        self.ids.copy_(ids.view(-1, 1))
        if self.graph is not None:
            self.graph.replay()
            return self.logits
        from edgelin.model.attention import fixed_capacity

        with fixed_capacity(self.model, self.capacity), torch.no_grad():
            self.logits = self._step()
        return self.logits


def timed(fn, steps: int, device: torch.device) -> tuple[float, float]:
    """(GPU ms per step by CUDA events, wall ms per step) over `steps` back-to-back calls, one sync at the end."""
    sync(device)
    if device.type == "cuda":
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
    began = time.perf_counter()
    for _ in range(steps):
        fn()
    if device.type == "cuda":
        b.record()
    sync(device)
    wall = (time.perf_counter() - began) * 1e3 / steps
    return (a.elapsed_time(b) / steps if device.type == "cuda" else wall), wall


def state_bytes(layers: list[dict]) -> tuple[int, int]:
    """(recurrent + conv state bytes, KV cache bytes) of a state (all rows)."""
    kv = sum(t.numel() * t.element_size() for layer in layers for k, t in layer.items() if k in ("key", "value"))
    total = sum(t.numel() * t.element_size() for layer in layers for t in layer.values())
    return total - kv, kv


def run_model(name: str, args, device: torch.device, out: dict) -> None:
    from edgelin.runtime import open_runner, prefill

    began = time.time()
    model, s = build_model(name, args.tiny, torch.device("cpu"))  # the export's reference runs on the CPU
    params = model.num_parameters()
    say(f"{s.name}: {params / 1e6:.1f} M parameters (random weights, seed 0) built in {time.time() - began:.0f} s")
    folder = args.out / s.name
    seconds = export(model, folder, s.name)
    del model
    if device.type == "cuda":
        torch.cuda.empty_cache()
    say(f"  exported (torch target, fp16) in {seconds:.0f} s")
    runner = open_runner(folder)
    model = runner.model
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())  # tied head counted once
    by_dtype: dict[str, int] = {}
    for p in model.parameters():
        by_dtype[str(p.dtype)] = by_dtype.get(str(p.dtype), 0) + p.numel() * p.element_size()
    bandwidth = copy_bandwidth(device)
    entry = {"name": s.name, "parameters": params, "weight_bytes": weight_bytes, "weight_bytes_by_dtype": by_dtype,
             "runner": runner.label, "decode": runner.decode, "export_seconds": round(seconds, 1),
             "copy_bandwidth_Bps": bandwidth, "rows": []}
    say(f"  runner: {runner.label}; weights read per step {weight_bytes / 1e9:.3f} GB {by_dtype}; "
        f"copy bandwidth {bandwidth / 1e12:.3f} TB/s -> weight floor {weight_bytes / bandwidth * 1e3:.3f} ms")
    batches = [int(b) for b in args.batches.split(",")]
    rng = np.random.default_rng(0)
    capacity = args.position + args.rounds * args.steps + 2 * args.steps + 8
    setups = {}
    for batch in batches:
        began = time.time()
        handle = runner.new_state(batch)
        ids = rng.integers(0, runner.manifest.vocab_size, (batch, args.position), dtype=np.int64)
        prefill(runner, ids, handle, start=0)
        sync(device)
        prefilled = time.time() - began
        token = torch.from_numpy(rng.integers(0, runner.manifest.vocab_size, batch, dtype=np.int64)).to(device)
        token_np = token.cpu().numpy()
        layers = handle._value.layers
        recurrent_bytes, kv_bytes = state_bytes(layers)
        graph = FixedGraphStep(model, layers, args.position, capacity, device)
        # the graph's step against the runner's, from the same state at the same position
        check_handle = runner.fork(handle)
        reference = runner.step(token_np, check_handle, np.full(batch, args.position, np.int64))
        del check_handle
        mine = graph.step(token).float().cpu().numpy()
        graph.rewind()
        agreement = float(np.abs(mine - reference).max() / np.abs(reference).max())
        position = [args.position]

        def runner_step(handle=handle, token_np=token_np, batch=batch, position=position, runner=runner):
            runner.step(token_np, handle, np.full(batch, position[0], np.int64))
            position[0] += 1

        def eager_step(handle=handle, token=token, batch=batch, position=position, model=model):
            with torch.no_grad():
                start = torch.full((batch,), position[0], dtype=torch.long, device=device)
                _, new = model(token.view(batch, 1), handle._value.layers, start, mode="recurrent", last_only=True)
            handle._value.layers = new
            position[0] += 1

        setups[batch] = {"runner": runner_step, "eager": eager_step, "graph": lambda g=graph, t=token: g.step(t),
                         "graph_obj": graph, "recurrent_bytes": recurrent_bytes, "kv_bytes": kv_bytes,
                         "agreement": agreement, "prefill_s": prefilled, "position": position}
        say(f"  B={batch}: prefilled {args.position} tokens in {prefilled:.1f} s; state {recurrent_bytes / 1e6:.1f} MB "
            f"recurrent + conv, {kv_bytes / 1e6:.1f} MB KV; graph vs runner logits max rel diff {agreement:.2e}")
    samples: dict[tuple[int, str], list[tuple[float, float]]] = {}
    for form_batch in [(b, f) for b in batches for f in FORMS]:  # warm-up: allocator, cuBLAS plans
        setups[form_batch[0]][form_batch[1]]()
    for round_ in range(args.rounds):
        order = [(b, f) for b in batches for f in FORMS]
        for batch, form in (order if round_ % 2 == 0 else order[::-1]):
            setups[batch]["graph_obj"].rewind()
            samples.setdefault((batch, form), []).append(timed(setups[batch][form], args.steps, device))
    for batch in batches:
        setup = setups[batch]
        for form in FORMS:
            gpu = statistics.median(x[0] for x in samples[(batch, form)])
            wall = statistics.median(x[1] for x in samples[(batch, form)])
            weight_floor = weight_bytes / bandwidth * 1e3
            # recurrent state read + written, the KV cache read (its one new row written: negligible)
            state_floor = (2 * setup["recurrent_bytes"] + setup["kv_bytes"]) / bandwidth * 1e3
            row = {"batch": batch, "form": form, "gpu_ms": gpu, "wall_ms": wall, "tokens_per_s": batch / gpu * 1e3,
                   "wall_tokens_per_s": batch / wall * 1e3, "weight_floor_ms": weight_floor,
                   "state_floor_ms": state_floor, "pct_weight_floor": 100 * weight_floor / gpu,
                   "pct_floor_with_state": 100 * (weight_floor + state_floor) / gpu,
                   "samples_gpu_ms": [x[0] for x in samples[(batch, form)]],
                   "samples_wall_ms": [x[1] for x in samples[(batch, form)]],
                   "graph_vs_runner_max_rel": setup["agreement"], "prefill_s": setup["prefill_s"],
                   "recurrent_state_bytes": setup["recurrent_bytes"], "kv_bytes_at_position": setup["kv_bytes"]}
            entry["rows"].append(row)
    entry["copy_bandwidth_end_Bps"] = copy_bandwidth(device)
    entry["positions_stepped"] = [args.position, args.position + (args.rounds + 1) * args.steps]
    out["models"].append(entry)
    del setups, runner, model
    if device.type == "cuda":
        torch.cuda.empty_cache()


def print_table(out: dict) -> None:
    gpu = out["env"]["gpu"]
    say("\n| model | B | form | GPU ms/step | wall ms/step | tokens/s (GPU) | weight floor ms | % of weight floor "
        "| + state floor ms | % of (weights + state) floor | card |")
    say("|---|---|---|---|---|---|---|---|---|---|---|")
    for model in out["models"]:
        for r in model["rows"]:
            say(f"| {model['name']} | {r['batch']} | {r['form']} | {r['gpu_ms']:.3f} | {r['wall_ms']:.3f} | "
                f"{r['tokens_per_s']:,.0f} | {r['weight_floor_ms']:.3f} | {r['pct_weight_floor']:.1f}% | "
                f"{r['state_floor_ms']:.3f} | {r['pct_floor_with_state']:.1f}% | {gpu} |")
    for model in out["models"]:
        rows = {(r["batch"], r["form"]): r for r in model["rows"]}
        for batch in sorted({r["batch"] for r in model["rows"]}):
            ratio = rows[(batch, "runner")]["gpu_ms"] / rows[(batch, "graph")]["gpu_ms"]
            say(f"{model['name']} B={batch}: runner / graph GPU time = {ratio:.1f}x; "
                f"eager / graph = {rows[(batch, 'eager')]['gpu_ms'] / rows[(batch, 'graph')]['gpu_ms']:.1f}x")


RESULT = ROOT / "bench" / "results" / "gpu-real-sizes.json"
FORM_NAMES = {"runner": "torch target runner (eager, logits to host)", "eager": "eager step, no host copy",
              "graph": "CUDA graph, fixed-capacity KV cache"}


def render(raw: dict, date: str, notes: str = "") -> dict:
    """The run's JSON as a bench/results table (bench/performance_doc.py's format)."""
    env = raw["env"]
    bandwidths = [m["copy_bandwidth_Bps"] for m in raw["models"]] + [m["copy_bandwidth_end_Bps"] for m in raw["models"]]
    machine = (f"one {env['gpu']} ({env['sms']} SMs, driver {env['driver']}), torch {env['torch']}, Triton "
               f"{env['triton']}, Python {env['python']}; copy bandwidth {min(bandwidths) / 1e12:.2f}-"
               f"{max(bandwidths) / 1e12:.2f} TB/s in the run")
    rows = []
    for model in raw["models"]:
        for r in model["rows"]:
            rows.append([f"{model['name']} ({model['parameters'] / 1e6:.0f} M, {model['weight_bytes'] / 1e9:.2f} GB)",
                         str(r["batch"]), FORM_NAMES[r["form"]], f"{r['gpu_ms']:.3f}", f"{r['wall_ms']:.3f}",
                         f"{r['tokens_per_s']:,.0f}", f"{r['weight_floor_ms']:.3f}", f"{r['pct_weight_floor']:.1f}%",
                         f"{r['pct_floor_with_state']:.1f}%", env["gpu"]])
    position = int(raw["args"]["position"])
    return {"id": RESULT.stem, "topic": "gpu-decode-at-real-size",
            "title": f"Qwen3.5-0.8B and -2B (published shapes, RANDOM weights), torch target fp16, decode at position "
                     f"~{position:,} on one {env['gpu']}",
            "command": (f"python bench/gpu_real_sizes.py --out DIR --position {position} --rounds {raw['args']['rounds']} "
                        f"--steps {raw['args']['steps']} --json; python bench/gpu_real_sizes.py --render "
                        "DIR/gpu-real-sizes.json"), "commit": env["commit"], "date": date, "machine": machine,
            "method": (f"edgelin's model of each published config (bench/real_shapes.py SHAPES) with random weights "
                       f"(seed 0), exported with the torch target at fp16 (library API; quality gate forced: random "
                       f"weights) and opened with its runner; each batch prefilled to {position:,} random tokens, "
                       f"then {raw['args']['steps']} back-to-back steps per sample, {raw['args']['rounds']} samples "
                       "interleaved over (B, form), medians; GPU time by CUDA events around the steps, wall by "
                       "perf_counter; tokens/s = B / GPU time. Forms: the runner's step as `edgelin bench` calls it "
                       "(a hybrid keeps a growing KV cache, so it steps eagerly and copies float32 logits to the "
                       "host); the same forward without the host copy; the same step with the KV cache at a fixed "
                       "capacity captured in one CUDA graph (checked against the runner's logits). Weight floor = "
                       "every weight read once per step (fp16, tied head once) / the copy bandwidth of a 1 GiB "
                       "device-to-device copy measured in the same run; '+ state' adds the recurrent state read + "
                       "written and the KV cache read; % of floor = floor / GPU time"),
            "source": f"the run's JSON, bench/results/raw/gpu-real-sizes-run.json (bench/gpu_real_sizes.py at {env['commit']}; issue 46, item 5)",
            "columns": ["model (parameters, fp16 bytes read per step)", "B", "decode", "GPU ms / step",
                        "wall ms / step", "tokens/s", "weight floor ms", "% of weight floor",
                        "% of (weights + state) floor", "card"],
            "rows": rows,
            "notes": ("Random weights: speed only, no quality figure. " + notes).strip()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--render", type=Path, metavar="RUN_JSON", help="write bench/results/gpu-real-sizes.json")
    parser.add_argument("--date", default=time.strftime("%Y-%m-%d", time.gmtime()))
    parser.add_argument("--notes", default="", help="with --render: what the table shows, in a few sentences")
    parser.add_argument("--out", type=Path, help="a folder for the exports and the JSON")
    parser.add_argument("--models", default="qwen3.5-0.8b,qwen3.5-2b")
    parser.add_argument("--batches", default="1,8,64")
    parser.add_argument("--position", type=int, default=1024, help="prefilled tokens before the timed steps")
    parser.add_argument("--steps", type=int, default=24, help="steps per timed sample")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved samples per (B, form)")
    parser.add_argument("--tiny", action="store_true", help="toy sizes of the same layouts (a CPU check)")
    parser.add_argument("--commit", default="working tree")
    parser.add_argument("--json", action="store_true", help="write OUT/gpu-real-sizes.json")
    args = parser.parse_args()
    if args.render:
        RESULT.write_text(json.dumps(render(json.loads(args.render.read_text()), args.date, args.notes), indent=1) + "\n")
        return say(f"wrote {RESULT}")
    if args.out is None:
        parser.error("--out is required")
    args.out.mkdir(parents=True, exist_ok=True)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else f"CPU ({platform.processor() or 'cpu'})"
    out = {"env": {"gpu": gpu, "torch": torch.__version__, "python": platform.python_version(),
                   "commit": args.commit, "triton": _version("triton"),
                   "sms": torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda"
                   else None, "driver": _driver()},
           "args": {k: str(v) for k, v in vars(args).items()}, "models": []}
    say(f"gpu_real_sizes: {out['env']}")
    for name in args.models.split(","):
        run_model(name, args, device, out)
        if args.json:
            (args.out / "gpu-real-sizes.json").write_text(json.dumps(out, indent=1))
    print_table(out)
    if args.json:
        (args.out / "gpu-real-sizes.json").write_text(json.dumps(out, indent=1))


def _version(module: str) -> str | None:
    try:
        return __import__(module).__version__
    except ImportError:
        return None


def _driver() -> str | None:
    try:
        return subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                              capture_output=True, text=True, timeout=20).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


if __name__ == "__main__":
    main()
