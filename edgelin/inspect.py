"""`edgelin inspect`: what a checkpoint is, what it costs per sequence, and where it can go; on an
export folder what it holds (no torch: a runtime-only install inspects the folders it runs)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from edgelin.devices import check_state_dims, export_settings, load_devices
from edgelin.errors import EdgelinError
from edgelin.export.targets import get_target, target_names
from edgelin.tokenizer import TOKENIZER, tokenizer_status

if TYPE_CHECKING:
    from edgelin.model.lm import CausalLM


@dataclass
class InspectReport:
    path: str
    model_type: str | None
    source: str  # edgelin | fla | transformers | unsupported
    supported: bool
    reason: str | None = None
    fix: str | None = None
    note: str = ""
    layers: list[dict] = field(default_factory=list)
    num_parameters: int = 0
    state_bytes_per_sequence: int = 0
    kv_bytes_per_token: int = 0  # growing KV caches (full-context softmax layers)
    targets: list[dict] = field(default_factory=list)  # device x target -> ok / reason
    inert_fields: list[str] = field(default_factory=list)  # config.json fields upstream never reads (accepted)
    tokenizer: str = "missing"  # ok | missing | corrupt: REASON
    warnings: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        return asdict(self)


def _state_costs(model: CausalLM) -> tuple[int, int]:
    fixed = per_token = 0
    for layer in model.state_tensors():
        for t in layer:
            size = 4  # float32
            for d in t.dims:
                size *= 1 if isinstance(d, str) else d
            if "past_sequence" in t.dims:
                per_token += size
            else:
                fixed += size
    return fixed, per_token


def _placements(model: CausalLM) -> list[dict]:
    rows = []
    for device in load_devices().values():
        for name in device.targets:
            if name not in target_names():
                rows.append({"device": device.name, "target": name, "ok": False,
                             "reason": f"the {name} target is not implemented in this edgelin version"})
                continue
            target = get_target(name)
            export_phase = target.can_export()  # whether this machine can export it (build and run may differ)
            reason = target.supports(model, device) or (None if export_phase.ok else export_phase.reason)
            if reason is None:  # what the profile asks (precision, state dtype, dim multiples): as export decides
                try:
                    settings = export_settings(device, name)
                    if not getattr(target, "pads_state_dims", False):  # Core ML pads the state instead
                        check_state_dims(model.state_tensors(), settings)
                except EdgelinError as exc:
                    reason = f"{exc.why} ({exc.fix})"
            rows.append({"device": device.name, "target": name, "ok": reason is None, "reason": reason})
    return rows


def inspect_checkpoint(path: Path) -> InspectReport:
    from edgelin.checkpoint import checkpoint_dir, describe_model, read_config

    path = checkpoint_dir(Path(path))
    data = read_config(path)
    model_type = data.get("model_type")
    try:
        model, info = describe_model(path)  # from config.json and the weights' headers: nothing else is read
    except EdgelinError as exc:
        tokenizer = path / TOKENIZER
        return InspectReport(str(path), model_type, "unsupported", False, reason=f"{exc.what}: {exc.why}", fix=exc.fix,
                             tokenizer=tokenizer_status(tokenizer if tokenizer.is_file() else None, None))
    note = ""
    if info.format != "edgelin":
        from edgelin.convert import get_converter

        note = get_converter(model_type, str(path)).note
    fixed, per_token = _state_costs(model)
    layers = [{"index": i, "type": t, "state": [s.name for s in model.state_tensors()[i]]}
              for i, t in enumerate(model.config.layer_types)]
    tokenizer = tokenizer_status(info.tokenizer, model.config.vocab_size)
    return InspectReport(str(path), model_type, info.format, True, None, None, note, layers,
                         model.num_parameters(), fixed, per_token, _placements(model),
                         inert_fields=list(info.inert_fields), tokenizer=tokenizer,
                         warnings=tokenizer_warnings(path, tokenizer))


def tokenizer_warnings(path: Path, status: str) -> list[str]:
    """What export will say about the tokenizer: a missing one is a warning, a corrupt one a refusal."""
    if status == "missing":
        return [f"no {TOKENIZER} in {path}: the export will have no tokenizer, so generate will need one"]
    if status.startswith("corrupt"):
        return [f"{path / TOKENIZER} is {status}: export refuses it; repair it or pass --no-tokenizer"]
    return []


@dataclass
class ExportInspectReport:
    """`edgelin inspect DIR` on an export folder: what it holds and its bytes on disk (no runtime needed)."""

    path: str
    target: str
    precision: dict  # manifest extra["precision"]: the dtype of weights, compute, recurrence, state, logits
    quantization: dict | None
    files: dict[str, int]  # every file under the folder -> bytes
    runtime_bytes: int  # what a runner loads: graphs + weights file
    total_bytes: int
    weights: dict | None  # manifest extra["weights"]: the one weights file both graphs read

    def to_dict(self) -> dict:
        return asdict(self)


def inspect_export(folder: Path) -> ExportInspectReport:
    from edgelin.bench import disk_usage, files_bytes, runtime_files
    from edgelin.artifact.manifest import Manifest

    manifest = Manifest.load(folder)  # checked: a malformed or inconsistent manifest is one line
    files = disk_usage(folder)
    precision = manifest.extra.get("precision") or {"graphs": manifest.precision}
    return ExportInspectReport(str(folder), manifest.target, precision, manifest.extra.get("quantization"), files,
                               files_bytes(files, runtime_files(manifest)), folder_bytes(folder),
                               manifest.extra.get("weights"))


def folder_bytes(folder: Path) -> int:
    """Bytes a folder takes on disk, a file hard-linked twice inside it (the Triton repository's
    weights) counted once."""
    stats = (p.stat() for p in Path(folder).rglob("*") if p.is_file())
    return sum({(s.st_dev, s.st_ino): s.st_size for s in stats}.values())
