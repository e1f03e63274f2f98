"""What an export needs of the machine, estimated from the config before the checkpoint loads, and refused in one
line when the machine lacks it: a 2 B-parameter model's export holds several float32 copies of its weights at
peak and writes a few more to disk, and running out of either half-way costs the user many minutes (or the OOM
killer ends the process with nothing said).

The estimate is the model's float32 bytes times the target's measured factors (Target.export_memory_factor,
Target.export_disk_factor; docs/benchmarks.md, "Export cost") plus the process's own footprint.
"""

from __future__ import annotations

import shutil
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

from edgelin.environment import available_memory
from edgelin.errors import EdgelinError

if TYPE_CHECKING:
    from edgelin.devices import ExportSettings
    from edgelin.export.base import Target
    from edgelin.model.config import ModelConfig

PROCESS_BYTES = 3 << 29  # 1.5 GiB: Python, torch, onnx and ONNX Runtime loaded, the tracer's own tables
GiB = 1 << 30


@dataclass(frozen=True)
class ExportNeeds:
    """Peak memory and disk an export is estimated to need, with what they were estimated from."""

    parameters: int
    float32_bytes: int
    memory: int
    disk: int


def estimate(config: "ModelConfig", target: "Target", settings: "ExportSettings") -> ExportNeeds:
    from edgelin.checkpoint import float32_footprint

    parameters, weights = float32_footprint(config)
    memory = int(weights * target.export_memory_factor(settings)) + PROCESS_BYTES
    disk = int(weights * target.export_disk_factor(settings))
    return ExportNeeds(parameters, weights, memory, disk)


def lighter_exports(config: "ModelConfig", target: "Target", settings: "ExportSettings") -> list[tuple[str, ExportNeeds]]:
    """The estimates of `target`'s weight quantisations other than the one asked for, most memory first (the
    closest to the float weights first): what a refusal offers instead."""
    others = [(mode, estimate(config, target, replace(settings, quantize=mode)))
              for mode in target.quantize_modes if mode != settings.quantize]
    return sorted(others, key=lambda entry: -entry[1].memory)


def free_disk(out: Path) -> int | None:
    """Free bytes on the file system `out` will be written to (its nearest existing parent)."""
    where = Path(out).absolute()
    while not where.exists() and where != where.parent:
        where = where.parent
    try:
        return shutil.disk_usage(where).free
    except OSError:
        return None


def check_resources(needs: ExportNeeds, out: Path, target: str, force: bool = False,
                    lighter: Sequence[tuple[str, ExportNeeds]] = ()) -> None:
    """Refuse, in one line, an export this machine has not the memory or the disk for (with the estimate and
    what is there; `lighter`: the estimates of the target's weight quantisations, (mode, needs), most memory
    first: the first that fits is named as what would). `force` lets the memory check pass (the estimate is conservative; swap may carry
    it); a full disk is never forced."""
    size = f"{needs.parameters / 1e9:.2f} B parameters, {needs.float32_bytes / GiB:.1f} GiB in float32"
    memory = available_memory()
    if memory is not None and needs.memory > memory and not force:
        fits = [f"--quantize {mode} (about {other.memory / GiB:.1f} GiB)" for mode, other in lighter
                if other.memory <= memory and other.memory < needs.memory]
        instead = f"export with {fits[0]}, " if fits else ""
        raise EdgelinError(f"exporting this model ({size}) to {target} needs about {needs.memory / GiB:.1f} GiB of "
                           f"memory at peak", f"this machine has {memory / GiB:.1f} GiB available",
                           f"{instead}close other programs or export on a machine with more memory (--force tries "
                           "anyway)")
    disk = free_disk(out)
    if disk is not None and needs.disk > disk:
        raise EdgelinError(f"exporting this model ({size}) to {target} writes about {needs.disk / GiB:.1f} GiB",
                           f"{Path(out).absolute().parent} has {disk / GiB:.1f} GiB free",
                           "free disk space or pass an --out on a larger disk")
