"""Bytes on disk, memory after loading, and ORT CPU step latency of one model at fp32 / fp16 / int8 /
int4, with the weights shared by the step and prefill graphs (after) and embedded in each (before).

    python bench/precision_size.py [CHECKPOINT] [--work DIR] [--iters 1000] [--repeat 3] [--json]

Issue 11 (docs/performance.md#precision-and-size records the results). Exports go to --work
(reused when already there: delete the folder to re-export). "Before" is the fp32 export with every
weight embedded in both graph files again (onnx.load + onnx.save without external data): the layout
`edgelin export` wrote before the weights were shared, run with ONNX Runtime's defaults (prepacking on).
"-float-embed" variants keep the embedding table and LM head float (--keep-embeddings-float; the
default quantises them too); "+prepack" runs the same folder with ONNX Runtime's weight prepacking on
(`edgelin bench --prepack`; off by default for float exports). Quality columns: the export's own
quality gate (manifest extra["quality"]: 512 greedy steps and the recipe's validation split vs fp32).

Method, per variant, each in a fresh Python process so one variant's memory cannot hide another's:
  disk     bytes of step.onnx + prefill.onnx (+ weights.bin): what a device loads
  memory   RSS and PSS (/proc/self/smaps_rollup) after opening the runner (both sessions) and running
           one step and one 16-token prefill, minus before; onnxruntime is imported first
           (edgelin.bench.load_memory). PSS counts a page mapped by both sessions once.
  latency  median of --iters steps at batch 1 after 50 warm-up steps, position 1.., one runner
           step (token + state handle through IO bindings) per sample, time.perf_counter; the
           variants run --repeat times in turn and the table gives the lowest median (the run least
           disturbed by other processes on a shared machine), memory from the same run.
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
from pathlib import Path

DEFAULT = Path(__file__).resolve().parents[1] / "recipes" / "tiny-gdn-hybrid"
# name: (precision, quantize, quantize the embedding table and head)
VARIANTS = {"fp32": ("fp32", None, True), "fp16": ("fp16", None, True), "int8": ("fp32", "int8", True),
            "int8-float-embed": ("fp32", "int8", False), "int4": ("fp32", "int4", True),
            "int4-float-embed": ("fp32", "int4", False), "fp16-int4": ("fp16", "int4", True)}
PREPACKED = ("fp32", "fp16")  # float exports also measured with prepacking on (quantised ones always prepack)


def export_all(checkpoint: Path, work: Path) -> dict[str, Path]:
    from edgelin.devices import export_settings
    from edgelin.export.onnx.options import OnnxOptions
    from edgelin.export.pipeline import export_checkpoint

    folders = {}
    for name, (precision, quantize, embeddings) in VARIANTS.items():
        folders[name] = work / name
        if not (folders[name] / "manifest.json").is_file():
            print(f"exporting {name} ...", file=sys.stderr)
            export_checkpoint(checkpoint, folders[name], force=True, options=OnnxOptions(quantize_embeddings=embeddings),
                              settings=export_settings(None, "onnx", precision, quantize))
    folders["fp32-before"] = embedded_copy(folders["fp32"], work / "fp32-before")
    return folders


def embedded_copy(folder: Path, out: Path) -> Path:
    """The export as `edgelin export` wrote it before issue 11: each graph holds its own weights."""
    import onnx

    if (out / "manifest.json").is_file():
        return out
    out.mkdir(parents=True, exist_ok=True)
    manifest = json.loads((folder / "manifest.json").read_text())
    for kind in ("step", "prefill"):
        onnx.save(onnx.load(str(folder / f"{kind}.onnx")), str(out / f"{kind}.onnx"))  # external data inlined
    manifest["extra"].pop("weights", None)
    manifest["files"] = ["manifest.json", "prefill.onnx", "step.onnx"]
    (out / "manifest.json").write_text(json.dumps(manifest, indent=2))
    return out


MEASURE = r"""
import json, sys, time
import numpy as np
from pathlib import Path
from edgelin.bench import load_memory, runtime_files
folder, iters = Path(sys.argv[1]), int(sys.argv[2])
runner, rss, pss = load_memory(folder, None, None)
disk = {name: (folder / name).stat().st_size for name in runtime_files(runner.manifest)}
state = runner.new_state(1)
pos = runner.manifest.needs_position
times = []
for i in range(50 + iters):
    ids, p = np.array([i % runner.manifest.vocab_size]), (np.array([i + 1]) if pos else None)
    t0 = time.perf_counter()
    runner.step(ids, state, p)
    times.append(time.perf_counter() - t0)
print(json.dumps({"disk": disk, "rss": rss, "pss": pss, "step_ms": 1e3 * float(np.median(times[50:])),
                  "quantization": runner.manifest.extra.get("quantization", {}).get("bits"),
                  "prepack": runner.prepack, "quality": runner.manifest.extra.get("quality")}))
"""


def measure(folder: Path, iters: int, prepack: bool | None = None) -> dict:
    import os

    from edgelin.export.onnx.runner import PREPACK_ENV

    env = {k: v for k, v in os.environ.items() if k != PREPACK_ENV}
    if prepack is not None:
        env[PREPACK_ENV] = "1" if prepack else "0"
    out = subprocess.run([sys.executable, "-c", MEASURE, str(folder), str(iters)], check=True, capture_output=True,
                         text=True, env=env)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkpoint", nargs="?", type=Path, default=DEFAULT)
    parser.add_argument("--work", type=Path, default=Path("out/precision-size"))
    parser.add_argument("--iters", type=int, default=1000)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    folders = export_all(args.checkpoint, args.work)
    cases = {name: (folder, None) for name, folder in folders.items()}
    cases.update({f"{name}+prepack": (folders[name], True) for name in PREPACKED})
    runs = [{name: measure(folder, args.iters, prepack) for name, (folder, prepack) in cases.items()}
            for _ in range(args.repeat)]
    results = {name: min((run[name] for run in runs), key=lambda r: r["step_ms"]) for name in cases}
    if args.json:
        print(json.dumps({"machine": platform.processor() or platform.machine(), "results": results}, indent=2))
        return
    base = results["fp32-before"]
    mib = 1 / 2**20
    print("| variant | graphs + weights on disk | vs fp32 before | vs fp32 after | RSS after load | PSS after load "
          "| step B=1 (median) | top-1 (512 greedy) | top-1 (held-out) | perplexity change |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for name, r in results.items():
        disk = sum(r["disk"].values())
        pss = f"{r['pss'] * mib:.1f} MiB" if r["pss"] is not None else "-"
        figures = (r.get("quality") or {}).get("figures", {})
        change = figures.get("perplexity_change")
        quality = (f"{figures['top1']:.2%} | {figures['text_top1']:.2%} | {change:+.2%} ({figures['perplexity']:.2f})"
                   if figures.get("text_top1") is not None and change is not None else "- | - | -")
        print(f"| {name} | {disk * mib:.2f} MiB | {disk / sum(base['disk'].values()):.2f}x | "
              f"{disk / sum(results['fp32']['disk'].values()):.2f}x | {r['rss'] * mib:.1f} MiB | {pss} | "
              f"{r['step_ms']:.3f} ms | {quality} |")


if __name__ == "__main__":
    main()
