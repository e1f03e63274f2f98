"""`edgelin export`: checkpoint -> target graphs + manifest.json, written atomically."""

from __future__ import annotations

import dataclasses
import shutil
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

# export_model's on_progress(done, total, what): the phases a progress bar counts
Progress = Callable[[int, int, str], None]

from edgelin.checkpoint import TOKENIZER, load_model
from edgelin.devices import DeviceProfile, ExportSettings, check_state_dims, export_settings
from edgelin.errors import EdgelinError
from edgelin.export.base import Artifact, phase_refusal
from edgelin.export.graphs import GRAPHS, graph_io
from edgelin.artifact.manifest import MANIFEST, GraphEntry, Manifest
from edgelin.export.phases import export_phases, reporting
from edgelin.export.targets import get_target
from edgelin.integrity import digest_folder
from edgelin.model.lm import CausalLM, beyond_range
from edgelin.outputs import EXPORT, check_output, claim_output, files_below


@dataclass(frozen=True)
class ExportResult(Artifact):
    """The exported folder (an Artifact: folder, manifest, files) and what the export noticed."""

    inert_fields: tuple[str, ...] = ()  # config.json fields the upstream model never reads (accepted, listed)
    warnings: tuple[str, ...] = ()  # e.g. no tokenizer to ship


def prepare_output(out: Path, force: bool, protected: Sequence[Path] = ()) -> Path:
    """Refuse an --out that would lose data (see edgelin.outputs); returns it resolved. No side effects."""
    return check_output(out, force, EXPORT, protected)


def build_manifest(model: CausalLM, target: str, precision: str, files: dict[str, str], source: dict,
                   tokenizer: str | None, state_dtype: str = "float32") -> Manifest:
    graphs = {}
    for kind in GRAPHS:
        inputs, outputs = graph_io(model, kind, state_dtype)
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


def precision_entry(settings: ExportSettings) -> dict[str, str | int | None]:
    """manifest extra["precision"]: the dtype of each kind of tensor in the graphs. The state I/O, the
    recurrence (its state, decay and gates) and the logits are float32 at every precision; `weights`
    is the float dtype of the weights that are not quantised (norms, decay parameters; also the embedding
    table and LM head unquantised, or quantised with --keep-embeddings-float: extra["quantization"] lists them)."""
    low = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16"}[settings.precision]
    return {"graphs": settings.precision, "weights": low, "quantized_weights": settings.quantize,
            "block_size": settings.block_size if settings.quantize in ("int8", "int4") else None, "compute": low,
            "recurrence": "float32", "state": settings.state_dtype, "logits": "float32"}


def weights_entries(folder: Path, files: dict[str, str], settings: ExportSettings) -> dict[str, Any]:
    """The manifest's account of a target's weights file (ONNX: one weights.bin both graphs read), read
    off the written files: extra["weights"], ["precision"] and, when quantised, ["quantization"]."""
    from edgelin.export import quantize, weights

    if weights.WEIGHTS_KEY not in files:  # a target that keeps weights its own way
        return {}
    graph_files = {kind: files[kind] for kind in GRAPHS}
    quantized = quantize.describe(folder, graph_files)
    return {weights.WEIGHTS_KEY: weights.describe(folder, list(graph_files.values()), files[weights.WEIGHTS_KEY]),
            "precision": precision_entry(settings), **({"quantization": quantized} if quantized else {})}


def export_model(model: CausalLM, out: Path, target_name: str, source: dict, tokenizer: Path | None = None,
                 force: bool = False, device: DeviceProfile | None = None, options: Any = None,
                 protected: Sequence[Path] = (), settings: ExportSettings | None = None,
                 baselines: Sequence[str] = (), text: Path | None = None, serve: str | None = None,
                 on_progress: Progress | None = None, consume_model: bool = False) -> ExportResult:
    """The export phase: `target.export(model, device, settings, options, tmp)` into a temp folder, then
    the manifest, renamed into place. `options`: the target's own options (its `options_type`, e.g.
    OnnxOptions); None: its defaults. `settings` (precision, state dtype) come from
    edgelin.devices.export_settings, the one place that reads a device profile (default: `device`'s).
    `baselines`: names of edgelin.artifact.baselines.BASELINES to export inside the folder (--baseline kv).
    `text`: held-out text for the recorded quality figures (--text FILE; default: the checkpoint's recipe
    validation split, else random tokens). The quality gate's result (fp16/quantised exports) goes into
    extra["quality"], and a check failed under --force is also a warning of the result. `serve`: "triton" or
    "triton-native" (--serve) also writes DIR/triton/, a Triton Inference Server repository (edgelin.serve.triton);
    an export that flavour cannot serve is refused before anything is written. `on_progress(done, total,
    what)` hears each phase as it starts (a progress bar's count). `consume_model`: `model` is the export's own
    (export_checkpoint loaded it): once its fp32 figures are recorded, a quantised export's parity reference may
    take the place of its float weights (memory: edgelin.export.reference_vectors.record), and once the reference
    vectors are written its weights are released (moved to torch's meta device): the model is then no longer the
    checkpoint's."""
    from edgelin.artifact.baselines import BASELINE_SOURCE, MANIFEST_KEY as BASELINES_KEY, check_names
    from edgelin.artifact.reference_vectors import MANIFEST_KEY as REFERENCE_KEY, manifest_entry
    from edgelin.export import baselines as baseline_exports, reference_vectors
    from edgelin.export.quality_gate import check_export_quality

    check_names(baselines)
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
    target.check_export(model, settings, options)  # the target's own refusals, before anything is traced
    serve_warning = None
    if serve is not None:
        from edgelin.export.graphs import graph_io as _io
        from edgelin.serve.triton import check_config, check_server, check_servable

        check_server(serve)
        check_servable([t for t in _io(model, "step", settings.state_dtype)[0] if t.role == "state"], target.name,
                       serve)
        # the config.pbtxt it will write, parsed with Triton's schema before anything is written
        serve_warning = check_config(build_manifest(model, target.name, settings.precision,
                                                    {kind: f"{kind}.onnx" for kind in GRAPHS}, source, None,
                                                    settings.state_dtype), device, serve)
    if not target.pads_state_dims:  # a target that pads the state instead of refusing (Target.pads_state_dims)
        check_state_dims(model.state_tensors(), settings)
    from edgelin.precision import check_state_dtype

    # A state below float32 only for families whose measured drift meets the bound (or --force).
    state_precision = check_state_dtype(model.config.layer_types, settings.state_dtype, settings.force,
                                        f"{target.name} export")
    # The source checkpoint is protected: --out may not be it, sit inside it, or contain it.
    protected = tuple(protected) + ((Path(source["path"]),) if Path(str(source.get("path"))).is_dir() else ())
    phases = export_phases(baselines, serve)
    done = iter(range(len(phases)))
    saturated = float16_saturation(model, target, settings, options)
    current = [0, ""]  # the phase being reported: its index and name (a step's line names both)

    def phase(what: str) -> None:
        current[:] = [next(done), what]
        if on_progress is not None:
            on_progress(current[0], len(phases), what)

    def step(what: str) -> None:
        if on_progress is not None:
            on_progress(current[0], len(phases), f"{current[1]}: {what}")

    with claim_output(out, force, EXPORT, protected) as tmp, reporting(step):
        phase("tracing the graphs")
        files = target.export(model, device, settings, options, tmp)
        if tokenizer is not None:
            shutil.copyfile(tokenizer, tmp / TOKENIZER)
        manifest = build_manifest(model, target.name, settings.precision, files, source,
                                  TOKENIZER if tokenizer is not None else None, settings.state_dtype)
        finish = getattr(target, "finish_export", None)  # e.g. Core ML: source hash into the package, checks
        if finish is not None:  # it may return the manifest with more recorded (ONNX: a static KV cache's capacity)
            manifest = finish(tmp, manifest, options) or manifest
        # The weights' account first: the reference's meta and the quality gate read the quantisation from it.
        weights_recorded = weights_entries(tmp, files, settings)
        manifest = dataclasses.replace(manifest, extra={**manifest.extra, **weights_recorded})
        # What `validate DIR` and `bench DIR --baseline kv` run on a device, without torch or the checkpoint.
        phase("recording reference vectors")
        reference = reference_vectors.record(model, tmp, manifest, text=text, consume=consume_model)
        if consume_model:  # nothing reads the weights from here on (the gate runs the artifact; baselines read the
            model.to("meta")  # config): the float32 model is the export's largest holding, freed before the gate
        # fp16/quantised exports: the artifact's top-1 and perplexity vs fp32, refused unless --force
        phase("checking quality")
        gate = check_export_quality(model, tmp, manifest, settings)
        warnings = (*saturated, *((gate.warning(),) if gate is not None and not gate.passed else ()),
                    *((serve_warning,) if serve_warning else ()))
        if baselines:
            phase("exporting baselines")
        written = baseline_exports.export_baselines(model, tmp, baselines, lambda m, o: export_model(
            m, o, target.name, BASELINE_SOURCE, device=device, options=options, settings=settings))
        recorded = {REFERENCE_KEY: manifest_entry(tmp, reference),
                    **({BASELINES_KEY: written} if written else {}),
                    **weights_recorded, **({"quality": gate.to_dict(settings.force)} if gate is not None else {})}
        if serve is not None:  # DIR/triton/: the step graph's serving copy (weights hard-linked), config, client
            from edgelin.serve.triton import MANIFEST_KEY as SERVE_KEY, write_repository

            phase("writing the Triton repository")
            recorded[SERVE_KEY] = write_repository(tmp, manifest, device, serve)
        if state_precision:  # the verdicts the state dtype was checked against (failing ones too under --force)
            recorded["state_precision"] = [v.to_dict() for v in state_precision]
        phase("writing the manifest")
        # Record every file written (those inside its folders by path), so a later --force knows the folder is ours,
        # and each one's sha256, so that the run side finds a changed, truncated or swapped file before it runs it
        # (edgelin.integrity).
        device_entry = {"device": settings.manifest_entry()} if settings.device else {}
        manifest = dataclasses.replace(manifest, files=tuple(sorted(files_below(tmp) | {MANIFEST})),
                                       extra={**manifest.extra, **device_entry, **recorded},
                                       sha256=digest_folder(tmp))
        manifest.save(tmp)
    return ExportResult(out, manifest, files, warnings=warnings)


def float16_saturation(model: CausalLM, target: Any, settings: ExportSettings, options: Any) -> tuple[str, ...]:
    """Weights an export would store in float16 that lie beyond its range: refused (bad input, before anything is
    written) unless --force, which stores them saturated at ±65504, never as inf (the targets that convert them:
    `Target.saturates_float16`), and says so in a warning."""
    import torch

    if not target.saturates_float16:
        return ()
    if settings.precision == "fp16":
        found, what, instead = beyond_range(model, torch.float16), "--precision fp16", "--precision fp32"
    elif settings.quantize == "fp16":
        found = beyond_range(model, torch.float16, matmul_weights=True,
                             embeddings=getattr(options, "quantize_embeddings", True))
        what, instead = "--quantize fp16", "--quantize int8"
    else:
        return ()
    if found is None:
        return ()
    count, name, value = found
    values = f"{count} weight value{'s' if count > 1 else ''} beyond float16's range (largest {value:.4g}, in {name})"
    if not settings.force:
        raise EdgelinError(values, f"a {what} export would store them saturated at ±65504, another model",
                           f"export with {instead}, or pass --force to store them saturated")
    return (f"{values}: the {what} export stores them saturated at ±65504 (--force)",)


def check_export_resources(checkpoint: Path, out: Path, target_name: str, settings: ExportSettings) -> None:
    """Refuse, before the weights load, an export this machine lacks the memory or the disk for (estimated from the
    config by edgelin.export.resources with the target's measured factors)."""
    from edgelin.checkpoint import model_config
    from edgelin.export import resources

    config, target = model_config(checkpoint), get_target(target_name)
    resources.check_resources(resources.estimate(config, target, settings), out, target_name, settings.force,
                              resources.lighter_exports(config, target, settings))


def export_checkpoint(checkpoint: Path, out: Path, target: str | None = None, force: bool = False,
                      device: DeviceProfile | None = None, options: Any = None,
                      include_tokenizer: bool = True, settings: ExportSettings | None = None,
                      baselines: Sequence[str] = (), text: Path | None = None,
                      serve: str | None = None, on_progress: Progress | None = None) -> ExportResult:
    """`include_tokenizer=False` (--no-tokenizer): the checkpoint's tokenizer is neither checked nor copied.
    `baselines`, `text`: see export_model (an empty, binary or non-UTF-8 `text` is refused before the
    checkpoint loads). `target`: a registered target's name (None: the default, edgelin.export.targets)."""
    from dataclasses import replace

    from edgelin.export.targets import default_target

    from edgelin.artifact.baselines import check_names
    from edgelin.serve.triton import check_server
    from edgelin.tokenizer import check_tokenizer

    check_names(baselines)  # before the checkpoint loads
    check_server(serve)
    if text is not None:
        from edgelin.data import read_text

        read_text(text)  # the file's own faults, before the checkpoint loads (its tokens are counted at record)
    name = target or default_target()
    check_export_resources(checkpoint, out, name, settings or export_settings(device, name))
    if on_progress is not None:  # minutes at real sizes
        on_progress(0, len(export_phases(baselines, serve)), "loading the checkpoint")
    model, info = load_model(checkpoint)
    warnings: list[str] = []
    tokenizer = info.tokenizer if include_tokenizer else None
    if tokenizer is not None:  # before any work: a corrupt tokenizer would only surface in generate
        check_tokenizer(tokenizer, model.config.vocab_size)
    elif include_tokenizer:
        warnings.append(f"no {TOKENIZER} in {info.path}: the export has no tokenizer, so generate will need one")
    source = {"path": str(info.path), "sha256": info.sha256, "format": info.format, "model_type": info.model_type}
    result = export_model(model, out, name, source, tokenizer, force, device, options, settings=settings,
                          baselines=baselines, text=text, serve=serve, on_progress=on_progress,
                          consume_model=True)
    return replace(result, inert_fields=tuple(info.inert_fields), warnings=(*warnings, *result.warnings))
