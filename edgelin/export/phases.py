"""The phases an export reports to its progress callback, in order: a leaf module, so the request (torch-free,
the CLI's progress total) and the pipeline (which reports them) both read one list without importing each other."""

from __future__ import annotations

from collections.abc import Sequence


def export_phases(baselines: Sequence[str] = (), serve: str | None = None) -> list[str]:
    """The phases export_model reports to on_progress, in order (a progress bar's total)."""
    return ["tracing the graphs", "recording reference vectors", "checking quality",
            *(["exporting baselines"] if baselines else []), *(["writing the Triton repository"] if serve else []),
            "writing the manifest"]
