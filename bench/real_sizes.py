"""Real sizes on the CPU (issue 46): export, validate, bench and generate the real-shaped checkpoints of
bench/real_shapes.py as a user runs them, each step a child process whose wall time and peak RSS (wait4's
ru_maxrss) are recorded; docs/benchmarks.md is rendered from the results. Random weights: speed and memory only
(quality figures come from the trained peers: docs/performance.md).

    python bench/real_shapes.py --out runs/real-shapes                      # the checkpoints (minutes)
    python bench/real_sizes.py run runs/real-shapes/qwen3.5-0.8b --cells int4,int8 --out runs/real-sizes
    python bench/real_sizes.py doc                                           # docs/benchmarks.md from the results

A cell is an export's precision flags: fp32, fp16 (--quantize fp16), int8, int4, int4-e8 (--quantize int4
--embeddings-bits 8). `run` merges its cells into bench/results/real-sizes/cells.json (keyed by checkpoint and cell,
with commit and machine), replacing only the cells it measured.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results" / "real-sizes" / "cells.json"  # (not *.json of results/: performance_doc reads those)
DOC = ROOT / "docs" / "benchmarks.md"
# The quantised cells pass --force: on random weights the logits are nearly flat, so the export's quality gate (top-1
# agreement with the fp32 reference) measures noise and refuses; parity with the dequantised reference is still
# checked by validate. Quality figures belong to the trained peers (docs/performance.md#quantisation-quality).
CELLS = {"fp32": [], "fp16": ["--quantize", "fp16", "--force"], "int8": ["--quantize", "int8", "--force"],
         "int4": ["--quantize", "int4", "--force"],
         "int4-e8": ["--quantize", "int4", "--embeddings-bits", "8", "--force"]}
CLI = [sys.executable, "-m", "edgelin.cli"]


def timed(args: list[str], log: Path) -> dict:
    """Run a child to completion (stdout to `log`, stderr beside it): its exit status, wall seconds and peak RSS
    (bytes, the child's own)."""
    began = time.monotonic()
    with open(log, "w") as out, open(log.with_name(log.name + ".err"), "w") as err:
        child = subprocess.Popen(args, stdout=out, stderr=err)
        _, status, usage = os.wait4(child.pid, 0)
    child.returncode = os.waitstatus_to_exitcode(status)
    return {"rc": child.returncode, "seconds": round(time.monotonic() - began, 1),
            "peak_rss_bytes": usage.ru_maxrss * 1024, "log": str(log)}


def machine() -> str:
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor())
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return f"{os.cpu_count()}-core {cpu}, {memory / 2**30:.0f} GiB, {platform.system()}"


def run_cell(checkpoint: Path, cell: str, out: Path, positions: str, reuse: bool = False,
             export_only: bool = False) -> dict:
    """Export (unless `reuse` and the folder holds a finished export and its recorded stats), then (unless
    `export_only`: a later --reuse run measures the rest) validate, bench at 1 and 2 threads and generate."""
    folder = out / f"{checkpoint.name}-{cell}"
    logs = out / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    stem = f"{checkpoint.name}-{cell}"
    stats = logs / f"{stem}-export.json"
    result: dict = {"checkpoint": checkpoint.name, "cell": cell,
                    "command": f"edgelin export {checkpoint.name} --target onnx {' '.join(CELLS[cell])}".strip()}
    if reuse and (folder / "manifest.json").is_file() and stats.is_file():
        result["export"] = json.loads(stats.read_text())
    else:
        if folder.exists():
            shutil.rmtree(folder)  # ours: this script's own output folder
        result["export"] = timed(CLI + ["export", str(checkpoint), "--target", "onnx", *CELLS[cell], "--out",
                                        str(folder)], logs / f"{stem}-export.log")
        stats.write_text(json.dumps(result["export"]))
    if result["export"]["rc"] != 0:
        return result
    manifest = json.loads((folder / "manifest.json").read_text())
    result["weights_bytes"] = manifest["extra"]["weights"]["bytes"]
    result["num_parameters"] = manifest["model"]["num_parameters"]
    result["folder_bytes"] = sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())
    if export_only:
        return result
    result["validate"] = timed(CLI + ["validate", str(folder)], logs / f"{stem}-validate.log")
    said = [line for path in (logs / f"{stem}-validate.log", logs / f"{stem}-validate.log.err")
            for line in path.read_text().splitlines() if "checks passed" in line or "checks failed" in line]
    result["validate"]["summary"] = said[-1].split(" (")[0].removeprefix("error: ") if said else None
    bench_json = logs / f"{stem}-bench.json"
    for threads in (1, 2):
        # --prefill-tokens 0: bench's prefill-vs-steps figure steps the whole prompt one token at a time as well
        # (2,048 steps of a 0.75 B model: ~15 min at one thread); prefill throughput is timed on its own below
        result[f"bench_t{threads}"] = timed(CLI + ["bench", str(folder), "--positions", positions, "--iters", "20",
                                                   "--warmup", "3", "--threads", str(threads), "--prefill-tokens",
                                                   "0", "--json"], bench_json)
        if result[f"bench_t{threads}"]["rc"] == 0:
            result[f"bench_t{threads}"]["report"] = json.loads(bench_json.read_text())
    result["generate"] = timed(CLI + ["generate", str(folder), "--prompt", "def main(", "-n", "32", "--greedy",
                                      "--ignore-eos", "--json"], logs / f"{stem}-generate.json")
    if result["generate"]["rc"] == 0:
        result["generate"]["report"] = json.loads(Path(result["generate"]["log"]).read_text())
    return result


def command_run(args: argparse.Namespace) -> None:
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                            text=True).stdout.strip()
    changed = subprocess.run(["git", "status", "--porcelain", "--", "edgelin", "bench/*.py"], cwd=ROOT,
                             capture_output=True, text=True).stdout.strip()
    commit += "+" if changed else ""  # the code measured is the commit plus uncommitted changes
    for cell in args.cells.split(","):
        if cell not in CELLS:
            raise SystemExit(f"unknown cell {cell!r}: one of {', '.join(CELLS)}")
        result = run_cell(args.checkpoint, cell, args.out, args.positions, args.reuse, args.export_only)
        result.update(commit=commit, machine=machine(), when=time.strftime("%Y-%m-%d"))
        data = json.loads(RESULTS.read_text()) if RESULTS.exists() else {"cells": {}}  # read now: other runs write it
        data["cells"][f"{args.checkpoint.name}/{cell}"] = result
        RESULTS.write_text(json.dumps(data, indent=1) + "\n")
        export = result["export"]
        print(f"{args.checkpoint.name} {cell}: export rc {export['rc']}, {export['seconds']:.0f} s, peak RSS "
              f"{_gib(export.get('peak_rss_bytes'))} GiB", flush=True)


def _gib(value: float | None) -> str:
    return "-" if value is None else f"{value / 2**30:.2f}"  # None: not recorded


def _step_ms(result: dict, threads: int, position: int) -> str:
    report = result.get(f"bench_t{threads}", {}).get("report")
    if not report:
        return "-"
    for entry in report.get("positions", []):
        if entry.get("position") == position:
            return f"{entry['p50_ms']:.1f}"
    return "-"


def _floor_lines(report: dict, products: dict | None) -> list[str]:
    """Each runtime's decode step at position 1 and one thread against the time its bytes take to read once at the
    machine's read rate (a step reads every weight once: the floor), where bench/q4_rows.py measured that rate on
    the same CPU."""
    if not products or report["meta"]["cpu"] not in products["machine"]:
        return []
    rates = sorted(row["read_gb_per_s"] for row in products["rows"])
    rate, said = rates[len(rates) // 2], []  # the median of bench/q4_rows.py's read rates
    for row in report["rows"]:
        step = row["runs"].get("1", {}).get("latency", {}).get("1", {}).get("p50")
        if step and row.get("bytes_on_disk"):
            achieved = row["bytes_on_disk"] / 1e9 / (step / 1e3)
            said.append(f"{row['runtime']} {row['bytes_on_disk'] / 2**20:.0f} MiB in {step:.1f} ms: {achieved:.1f} "
                        f"GB/s ({achieved / rate:.0%})")
    return ["", "Against the weight-read floor (position 1, one thread; a step reads every byte of its weights once, "
                "so bytes on disk per step time is the rate it reads at, beside this CPU's one-thread read rate, "
                f"{rate:.1f} GB/s: the median of bench/q4_rows.py's numpy read rates, {rates[0]:.1f}-{rates[-1]:.1f} "
                f"over its rows at {products['commit']}, another moment of this shared host): " + "; ".join(said)
                + "."] if said else []


def _products_section(products: dict) -> list[str]:
    before = any("before_ms" in row for row in products["rows"])
    lines = ["## The 4- and 8-bit products from memory", "",
             f"`{products['command']}` at {products['commit']} on {products['machine']}: edgelin's one-token products "
             "(edgelin/ortops/q4_gemv.c, q8_gemv.c) over as many random matrices of each shape as fill 256 MiB, one "
             "thread, median ms per pass over all of them" + (" beside the build named by --before (the library "
             f"built from {products.get('before_commit', 'an earlier commit')}'s sources; the median of per-round "
             "ratios; outputs compared bit for bit)" if before else "") + ", and numpy's read rate over "
             "the same bytes (the floor).", "",
             "| bits | K x N | matrices | MiB | " + ("before ms | " if before else "") + "ms | GB/s | "
             + ("new / before | same outputs | " if before else "") + "read GB/s |",
             "| ---: | --- | ---: | ---: | " + ("---: | " if before else "") + "---: | ---: | "
             + ("---: | --- | " if before else "") + "---: |"]
    for row in products["rows"]:
        rate = row["bytes"] / 1e9 / row["new_ms"] * 1e3
        lines.append(f"| {row['bits']} | {row['K']} x {row['N']} | {row['matrices']} | {row['bytes'] / 2**20:.0f} | "
                     + (f"{row['before_ms']:.1f} | " if before else "") + f"{row['new_ms']:.1f} | {rate:.1f} | "
                     + (f"x{row['ratio']:.2f} | {'yes' if row['same_outputs'] else 'NO'} | " if before else "")
                     + f"{row['read_gb_per_s']:.1f} |")
    return lines + [""]


def command_doc(args: argparse.Namespace) -> None:
    data = json.loads(RESULTS.read_text())
    by_checkpoint: dict[str, list[dict]] = {}
    for result in data["cells"].values():
        by_checkpoint.setdefault(result["checkpoint"], []).append(result)
    lines = ["# Real-size benchmarks", "",
             "Generated by `python bench/real_sizes.py doc` from `bench/results/real-sizes/cells.json`; each row by",
             "`python bench/real_sizes.py run CHECKPOINT --cells CELL` (commit and machine in the row). The checkpoints",
             "are bench/real_shapes.py's: the published shapes with **seeded random weights** (speed and memory only;",
             "quality figures are measured on the trained peers, docs/performance.md). CPU figures come from a shared",
             "2-core VM: export times are wall times of `edgelin export` with other work on the machine; step",
             "latencies are `edgelin bench` medians (p50 of 20 steps after 3 warm-up, batch 1). Quantised cells are",
             "exported with --force: on random weights the logits are nearly flat, so top-1 agreement with the fp32",
             "reference is noise (0% at int4) and the quality gate refuses; validate's parity with the dequantised",
             "reference is the check that counts there.", ""]
    for name, results in sorted(by_checkpoint.items()):
        order = list(CELLS)
        results.sort(key=lambda r: order.index(r["cell"]))
        lines += [f"## {name}", "",
                  "| cell | export | export peak RSS (GiB) | weights (GiB) | validate | step p50 ms @1 (1 / 2 threads) "
                  "| @1024 | generate tok/s | commit | machine |",
                  "| --- | ---: | ---: | ---: | --- | ---: | ---: | ---: | --- | --- |"]
        for r in results:
            export, validate = r["export"], r.get("validate", {})
            generated = r.get("generate", {}).get("report") or {}
            rate = generated.get("tokens_per_second")
            took = "failed" if export["rc"] else f"{export['seconds'] / 60:.1f} min"
            lines.append(
                f"| {r['cell']} | {took} "
                f"| {_gib(export['peak_rss_bytes'])} | {_gib(r.get('weights_bytes'))} "
                f"| {'-' if not validate else validate.get('summary') or ('pass' if validate['rc'] == 0 else 'FAIL')} "
                f"| {_step_ms(r, 1, 1)} / {_step_ms(r, 2, 1)} | {_step_ms(r, 1, 1024)} / {_step_ms(r, 2, 1024)} "
                f"| {'-' if rate is None else f'{rate:.1f}'} | {r['commit']} | {r['machine']} |")
        lines += [""] + [f"- {r['cell']}: {r['note']}" for r in results if r.get("note")] + [""]
    products = RESULTS.parent / "q4-rows.json"  # bench/q4_rows.py --json
    products = json.loads(products.read_text()) if products.is_file() else None
    for peers in sorted(RESULTS.parent.glob("peers-*.json")):  # bench/peers.py --json, rendered by it
        report = json.loads(peers.read_text())
        meta = report["meta"]
        shown = subprocess.run([sys.executable, str(ROOT / "bench" / "peers.py"), "--from-json", str(peers)],
                               capture_output=True, text=True, check=True).stdout
        runtimes = ", ".join(row["runtime"] for row in report["rows"])  # a checkpoint may have a file per precision
        lines += [f"## Beside llama.cpp: {Path(report['checkpoint']).name} ({runtimes})", "",
                  f"`{report.get('command', 'python bench/peers.py')}` at {meta['commit']} on {meta['cpu']}; "
                  f"llama-cpp-python {meta['llama-cpp-python']}, onnxruntime {meta['onnxruntime']}. "
                  "Each runtime and thread count in a fresh process; llama.cpp converts the same random weights "
                  "(convert_hf_to_gguf.py, then Q8_0 / Q4_0 by llama_model_quantize); edgelin runs the exports of the "
                  "cells above (growing KV cache). Decode: p50 / p99 ms per token over the timed steps at each "
                  "position; prefill: a 2,048-token prompt. Greedy agreement is not shown: random weights.", shown,
                  *_floor_lines(report, products), ""]
    if products:
        lines += _products_section(products)
    for found in sorted(RESULTS.parent.glob("export-memory-*.json")):  # bench/export_memory.py --json
        run = json.loads(found.read_text())
        lines += [f"## Export memory by step: {run['checkpoint']} {run['quantize'] or 'fp32'}", "",
                  f"`python bench/export_memory.py {run['checkpoint']} OUT"
                  f"{' --quantize ' + run['quantize'] if run['quantize'] else ''} --force` at "
                  f"{run['commit']} on {run['machine']}: {run['seconds'] / 60:.1f} min, peak RSS (VmHWM) "
                  f"{run['peak_rss_bytes'] / 2**30:.2f} GiB{' (' + run['note'] + ')' if run.get('note') else ''}. "
                  "Resident memory sampled every 10 ms; each row is the largest anonymous + file-backed total seen "
                  "during that step.", "",
                  "| step | peak GiB | anonymous | file-backed |", "| --- | ---: | ---: | ---: |"]
        lines += [f"| {row['step']} | {(row['anon_bytes'] + row['file_bytes']) / 2**30:.2f} "
                  f"| {row['anon_bytes'] / 2**30:.2f} | {row['file_bytes'] / 2**30:.2f} |" for row in run["steps"]]
        lines.append("")
    shapes = ("qwen3.5-0.8b", "qwen3.5-2b", "mamba2-1.3b", "gla-1.3b")  # bench/real_shapes.py's SHAPES
    missing = [f"{name} ({', '.join(c for c in CELLS if c not in {r['cell'] for r in by_checkpoint.get(name, [])})})"
               for name in shapes]
    lines += [f"Not yet measured here, by checkpoint (cells): {'; '.join(missing)}; positions 8,192 and 32,768. The GPU",
              "figures at these shapes are in [performance.md](performance.md#gpu-decode-at-real-size).", ""]
    lines += ["## Export cost", "",
              "`edgelin export` refuses, before the weights load, an export the machine lacks the memory or disk for",
              "(edgelin.export.resources): its estimate is the model's float32 bytes times the target's factor plus",
              "1.5 GiB for the process. The measured peaks behind the ONNX target's factors:", "",
              "| checkpoint | cell | parameters | float32 GiB | export peak RSS GiB | (peak - 1.5 GiB) / float32 |",
              "| --- | --- | ---: | ---: | ---: | ---: |"]
    for r in sorted(data["cells"].values(), key=lambda r: (r["checkpoint"], list(CELLS).index(r["cell"]))):
        if r["export"]["rc"] == 0 and "num_parameters" in r and r["export"].get("peak_rss_bytes"):
            weights, peak = 4 * r["num_parameters"], r["export"]["peak_rss_bytes"]
            lines.append(f"| {r['checkpoint']} | {r['cell']} | {r['num_parameters']:,} | {weights / 2**30:.2f} "
                         f"| {peak / 2**30:.2f} | {(peak - 1.5 * 2**30) / weights:.2f} |")
    cells = {r["checkpoint"]: r.get("num_parameters") for r in data["cells"].values()}
    for found in sorted(RESULTS.parent.glob("export-memory-*.json")):  # the same code's latest peak, by step
        run = json.loads(found.read_text())
        if cells.get(run["checkpoint"]):
            weights, peak = 4 * cells[run["checkpoint"]], run["peak_rss_bytes"]
            lines.append(f"| {run['checkpoint']} | {run['quantize'] or 'fp32'} (export_memory.py, {run['commit']}) "
                         f"| {cells[run['checkpoint']]:,} | {weights / 2**30:.2f} | {peak / 2**30:.2f} "
                         f"| {(peak - 1.5 * 2**30) / weights:.2f} |")
    lines.append("")
    DOC.write_text("\n".join(lines))
    print(f"wrote {DOC}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="export, validate, bench and generate a checkpoint's cells")
    run.add_argument("checkpoint", type=Path)
    run.add_argument("--cells", default="int4")
    run.add_argument("--out", type=Path, default=ROOT / "runs" / "real-sizes")
    run.add_argument("--positions", default="1,1024")
    run.add_argument("--export-only", action="store_true", help="export and record its time and peak RSS only "
                     "(validate, bench and generate by a later --reuse run)")
    run.add_argument("--reuse", action="store_true", help="keep a finished export of an earlier run (its recorded "
                     "time and peak RSS) and measure the rest")
    sub.add_parser("doc", help="render docs/benchmarks.md from the results")
    args = parser.parse_args()
    {"run": command_run, "doc": command_doc}[args.command](args)


if __name__ == "__main__":
    main()
