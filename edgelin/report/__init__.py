"""`edgelin report RESULTS... --out DIR`: a Markdown report and a self-contained HTML page, with PNG plots,
from `bench --json` and `validate --json` results, merged across runs and devices.

Results of one artifact (export folder content, by its hash) are plotted together, each series labelled
by what differs (threads, device, target, ...); results of different artifacts are grouped, one section
each, and the report says so. The folder is written like an export: into a temp folder renamed into
place, never over a folder edgelin did not write (`--force` replaces only an earlier report, whose
report.json lists every file). matplotlib is imported here only (`pip install 'edgelin[report]'`)."""

from __future__ import annotations

import dataclasses
import datetime
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from edgelin import __version__
from edgelin.errors import EdgelinError
from edgelin.outputs import OutputKind, claim_output
from edgelin.report.inputs import check_files
from edgelin.report.render import Block, Heading, Image, Paragraph, Table, Text, User, markdown, page
from edgelin.report.results import Group, Result, file_names, group, load_result

INDEX = "report.json"
FORMAT = "edgelin-report"
PLOTS = ("latency", "memory", "prefill", "parity")


def _owned_report(folder: Path) -> tuple[frozenset[str], str]:
    try:
        data = json.loads((folder / INDEX).read_text())
    except FileNotFoundError:
        return frozenset(), f"it has no {INDEX}"
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
        return frozenset(), f"its {INDEX} is unreadable ({type(exc).__name__})"
    files = data.get("files") if isinstance(data, dict) and data.get("format") == FORMAT else None
    if not (isinstance(files, list) and all(isinstance(n, str) and "/" not in n for n in files)):
        return frozenset(), f"its {INDEX} is not an edgelin report's"
    return frozenset(files) | {INDEX}, ""


REPORT = OutputKind("report", "an edgelin report", "partial", True, _owned_report, reads="the results files")


@dataclass(frozen=True)
class ReportSummary:
    folder: Path
    files: tuple[str, ...]
    results: int
    groups: tuple[str, ...]  # artifact hashes, in the order of the sections

    def to_dict(self) -> dict:
        return {"folder": str(self.folder), "files": list(self.files), "results": self.results,
                "artifacts": list(self.groups)}


def write_report(paths: list[Path], out: Path, force: bool = False,
                 on_progress: Callable[[int, int, str], None] | None = None) -> ReportSummary:
    """Read every results file (refused with one line naming a bad one before anything is written),
    draw the plots and write report.md, report.html and report.json into `out`."""
    if not paths:
        raise EdgelinError("no results files", "a report is made of bench/validate results",
                           "pass files written by `edgelin bench --json` or `edgelin validate --json`")
    paths = [Path(p) for p in paths]
    check_files(paths)  # all of them, by stat, before any is read
    results = [dataclasses.replace(load_result(p), name=name) for p, name in zip(paths, file_names(paths))]
    import importlib.util

    if importlib.util.find_spec("matplotlib") is None:
        raise EdgelinError("edgelin report needs matplotlib", "it draws the report's plots",
                           "pip install 'edgelin[report]'")
    groups = group(results)
    short = short_hashes([g.artifact for g in groups])
    total = len(groups) * len(PLOTS) + 1
    done = 0

    def tick(what: str) -> None:
        nonlocal done
        done += 1
        if on_progress:
            on_progress(done, total, what)

    with claim_output(out, force, REPORT, protected=[Path(p) for p in paths]) as tmp:
        blocks = _intro(results, groups, short)
        for g in groups:
            blocks += _section(g, groups, short, tmp, tick)
        (tmp / "report.md").write_text(markdown(blocks))
        (tmp / "report.html").write_text(page(blocks, tmp, "edgelin report"))
        files = sorted(p.name for p in tmp.iterdir())
        (tmp / INDEX).write_text(json.dumps({"format": FORMAT, "version": 1, "edgelin_version": __version__,
                                             "files": files, "results": [str(p) for p in paths],
                                             "artifacts": [g.artifact for g in groups]}, indent=1) + "\n")
        tick("report.md and report.html")
    return ReportSummary(Path(out), tuple(files + [INDEX]), len(results), tuple(g.artifact for g in groups))


def short_hashes(hashes: list[str]) -> dict[str, str]:
    """Each artifact hash (64 hex digits, checked) shortened to 12 digits, or more where two exports share
    the first 12: one section and one plot file name per export."""
    width = 12
    while len({h[:width] for h in hashes}) < len(hashes):
        width += 1
    return {h: h[:width] for h in hashes}


def _intro(results: list[Result], groups: list[Group], short: dict[str, str]) -> list[Block]:
    now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    blocks: list[Block] = [Heading("edgelin report", 1),
                           Paragraph(f"{len(results)} result file(s), written by edgelin {__version__} on {now}. "
                                     "Plots: edgelin's series are solid and coloured; the KV-cache baseline (a "
                                     "same-size transformer whose cache grows with the context) is dashed grey.")]
    if len(groups) > 1:
        blocks.append(Paragraph(
            f"These results measure {len(groups)} different exports (artifact hashes "
            + ", ".join(short[g.artifact] for g in groups) + "): they are grouped by artifact below, one section "
            "each; only results of the same export are plotted together.", note=True))
    rows = []
    for g in groups:
        for r, label in zip(g.results, g.labels):
            env = r.environment
            rows.append((User(r.shown), r.kind, User(label) if label else "-", _fact(env, "device"),
                         _fact(env, "cpu"), _fact(env, "gpu"), _fact(env, "os"),
                         (_fact(env, "runtime"), " ", _fact(env, "runtime_version")),
                         "default" if env.get("threads") is None else str(env.get("threads")),
                         _export(env),
                         short[r.artifact], _fact(env, "command")))
    blocks += [Heading("Results"), Table(("file", "kind", "series", "device", "CPU", "GPU", "OS", "runtime",
                                          "threads", "export", "artifact", "command"), tuple(rows))]
    return blocks


def _fact(env: dict, key: str) -> Text:
    """An environment fact (text or null, checked) as the tables show it."""
    return "-" if env.get(key) is None else User(env[key])


def _count(value: int | None) -> str:
    return "-" if value is None else str(value)


def _export(env: dict) -> tuple[str | User, ...]:
    """Target, precision and weights' quantisation, as the tables and headings name an export."""
    weights = (", ", User(env["quantization"])) if env.get("quantization") else ()
    return (_fact(env, "target"), " ", _fact(env, "precision")) + weights


def _section(g: Group, groups: list[Group], short: dict[str, str], folder: Path,
             tick: Callable[[str], None]) -> list[Block]:
    from edgelin.report import plots

    many = len(groups) > 1
    first = g.results[0].environment
    blocks: list[Block] = []
    if many:
        blocks.append(Heading((f"Export {short[g.artifact]} (", *_export(first), ")")))
    level = 3 if many else 2
    note = f"artifact {short[g.artifact]}"
    benches, validations = g.of("bench"), g.of("validate")
    suffix = f"-{short[g.artifact]}" if many else ""  # checked hex digits: never a file's text
    for name, draw, title, table in (
            ("latency", plots.latency, "Per-token latency vs context position", _latency_table),
            ("memory", plots.memory, "Memory vs context position", _memory_table),
            ("prefill", plots.prefill, "Prompt throughput", _prefill_table),
            ("parity", plots.parity, "Parity vs the reference", _validate_table)):
        file = f"{name}{suffix}.png"
        chosen = validations if name == "parity" else benches
        drawn = bool(chosen) and draw(chosen, folder / file, note)
        rows = table(chosen) if chosen else None
        if drawn or rows:
            blocks.append(Heading(title, level))
        if drawn:
            blocks.append(Image(file, title))
        if name == "parity" and validations and not drawn:
            blocks.append(Paragraph("No per-step errors in these results: `edgelin validate DIR --against CKPT "
                                    "--json` records the error at every decode step (the replay of the recorded "
                                    "reference vectors reports the worst error per check, below)."))
        if rows:
            blocks.append(rows)
        tick(f"{name} plot")
    return blocks


def _series_name(model: str, label: str) -> Text:
    base = "KV-cache baseline" if model == "kv-baseline" else User(model)
    return (base, " (", User(label), ")") if label else base


def _latency_table(benches: list[tuple[Result, str]]) -> Table:
    rows = [(_series_name(row["model"], label), f"{row['position']:,}", f"{row['p50_ms']:.3g}",
             f"{row['p90_ms']:.3g}", f"{row['p99_ms']:.3g}")
            for result, label in benches for row in result.data["positions"]]
    return Table(("series", "position", "p50 ms", "p90 ms", "p99 ms"), tuple(rows))


def _memory_table(benches: list[tuple[Result, str]]) -> Table:
    rows = [(_series_name(row["model"], label), f"{row['position']:,}", f"{row['state_bytes']:,}",
             f"{row['rss_bytes'] / (1 << 20):,.1f}")
            for result, label in benches for row in result.data["positions"]]
    return Table(("series", "position", "state bytes", "RSS MiB"), tuple(rows))


def _prefill_table(benches: list[tuple[Result, str]]) -> Table | None:
    rows = [(_series_name(model, label), _count(result.data.get("prefill_tokens")), f"{tps:,.0f}",
             f"{result.data['steps_tokens_per_s'].get(model, 0):,.0f}",
             f"{tps / max(result.data['steps_tokens_per_s'].get(model, 0), 1e-9):.1f}x")
            for result, label in benches for model, tps in result.data.get("prefill_tokens_per_s", {}).items()]
    return Table(("series", "prompt tokens", "prefill tok/s", "steps tok/s", "speed-up"), tuple(rows)) if rows else None


def _validate_table(validations: list[tuple[Result, str]]) -> Table:
    rows = []
    for result, label in validations:
        data, metrics = result.data, result.data["metrics"]
        worst = max(metrics, key=lambda m: float(m["max_rel"]), default=None)
        quality = data.get("quality") or {}
        change = quality.get("perplexity_change")
        rows.append((User(label or result.shown), _fact(data, "against"), _count(data.get("steps")),
                     f"{sum(m['passed'] for m in metrics)}/{len(metrics)}",
                     "-" if worst is None else (f"{float(worst['max_rel']):.2e} (", User(worst["check"]), "/",
                                                User(worst["output"]), ")"),
                     f"{data.get('threshold'):g}" if isinstance(data.get("threshold"), (int, float)) else "-",
                     "-" if quality.get("top1") is None else f"{quality['top1']:.2%}",
                     "-" if change is None else f"{change:+.2%}",
                     "passed" if data.get("passed") else "FAILED"))
    return Table(("series", "against", "steps", "checks ok", "worst relative error", "threshold", "top-1",
                  "perplexity change", "result"), tuple(rows))
