"""`edgelin export`: checkpoint -> target graphs + manifest.json, written atomically."""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from edgelin.checkpoint import TOKENIZER, load_model
from edgelin.devices import DeviceProfile
from edgelin.errors import EdgelinError
from edgelin.export.base import ExportOptions
from edgelin.export.graphs import GRAPHS, graph_io
from edgelin.export.manifest import GraphEntry, Manifest
from edgelin.export.targets import get_target
from edgelin.model.lm import CausalLM


@dataclass(frozen=True)
class ExportResult:
    folder: Path
    manifest: Manifest
    files: dict[str, str]


def prepare_output(out: Path, force: bool) -> None:
    if out.exists() and not force:
        raise EdgelinError(f"output folder {out} already exists", "edgelin never overwrites an export silently",
                           "pick another --out, or pass --force to replace it")
    if out.exists() and not out.is_dir():
        raise EdgelinError(f"output {out} is a file", "an export is a folder", "pick another --out")


def build_manifest(model: CausalLM, target: str, precision: str, files: dict[str, str], source: dict,
                   tokenizer: str | None) -> Manifest:
    graphs = {}
    for kind in GRAPHS:
        inputs, outputs = graph_io(model, kind)
        graphs[kind] = GraphEntry(files[kind], tuple(inputs), tuple(outputs))
    layers = tuple(
        {"index": i, "type": t, "state": [s.name for s in model.state_tensors()[i]]}
        for i, t in enumerate(model.config.layer_types)
    )
    return Manifest(
        target=target, precision=precision, graphs=graphs, layers=layers,
        vocab_size=model.config.vocab_size, needs_position=model.needs_position, source=source,
        tokenizer=tokenizer, bos_token_id=model.config.bos_token_id, eos_token_id=model.config.eos_token_id,
        num_parameters=model.num_parameters(),
    )


def export_model(model: CausalLM, out: Path, target_name: str, source: dict, tokenizer: Path | None = None,
                 force: bool = False, device: DeviceProfile | None = None,
                 options: ExportOptions = ExportOptions()) -> ExportResult:
    out = Path(out)
    target = get_target(target_name)
    reason = target.unavailable_reason()
    if reason:
        raise EdgelinError(f"target {target.name} is not available here", reason,
                           f"install edgelin[{target.extra}] or pick another --target")
    reason = target.supports(model, device)
    if reason:
        raise EdgelinError(f"target {target.name} cannot take this model", reason,
                           "pick another --target or --device (edgelin devices lists them)")
    prepare_output(out, force)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.partial-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        files = target.export(model, tmp, options)
        if tokenizer is not None:
            shutil.copyfile(tokenizer, tmp / TOKENIZER)
        manifest = build_manifest(model, target.name, options.precision, files, source,
                                  TOKENIZER if tokenizer is not None else None)
        manifest.save(tmp)
        if out.exists():
            old = out.parent / f".{out.name}.old-{os.getpid()}"
            out.rename(old)
            tmp.rename(out)
            shutil.rmtree(old, ignore_errors=True)
        else:
            tmp.rename(out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return ExportResult(out, manifest, files)


def export_checkpoint(checkpoint: Path, out: Path, target: str = "onnx", force: bool = False,
                      device: DeviceProfile | None = None, options: ExportOptions = ExportOptions()) -> ExportResult:
    model, info = load_model(checkpoint)
    source = {"path": str(info.path), "sha256": info.sha256, "format": info.format, "model_type": info.model_type}
    return export_model(model, out, target, source, info.tokenizer, force, device, options)
