"""Baselines exported next to a model (`edgelin export ... --baseline kv`), so that `edgelin bench DIR
--baseline kv` runs on a device: no torch, no export at bench time.

kv: a transformer of the same width, depth and heads with a growing KV cache (full softmax attention,
`window = None`), random weights (latency and memory do not depend on weight values; seeded, so
two exports of one model write the same baseline), exported with the same target and device
settings into DIR/baseline-kv/, an export folder of its own (manifest, graphs, reference vectors).
The parent manifest records it in `extra["baselines"]` ({"kv": "baseline-kv"}) and in `files`.

This module is the format (the names, the manifest entry) and its reading, torch-free: bench reads
`baseline_folder`; edgelin/export/baselines.py builds and exports the baseline model (torch).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from edgelin.errors import EdgelinError

if TYPE_CHECKING:
    from edgelin.artifact.manifest import Manifest

BASELINES = {"kv": "baseline-kv"}  # --baseline NAME -> its folder inside the export
MANIFEST_KEY = "baselines"
BASELINE_SOURCE = {"path": "(random-weight KV-cache baseline)", "sha256": "", "format": "edgelin",
                   "model_type": "edgelin"}


def check_names(names: Sequence[str]) -> None:
    for name in names:
        if name not in BASELINES:
            raise EdgelinError(f"unknown baseline {name!r}", f"the baselines are: {', '.join(BASELINES)}",
                               "use --baseline kv")


def baseline_folder(folder: Path, manifest: "Manifest", name: str) -> Path:
    """The folder of baseline `name` inside an export, or one line saying to re-export with it."""
    check_names([name])
    entry = manifest.extra.get(MANIFEST_KEY)
    sub = entry.get(name) if isinstance(entry, dict) else None
    if sub is None:
        raise EdgelinError(f"{folder} has no {name} baseline", f"--baseline {name} runs the baseline exported "
                           f"with the model (nothing is exported at bench time)",
                           f"re-export with --baseline {name}")
    if not isinstance(sub, str) or Path(sub).name != sub or sub in ("", ".", ".."):
        raise EdgelinError(f"{folder}/manifest.json is malformed", f"baseline folder {sub!r} escapes the export "
                           "folder", f"re-export with --baseline {name}")
    path = Path(folder) / sub
    if not path.is_dir():
        raise EdgelinError(f"the {name} baseline {path} is missing", "the manifest lists it",
                           f"re-export with --baseline {name}")
    return path
