"""The `edgelin` command line. Commands parse, call the library, print; nothing else. The machinery they
share (the app, one-line errors, option checks) is edgelin.cli_support."""

from __future__ import annotations

import dataclasses
from pathlib import Path
import inspect as pyinspect
from typing import Any, Callable, Literal, Optional

import typer
from rich.text import Text

from edgelin import __version__
from edgelin.cli_support import (JSON, NO_VERIFY, POSITIVE, _debug, _finite, app, argv_text, command,
                                 library_load_fault, prepare_process)
from edgelin.devices import MAX_THREADS
from edgelin.errors import EdgelinError
from edgelin.cli_support import EdgelinCommand
from edgelin.artifact.vocabulary import PRECISIONS, QUANTIZE
from edgelin.export.targets import target_names
from edgelin.output import Output, human_bytes, styled

# Choices typer shows in --help and checks at parse time.
TargetName = Literal[tuple(target_names())]  # type: ignore[valid-type]  # the registry, not a hand-kept list
Precision = Literal[PRECISIONS]  # type: ignore[valid-type]  # the vocabulary, declared once (edgelin.artifact.vocabulary)
Quantize = Literal[QUANTIZE]  # type: ignore[valid-type]
Baseline = Literal["kv"]
Serve = Literal["triton", "triton-native"]


def _print_version(value: bool) -> None:
    if value:
        typer.echo(f"edgelin {__version__}")
        raise typer.Exit(0)


@app.callback()
def main_options(
    debug: bool = typer.Option(False, "--debug", help="Show full tracebacks on errors."),
    version: bool = typer.Option(False, "--version", callback=_print_version, is_eager=True,
                                 help="Print the version and exit."),
) -> None:
    _debug["on"] = _debug["on"] or debug


@command
def families(out: Output, as_json: bool = JSON) -> None:
    """The families, their state tensors and what each target supports."""
    from edgelin.catalog import family_rows

    rows = family_rows()
    out.result(rows)
    out.table("Layer families", ["family", "update rule", "decay", "readout", "state (per layer)", "targets",
                                 "TensorRT step", "fp16 state"],
              [[r["family"], r["rule"], r["decay"], r["readout"], "\n".join(r["state"]), r["targets"],
                r["tensorrt_step"], r["fp16_state"]] for r in rows])


@command
def devices(out: Output, as_json: bool = JSON) -> None:
    """Device profiles (devices/*.toml) and the targets each takes."""
    from edgelin.devices import DEVICES_DIR, load_devices

    profiles = load_devices()
    out.result([dataclasses.asdict(p) for p in profiles.values()])  # nested tables (serving) as objects too
    out.table(f"Device profiles ({DEVICES_DIR})", ["device", "title", "targets", "compute", "precision", "state"],
              [[p.name, p.title, ", ".join(p.targets), p.compute, p.precision, p.state_dtype] for p in profiles.values()])


@command
def inspect(
    out: Output,
    checkpoint: Path = typer.Argument(..., help="Checkpoint directory (edgelin, fla or transformers format)."),
    as_json: bool = JSON,
) -> None:
    """Detected architecture, family per layer, parameters, state bytes, and where it can go (or why not);
    on an export folder: its precision and bytes on disk."""
    from edgelin.inspect import inspect_checkpoint, inspect_export

    if (checkpoint / "manifest.json").is_file():  # an export folder (edgelin export wrote it)
        exported = inspect_export(checkpoint)
        out.result(exported.to_dict())
        quantized = exported.quantization
        from edgelin.artifact.quality import quantized_weights

        out.line(Text.assemble((str(checkpoint), "bold"), f": {exported.target} export, precision "
                               + ", ".join(f"{k} {v}" for k, v in exported.precision.items() if v is not None)
                               + (f"; {quantized_weights(quantized)} weights ({len(quantized['matrices'])} matrices)"
                                  if quantized else "")))
        out.table("Bytes on disk", ["file", "bytes"], [[name, human_bytes(n)] for name, n in exported.files.items()])
        out.line(f"loaded by the runner (graphs + weights): {human_bytes(exported.runtime_bytes)}; folder: "
                 f"{human_bytes(exported.total_bytes)}" + (f"; {exported.weights['file']} is read by both graphs "
                                                          f"({exported.weights['shared_tensors']} shared tensors)"
                                                          if exported.weights else ""))
        return
    report = inspect_checkpoint(checkpoint)
    out.result(report.to_dict())
    if not report.supported:
        raise EdgelinError(f"{checkpoint} cannot be exported", report.reason or "unsupported",
                           report.fix or "see the supported checkpoints in README.md")
    out.line(Text.assemble((str(checkpoint), "bold"), f": {report.model_type} ({report.source}), "
                           f"{report.num_parameters:,} parameters" + (f" — {report.note}" if report.note else "")))
    for warning in report.warnings:
        out.warning(warning)
    kinds: dict[str, int] = {}
    for layer in report.layers:
        kinds[layer["type"]] = kinds.get(layer["type"], 0) + 1
    out.line("layers: " + ", ".join(f"{n} x {k}" for k, n in kinds.items()))
    growth = f" + {human_bytes(report.kv_bytes_per_token)} per token of context (full-attention KV cache)" \
        if report.kv_bytes_per_token else " (constant)"
    out.line(f"state per sequence: {human_bytes(report.state_bytes_per_sequence)}{growth}")
    out.line(f"tokenizer: {report.tokenizer}")
    if report.inert_fields:
        out.line(f"ignored (inert upstream fields): {', '.join(report.inert_fields)}")
    out.table("Targets by device", ["device", "target", "ok", "why not"],
              [[r["device"], r["target"], "yes" if r["ok"] else "no", r["reason"] or ""] for r in report.targets])


def _target_options(flags_of: Callable[[Any], tuple], prefix: str = "") -> dict[str, tuple[Any, list[str]]]:
    """{keyword: (typer Option, owning targets)} for every registered target's flags (TargetFlag, declared as data
    by each target), one help panel per target; a flag two targets declare is one option of both."""
    from edgelin.export.targets import get_target

    found: dict[str, tuple[Any, list[str]]] = {}
    for name in target_names():
        for flag in flags_of(get_target(name)):
            keyword = prefix + flag.field
            if keyword in found:
                found[keyword][1].append(name)
                continue
            kind = Optional[Literal[flag.choices]] if flag.choices else Optional[flag.type]  # type: ignore[valid-type]
            switch = flag.type is bool and "/" not in flag.flag  # on or off; an --x/--no-x pair has three states
            option = typer.Option(False if switch else None, flag.flag, help=flag.help,
                                  rich_help_panel=f"{name} options")
            found[keyword] = ((option, bool if switch else kind), [name])
    return found


def with_target_options(options: dict[str, tuple[Any, list[str]]]) -> Callable[[Callable], Callable]:
    """A command whose **keywords become the targets' own options (the signature typer reads)."""
    def apply(fn: Callable) -> Callable:
        sig = pyinspect.signature(fn)
        fixed = [p for p in sig.parameters.values() if p.kind is not pyinspect.Parameter.VAR_KEYWORD]
        added = [pyinspect.Parameter(keyword, pyinspect.Parameter.KEYWORD_ONLY, default=option, annotation=kind)
                 for keyword, ((option, kind), _) in options.items()]
        fn.__signature__ = sig.replace(parameters=[*fixed, *added])  # type: ignore[attr-defined]
        return fn
    return apply


EXPORT_FLAGS = _target_options(lambda t: t.flags, prefix="target_")
BUILD_FLAGS = _target_options(lambda t: t.build_flags, prefix="build_")
RUN_FLAGS = _target_options(lambda t: t.run_flags, prefix="run_")
OWNERS = {keyword: owners for keyword, (_, owners) in {**EXPORT_FLAGS, **BUILD_FLAGS, **RUN_FLAGS}.items()}


def given_flags(values: dict[str, Any], prefix: str) -> dict[str, Any]:
    """{field: value} of the target flags passed (an unset option is None; an unset on-switch is False)."""
    return {keyword.removeprefix(prefix): value for keyword, value in values.items()
            if value is not None and not (value is False and "/" not in _flag_name(keyword))}


def _flag_name(keyword: str) -> str:
    option, _ = {**EXPORT_FLAGS, **BUILD_FLAGS, **RUN_FLAGS}[keyword][0]
    return " ".join(option.param_decls)


def refuse_foreign_flags(given: dict[str, Any], prefix: str, target: str, what: str) -> None:
    """A flag of another target's, given for a folder or export of `target`: one line naming whose it is."""
    foreign = [field for field in given if target not in OWNERS[prefix + field]]
    if foreign:
        names = [_flag_name(prefix + field).split("/")[0] for field in foreign]
        owners = sorted({o for field in foreign for o in OWNERS[prefix + field]})
        raise EdgelinError(f"{'/'.join(names)} on a {target} {what}", f"{'it is' if len(names) == 1 else 'they are'} "
                           f"the {' and '.join(owners)} target's own", f"drop {', '.join(names)}")


class ExportCommand(EdgelinCommand):
    """`edgelin export <target> CHECKPOINT` (optimum-cli's shape) with that target's own flags only (its --help
    shows them); `edgelin export CHECKPOINT --target X` (the alias) takes every target's flags and refuses
    another target's by name."""

    def parse_args(self, ctx: Any, args: list[str]) -> list[str]:
        if args and args[0] in target_names():  # the optimum-cli shape: the target first
            ctx.meta["edgelin.target"] = args[0]
        return super().parse_args(ctx, args)

    def get_params(self, ctx: Any) -> list:
        params = super().get_params(ctx)
        chosen = ctx.meta.get("edgelin.target")
        if chosen is None:
            return params
        return [p for p in params if p.name != "target" and chosen in OWNERS.get(p.name, [chosen])]


@command(cls=ExportCommand)
@with_target_options(EXPORT_FLAGS)
def export(
    out: Output,
    positional: list[Path] = typer.Argument(..., metavar="[TARGET] CHECKPOINT",
                                            help="The target (`edgelin export TARGET CKPT`; else --target, else the "
                                                 "default target) and the checkpoint directory (config.json + "
                                                 "safetensors), or a recipe folder.", show_default=False),
    target: Optional[TargetName] = typer.Option(None, "--target", "-t", help="Export target (the alias of the "
                                                "positional TARGET)."),
    out_dir: Path = typer.Option(..., "--out", "-o", help="Output folder (must not exist unless --force)."),
    force: bool = typer.Option(False, "--force", help="Replace an existing output folder that edgelin wrote."),
    device: Optional[str] = typer.Option(None, "--device", help="Check the export against a device profile "
                                                                  "(`edgelin devices` lists them)."),
    precision: Optional[Precision] = typer.Option(None, "--precision",
                                                  help="Compute precision of the graphs (default: the device's, else fp32)."),
    quantize: Optional[Quantize] = typer.Option(
        None, "--quantize", help="Weight-only quantisation of the matmul weights, embedding table and LM head "
                                 "(int8/int4: block-wise, ONNX Runtime's MatMulNBits and GatherBlockQuantized; "
                                 "fp16: float16 weights, float32 arithmetic, edgelin's MatMulF16); state and "
                                 "recurrence stay float."),
    text: Optional[Path] = typer.Option(
        None, "--text", help="Held-out UTF-8 text for the recorded quality figures (perplexity; default: the "
                             "recipe's validation split)."),
    block_size: Optional[int] = typer.Option(None, "--block-size",
                                             help="Weights per quantisation block with --quantize int8/int4: "
                                                  "16, 32, 64, 128 or 256 (32: edgelin's own kernels) [32]."),
    no_tokenizer: bool = typer.Option(False, "--no-tokenizer",
                                      help="Export without a tokenizer (generate will then need one)."),
    baseline: Optional[Baseline] = typer.Option(
        None, "--baseline", help="Also export a same-size KV-cache softmax model into DIR/baseline-kv "
                                 "(for `bench --baseline kv`)."),
    serve: Optional[Serve] = typer.Option(
        None, "--serve", help="Also write a Triton Inference Server model repository into DIR/triton/: triton (Python "
                              "backend running edgelin's runner: prefill, hybrids, every target; `edgelin serve DIR`) "
                              "or triton-native (the target's own Triton backend, implicit state; docs/serving.md)."),
    as_json: bool = JSON,
    **target_flags: Any,
) -> None:
    """Export step + prefill graphs, reference vectors and manifest.json for a target:
    `edgelin export TARGET CHECKPOINT --out DIR` (each target's own flags: `edgelin export TARGET --help`)."""
    from edgelin.export.request import ExportRequest, prepare_export
    from edgelin.export.targets import default_target, get_target

    if len(positional) > 2:
        raise EdgelinError(f"{len(positional)} arguments", "export takes [TARGET] CHECKPOINT",
                           f"pass e.g. `edgelin export {default_target()} CKPT --out DIR`")
    *named, checkpoint = positional
    if named:
        get_target(str(named[0]))  # an unknown target: one line with the closest name
        if target is not None and target != str(named[0]):
            raise EdgelinError(f"target {named[0]} and --target {target}", "an export has one target",
                               "name the target once")
        target = str(named[0])
    target = target or default_target()
    given = given_flags(target_flags, "target_")
    request = ExportRequest(checkpoint, out_dir, target, force, device, precision, quantize, block_size, text,
                            not no_tokenizer, (baseline,) if baseline else (), serve, given)
    prepared = prepare_export(request)  # its refusals before the progress line
    doing, phases = f"exporting {checkpoint} to {target}", request.phases()
    with out.progress(doing, total=len(phases)) as update:
        result = prepared.run(on_progress=lambda done, total, what: update(done, f"{doing}: {what}", total))
        update(len(phases), description=doing)  # all done; the closing line names the whole job
    for warning in result.warnings:
        out.warning(warning)
    m = result.manifest
    out.result({"folder": str(result.folder), "files": result.files, "manifest": m.to_dict(),
                "inert_fields": list(result.inert_fields), "warnings": list(result.warnings)})
    out.table(f"Exported {checkpoint} -> {result.folder}", ["graph", "file", "inputs", "outputs"],
              [[kind, g.file, len(g.inputs), len(g.outputs)] for kind, g in m.graphs.items()])
    out.line(f"state per sequence: {human_bytes(m.state_bytes(1))} "
             f"({'constant' if m.constant_memory else 'grows with context'}"
             f"{f', in place up to {m.kv_capacity:,} tokens' if m.kv_capacity else ''}); "
             f"layers: {', '.join(layer['type'] for layer in m.layers)}")
    weights, precision = m.extra.get("weights"), m.extra.get("precision", {})
    if weights:
        quantized = m.extra.get("quantization")
        from edgelin.artifact.quality import quantized_weights

        what = (f"{quantized_weights(quantized)} matmul weights, others {precision.get('weights')}" if quantized
                else precision.get("weights", "?"))
        from edgelin.inspect import folder_bytes  # each file once: DIR/triton's weights link weights.bin

        total = folder_bytes(result.folder)
        out.line(f"weights: {weights['file']} {human_bytes(weights['bytes'])} ({what}; {weights['shared_tensors']} "
                 f"tensors read by both graphs); state and logits float32; folder {human_bytes(total)} on disk")
    recorded = m.extra.get("reference_vectors", {}).get("file")
    baselines = m.extra.get("baselines", {})
    out.line(f"reference vectors: {recorded} (`edgelin validate {result.folder}` replays them)"
             + "".join(f"; {name} baseline: {sub}/" for name, sub in baselines.items()))
    gate = m.extra.get("quality")
    if isinstance(gate, dict):  # fp16/quantised exports: the quality check the export ran
        figures, change = gate.get("figures", {}), gate.get("figures", {}).get("perplexity_change")
        out.line(f"quality ({gate.get('precision')} vs fp32, {figures.get('source')}): top-1 {figures.get('top1', 0):.2%}"
                 + (f", perplexity {figures.get('perplexity'):.2f} ({change:+.2%})" if change is not None else "")
                 + f"; check {'passed' if gate.get('passed') else 'FAILED (exported with --force)'}")
    served = m.extra.get("serve", {}).get("triton")
    if served:
        held = (f"{served['states']} implicit states" if "states" in served
                else f"state held per sequence, {served['limits']['max_candidate_sequences']} sequences")
        out.line(f"Triton repository: {result.folder}/{served['repository']}/{served['model']} ({served['backend']} "
                 f"backend, {held}, max batch {served['limits']['max_batch_size']}); serve it: edgelin serve "
                 f"{result.folder} (docs/serving.md)")
    if result.inert_fields:
        out.line(f"ignored (inert upstream fields): {', '.join(result.inert_fields)}")


@command
def validate(
    out: Output,
    folder: Path = typer.Argument(..., help="An export folder."),
    against: Optional[Path] = typer.Option(
        None, "--against", help="Checkpoint to run in PyTorch next to the export, for a full check of any length "
                                "(default: replay the reference vectors recorded at export; no torch)."),
    steps: Optional[int] = typer.Option(None, min=1, help="With --against: decode steps after the prompt [512]."),
    prompt_len: Optional[int] = typer.Option(None, min=1, help="With --against: prompt tokens (prefilled) [32]."),
    batch: Optional[int] = typer.Option(None, min=1, help="With --against: sequences per batch [2]."),
    seed: Optional[int] = typer.Option(None, min=0, help="With --against: seed of the random token sequences [0]."),
    rtol: Optional[float] = typer.Option(None, callback=POSITIVE,
                                         help="Max error relative to the reference's scale (default by precision)."),
    text: Optional[Path] = typer.Option(
        None, "--text", help="With --against: held-out UTF-8 text for the perplexity figure (default: the "
                             "checkpoint's recipe validation split, else random tokens and top-1 only)."),
    text_tokens: Optional[int] = typer.Option(None, "--text-tokens", min=64, max=1 << 16,  # quality.MIN_TEXT_TOKENS..
                                              help="With --against: held-out tokens scored [512]."),
    min_top1: Optional[float] = typer.Option(
        None, "--min-top1", callback=_finite(0.0, 1.0),
        help="Fail below this top-1 agreement with the fp32 reference, e.g. 0.95 (default by precision: "
             "fp16/int8 0.95, int4 0.90, fp32 none)."),
    max_ppl_change: Optional[float] = typer.Option(
        None, "--max-ppl-change", callback=POSITIVE,
        help="Fail above this relative perplexity increase over the fp32 reference, e.g. 0.05 = +5% (default by "
             "precision: fp16 0.01, int8 0.02, int4 0.05, fp32 none)."),
    no_verify: bool = NO_VERIFY,
    as_json: bool = JSON,
) -> None:
    """Replay the reference vectors recorded at export through the runner (no checkpoint, no torch), or with
    --against CKPT roll out prefill + N steps and compare with PyTorch at every step; then the quality
    figures: top-1 agreement with the fp32 reference and perplexity on held-out text."""
    from edgelin.errors import ValidationFailed
    from edgelin.artifact.quality import TEXT_TOKENS

    if against is None:
        from edgelin.replay import replay

        given = [flag for flag, value in (("--steps", steps), ("--prompt-len", prompt_len), ("--batch", batch),
                                          ("--seed", seed), ("--text", text), ("--text-tokens", text_tokens))
                 if value is not None]
        if given:
            raise EdgelinError(f"{given[0]} applies to --against only", "without --against, validate replays the "
                               "prompt, steps, batch sizes and held-out text recorded at export (the reference's "
                               "log-likelihoods on other text need the checkpoint)",
                               f"drop {', '.join(given)}, or add --against CKPT for a check of any length")
        with out.progress("validating") as update:
            report = replay(folder, rtol, on_progress=lambda message: update(description=message),
                            min_top1=min_top1, max_ppl_change=max_ppl_change)
        from edgelin.environment import environment

        ran_on = environment("validate", folder, report.runner, None, None)  # what validate --against records
    else:
        try:
            import torch  # noqa: F401 (edgelin.validate imports it only when --against runs)
            from edgelin.validate import validate as run_validate
        except ImportError as exc:  # a runtime-only install (edgelin[runtime]) has no torch
            if library_load_fault(exc) is not None:  # torch is there but could not be mapped (ulimit -v)
                raise
            raise EdgelinError("validate --against needs PyTorch", f"it runs the checkpoint's reference model ({exc})",
                               "install edgelin[onnx], or validate without --against (the recorded reference "
                               "vectors)") from None

        steps, prompt_len = steps or 512, prompt_len or 32
        with out.progress("validating", total=2 * prompt_len + steps) as update:
            report = run_validate(folder, steps, prompt_len, batch or 2, seed or 0, rtol, against,
                                  on_progress=lambda done, total: update(done), text=text,
                                  text_tokens=text_tokens or TEXT_TOKENS, min_top1=min_top1,
                                  max_ppl_change=max_ppl_change)
        ran_on = report.environment
    out.result({"environment": ran_on, **report.to_dict()})
    from edgelin.artifact.reference_vectors import FLOOR_FACTOR

    batches = " and ".join(str(b) for b in report.batches)
    floors = any(m.noise_floor for m in report.metrics)  # the reference recorded its noise floor (docs/checks.md)
    out.table(f"{folder}: {report.target} {report.precision} against {report.against}, batch {batches}, "
              f"prompt {report.prompt_len}, {report.steps} steps (threshold {report.threshold:g} relative"
              + (f", or {FLOOR_FACTOR:g}x the reference's noise floor where larger" if floors else "") + ")",
              ["check", "batch", "output", "max abs", "max rel", *(["bound"] if floors else []), "worst step",
               "result"],
              [[m.check, m.batch, m.output, m.max_abs, m.max_rel, *([m.threshold] if floors else []),
                "-" if m.worst_step is None else m.worst_step,
                styled("ok", "green") if m.passed else styled("FAIL", "bold red")] for m in report.metrics])
    if report.reference_weights:
        weights, unmatched = report.reference_weights, report.reference_weights.get("unmatched_rows", 0)
        out.line(f"parity reference: PyTorch with the export's own dequantised {report.precision} weights "
                 f"({len(weights.get('replaced', []))} tensors" + (f"; {unmatched} quantised rows matched no weight "
                 "and stay float32 there" if unmatched else "") + "); quality figures: against fp32")
    _quality_table(out, report)
    out.line(f"runner: {report.runner}")
    checks = len(report.metrics) + len(report.quality_checks)
    if not report.passed:
        failed = report.failures
        names = ", ".join([f"{m.check}/{m.output}" + (f"@{m.batch}" if len(report.batches) > 1 else "")
                           for m in failed[:5]] + [c.name for c in report.quality_failures])
        bound = f"{report.threshold:g} of the reference's scale" + (
            f" (or {FLOOR_FACTOR:g}x the reference's noise floor)" if floors else "")
        why = "; ".join(([f"errors exceed {bound}"] if failed else [])
                        + [c.describe() + " (the bound)" for c in report.quality_failures])
        fix = "; ".join((["inspect the table; re-export, or loosen --rtol only if the precision warrants it"]
                         if failed else [])
                        + (["re-export with a gentler precision (fp16 or int8 weights), or loosen --min-top1/"
                            "--max-ppl-change only if the use warrants it"] if report.quality_failures else []))
        raise ValidationFailed(f"{len(failed) + len(report.quality_failures)} of {checks} checks failed ({names})",
                               why, fix)
    out.line(Text.assemble((f"all {checks} checks passed", "green"), f" in {report.seconds:.1f} s"))


def _quality_table(out: Output, report: Any) -> None:
    """validate's quality figures (edgelin/quality.py) under the parity table; a note when unmeasured."""
    q = report.quality
    if q is None:
        if report.quality_note:
            out.line(report.quality_note)  # stdout: part of the report (stderr holds only the error line)
        return
    bound = {c.name: c for c in report.quality_checks}

    def verdict(name: str) -> list[Any]:
        check = bound.get(name)
        if check is None:
            return ["-", "-"]
        op = ">=" if check.kind == "min" else "<="
        return [f"{op} {check.bound:.2%}", styled("ok", "green") if check.passed else styled("FAIL", "bold red")]

    rows = [[f"top-1 agreement ({q.greedy_steps} greedy steps)", f"{q.top1:.2%}", "-", *verdict("top-1 agreement")]]
    if q.perplexity is not None:
        rows += [[f"top-1 agreement ({q.text_tokens} held-out tokens)", f"{q.text_top1:.2%}", "-", "-", "-"],
                 [f"perplexity ({q.text_tokens} held-out tokens)", f"{q.perplexity:.4g}",
                  f"{q.reference_perplexity:.4g}", "-", "-"],
                 ["perplexity change", f"{q.perplexity_change:+.2%}", "-", *verdict("perplexity change")]]
    out.table(f"quality vs the fp32 reference ({report.precision} export; held-out text: {q.source})",
              ["figure", "export", "reference", "bound", "result"], rows)
    if report.quality_note:
        out.line(report.quality_note)


@command
@with_target_options(RUN_FLAGS)
def bench(
    out: Output,
    folder: Path = typer.Argument(..., help="An export folder."),
    positions: str = typer.Option("1,1024,8192,32768", help="Context positions (comma-separated)."),
    batch: int = typer.Option(1, min=1, help="Sequences per step."),
    iters: int = typer.Option(200, min=1, help="Timed steps per position."),
    warmup: int = typer.Option(20, min=0, help="Untimed steps before timing, per position."),
    prefill_tokens: int = typer.Option(2048, min=0, help="Prompt length for prefill-vs-steps throughput (0: skip)."),
    baseline: Optional[Baseline] = typer.Option(None, help="Also measure a same-size KV-cache softmax model."),
    threads: Optional[int] = typer.Option(None, min=0, max=MAX_THREADS, help="Runtime threads (0 or unset: the device's, "
                                                            "else the runtime's default)."),
    device: Optional[str] = typer.Option(None, "--device", help="Device profile (threads, targets)."),
    no_verify: bool = NO_VERIFY,
    as_json: bool = JSON,
    **run_flags: Any,
) -> None:
    """Per-token latency at each context position, prefill throughput and memory."""
    from edgelin.bench import bench as run_bench
    from edgelin.devices import get_device

    try:
        points = [int(p) for p in positions.split(",") if p.strip()]
    except ValueError:
        raise EdgelinError(f"--positions {positions!r} is not a list of integers", "positions are token counts",
                           "e.g. --positions 1,1024,8192") from None
    profile = get_device(device) if device is not None else None
    threads = threads or (profile.threads if profile and profile.threads else None)
    given = given_flags(run_flags, "run_")
    if given:  # the runner's own options (e.g. ONNX Runtime's weight prepacking), set by its target
        from edgelin.export.targets import get_target
        from edgelin.runtime import load_artifact

        target = load_artifact(folder).manifest.target
        refuse_foreign_flags(given, "run_", target, "export")
        get_target(target).apply_run_options(given)
    with out.progress("benchmarking", total=len(set(points)) * (2 if baseline else 1) + bool(prefill_tokens)) as update:
        report = run_bench(folder, points, batch, warmup, iters, prefill_tokens, baseline=baseline, threads=threads,
                           on_progress=lambda msg: update(description=msg), device=profile,
                           on_count=lambda done, total: update(done))
    out.result(report.to_dict())
    out.table(f"{folder}: step latency ({report.target}, batch {batch}, {iters} steps per position)",
              ["model", "position", "p50 ms", "p90 ms", "p99 ms", "state", "RSS"],
              [[r.model, r.position, r.p50_ms, r.p90_ms, r.p99_ms, human_bytes(r.state_bytes), human_bytes(r.rss_bytes)]
               for r in report.positions])
    for label, tps in report.prefill_tokens_per_s.items():
        steps = report.steps_tokens_per_s[label]
        out.line(f"{label}: prefill {tps:,.0f} tok/s vs token-by-token steps {steps:,.0f} tok/s over "
                 f"{report.prefill_tokens} tokens ({tps / steps:.1f}x)")
    out.line(report.footprint_line())  # bytes on disk and in memory (edgelin.bench.load_memory: the method)
    out.line(f"runner: {report.runner}")


@command
def generate(
    out: Output,
    folder: Path = typer.Argument(..., help="An export folder."),
    prompt: str = typer.Option(..., "--prompt", "-p", help="Text to continue."),
    max_new_tokens: int = typer.Option(200, "--max-new-tokens", "-n", min=0, help="Tokens to generate at most."),
    # Sampling options default to None so that --greedy can refuse them when given (Sampling's defaults apply).
    temperature: Optional[float] = typer.Option(None, callback=POSITIVE, help="Sampling temperature (> 0) [0.8]."),
    top_k: Optional[int] = typer.Option(None, min=0, help="Sample among the K likeliest tokens (0: all) [50]."),
    top_p: Optional[float] = typer.Option(
        None, callback=_finite(0.0, 1.0), help="Sample within the smallest set of tokens of total probability P "
                                               "(0 < P <= 1) [0.95]."),
    repetition_penalty: float = typer.Option(
        1.0, callback=POSITIVE, help="Divide the positive logits (multiply the negative ones) of every token "
                                     "already in the context by P; 1: off, 1.1-1.3: typical."),
    greedy: bool = typer.Option(False, "--greedy", help="Argmax decoding (takes no --temperature, --top-k, --top-p)."),
    ignore_eos: bool = typer.Option(False, "--ignore-eos", help="Go on past the end-of-text token: exactly -n tokens "
                                                                "(for timing and memory runs, as llama.cpp's)."),
    seed: int = typer.Option(0, min=0, help="Sampling seed."),
    threads: Optional[int] = typer.Option(None, min=0, max=MAX_THREADS, help="Runtime threads (0 or unset: the device's, "
                                                            "else the runtime's default)."),
    device: Optional[str] = typer.Option(None, "--device", help="Device profile (threads, targets)."),
    save_state: Optional[Path] = typer.Option(None, "--save-state", help="Write the conversation (state, position, "
                                              "tokens) to FILE at the end: --load-state continues it later."),
    load_state: Optional[Path] = typer.Option(None, "--load-state", help="Continue the conversation saved in FILE: "
                                              "the prompt is the next turn (only its tokens are prefilled)."),
    prompt_cache: Optional[Path] = typer.Option(None, "--prompt-cache", help="Reuse FILE's state when the prompt "
                                                "starts with its tokens (prefill only the rest); else prefill the "
                                                "prompt and write FILE."),
    server: Optional[str] = typer.Option(None, "--server", help="Generate on a running `edgelin serve` (gRPC "
                                         "HOST:PORT) instead of here: the folder gives the tokenizer and model name."),
    no_verify: bool = NO_VERIFY,
    as_json: bool = JSON,
) -> None:
    """Decode from a prompt with constant memory, streaming tokens to stdout (statistics on stderr)."""
    from edgelin.devices import get_device
    from edgelin.generate import SETTLE_STEPS, Sampling, StateFiles
    from edgelin.generate import generate as run_generate

    prompt = argv_text(prompt, "--prompt")  # bytes that are not UTF-8: one line, not the tokenizer's TypeError
    given = {"--temperature": temperature, "--top-k": top_k, "--top-p": top_p}
    if greedy and any(v is not None for v in given.values()):
        flags = [flag for flag, value in given.items() if value is not None]
        raise EdgelinError(f"--greedy with {', '.join(flags)}", "greedy decoding takes the likeliest token; "
                           "temperature, top-k and top-p only shape sampling", f"drop --greedy to sample, or drop "
                           f"{', '.join(flags)}")
    defaults = Sampling()
    sampling = Sampling(defaults.temperature if temperature is None else temperature,
                        defaults.top_k if top_k is None else top_k, defaults.top_p if top_p is None else top_p,
                        greedy, seed, repetition_penalty)
    profile = get_device(device) if device is not None else None
    threads = threads or (profile.threads if profile and profile.threads else None)
    # The prompt is echoed only once the folder, tokenizer and prefill have worked: a failure prints
    # one error line, not the prompt followed by an error.
    result = run_generate(folder, prompt, max_new_tokens, sampling, on_text=out.stream, keep_ids=as_json,
                          stop_at_eos=not ignore_eos, threads=threads, on_start=lambda: out.stream(prompt),
                          device=profile, states=StateFiles(load_state, save_state, prompt_cache), server=server)
    out.stream("\n")
    out.result(result.to_dict())
    out.note(f"{result.new_tokens} tokens, {result.tokens_per_second:,.0f} tok/s, prefill "
             f"{result.prefilled_tokens} tokens in {result.prefill_seconds * 1e3:.1f} ms"
             + (f" ({result.reused_tokens} reused from the state file)" if result.reused_tokens else "") + ", RSS "
             + (f"{human_bytes(result.rss_start_bytes)} -> {human_bytes(result.rss_end_bytes)}" if result.rss_settled
                else f"{human_bytes(result.rss_end_bytes)} (its growth is measured from token {SETTLE_STEPS + 1} on)")
             + f"; runner: {result.runner}")


@command
def chat(
    out: Output,
    folder: Path = typer.Argument(..., help="An export folder."),
    max_new_tokens: int = typer.Option(200, "--max-new-tokens", "-n", min=0, help="Tokens per answer at most."),
    greedy: bool = typer.Option(False, "--greedy", help="Argmax decoding."),
    temperature: float = typer.Option(0.8, callback=POSITIVE, help="Sampling temperature (> 0)."),
    seed: int = typer.Option(0, min=0, help="Sampling seed."),
    load_state: Optional[Path] = typer.Option(None, "--load-state", help="Continue the conversation saved in FILE."),
    threads: Optional[int] = typer.Option(None, min=0, max=MAX_THREADS, help="Runtime threads."),
    device: Optional[str] = typer.Option(None, "--device", help="Device profile (threads, targets)."),
    no_verify: bool = NO_VERIFY,
) -> None:
    """Talk to an export, a line a turn: each turn prefills only its own text (/save FILE, /load FILE, /undo,
    /reset, /quit)."""
    import sys

    from edgelin.chat import ChatRequest, ChatSession
    from edgelin.devices import get_device
    from edgelin.generate import Sampling

    profile = get_device(device) if device is not None else None
    threads = threads or (profile.threads if profile and profile.threads else None)
    session = ChatSession(ChatRequest(folder, max_new_tokens, Sampling(temperature=temperature, greedy=greedy,
                                                                      seed=seed), threads, profile, load_state))
    interactive = sys.stdin.isatty()
    while True:
        if interactive:
            out.stream("> ")
        line = sys.stdin.readline()
        if not line or line.strip() == "/quit":
            break
        try:
            said = session.handle(line.rstrip("\n"), out.stream)
        except EdgelinError as exc:  # a refused command: one line, and the conversation goes on
            out.error(exc.line())
            continue
        if said is None:
            out.stream("\n")
        else:
            out.note(said)


@command
@with_target_options(BUILD_FLAGS)
def build(
    out: Output,
    folder: Path = typer.Argument(..., help="An export folder."),
    device: Optional[str] = typer.Option(None, "--device", help="Device profile to build for "
                                                                  "(`edgelin devices` lists them)."),
    no_verify: bool = NO_VERIFY,
    as_json: bool = JSON,
    **build_flags: Any,
) -> None:
    """The build phase: turn an export into what its runtime loads (engine, compiled model), where the target has one."""
    from edgelin.devices import get_device
    from edgelin.export.base import phase_refusal
    from edgelin.export.targets import get_target
    from edgelin.runtime import load_artifact

    profile = get_device(device) if device is not None else None
    artifact = load_artifact(folder)
    target = get_target(artifact.manifest.target)
    given = given_flags(build_flags, "build_")
    refuse_foreign_flags(given, "build_", target.name, "export")
    refused = target.device_refusal(profile)  # as generate and bench refuse it, with or without a build phase
    if refused is not None:
        raise phase_refusal(target, "build", refused)
    phase = target.can_build(profile)
    if phase is None:
        out.result({"folder": str(folder), "target": target.name, "build": None})
        out.line(f"{folder}: the {target.name} target has no build phase; the exported files run as they are")
        return
    if not phase.ok:
        raise phase_refusal(target, "build", phase)
    with out.progress(f"building {folder} for {target.name}"):
        built = target.build(artifact, profile, given)  # a partial build (e.g. a library, no engine) still exits 0
    out.result({"folder": str(built.folder), "target": target.name, "build": built.files, "missing": built.missing})
    moved = Path(built.folder).resolve() != Path(artifact.folder).resolve()
    out.line(f"built {folder}{f' -> {built.folder}' if moved else ''}: {', '.join(built.files.values())}")
    if built.missing:
        out.line(f"not built: {built.missing}")


from edgelin import cli_serve, cli_train_report  # noqa: E402,F401  (register serve, train, report after the above)


def main() -> None:
    prepare_process()  # the working folder exists, streams print any text, SIGTERM/SIGHUP clean up like Ctrl-C
    app()


if __name__ == "__main__":
    main()
