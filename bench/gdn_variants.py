"""Gated DeltaNet vs Gated DeltaNet-2 vs Gated DeltaNet + CLVR (issue 15 part 3): validation loss and
bits per byte of recipes/tiny-gdn, tiny-gdn2 and tiny-gdn-clvr over several seeds, same text, steps,
batch and seq_len as the shipped model (recipes/tiny-gdn-hybrid).

    python bench/gdn_variants.py [--seeds 0,1] [--device cuda] [--jobs 6] [--steps N] [--out runs/gdn-variants]
                                 [--json FILE]
    python bench/gdn_variants.py --summarize runs/gdn-variants [--json FILE]    # the table from existing logs

docs/performance.md#gated-deltanet-variants records the results. Method:
  - one `python -m edgelin.train RECIPE --seed S --device D --out OUT/ARCH-sS` per architecture and seed,
    --jobs of them at a time (separate processes; on one GPU they overlap well: these models are tiny
    and launch-bound); a run whose training_log.json exists is kept, not redone;
  - the corpus (tokenizer + token streams) is built once first into OUT/cache (EDGELIN_CACHE): the three
    recipes share [data] and [tokenizer], so every run reads the same tokens. The corpus is the stdlib of
    the Python that runs this script: figures from another Python version are not comparable;
  - EDGELIN_KERNELS=torch: every recurrence (training, evaluation, sample) runs the torch reference, so
    the three architectures go through the same code path (GDN-2 has no GPU kernel yet);
  - the figures are the trainer's own: final val loss over every held-out token after rounding the
    weights to float16 (nats/token) and bits per byte = loss / ln 2 * val tokens / val bytes;
  - per architecture: mean and sample standard deviation over seeds, and the paired difference to
    Gated DeltaNet with the same seed (the seed fixes the init of the shared parts and the batches).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ARCHS = {"gdn": "tiny-gdn", "gdn2": "tiny-gdn2", "gdn-clvr": "tiny-gdn-clvr"}
NAMES = {"gdn": "Gated DeltaNet", "gdn2": "Gated DeltaNet-2", "gdn-clvr": "Gated DeltaNet + CLVR"}


def build_corpus_once(out: Path) -> None:
    sys.path.insert(0, str(ROOT))
    from edgelin.train import Recipe, build_corpus

    started = time.perf_counter()
    corpus = build_corpus(Recipe.load(ROOT / "recipes" / ARCHS["gdn"] / "recipe.toml"), out / "cache")
    print(f"corpus: {len(corpus.train)} train / {len(corpus.val)} val tokens, {corpus.val_bytes} val bytes "
          f"({time.perf_counter() - started:.0f} s; Python {platform.python_version()} stdlib)", flush=True)


def run_all(out: Path, seeds: list[int], device: str, jobs: int, steps: int | None) -> None:
    env = {**os.environ, "EDGELIN_CACHE": str(out / "cache"), "EDGELIN_KERNELS": "torch", "PYTHONUNBUFFERED": "1",
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)}
    todo = [(arch, seed) for seed in seeds for arch in ARCHS
            if not (out / f"{arch}-s{seed}" / "training_log.json").is_file()]
    running: dict[tuple[str, int], subprocess.Popen] = {}
    started, last_report = time.perf_counter(), 0.0
    while todo or running:
        while todo and len(running) < jobs:
            arch, seed = todo.pop(0)
            cmd = [sys.executable, "-m", "edgelin.train", str(ROOT / "recipes" / ARCHS[arch] / "recipe.toml"),
                   "--seed", str(seed), "--device", device, "--out", str(out / f"{arch}-s{seed}")]
            cmd += ["--steps", str(steps)] if steps else []
            log = (out / f"{arch}-s{seed}.log").open("w")
            running[(arch, seed)] = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
        time.sleep(2)
        for key, proc in list(running.items()):
            if proc.poll() is not None:
                del running[key]
                status = "done" if proc.returncode == 0 else f"FAILED (exit {proc.returncode})"
                print(f"[{time.perf_counter() - started:4.0f} s] {key[0]}-s{key[1]} {status}: "
                      f"{_last_line(out / f'{key[0]}-s{key[1]}.log')}", flush=True)
        if running and time.perf_counter() - last_report > 60:
            last_report = time.perf_counter()
            for arch, seed in running:
                print(f"[{last_report - started:4.0f} s] {arch}-s{seed}: {_last_line(out / f'{arch}-s{seed}.log')}",
                      flush=True)


def _last_line(path: Path) -> str:
    lines = [line for line in path.read_text(errors="replace").splitlines() if line.strip()]
    return lines[-1][:160] if lines else "(no output yet)"


def summarize(out: Path) -> dict:
    runs = []
    for log_path in sorted(out.glob("*-s*/training_log.json")):
        arch, seed = log_path.parent.name.rsplit("-s", 1)
        log = json.loads(log_path.read_text())
        runs.append({"arch": arch, "seed": int(seed), "val_loss": log["final_val_loss"],
                     "val_bpb": log["val_bits_per_byte"], "parameters": log["parameters"], "steps": log["steps"],
                     "tokens_seen": log["tokens_seen"], "train_loop_time_s": log["train_loop_time_s"],
                     "wall_time_s": log["wall_time_s"], "device": log.get("device", "cpu"),
                     "machine": log["machine"], "curve": log["curve"]})
    by_arch = {arch: {r["seed"]: r for r in runs if r["arch"] == arch} for arch in ARCHS}
    table = []
    for arch, seeds in by_arch.items():
        if not seeds:
            continue
        losses = [r["val_loss"] for r in seeds.values()]
        bpbs = [r["val_bpb"] for r in seeds.values()]
        paired = [r["val_loss"] - by_arch["gdn"][s]["val_loss"] for s, r in seeds.items() if s in by_arch["gdn"]]
        table.append({"arch": arch, "name": NAMES[arch], "seeds": sorted(seeds),
                      "parameters": next(iter(seeds.values()))["parameters"],
                      "val_loss": {str(s): r["val_loss"] for s, r in sorted(seeds.items())},
                      "val_bpb": {str(s): r["val_bpb"] for s, r in sorted(seeds.items())},
                      "mean_val_loss": statistics.fmean(losses), "std_val_loss": _std(losses),
                      "mean_val_bpb": statistics.fmean(bpbs), "std_val_bpb": _std(bpbs),
                      "paired_delta_vs_gdn": paired, "mean_delta_vs_gdn": statistics.fmean(paired) if paired else None,
                      "std_delta_vs_gdn": _std(paired), "better_than_gdn": sum(d < 0 for d in paired),
                      "mean_train_loop_time_s": statistics.fmean(r["train_loop_time_s"] for r in seeds.values())})
    return {"runs": runs, "table": table}


def _std(values: list[float]) -> float | None:
    return statistics.stdev(values) if len(values) > 1 else None


def markdown(summary: dict) -> str:
    rows = ["| architecture | params | seeds | val loss per seed (nats/token) | mean ± sd | bits/byte per seed | "
            "mean bpb | Δ loss vs GDN, same seed: mean ± sd |", "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for t in summary["table"]:
        sd = f" ± {t['std_val_loss']:.4f}" if t["std_val_loss"] is not None else ""
        paired = t["paired_delta_vs_gdn"]
        delta = "—" if t["arch"] == "gdn" or not paired else (
            f"{t['mean_delta_vs_gdn']:+.4f}" + (f" ± {t['std_delta_vs_gdn']:.4f}" if len(paired) > 1 else "") +
            f" (lower in {t['better_than_gdn']} of {len(paired)}: {', '.join(f'{d:+.4f}' for d in paired)})")
        rows.append(f"| {t['name']} | {t['parameters'] / 1e6:.2f} M | {', '.join(map(str, t['seeds']))} | "
                    f"{', '.join(f'{v:.4f}' for v in t['val_loss'].values())} | {t['mean_val_loss']:.4f}{sd} | "
                    f"{', '.join(f'{v:.4f}' for v in t['val_bpb'].values())} | {t['mean_val_bpb']:.4f} | {delta} |")
    return "\n".join(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", default="0,1", help="comma-separated [train] seeds")
    parser.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    parser.add_argument("--jobs", type=int, default=1, help="training processes at a time")
    parser.add_argument("--steps", type=int, default=None, help="override the recipes' 800 steps (smoke runs)")
    parser.add_argument("--out", type=Path, default=Path("runs/gdn-variants"))
    parser.add_argument("--summarize", type=Path, default=None, help="only tabulate the logs under this folder")
    parser.add_argument("--json", type=Path, default=None, help="write the summary (every run, every figure) here")
    args = parser.parse_args()
    out = (args.summarize or args.out).resolve()  # the training processes run from the repo root
    if args.summarize is None:
        out.mkdir(parents=True, exist_ok=True)
        build_corpus_once(out)
        run_all(out, [int(s) for s in args.seeds.split(",")], args.device, args.jobs, args.steps)
    summary = summarize(out)
    print(markdown(summary))
    if args.json:
        args.json.write_text(json.dumps(summary, indent=1) + "\n")


if __name__ == "__main__":
    main()
