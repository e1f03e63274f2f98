"""`edgelin export`'s request: one frozen object with the choices every target takes and the target's own flags
as given, checked in one place before the checkpoint loads, then handed to the pipeline. No torch here: a machine
without the exporter's libraries is told so in one line by the target's export phase."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from edgelin.errors import EdgelinError
from edgelin.export.phases import export_phases

if TYPE_CHECKING:
    from edgelin.devices import DeviceProfile, ExportSettings
    from edgelin.export.pipeline import ExportResult, Progress


@dataclass(frozen=True)
class ExportRequest:
    """One `edgelin export`: the choices every target takes, and the target's own flags as given
    (`target_flags`: {field: value} of its TargetFlags that were passed; the target validates them)."""

    checkpoint: Path
    out: Path
    target: str
    force: bool = False
    device: str | None = None  # a device profile's name (edgelin devices)
    precision: str | None = None
    quantize: str | None = None
    block_size: int | None = None
    text: Path | None = None
    include_tokenizer: bool = True
    baselines: tuple[str, ...] = ()
    serve: str | None = None
    target_flags: Mapping[str, Any] = field(default_factory=dict)

    def phases(self) -> list[str]:
        return export_phases(self.baselines, self.serve)


def flag_owners() -> dict[str, tuple[str, list[str]]]:
    """{field of a target's export flag: (the flag, the targets that declare it)}, over every registered target."""
    from edgelin.export.targets import get_target, target_names

    owners: dict[str, tuple[str, list[str]]] = {}
    for name in target_names():
        for flag in get_target(name).flags:
            owners.setdefault(flag.field, (flag.flag, []))[1].append(name)
    return owners


@dataclass(frozen=True)
class PreparedExport:
    """A checked request: the target's options from its flags, the device profile and the export settings."""

    request: ExportRequest
    options: Any
    device: "DeviceProfile | None"
    settings: "ExportSettings"

    def run(self, on_progress: "Progress | None" = None) -> "ExportResult":
        """The export (edgelin.export.pipeline.export_checkpoint; its imports, torch among them, only now)."""
        from edgelin.export import pipeline

        r = self.request
        return pipeline.export_checkpoint(r.checkpoint, r.out, r.target, r.force, self.device, options=self.options,
                                          include_tokenizer=r.include_tokenizer, settings=self.settings,
                                          baselines=r.baselines, text=r.text, serve=r.serve, on_progress=on_progress)


def prepare_export(request: ExportRequest) -> PreparedExport:
    """Everything about the request that can be refused before the checkpoint loads, in one line each: the
    target's export phase, the common choices (edgelin.devices.export_settings), the held-out text, and the
    target's own flags (a flag of another target named as such)."""
    from edgelin.devices import export_settings, get_device
    from edgelin.export.base import phase_refusal
    from edgelin.export.targets import get_target

    target = get_target(request.target)
    phase = target.can_export()  # before the exporter's own imports (torch): one line if missing
    if not phase.ok:
        raise phase_refusal(target, "export", phase, "pick another --target")
    device = get_device(request.device) if request.device is not None else None
    if request.block_size is not None and request.quantize is None:
        raise EdgelinError(f"--block-size {request.block_size} without --quantize", "the block size is a quantisation "
                           "setting; unquantised weights have no blocks", "add --quantize int4 (or int8), or drop "
                           "--block-size")
    if request.block_size is not None and request.quantize == "fp16":
        raise EdgelinError(f"--block-size {request.block_size} with --quantize fp16", "float16 weights are stored one "
                           "by one, not in blocks", "drop --block-size, or use --quantize int4 (or int8)")
    settings = export_settings(device, target.name, request.precision, request.quantize, request.block_size,
                               request.force)
    if request.text is not None:
        from edgelin.data import read_text

        read_text(request.text)  # empty, binary or not UTF-8: one line, before the checkpoint loads
    foreign = [name for name in request.target_flags if name not in {flag.field for flag in target.flags}]
    if foreign:  # another target's flag: named with its owner, as one line
        owners = flag_owners()
        names = [owners[name][0] if name in owners else name for name in foreign]
        where = sorted({owner for name in foreign for owner in owners.get(name, ("", []))[1]}) or ["another"]
        raise EdgelinError(f"{'/'.join(names)} appl{'ies' if len(names) == 1 else 'y'} to --target "
                           f"{' or '.join(where)} only, not {target.name}",
                           f"{'it is' if len(names) == 1 else 'they are'} the {' and '.join(where)} target's own "
                           "option" + ("" if len(names) == 1 else "s"), f"drop {', '.join(names)}")
    options, settings = target.options_from_flags(dict(request.target_flags), settings, request.precision)
    return PreparedExport(request, options, device, settings)


def run_export(request: ExportRequest, on_progress: "Progress | None" = None) -> "ExportResult":
    """`edgelin export` from Python: the request checked (prepare_export), then run."""
    return prepare_export(request).run(on_progress)
