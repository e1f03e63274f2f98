"""The one output layer: rich tables and progress for people, JSON for machines (--json)."""

from __future__ import annotations

import contextlib
import json
import sys
from typing import Any, Iterator, Sequence

from rich.console import Console
from rich.progress import BarColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn
from rich.table import Table


class Output:
    def __init__(self, as_json: bool = False):
        self.as_json = as_json
        self.console = Console(highlight=False)
        self.err = Console(stderr=True, highlight=False)

    # ---- people --------------------------------------------------------------------------------
    def table(self, title: str, columns: Sequence[str], rows: Sequence[Sequence[Any]]) -> None:
        if self.as_json:
            return
        table = Table(title=title, title_justify="left")
        for i, col in enumerate(columns):
            numeric = all(isinstance(row[i], (int, float)) for row in rows if row[i] not in ("-", None))
            table.add_column(col, justify="right" if numeric and rows else "left", overflow="fold")
        for row in rows:
            table.add_row(*[_cell(v) for v in row])
        self.console.print(table)

    def line(self, text: str, style: str | None = None) -> None:
        if not self.as_json:
            self.console.print(text, style=style, markup=style is None)

    def stream(self, text: str) -> None:
        """Raw text as it is produced (generation), never wrapped or re-styled."""
        if not self.as_json:
            sys.stdout.write(text)
            sys.stdout.flush()

    def error(self, text: str) -> None:
        self.err.print(f"[bold red]error:[/] {text}", markup=True, soft_wrap=True) if not self.as_json else \
            print(json.dumps({"error": text}), file=sys.stderr)

    @contextlib.contextmanager
    def progress(self, description: str, total: int | None = None) -> Iterator[Any]:
        """Yields update(completed=None, description=None). Silent in JSON mode or off a terminal."""
        if self.as_json or not self.err.is_terminal:
            yield lambda completed=None, description=None: None
            return
        columns = [SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                   TimeElapsedColumn()] if total else [SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn()]
        with Progress(*columns, console=self.err, transient=True) as bar:
            task = bar.add_task(description, total=total)

            def update(completed: int | None = None, description: str | None = None) -> None:
                bar.update(task, **({"completed": completed} if completed is not None else {}),
                           **({"description": description} if description else {}))

            yield update

    # ---- machines ------------------------------------------------------------------------------
    def result(self, data: Any) -> None:
        if self.as_json:
            print(json.dumps(data, indent=2, default=str))


def _cell(value: Any) -> str:
    if isinstance(value, float):
        if value == 0:
            return "0"
        return f"{value:.3g}" if abs(value) < 1e-2 or abs(value) >= 1e5 else f"{value:.4g}"
    return str(value)


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n:.1f} GiB"
