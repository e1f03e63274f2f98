"""The torch export's contract, torch.json (written by the target, read by the runner): which files hold
the model, their size and sha256, the precision. No torch here."""

from __future__ import annotations

import json
from pathlib import Path

from edgelin.errors import EdgelinError

CONFIG = "config.json"
WEIGHTS = "model.safetensors"
CONTRACT = "torch.json"
CONTRACT_FORMAT = "edgelin-torch"
CONTRACT_VERSION = 1
PRECISIONS = ("fp32", "fp16")  # the weights it writes (the vocabulary's bf16 is the coreai target's)


def read_contract(folder: Path) -> dict:
    """torch.json, checked: the files it names sit in the folder, the weights at their recorded size."""
    path = Path(folder) / CONTRACT
    if not path.is_file():
        raise EdgelinError(f"{path} is missing", "a torch export keeps its contract there",
                           "copy the whole export folder, or re-run `edgelin export --target torch`")
    try:
        data = json.loads(path.read_text())
        if data.get("format") != CONTRACT_FORMAT or data.get("version") != CONTRACT_VERSION:
            raise ValueError(f"format {data.get('format')!r} version {data.get('version')!r}")
        names = [data["config"], data["weights"]]
        if any(not isinstance(n, str) or Path(n).name != n or n in (".", "..") for n in names):
            raise ValueError(f"file names {names!r} must name files inside the folder")
        if not isinstance(data["bytes"], int) or data.get("precision") not in PRECISIONS:
            raise ValueError("bytes must be an integer and precision fp32 or fp16")
    except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError, ValueError, AttributeError) as exc:
        raise EdgelinError(f"{path} is malformed", f"{type(exc).__name__}: {exc}",
                           "re-run `edgelin export --target torch`") from exc
    for name in names:
        if not (Path(folder) / name).is_file():
            raise EdgelinError(f"{Path(folder) / name} is missing", f"{CONTRACT} lists it",
                               "copy the whole export folder, or re-run `edgelin export --target torch`")
    actual = (Path(folder) / data["weights"]).stat().st_size
    if actual != data["bytes"]:
        raise EdgelinError(f"{Path(folder) / data['weights']} has {actual} bytes, {CONTRACT} says {data['bytes']}",
                           "the file is truncated or belongs to another export", "re-run `edgelin export`")
    return data
