"""Running an exported folder: open its runner, prefill long prompts piecewise, measure memory."""

from __future__ import annotations

import resource
from pathlib import Path

import numpy as np

from edgelin.errors import EdgelinError
from edgelin.export.base import Runner, State
from edgelin.export.manifest import Manifest
from edgelin.export.targets import get_target


def open_runner(folder: Path, threads: int | None = None) -> Runner:
    manifest = Manifest.load(folder)
    target = get_target(manifest.target)
    reason = target.unavailable_reason()
    if reason:
        raise EdgelinError(f"cannot run a {manifest.target} export here", reason,
                           f"install edgelin[{target.extra}] or run on a machine that has it")
    kwargs = {"threads": threads} if threads else {}
    return target.runner(Path(folder), manifest, **kwargs)


def check_state(runner: Runner, state: State, batch: int) -> None:
    """Refuse a state that does not fit the graphs or holds NaN/Inf (the runner's own check)."""
    runner.check_state(state, batch)


def prefill(runner: Runner, ids: np.ndarray, state: State | None = None, start: int = 0,
            chunk: int = 2048) -> tuple[np.ndarray, State]:
    """Prefill ids [B, T] in pieces of at most `chunk` tokens (bounded memory for any T).
    runner.prefill checks every piece (ids, positions, state) before it reaches the runtime."""
    ids = np.asarray(ids)
    if ids.ndim != 2:
        raise EdgelinError(f"prefill ids have shape {list(ids.shape)}", "prefill takes [batch, tokens]",
                           "pass a 2-D array, e.g. ids[None] for one sequence")
    if ids.shape[1] == 0:
        raise EdgelinError("the prompt is empty", "prefill needs at least one token", "pass a non-empty prompt")
    if chunk < 1:
        raise EdgelinError(f"prefill chunk {chunk}", "a piece holds at least one token", "pass chunk >= 1")
    batch = ids.shape[0]
    state = runner.initial_state(batch) if state is None else state
    logits = None
    for lo in range(0, ids.shape[1], chunk):
        piece = ids[:, lo:lo + chunk]
        logits, state = runner.prefill(piece, state, np.full(batch, start + lo, np.int64))
    return logits, state


def rss_bytes() -> int:
    """Current resident set size (Linux /proc; falls back to the peak elsewhere)."""
    try:
        with open("/proc/self/statm") as fh:
            import os

            return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return peak_rss_bytes()


def peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
