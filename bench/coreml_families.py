"""Every family and the hybrid through the Core ML target, both state styles: converted, then the
recorded reference replayed through the package's MIL program in numpy (`edgelin validate DIR`).

    python bench/coreml_families.py [--families gla,hybrid] [--styles explicit,mlstate] [--json]

Tiny random models (tests/conftest.py sizes, chunk size 8), one prefill length (12: a full chunk and a
partial one; the replay's 15-token prompt is prefill_12 + 3 steps), batch 1 and 3, 24 steps:
- explicit: fp32 compute, float32 state;
- mlstate: fp16 compute, float16 state (MLState), exported only where the measured fp16-state verdict
  (edgelin/precision/state_precision.toml) allows it; elsewhere the row is the export's refusal.
The figure is the worst max-relative error over every replay check (logits and states). A check of the
conversion, not of Apple's runtime (that needs a Mac). docs/performance.md#core-ml records a run.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PREFILL = 12
CHUNK = 8


def tiny_checkpoint(folder: Path, family: str) -> Path:
    sys.path.insert(0, str(ROOT / "tests"))
    from helpers import make_checkpoint  # the test suite's tiny configs

    return make_checkpoint(folder, family, tokenizer=False, chunk_size=CHUNK)


def run_one(root: Path, family: str, style: str) -> dict:
    from edgelin.devices import ExportSettings
    from edgelin.errors import EdgelinError
    from edgelin.export.coreml.target import CoremlOptions
    from edgelin.export.pipeline import export_checkpoint
    from edgelin.replay import replay

    ckpt = root / f"{family}-ckpt"
    if not ckpt.exists():
        tiny_checkpoint(ckpt, family)
    settings = ExportSettings(precision="fp32", state_dtype="float32") if style == "explicit" else \
        ExportSettings(precision="fp16", state_dtype="float16")
    start = time.process_time()
    try:
        folder = export_checkpoint(ckpt, root / f"{family}-{style}", "coreml",
                                   options=CoremlOptions(style, (PREFILL,)), settings=settings).folder
    except EdgelinError as err:
        return {"family": family, "style": style, "refused": f"{err.what}: {err.why}"}
    exported = time.process_time() - start
    report = replay(folder)
    return {"family": family, "style": style, "passed": report.passed, "threshold": report.threshold,
            "worst": max(m.max_rel for m in report.metrics), "export_cpu_s": round(exported, 1),
            "replay_cpu_s": round(time.process_time() - start - exported, 1)}


def main() -> None:
    from edgelin.families import FAMILIES

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--families", default=",".join([*FAMILIES, "hybrid"]))
    parser.add_argument("--styles", default="explicit,mlstate")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    import torch

    torch.set_num_threads(1)
    rows = []
    with tempfile.TemporaryDirectory(prefix="coreml-families-") as tmp:
        for family in args.families.split(","):
            for style in args.styles.split(","):
                rows.append(run_one(Path(tmp), family, style))
                if not args.json:
                    print(f"progress: {family} {style} done", file=sys.stderr)
    if args.json:
        print(json.dumps(rows, indent=2))
        return
    print("| family | style | worst error (threshold) | export CPU s |")
    print("| --- | --- | --- | --- |")
    for r in rows:
        figure = f"refused: {r['refused']}" if "refused" in r else \
            f"{r['worst']:.1e} ({r['threshold']:g}){'' if r['passed'] else ' FAILED'}"
        print(f"| {r['family']} | {r['style']} | {figure} | {r.get('export_cpu_s', '')} |")


if __name__ == "__main__":
    main()
