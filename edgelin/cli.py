"""The `edgelin` command line. Commands parse, call the library, print; nothing else."""

from __future__ import annotations

import functools
import os
from pathlib import Path
from typing import Callable, Optional

import typer

from edgelin import __version__
from edgelin.errors import EdgelinError
from edgelin.output import Output, human_bytes

app = typer.Typer(no_args_is_help=True, add_completion=False, pretty_exceptions_enable=False,
                  help="Ship trained linear-attention models to edge devices.")
JSON = typer.Option(False, "--json", help="Print machine-readable JSON instead of tables.")
_debug = {"on": bool(os.environ.get("EDGELIN_DEBUG"))}


def command(fn: Callable) -> Callable:
    """Register a command whose EdgelinErrors become one line on stderr and a non-zero exit."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        out = Output(kwargs.get("as_json", False))
        try:
            return fn(out, *args, **kwargs)
        except EdgelinError as exc:
            if _debug["on"]:
                raise
            out.error(exc.line())
            raise typer.Exit(exc.exit_code)
        except KeyboardInterrupt:
            out.error("interrupted")
            raise typer.Exit(130)
        except BrokenPipeError:  # `edgelin ... | head`: the reader left; nothing to report
            raise typer.Exit(0)
        except (typer.Exit, typer.Abort):
            raise
        except Exception as exc:  # a bug in edgelin: still one line unless --debug
            if _debug["on"]:
                raise
            out.error(f"internal error: {type(exc).__name__}: {exc}. Fix: re-run with --debug and report it")
            raise typer.Exit(3)

    import inspect

    sig = inspect.signature(fn)
    wrapper.__signature__ = sig.replace(parameters=list(sig.parameters.values())[1:])
    return app.command()(wrapper)


@app.callback()
def main_options(
    debug: bool = typer.Option(False, "--debug", help="Show full tracebacks on errors."),
    version: bool = typer.Option(False, "--version", help="Print the version and exit."),
) -> None:
    if version:
        typer.echo(f"edgelin {__version__}")
        raise typer.Exit(0)
    _debug["on"] = _debug["on"] or debug


@command
def families(out: Output, as_json: bool = JSON) -> None:
    """The families, their state tensors and what each target supports."""
    from edgelin.catalog import family_rows

    rows = family_rows()
    out.result(rows)
    out.table("Layer families", ["family", "update rule", "decay", "readout", "state (per layer)", "targets"],
              [[r["family"], r["rule"], r["decay"], r["readout"], "\n".join(r["state"]), r["targets"]] for r in rows])


@command
def devices(out: Output, as_json: bool = JSON) -> None:
    """Device profiles (devices/*.toml) and the targets each takes."""
    from edgelin.devices import DEVICES_DIR, load_devices

    profiles = load_devices()
    out.result([p.__dict__ for p in profiles.values()])
    out.table(f"Device profiles ({DEVICES_DIR})", ["device", "title", "targets", "compute", "precision", "state"],
              [[p.name, p.title, ", ".join(p.targets), p.compute, p.precision, p.state_dtype] for p in profiles.values()])


@command
def inspect(
    out: Output,
    checkpoint: Path = typer.Argument(..., help="Checkpoint directory (edgelin, fla or transformers format)."),
    as_json: bool = JSON,
) -> None:
    """Detected architecture, family per layer, parameters, state bytes, and where it can go (or why not)."""
    from edgelin.inspect import inspect_checkpoint

    report = inspect_checkpoint(checkpoint)
    out.result(report.to_dict())
    if not report.supported:
        raise EdgelinError(f"{checkpoint} cannot be exported", report.reason or "unsupported",
                           report.fix or "see the supported checkpoints in README.md")
    out.line(f"[bold]{checkpoint}[/]: {report.model_type} ({report.source}), {report.num_parameters:,} parameters"
             + (f" — {report.note}" if report.note else ""))
    kinds: dict[str, int] = {}
    for layer in report.layers:
        kinds[layer["type"]] = kinds.get(layer["type"], 0) + 1
    out.line("layers: " + ", ".join(f"{n} x {k}" for k, n in kinds.items()))
    growth = f" + {human_bytes(report.kv_bytes_per_token)} per token of context (full-attention KV cache)" \
        if report.kv_bytes_per_token else " (constant)"
    out.line(f"state per sequence: {human_bytes(report.state_bytes_per_sequence)}{growth}")
    out.table("Targets by device", ["device", "target", "ok", "why not"],
              [[r["device"], r["target"], "yes" if r["ok"] else "no", r["reason"] or ""] for r in report.targets])


@command
def export(
    out: Output,
    checkpoint: Path = typer.Argument(..., help="Checkpoint directory (config.json + safetensors), or a recipe folder."),
    target: str = typer.Option("onnx", "--target", "-t", help="Export target."),
    out_dir: Path = typer.Option(..., "--out", "-o", help="Output folder (must not exist unless --force)."),
    force: bool = typer.Option(False, "--force", help="Replace an existing output folder."),
    device: Optional[str] = typer.Option(None, "--device", help="Check the export against a device profile."),
    precision: str = typer.Option("fp32", "--precision", help="Compute precision of the graphs."),
    as_json: bool = JSON,
) -> None:
    """Export step + prefill graphs and manifest.json for a target."""
    from edgelin.devices import get_device
    from edgelin.export.base import ExportOptions
    from edgelin.export.pipeline import export_checkpoint

    profile = get_device(device) if device else None
    with out.progress(f"exporting {checkpoint} to {target}"):
        result = export_checkpoint(checkpoint, out_dir, target, force, profile, ExportOptions(precision=precision))
    m = result.manifest
    out.result({"folder": str(result.folder), "files": result.files, "manifest": m.to_dict()})
    out.table(f"Exported {checkpoint} -> {result.folder}", ["graph", "file", "inputs", "outputs"],
              [[kind, g.file, len(g.inputs), len(g.outputs)] for kind, g in m.graphs.items()])
    out.line(f"state per sequence: {human_bytes(m.state_bytes(1))} "
             f"({'constant' if m.constant_memory else 'grows with context'}); "
             f"layers: {', '.join(layer['type'] for layer in m.layers)}")


@command
def validate(
    out: Output,
    folder: Path = typer.Argument(..., help="An export folder."),
    steps: int = typer.Option(512, help="Decode steps rolled out after the prompt."),
    prompt_len: int = typer.Option(32, help="Prompt tokens (prefilled)."),
    batch: int = typer.Option(2, help="Sequences per batch."),
    rtol: Optional[float] = typer.Option(None, help="Max error relative to the reference's scale (default by precision)."),
    reference: Optional[Path] = typer.Option(None, help="Reference checkpoint (default: the one exported)."),
    seed: int = typer.Option(0),
    as_json: bool = JSON,
) -> None:
    """Roll out prefill + N steps through the exported graphs and compare with PyTorch at every step."""
    from edgelin.errors import ValidationFailed
    from edgelin.validate import validate as run_validate

    with out.progress("validating", total=2 * prompt_len + steps) as update:
        report = run_validate(folder, steps, prompt_len, batch, seed, rtol, reference,
                              on_progress=lambda done, total: update(done))
    out.result(report.to_dict())
    out.table(f"{folder}: {report.target} {report.precision}, batch {batch}, prompt {prompt_len}, {steps} steps "
              f"(threshold {report.threshold:g} relative)",
              ["check", "output", "max abs", "max rel", "worst step", "result"],
              [[m.check, m.output, m.max_abs, m.max_rel, "-" if m.worst_step is None else m.worst_step,
                "[green]ok[/]" if m.passed else "[red]FAIL[/]"] for m in report.metrics])
    if not report.passed:
        names = ", ".join(f"{m.check}/{m.output}" for m in report.failures[:5])
        raise ValidationFailed(f"{len(report.failures)} of {len(report.metrics)} checks failed ({names})",
                               f"errors exceed {report.threshold:g} of the reference's scale",
                               "inspect the table; re-export, or loosen --rtol only if the precision warrants it")
    out.line(f"[green]all {len(report.metrics)} checks passed[/] in {report.seconds:.1f} s")


@command
def bench(
    out: Output,
    folder: Path = typer.Argument(..., help="An export folder."),
    positions: str = typer.Option("1,1024,8192,32768", help="Context positions (comma-separated)."),
    batch: int = typer.Option(1),
    iters: int = typer.Option(200, help="Timed steps per position."),
    warmup: int = typer.Option(20),
    prefill_tokens: int = typer.Option(2048, help="Prompt length for prefill-vs-steps throughput (0: skip)."),
    baseline: Optional[str] = typer.Option(None, help="'kv': also measure a same-size KV-cache softmax model."),
    threads: Optional[int] = typer.Option(None, help="Runtime threads (default: the device's, else runtime's)."),
    device: Optional[str] = typer.Option(None, "--device", help="Device profile (threads, targets)."),
    as_json: bool = JSON,
) -> None:
    """Per-token latency at each context position, prefill throughput and memory."""
    from edgelin.bench import bench as run_bench
    from edgelin.devices import get_device

    try:
        points = [int(p) for p in positions.split(",") if p.strip()]
    except ValueError:
        raise EdgelinError(f"--positions {positions!r} is not a list of integers", "positions are token counts",
                           "e.g. --positions 1,1024,8192") from None
    profile = get_device(device) if device else None
    threads = threads or (profile.threads if profile and profile.threads else None)
    with out.progress("benchmarking") as update:
        report = run_bench(folder, points, batch, warmup, iters, prefill_tokens, baseline=baseline, threads=threads,
                           on_progress=lambda msg: update(description=msg))
    out.result(report.to_dict())
    out.table(f"{folder}: step latency ({report.target}, batch {batch}, {iters} steps per position)",
              ["model", "position", "p50 ms", "p90 ms", "p99 ms", "state", "RSS"],
              [[r.model, r.position, r.p50_ms, r.p90_ms, r.p99_ms, human_bytes(r.state_bytes), human_bytes(r.rss_bytes)]
               for r in report.positions])
    for label, tps in report.prefill_tokens_per_s.items():
        steps = report.steps_tokens_per_s[label]
        out.line(f"{label}: prefill {tps:,.0f} tok/s vs token-by-token steps {steps:,.0f} tok/s over "
                 f"{report.prefill_tokens} tokens ({tps / steps:.1f}x)")
    out.line(f"peak RSS {human_bytes(report.peak_rss_bytes)}")


@command
def generate(
    out: Output,
    folder: Path = typer.Argument(..., help="An export folder."),
    prompt: str = typer.Option(..., "--prompt", "-p"),
    max_new_tokens: int = typer.Option(200, "--max-new-tokens", "-n"),
    temperature: float = typer.Option(0.8),
    top_k: int = typer.Option(50),
    top_p: float = typer.Option(0.95),
    greedy: bool = typer.Option(False, help="Argmax decoding."),
    seed: int = typer.Option(0),
    threads: Optional[int] = typer.Option(None),
    as_json: bool = JSON,
) -> None:
    """Decode from a prompt with constant memory, streaming tokens to the terminal."""
    from edgelin.generate import Sampling
    from edgelin.generate import generate as run_generate

    sampling = Sampling(temperature, top_k, top_p, greedy, seed)
    out.stream(prompt)
    result = run_generate(folder, prompt, max_new_tokens, sampling, on_text=out.stream, keep_ids=as_json,
                          threads=threads)
    out.stream("\n")
    out.result(result.to_dict())
    out.line(f"[dim]{result.new_tokens} tokens, {result.tokens_per_second:,.0f} tok/s, prefill "
             f"{result.prompt_tokens} tokens in {result.prefill_seconds * 1e3:.1f} ms, RSS "
             f"{human_bytes(result.rss_start_bytes)} -> {human_bytes(result.rss_end_bytes)}[/]")


@command
def train(
    out: Output,
    recipe: Path = typer.Argument(..., help="A recipe.toml (recipes/*/recipe.toml)."),
    out_dir: Optional[Path] = typer.Option(None, "--out", "-o", help="Checkpoint folder (default: next to the recipe)."),
    steps: Optional[int] = typer.Option(None, help="Override the recipe's step count (smoke runs)."),
    as_json: bool = JSON,
) -> None:
    """Train a recipe on CPU into a checkpoint folder (config.json + safetensors + tokenizer.json)."""
    from edgelin.train import train as run_train

    with out.progress(f"training {recipe}", total=steps) as update:
        result = run_train(recipe, out_dir, steps, progress=lambda step, total, loss: update(
            step, description=f"step {step}/{total} loss {loss:.3f}"))
    out.result({"out_dir": str(result.out_dir), "final_val_loss": result.final_val_loss, "val_bpb": result.val_bpb,
                "wall_time_s": result.wall_time_s, "sample": result.sample})
    out.line(f"trained {recipe}: val loss {result.final_val_loss:.3f} nats/token, {result.val_bpb:.3f} bits/byte "
             f"in {result.wall_time_s:.0f} s -> {result.out_dir}")


def main() -> None:
    app()


if __name__ == "__main__":
    main()
