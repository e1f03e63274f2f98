"""The CUDA step launcher's ABI version, read from its header: the one source of the number. Torch-free,
so the TensorRT plugin build and check (edgelin.plugins.tensorrt) share it with the torch extension."""

from __future__ import annotations

import re
from pathlib import Path

from edgelin.errors import EdgelinError

CUDA_DIR = Path(__file__).parent / "cuda"


def header_abi_version() -> int:
    """EDGELIN_STEP_ABI_VERSION as edgelin_step.h defines it."""
    match = re.search(r"#define EDGELIN_STEP_ABI_VERSION (\d+)", (CUDA_DIR / "edgelin_step.h").read_text())
    if match is None:
        raise EdgelinError("edgelin_step.h has no EDGELIN_STEP_ABI_VERSION", "the installed header is damaged",
                           "reinstall edgelin")
    return int(match.group(1))
