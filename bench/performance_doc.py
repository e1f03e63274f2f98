"""Render docs/performance.md from the saved results in bench/results/*.json.

    python bench/performance_doc.py           # rewrite docs/performance.md
    python bench/performance_doc.py --check   # exit 1 if docs/performance.md differs from the rendering

A result file is one table: where it belongs (`topic`, a section below), what was measured (`title`), how
(`command`, `method`), on what (`commit`, `date`, `machine`), where the figures were first recorded (`source`),
then `columns` and `rows` (cells as text, as measured) and optionally `notes` and `image` (a plot of
the same run under docs/img/). A new measurement replaces its file: the page holds
only the current numbers, and git keeps the history. tests/test_performance_doc.py checks that the committed
page is this rendering.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
PAGE = ROOT / "docs" / "performance.md"
REQUIRED = ("id", "topic", "title", "command", "commit", "date", "machine", "method", "source", "columns", "rows")


@dataclass(frozen=True)
class Section:
    heading: str  # its anchor (the GitHub slug) is the results' `topic`; code comments cite it: keep it stable
    intro: str


SECTIONS = (
    Section("CPU step latency", "Decode latency per token at batch 1 on a 2-core x86 CPU, against llama.cpp, "
            "ExecuTorch and transformers on the same checkpoints, at the same weight precision. `@N`: the step "
            "at context position N, p50 / p99 ms. edgelin rows are ONNX exports run by edgelin's own CPU kernels "
            "(`--step-ops edgelin`, the default); `f16w` is `--quantize fp16`, `int4-e8` is `--quantize int4 "
            "--embeddings-bits 8`, `-kv16` is `--kv-dtype fp16`. Peers' set-up: `bench/peers.md`."),
    Section("Quantisation quality", "What int8 and int4 weights cost in agreement with the fp32 model, against "
            "llama.cpp's Q8_0 and Q4_0 files of the same checkpoints."),
    Section("Precision and size", "Bytes on disk, memory after load, step latency and quality of each precision "
            "and quantisation of the shipped model (see [precision.md](precision.md))."),
    Section("State precision", "Whether a family's recurrent state may be stored in float16 or bfloat16: the "
            "measurement behind `edgelin families`' fp16-state column and the exporter's refusal."),
    Section("Constant memory", "The shipped model (`recipes/tiny-gdn-hybrid`) decodes in constant memory: its "
            "state and step time stay flat with the position, where a same-size KV-cache transformer's grow."),
    Section("GPU prefill", "edgelin's Triton chunked prefill against flash-linear-attention's `chunk_*` kernels "
            "(see [kernels.md](kernels.md))."),
    Section("GPU decode", "The whole-model decode step, the torch target through `edgelin bench`, and the CUDA "
            "step kernel the TensorRT plugin calls."),
    Section("GPU decode at real size", "The models people ship (0.8-2 B parameters) through the torch target on one "
            "GPU: tokens/s at batch 1, 8 and 64 against the card's weight-read floor (bench/gpu_real_sizes.py)."),
    Section("Gated DeltaNet variants", "Training quality of the Gated DeltaNet variants edgelin exports (recipes "
            "in `recipes/`)."),
    Section("TensorRT", "See [targets/tensorrt.md](targets/tensorrt.md)."),
    Section("Core ML", "See [targets/coreml.md](targets/coreml.md)."),
    Section("Core AI", "See [targets/coreai.md](targets/coreai.md): Apple's Core AI runtime, here the CPU runtime "
            "the coreai-core wheel carries on Linux."),
    Section("Upstream parity", "edgelin's reference and its ONNX export against the library a checkpoint came "
            "from (see [checkpoints.md](checkpoints.md))."),
)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading."""
    return re.sub(r"[^a-z0-9 -]", "", heading.lower()).replace(" ", "-")


def load(folder: Path = RESULTS) -> list[dict]:
    results = []
    for path in sorted(folder.glob("*.json")):
        data = json.loads(path.read_text(encoding="utf-8"))
        missing = [k for k in REQUIRED if not data.get(k)]
        if missing:
            raise ValueError(f"{path.name}: missing or empty {', '.join(missing)}")
        if data["id"] != path.stem:
            raise ValueError(f"{path.name}: id {data['id']!r} is not the file's name")
        if data["topic"] not in {slug(s.heading) for s in SECTIONS}:
            raise ValueError(f"{path.name}: topic {data['topic']!r} is no section of the page")
        if data.get("image") and not (PAGE.parent / data["image"]).is_file():
            raise ValueError(f"{path.name}: image {data['image']} is not under docs/")
        width = len(data["columns"])
        if any(len(row) != width for row in data["rows"]):
            raise ValueError(f"{path.name}: a row does not have the {width} columns")
        results.append(data)
    return results


def cell(text: str) -> str:
    return str(text).replace("|", "\\|")


def table(result: dict) -> list[str]:
    lines = ["| " + " | ".join(cell(c) for c in result["columns"]) + " |",
             "|" + "---|" * len(result["columns"])]
    lines += ["| " + " | ".join(cell(c) for c in row) + " |" for row in result["rows"]]
    return lines


def render(results: list[dict]) -> str:
    out = ["# Performance", "",
           "<!-- Generated by `python bench/performance_doc.py` from bench/results/*.json: edit those and rerun "
           "(tests/test_performance_doc.py checks this page). -->", "",
           "The current numbers only: each table is the latest measurement of its kind, with the command that "
           "produced it, the commit and the machine. Earlier rounds of work are in git history "
           "(`git log -p -- docs/benchmarks.md`). Compare figures within a table: the shared CPU machine's speed "
           "drifts by up to 3x over a day.", ""]
    out += [f"- [{s.heading}](#{slug(s.heading)})" for s in SECTIONS] + [""]
    for section in SECTIONS:
        mine = [r for r in results if r["topic"] == slug(section.heading)]
        out += [f"## {section.heading}", "", section.intro, ""]
        for result in mine:
            out += [f"### {result['title']}", "",
                    f"- Command: `{result['command']}`",
                    f"- Commit: `{result['commit']}` ({result['date']})",
                    f"- Machine: {result['machine']}",
                    f"- Method: {result['method']}",
                    f"- Recorded first in: {result['source']}", ""]
            out += table(result) + [""]
            if result.get("image"):  # a plot of the same run, beside the page (docs/img/)
                out += [f"![{result['title']}]({result['image']})", ""]
            if result.get("notes"):
                out += [result["notes"], ""]
    return "\n".join(out).rstrip("\n") + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if the page differs from the rendering")
    args = parser.parse_args()
    text = render(load())
    if args.check:
        same = PAGE.exists() and PAGE.read_text(encoding="utf-8") == text
        print("docs/performance.md is current" if same else "docs/performance.md differs: run "
              "python bench/performance_doc.py", file=sys.stderr)
        return 0 if same else 1
    PAGE.write_text(text, encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
