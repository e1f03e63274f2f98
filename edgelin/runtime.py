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
    """Refuse a state that does not fit the graphs or holds NaN/Inf, before it reaches a runtime."""
    for t in runner.manifest.state_inputs:
        if t.name not in state:
            raise EdgelinError(f"state input {t.name} is missing", "every past_key_values.* must be fed",
                               "start from runner.initial_state(batch)")
        value = state[t.name]
        fixed = [(axis, d) for axis, d in enumerate(t.dims) if isinstance(d, int)]
        if value.ndim != len(t.dims) or value.shape[0] != batch or any(value.shape[a] != d for a, d in fixed):
            raise EdgelinError(f"state input {t.name} has shape {list(value.shape)}",
                               f"the graph expects {list(t.dims)} with batch {batch}", "feed the state the "
                               "graphs returned, or runner.initial_state(batch)")
        if not np.isfinite(value).all():
            raise EdgelinError(f"state input {t.name} contains NaN or Inf", "the recurrence would propagate it "
                               "to every later token", "start from runner.initial_state(batch)")


def prefill(runner: Runner, ids: np.ndarray, state: State | None = None, start: int = 0,
            chunk: int = 2048) -> tuple[np.ndarray, State]:
    """Prefill ids [B, T] in pieces of at most `chunk` tokens (bounded memory for any T)."""
    ids = np.asarray(ids, np.int64)
    if ids.ndim != 2 or ids.shape[1] == 0:
        raise EdgelinError("the prompt is empty", "prefill needs at least one token", "pass a non-empty prompt")
    if ((ids < 0) | (ids >= runner.manifest.vocab_size)).any():
        raise EdgelinError("token id out of range", f"ids must be in [0, {runner.manifest.vocab_size})",
                           "use the tokenizer shipped with the export")
    batch = ids.shape[0]
    state = runner.initial_state(batch) if state is None else state
    check_state(runner, state, batch)
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
