"""`edgelin export`: checkpoint -> target graphs + manifest.json, written atomically."""

from __future__ import annotations

import dataclasses
import shutil
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from edgelin.checkpoint import TOKENIZER, load_model
from edgelin.devices import DeviceProfile, ExportSettings, check_state_dims, export_settings
from edgelin.errors import EdgelinError
from edgelin.export.base import Artifact, phase_refusal
from edgelin.export.graphs import GRAPHS, graph_io
from edgelin.export.manifest import MANIFEST, GraphEntry, Manifest
from edgelin.export.targets import get_target
from edgelin.model.lm import CausalLM
from edgelin.outputs import EXPORT, check_output, claim_output


@dataclass(frozen=True)
class ExportResult(Artifact):
    """The exported folder (an Artifact: folder, manifest, files) and what the export noticed."""

    inert_fields: tuple[str, ...] = ()  # config.json fields the upstream model never reads (accepted, listed)
    warnings: tuple[str, ...] = ()  # e.g. no tokenizer to ship


def prepare_output(out: Path, force: bool, protected: Sequence[Path] = ()) -> Path:
    """Refuse an --out that would lose data (see edgelin.outputs); returns it resolved. No side effects."""
    return check_output(out, force, EXPORT, protected)


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
                 force: bool = False, device: DeviceProfile | None = None, options: Any = None,
                 protected: Sequence[Path] = (), settings: ExportSettings | None = None,
                 baselines: Sequence[str] = ()) -> ExportResult:
    """The export phase: `target.export(model, device, settings, options, tmp)` into a temp folder, then
    the manifest, renamed into place. `options`: the target's own options (its `options_type`, e.g.
    OnnxOptions); None: its defaults. `settings` (precision, state dtype) come from
    edgelin.devices.export_settings, the one place that reads a device profile (default: `device`'s).
    `baselines`: names of edgelin.export.baselines.BASELINES to export inside the folder (--baseline kv)."""
    from edgelin.export import baselines as baseline_exports, reference_vectors

    baseline_exports.check_names(baselines)
    out = Path(out)
    target = get_target(target_name)
    phase = target.can_export()
    if not phase.ok:
        raise phase_refusal(target, "export", phase, "pick another --target")
    reason = target.supports(model, device)
    if reason:
        raise EdgelinError(f"target {target.name} cannot take this model", reason,
                           "pick another --target or --device (edgelin devices lists them)")
    options = target.default_options() if options is None else options
    if not isinstance(options, target.options_type):
        raise EdgelinError(f"export options of type {type(options).__name__}",
                           f"the {target.name} target takes {target.options_type.__name__}",
                           f"pass {target.options_type.__name__}(...) or no options")
    settings = settings or export_settings(device, target.name)
    check_state_dims(model.state_tensors(), settings)
    # The source checkpoint is protected: --out may not be it, sit inside it, or contain it.
    protected = tuple(protected) + ((Path(source["path"]),) if Path(str(source.get("path"))).is_dir() else ())
    with claim_output(out, force, EXPORT, protected) as tmp:
        files = target.export(model, device, settings, options, tmp)
        if tokenizer is not None:
            shutil.copyfile(tokenizer, tmp / TOKENIZER)
        manifest = build_manifest(model, target.name, settings.precision, files, source,
                                  TOKENIZER if tokenizer is not None else None)
        # What `validate DIR` and `bench DIR --baseline kv` run on a device, without torch or the checkpoint.
        reference = reference_vectors.record(model, tmp, manifest)
        written = baseline_exports.export_baselines(model, tmp, baselines, lambda m, o: export_model(
            m, o, target.name, baseline_exports.BASELINE_SOURCE, device=device, options=options, settings=settings))
        recorded = {reference_vectors.MANIFEST_KEY: reference_vectors.manifest_entry(tmp, reference),
                    **({baseline_exports.MANIFEST_KEY: written} if written else {})}
        # Record every file written, so a later --force knows the whole folder is ours.
        device_entry = {"device": settings.manifest_entry()} if settings.device else {}
        manifest = dataclasses.replace(manifest, files=tuple(sorted({p.name for p in tmp.iterdir()} | {MANIFEST})),
                                       extra={**manifest.extra, **device_entry, **recorded})
        manifest.save(tmp)
    return ExportResult(out, manifest, files)


def export_checkpoint(checkpoint: Path, out: Path, target: str = "onnx", force: bool = False,
                      device: DeviceProfile | None = None, options: Any = None,
                      include_tokenizer: bool = True, settings: ExportSettings | None = None,
                      baselines: Sequence[str] = ()) -> ExportResult:
    """`include_tokenizer=False` (--no-tokenizer): the checkpoint's tokenizer is neither checked nor copied.
    `baselines`: see export_model."""
    from dataclasses import replace

    from edgelin.export.baselines import check_names
    from edgelin.tokenizer import check_tokenizer

    check_names(baselines)  # before the checkpoint loads
    model, info = load_model(checkpoint)
    warnings: list[str] = []
    tokenizer = info.tokenizer if include_tokenizer else None
    if tokenizer is not None:  # before any work: a corrupt tokenizer would only surface in generate
        check_tokenizer(tokenizer, model.config.vocab_size)
    elif include_tokenizer:
        warnings.append(f"no {TOKENIZER} in {info.path}: the export has no tokenizer, so generate will need one")
    source = {"path": str(info.path), "sha256": info.sha256, "format": info.format, "model_type": info.model_type}
    result = export_model(model, out, target, source, tokenizer, force, device, options, settings=settings,
                          baselines=baselines)
    return replace(result, inert_fields=tuple(info.inert_fields), warnings=tuple(warnings))
