"""The CLI's `train` and `report` commands (edgelin.cli holds the others; both register on one app)."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from edgelin.cli_support import JSON, command
from edgelin.output import Output


@command
def train(
    out: Output,
    recipe: Path = typer.Argument(..., help="A recipe.toml (recipes/*/recipe.toml)."),
    out_dir: Optional[Path] = typer.Option(
        None, "--out", "-o", help="Checkpoint folder (default: a fresh runs/<recipe folder name>, or -2, -3... "
                                  "if taken, under the current folder; never the recipe's own folder)."),
    force: bool = typer.Option(False, "--force", help="Write into an existing --out: replaces a checkpoint edgelin "
                                                      "trained (config, weights, tokenizer, log), keeps other files."),
    steps: Optional[int] = typer.Option(None, help="Override the recipe's step count (smoke runs)."),
    seed: Optional[int] = typer.Option(None, help="Override the recipe's [train] seed (seed studies)."),
    device: str = typer.Option("cpu", help="Where to train: cpu, cuda or cuda:N (an NVIDIA GPU)."),
    as_json: bool = JSON,
) -> None:
    """Train a recipe (on CPU, or --device cuda) into a checkpoint folder (config.json + safetensors + tokenizer.json)."""
    from edgelin.train import train as run_train

    with out.progress(f"training {recipe}", total=steps) as update:
        result = run_train(recipe, out_dir, steps, progress=lambda step, total, loss: update(
            step, description=f"step {step}/{total} loss {loss:.3f}"), force=force, seed=seed, device=device)
    out.result({"out_dir": str(result.out_dir), "final_val_loss": result.final_val_loss, "val_bpb": result.val_bpb,
                "wall_time_s": result.wall_time_s, "sample": result.sample})
    out.line(f"trained {recipe}: val loss {result.final_val_loss:.3f} nats/token, {result.val_bpb:.3f} bits/byte "
             f"in {result.wall_time_s:.0f} s -> {result.out_dir}")


@command
def report(
    out: Output,
    results: list[Path] = typer.Argument(..., help="Results files: what `bench --json` and `validate --json` wrote."),
    out_dir: Path = typer.Option(..., "--out", "-o", help="Report folder (must not exist unless --force)."),
    force: bool = typer.Option(False, "--force", help="Replace an existing report folder that edgelin wrote."),
    as_json: bool = JSON,
) -> None:
    """A Markdown report and a self-contained HTML page with plots (latency and memory vs context position
    against the KV-cache baseline, prompt throughput, parity vs step), merging results across runs and devices."""
    from edgelin.report import PLOTS, short_hashes, write_report

    with out.progress("writing the report", total=len(PLOTS) + 1) as update:
        summary = write_report(results, out_dir, force,
                               on_progress=lambda done, total, what: update(done, description=what, total=total))
    out.result(summary.to_dict())
    if len(summary.groups) > 1:
        out.line(f"{len(summary.groups)} different exports among the results (artifact hashes "
                 f"{', '.join(short_hashes(list(summary.groups)).values())}): one section each")
    out.line(f"wrote {out_dir}: {', '.join(summary.files)} from {summary.results} result file(s); open "
             f"{out_dir / 'report.html'} in a browser, or read {out_dir / 'report.md'}")
