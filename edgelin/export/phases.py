"""The phases an export reports to its progress callback, in order: a leaf module, so the request (torch-free,
the CLI's progress total) and the pipeline (which reports them) both read one list without importing each other."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from contextvars import ContextVar

_LISTENER: ContextVar[Callable[[str], None] | None] = ContextVar("edgelin_export_step", default=None)


def export_phases(baselines: Sequence[str] = (), serve: str | None = None) -> list[str]:
    """The phases export_model reports to on_progress, in order (a progress bar's total)."""
    return ["tracing the graphs", "recording reference vectors", "checking quality",
            *(["exporting baselines"] if baselines else []), *(["writing the Triton repository"] if serve else []),
            "writing the manifest"]


@contextlib.contextmanager
def reporting(listener: Callable[[str], None]) -> Iterator[None]:
    """Within it, `step(what)` calls `listener(what)`: the pipeline passes the steps of its current phase on to
    the progress line (at real sizes a phase takes minutes)."""
    token = _LISTENER.set(listener)
    try:
        yield
    finally:
        _LISTENER.reset(token)


def step(what: str) -> None:
    """A step inside the current export phase (e.g. "prefill.onnx: quantising"), for the progress line; a no-op
    outside an export that reports progress."""
    listener = _LISTENER.get()
    if listener is not None:
        listener(what)
