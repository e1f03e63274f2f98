"""The report's figures (matplotlib, Agg backend: no display needed). Each function draws one PNG from the
results of one artifact and returns False when it has nothing to draw. edgelin's series are coloured and
solid; the KV-cache baseline is grey and dashed, so it reads as the reference at a glance."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

from edgelin.output import escape_controls
from edgelin.report.results import Result

DPI = 110
SIZE = (8.0, 4.6)
BASELINE = "kv-baseline"
GREYS = ("0.45", "0.65", "0.3", "0.75")
MARKERS = ("o", "s", "^", "D", "v", "P")
LABEL_CHARS = 80  # of a legend entry from a results file (the tables give it whole)


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    # text.parse_math off: labels are text from results files (a file `cost_$5_vs_$10.json`), never TeX
    plt.rcParams.update({"text.parse_math": False, "text.usetex": False, "font.size": 10, "axes.titlesize": 12, "axes.titleweight": "bold",
                         "axes.grid": True, "grid.alpha": 0.3, "legend.fontsize": 9, "legend.framealpha": 0.9})
    return plt


def _text(text: str) -> str:
    """Text from a results file as a plot shows it: control characters escaped (no font has them), cut short."""
    flat = escape_controls(text)
    return flat if len(flat) <= LABEL_CHARS else flat[:LABEL_CHARS - 1] + "\u2026"


def _name(model: str, label: str) -> str:
    base = "KV-cache baseline" if model == BASELINE else _text(model)
    return f"{base} ({_text(label)})" if label else base


def _series(benches: list[tuple[Result, str]]) -> list[tuple[str, str, int, list[dict]]]:
    """(model, label, index of its result, rows sorted by position) for every model of every bench result."""
    out = []
    for i, (result, label) in enumerate(benches):
        models: dict[str, list[dict]] = {}
        for row in result.data["positions"]:
            models.setdefault(row["model"], []).append(row)
        for model, rows in models.items():
            out.append((model, label, i, sorted(rows, key=lambda r: r["position"])))
    return sorted(out, key=lambda s: (s[0] == BASELINE, s[2]))  # edgelin's first: the legend reads top-down


def _style(model: str, index: int) -> dict[str, Any]:
    marker = MARKERS[index % len(MARKERS)]
    # later series thinner and smaller: where two coincide (the same state bytes at 1 and 2 threads) both show
    shrink = min(index, 3)
    if model == BASELINE:
        return {"color": GREYS[index % len(GREYS)], "linestyle": "--", "marker": marker,
                "linewidth": 2.0 - 0.35 * shrink, "markersize": 7 - 1.2 * shrink, "markerfacecolor": "white"}
    return {"color": f"C{index % 10}", "linestyle": "-", "marker": marker, "linewidth": 2.6 - 0.5 * shrink,
            "markersize": 8 - 1.5 * shrink}


def _unit(values: list[float]) -> tuple[float, str]:
    top = max(values, default=0)
    for scale, unit in ((1 << 30, "GiB"), (1 << 20, "MiB"), (1 << 10, "KiB")):
        if top >= scale:
            return float(scale), unit
    return 1.0, "B"


def _finish(plt: Any, fig: Any, path: Path, note: str, bottom: float = 0.0) -> None:
    if note:
        fig.text(0.99, 0.01, note, ha="right", va="bottom", fontsize=7, color="0.4")
    with warnings.catch_warnings():  # long labels: savefig's bbox_inches="tight" still fits them in
        warnings.filterwarnings("ignore", "Tight layout not applied")
        fig.tight_layout(rect=(0, bottom or (0.03 if note else 0), 1, 1))
    fig.savefig(path, dpi=DPI, bbox_inches="tight")
    plt.close(fig)


def latency(benches: list[tuple[Result, str]], path: Path, note: str = "") -> bool:
    """p50 (solid or dashed line with markers) and p99 (thin dotted line, same colour) per-token latency vs
    context position, log-x; log-y when the values span more than 10x (a long p99 tail stays on the plot
    without flattening the p50s)."""
    series = _series(benches)
    if not series:
        return False
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(SIZE[0], SIZE[1] + 0.25 * len(series)))
    medians, tails = [], []
    for model, label, index, rows in series:
        x = [r["position"] for r in rows]
        p50, p99 = [r["p50_ms"] for r in rows], [r["p99_ms"] for r in rows]
        style = _style(model, index)
        ax.plot(x, p50, label=f"{_name(model, label)}: p50", **style)
        ax.plot(x, p99, color=style["color"], linestyle=":", linewidth=1.1, alpha=0.9)
        medians += p50
        tails += p99
    ax.set_xscale("log")
    positive = [v for v in medians if v > 0]
    if positive and max(positive + tails) / min(positive) > 10:
        ax.set_yscale("log")
    else:
        ax.set_ylim(bottom=0)
    ax.set_title("Per-token decode latency vs context position (lower is better)")
    ax.set_xlabel("context position (tokens already in the state; log scale)")
    ax.set_ylabel("latency per token (ms)")
    from matplotlib.lines import Line2D

    handles, names = ax.get_legend_handles_labels()
    handles.append(Line2D([], [], color="0.3", linestyle=":", linewidth=1.1))
    names.append("dotted, same colour: p99")
    _legend_below(ax, handles, names)
    _finish(plt, fig, path, note)
    return True


def _legend_below(ax: Any, handles: list, names: list[str]) -> None:
    ax.legend(handles, names, loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=2 if len(names) > 2 else 1,
              frameon=False)


def memory(benches: list[tuple[Result, str]], path: Path, note: str = "") -> bool:
    """State bytes per batch (recurrent state or KV cache) and process RSS vs position, log-x."""
    series = _series(benches)
    if not series:
        return False
    plt = _pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(SIZE[0] + 1.5, SIZE[1]))
    for ax, key, title in ((left, "state_bytes", "State held for the sequence"),
                           (right, "rss_bytes", "Process resident memory (RSS)")):
        scale, unit = _unit([r[key] for *_, rows in series for r in rows])
        for model, label, index, rows in series:
            ax.plot([r["position"] for r in rows], [r[key] / scale for r in rows], label=_name(model, label),
                    **_style(model, index))
        ax.set_xscale("log")
        ax.set_ylim(bottom=0)
        ax.set_title(title)
        ax.set_xlabel("context position (tokens; log scale)")
        ax.set_ylabel(unit)
    handles, names = left.get_legend_handles_labels()
    fig.legend(handles, names, loc="lower center", ncol=min(len(names), 2), frameon=False)
    fig.suptitle("Memory vs context position: constant state vs a growing KV cache", fontweight="bold")
    _finish(plt, fig, path, note, bottom=0.02 + 0.05 * ((len(names) + 1) // 2))
    return True


def prefill(benches: list[tuple[Result, str]], path: Path, note: str = "") -> bool:
    """Prompt throughput: chunked prefill vs token-by-token steps, one pair of bars per result."""
    rows = [(label, model, result.data["prefill_tokens_per_s"][model], result.data["steps_tokens_per_s"].get(model),
             result.data.get("prefill_tokens"))
            for result, label in benches for model in result.data.get("prefill_tokens_per_s", {})]
    if not rows:
        return False
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(SIZE[0], 1.6 + 0.75 * len(rows)))
    names = [_name(model, label) for label, model, *_ in rows]
    y = list(range(len(rows)))
    height = 0.38
    bars = ax.barh([v - height / 2 for v in y], [r[2] for r in rows], height, color="C0", label="chunked prefill")
    steps = ax.barh([v + height / 2 for v in y], [r[3] or 0 for r in rows], height, color="0.6",
                    label="token-by-token steps")
    for group in (bars, steps):
        ax.bar_label(group, labels=[f"{b.get_width():,.0f}" for b in group], padding=3, fontsize=8)
    ax.set_yticks(y, names)
    ax.invert_yaxis()
    ax.set_xlim(right=max(r[2] for r in rows) * 1.18)
    tokens = sorted({r[4] for r in rows if r[4]})
    ax.set_title("Prompt throughput" + (f" over {', '.join(map(str, tokens))} tokens" if tokens else "")
                 + " (higher is better)")
    ax.set_xlabel("tokens per second")
    ax.legend(loc="lower right")
    ax.grid(axis="y", visible=False)
    _finish(plt, fig, path, note)
    return True


def parity(validations: list[tuple[Result, str]], path: Path, note: str = "") -> bool:
    """validate --against: the worst relative error at every rollout step (logits, state), log-y, with the
    threshold as a red line."""
    drawn = [(r, label) for r, label in validations if r.data.get("step_errors")]
    if not drawn:
        return False
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=SIZE)
    thresholds = set()
    floor = 1e-12
    for index, (result, label) in enumerate(drawn):
        for output, style in (("logits", "-"), ("state", "--")):
            series = result.data["step_errors"].get(output)
            if not series or not series["max_rel"]:
                continue
            width = series["steps_per_point"]
            ax.plot([i * width for i in range(len(series["max_rel"]))], [max(v, floor) for v in series["max_rel"]],
                    color=f"C{index % 10}", linestyle=style, linewidth=1.4,
                    label=output + (f" ({_text(label)})" if label else ""))
        thresholds.add(result.data.get("threshold"))
    for threshold in sorted(t for t in thresholds if t):
        ax.axhline(threshold, color="red", linestyle=":", linewidth=1.5, label=f"threshold {threshold:g}")
    ax.set_yscale("log")
    ax.set_title("Parity with the PyTorch reference at every decode step")
    ax.set_xlabel("decode step after the prompt")
    # per step: |reference| of that step alone, so a point can sit above the check's figure (and the line),
    # which divides by the whole rollout's max |reference|: the plot is the stricter reading
    ax.set_ylabel("relative error (log scale)\nmax |exported - reference| / max |reference| of the step")
    handles, names = ax.get_legend_handles_labels()
    _legend_below(ax, handles, names)
    _finish(plt, fig, path, note)
    return True
