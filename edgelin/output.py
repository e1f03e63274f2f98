"""The one output layer: rich tables and progress for people, JSON for machines (--json).

Every string handed to this layer is plain text: paths, names and messages are never parsed as rich
markup (a path like `ckpt[/y]` or a hint like `pip install 'edgelin[onnx]'` prints verbatim). Our
own styling is passed as `rich.text.Text` objects (`styled()`), never as markup in a string.

Control characters in that text (a path holding ESC sequences, a newline) are printed escaped (`\\e`,
`\\n`, `\\xNN`): no user text can restyle the terminal, set its title, or split an error over lines."""

from __future__ import annotations

import contextlib
import contextvars
import json
import re
import sys
import threading
import time
from typing import Any, Callable, Iterator, Sequence

from rich.console import Console
from rich.measure import Measurement
from rich.progress import BarColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn
from rich.table import Table
from rich.text import Span, Text

Update = Callable[..., None]  # update(completed=None, description=None, total=None)


def styled(text: str, style: str) -> Text:
    """Plain text with one of our styles: the only way styling enters the output."""
    return Text(text, style=style)


# C0 controls, DEL and C1 controls (\x9b is a one-byte CSI): each can start a terminal escape sequence.
# And the bytes of a path that are not UTF-8 (Python holds them as surrogates \udc80-\udcff), which
# would otherwise reach the terminal raw, or fail to encode.
_CONTROL = re.compile("[\x00-\x1f\x7f-\x9f\udc80-\udcff]")
_CONTROL_NO_NEWLINE = re.compile("[\x00-\x09\x0b-\x1f\x7f-\x9f\udc80-\udcff]")
_NAMED = {"\n": "\\n", "\r": "\\r", "\t": "\\t", "\x1b": "\\e"}


def _escape_char(match: re.Match[str]) -> str:
    char = match.group()
    code = ord(char) - 0xDC00 if ord(char) >= 0xDC80 else ord(char)  # a surrogate: the byte it stands for
    return _NAMED.get(char, f"\\x{code:02x}")


def escape_controls(text: str, keep_newlines: bool = False) -> str:
    """`text` with its control characters as visible escapes (`\\e`, `\\n`, `\\x07`)."""
    return (_CONTROL_NO_NEWLINE if keep_newlines else _CONTROL).sub(_escape_char, text)


def _safe(value: str | Text, keep_newlines: bool = False) -> Text:
    """`value` as a Text with its control characters escaped; a Text keeps its styles on the same characters."""
    if not isinstance(value, Text):
        return Text(escape_controls(str(value), keep_newlines))
    pattern = _CONTROL_NO_NEWLINE if keep_newlines else _CONTROL
    if not pattern.search(value.plain):
        return value
    # Escaping lengthens the text: map every old offset to its new one and move the spans with it.
    pieces, starts, position = [], [], 0
    for char in value.plain:
        starts.append(position)
        pieces.append(pattern.sub(_escape_char, char))
        position += len(pieces[-1])
    starts.append(position)
    end = len(value.plain)
    safe = Text("".join(pieces), style=value.style, justify=value.justify, overflow=value.overflow,
                no_wrap=value.no_wrap, end=value.end)
    safe.spans = [Span(starts[min(span.start, end)], starts[min(span.end, end)], span.style) for span in value.spans]
    return safe


# A front end that runs an edgelin command under its own syntax (`optimum-cli export edgelin`) names the
# options in error and warning lines its own way: it sets a rewrite of those lines for the call (spelled).
_SPELLING: contextvars.ContextVar[Callable[[str], str] | None] = contextvars.ContextVar("spelling", default=None)


@contextlib.contextmanager
def spelled(rewrite: Callable[[str], str]) -> Iterator[None]:
    """Error and warning lines written inside the block pass through `rewrite` (a front end's option names)."""
    token = _SPELLING.set(rewrite)
    try:
        yield
    finally:
        _SPELLING.reset(token)


def _spelled(text: str) -> str:
    rewrite = _SPELLING.get()
    return rewrite(text) if rewrite is not None else text


class Output:
    def __init__(self, as_json: bool = False):
        self.as_json = as_json
        # emoji=False: a path containing `:smile:` must not become a glyph; markup is off per call.
        self.console = Console(highlight=False, emoji=False)
        # Bound to the stream of now: a library that redirects sys.stderr for a while (the ONNX exporter's chatter)
        # must not swallow the progress heartbeat.
        self.err = Console(file=sys.stderr, highlight=False, emoji=False)

    # ---- people --------------------------------------------------------------------------------
    def table(self, title: str, columns: Sequence[str], rows: Sequence[Sequence[Any]]) -> None:
        """Cells are plain text unless given as `Text` (status cells)."""
        if self.as_json:
            return
        # The title is a line of its own: as a table title it would wrap at the table's width and
        # split a long path across lines.
        self.console.print(styled(escape_controls(title), "italic"), soft_wrap=True)
        table = Table()
        for i, col in enumerate(columns):
            numeric = all(isinstance(row[i], (int, float)) for row in rows if row[i] not in ("-", None))
            # fold: on a narrow terminal a long cell wraps instead of being cut off (no text lost)
            table.add_column(_safe(col), justify="right" if numeric and rows else "left", overflow="fold")
        for row in rows:
            # a cell may hold lines of its own ("\n"-joined): those stay, other control characters do not
            table.add_row(*[_safe(v if isinstance(v, Text) else _cell(v), keep_newlines=True) for v in row])
        if self.console.is_terminal:
            self.console.print(table)
            return
        # Piped or logged: as wide as the content needs, so no name is split across lines
        # (print(width=...) cannot exceed the console's width, so the console is widened for it).
        wide = self.console.options.update_width(1 << 16)
        width, self.console.width = self.console.width, max(self.console.width,
                                                             Measurement.get(self.console, wide, table).maximum)
        try:
            self.console.print(table, crop=False)
        finally:
            self.console.width = width

    def line(self, text: str | Text) -> None:
        """One line on stdout; a `str` is printed verbatim (no markup), a `Text` keeps its styles."""
        if not self.as_json:
            self.console.print(_safe(text, keep_newlines=True), soft_wrap=True)

    def note(self, text: str | Text) -> None:
        """A side remark on stderr (statistics, hints): stdout stays the command's product."""
        if not self.as_json:
            self.err.print(_safe(styled(text, "dim") if isinstance(text, str) else text, keep_newlines=True),
                           soft_wrap=True)

    def warning(self, text: str) -> None:
        """`warning: TEXT` on stderr; with --json nothing: the command puts its warnings in its result."""
        if not self.as_json:
            self.err.print(Text.assemble(("warning:", "bold yellow"), " ", escape_controls(_spelled(text))),
                           soft_wrap=True)

    def stream(self, text: str) -> None:
        """Raw text as it is produced (generation), never wrapped or re-styled."""
        if not self.as_json:
            sys.stdout.write(text)
            sys.stdout.flush()

    def error(self, text: str) -> None:
        """The whole message is user text (it embeds paths and pip hints): printed without markup, on one
        line (control characters escaped). JSON escapes them itself (ensure_ascii: as \\u001b, \\u009b)."""
        text = _spelled(text)
        if self.as_json:
            print(json.dumps({"error": text}), file=sys.stderr)
        else:
            self.err.print(Text.assemble(("error:", "bold red"), " ", escape_controls(text)), soft_wrap=True)

    @contextlib.contextmanager
    def progress(self, description: str, total: int | None = None) -> Iterator[Update]:
        """Yields update(completed=None, description=None, total=None) (`total`: once the work is known).

        On a terminal: a transient rich bar on stderr. Off a terminal (CI logs, pipes): plain,
        rate-limited lines on stderr so a long run shows life. With --json: nothing."""
        if self.as_json:
            yield lambda completed=None, description=None, total=None: None
            return
        if not self.err.is_terminal:
            # "progress:" like "error:"/"warning:": a log reader (or a test) can tell the kinds apart.
            log = LogProgress(lambda line: self.err.print(Text.assemble(("progress:", "dim"), " ",
                                                                        escape_controls(line)), soft_wrap=True),
                              description, total)
            try:
                yield log.update
            except BaseException:
                log.close(ok=False)
                raise
            log.close(ok=True)
            return
        text = TextColumn("{task.description}", markup=False)
        columns = [SpinnerColumn(), text, BarColumn(), TextColumn("{task.completed}/{task.total}"),
                   TimeElapsedColumn()] if total else [SpinnerColumn(), text, TimeElapsedColumn()]
        with Progress(*columns, console=self.err, transient=True) as bar:
            task = bar.add_task(escape_controls(description), total=total)

            def update(completed: int | None = None, description: str | None = None,
                       total: int | None = None) -> None:
                bar.update(task, **({"completed": completed} if completed is not None else {}),
                           **({"description": escape_controls(description)} if description else {}),
                           **({"total": total} if total else {}))

            yield update

    # ---- machines ------------------------------------------------------------------------------
    def result(self, data: Any) -> None:
        if self.as_json:
            print(json.dumps(data, indent=2, default=str))


class LogProgress:
    """Progress as log lines: the description when it changes, the count every 10 %, a heartbeat
    while nothing changes; at most one line every `min_gap` seconds (a fast loop must not flood a
    CI log), and a final line with the elapsed time."""

    def __init__(self, emit: Callable[[str], None], description: str, total: int | None = None,
                 min_gap: float = 5.0, heartbeat: float = 15.0):
        self.emit, self.description, self.total = emit, description, total
        self.min_gap, self.heartbeat = min_gap, heartbeat
        self.completed: int | None = None
        self.decile = 0
        self.started = self.last = time.monotonic()
        self.lock = threading.Lock()
        self.stopped = threading.Event()
        self.emit(f"{description} ...")
        # A daemon thread only for the heartbeat: an export is one long call with no updates.
        self.thread = threading.Thread(target=self._beat, daemon=True)
        self.thread.start()

    def update(self, completed: int | None = None, description: str | None = None, total: int | None = None) -> None:
        with self.lock:
            news = False
            self.total = total or self.total
            if description and description != self.description:
                self.description, news = description, True
            if completed is not None:
                self.completed = completed
                if self.total:
                    decile = min(10, 10 * completed // self.total)
                    news = news or decile > self.decile
                    self.decile = max(decile, self.decile)
            if news and time.monotonic() - self.last >= self.min_gap:
                self._emit()

    def close(self, ok: bool) -> None:
        self.stopped.set()
        self.thread.join()
        if ok:
            self.emit(f"{self.description}: done in {time.monotonic() - self.started:.1f} s")

    def _beat(self) -> None:
        while not self.stopped.wait(min(1.0, self.heartbeat)):
            with self.lock:
                if time.monotonic() - self.last >= self.heartbeat:
                    self._emit()

    def _emit(self) -> None:
        self.last = time.monotonic()
        self.emit(self._format())

    def _format(self) -> str:
        elapsed = f"{time.monotonic() - self.started:.0f} s"
        if self.completed is None:
            return f"{self.description} ... ({elapsed})"
        if self.total:
            percent = 100 * self.completed // self.total
            return f"{self.description}: {self.completed}/{self.total} ({percent}%, {elapsed})"
        return f"{self.description}: {self.completed} ({elapsed})"


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
