"""`edgelin bench`: per-token step latency at context positions, prefill throughput, memory.

Position p is reached by (piecewise) prefill, never by p steps; then the same state is stepped
repeatedly, so every timed step sits exactly at position p. `baseline="kv"` exports a same-size
softmax-attention model with a growing KV cache the same way and measures it in the same run.
"""

from __future__ import annotations

import shutil
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np

from edgelin.errors import EdgelinError
from edgelin.export.base import Runner
from edgelin.export.manifest import Manifest
from edgelin.runtime import open_runner, peak_rss_bytes, prefill, rss_bytes


@dataclass
class PositionResult:
    model: str
    position: int
    p50_ms: float
    p90_ms: float
    p99_ms: float
    state_bytes: int
    rss_bytes: int


@dataclass
class BenchReport:
    folder: str
    target: str
    batch: int
    threads: int | None
    positions: list[PositionResult] = field(default_factory=list)
    prefill_tokens: int = 0
    prefill_tokens_per_s: dict[str, float] = field(default_factory=dict)
    steps_tokens_per_s: dict[str, float] = field(default_factory=dict)
    peak_rss_bytes: int = 0

    def to_dict(self) -> dict:
        return asdict(self)

    def latency(self, model: str, position: int) -> float:
        return next(r.p50_ms for r in self.positions if r.model == model and r.position == position)


def time_steps(runner: Runner, state, position: int, batch: int, warmup: int, iters: int) -> np.ndarray:
    """Milliseconds per step, all at `position`, always from the same input state."""
    token = np.zeros(batch, np.int64)
    pos = np.full(batch, position, np.int64)
    for _ in range(warmup):
        runner.step(token, state, pos)
    times = np.empty(iters)
    for i in range(iters):
        t0 = time.perf_counter()
        runner.step(token, state, pos)
        times[i] = time.perf_counter() - t0
    return times * 1e3


def measure(runner: Runner, label: str, positions: list[int], batch: int, warmup: int, iters: int,
            prefill_chunk: int, report: BenchReport, seed: int,
            on_progress: Callable[[str], None] | None) -> None:
    rng = np.random.default_rng(seed)
    state, reached = runner.initial_state(batch), 0
    for p in sorted(positions):
        if p > reached:  # continue the prefill from the last position reached
            if on_progress:
                on_progress(f"{label}: prefill to position {p}")
            ids = rng.integers(0, runner.manifest.vocab_size, (batch, p - reached), dtype=np.int64)
            _, state = prefill(runner, ids, state, start=reached, chunk=prefill_chunk)
            reached = p
        if on_progress:
            on_progress(f"{label}: {iters} steps at position {p}")
        ms = time_steps(runner, state, p, batch, warmup, iters)
        nbytes = sum(v.nbytes for v in state.values())
        report.positions.append(PositionResult(label, p, *np.percentile(ms, [50, 90, 99]).tolist(), nbytes,
                                               rss_bytes()))


def prefill_throughput(runner: Runner, tokens: int, batch: int, prefill_chunk: int, seed: int) -> tuple[float, float]:
    """(prefill tokens/s, token-by-token steps tokens/s) over the same `tokens`-long prompt."""
    ids = np.random.default_rng(seed).integers(0, runner.manifest.vocab_size, (batch, tokens), dtype=np.int64)
    prefill(runner, ids, chunk=prefill_chunk)  # warm-up at the timed shapes: the runtime plans per shape
    runs = []
    for _ in range(3):
        t0 = time.perf_counter()
        prefill(runner, ids, chunk=prefill_chunk)
        runs.append(time.perf_counter() - t0)
    prefill_s = float(np.median(runs))
    state = runner.initial_state(batch)
    for t in range(min(tokens, 16)):  # warm up the step session too
        runner.step(ids[:, t], state, np.full(batch, t, np.int64))
    t0 = time.perf_counter()
    for t in range(tokens):
        _, state = runner.step(ids[:, t], state, np.full(batch, t, np.int64))
    steps_s = time.perf_counter() - t0
    return batch * tokens / prefill_s, batch * tokens / steps_s


def kv_baseline(folder: Path, workdir: Path) -> Path:
    """Export a same-size softmax-attention LM with a growing KV cache (random weights: latency and
    memory do not depend on weight values) with the same target."""
    from edgelin.checkpoint import load_model
    from edgelin.export.pipeline import export_model
    from edgelin.model.config import AttentionConfig
    from edgelin.model.lm import CausalLM

    manifest = Manifest.load(folder)
    config = load_model(Path(manifest.source["path"]))[0].config
    heads = config.num_heads
    baseline = config.replace(
        layer_types=("softmax",) * config.num_layers, family_overrides={},
        attention=AttentionConfig(heads, heads, config.head_v_dim, window=None),
    )
    out = workdir / "kv-baseline"
    export_model(CausalLM(baseline).eval(), out, manifest.target, {"path": "(kv baseline)", "sha256": "",
                                                                   "format": "edgelin", "model_type": "edgelin"})
    return out


def bench(
    folder: Path,
    positions: list[int] = (1, 1024, 8192, 32768),
    batch: int = 1,
    warmup: int = 20,
    iters: int = 200,
    prefill_tokens: int = 2048,
    prefill_chunk: int = 2048,
    baseline: str | None = None,
    threads: int | None = None,
    seed: int = 0,
    on_progress: Callable[[str], None] | None = None,
) -> BenchReport:
    positions = sorted(set(int(p) for p in positions))
    if not positions or positions[0] < 1 or batch < 1 or iters < 1:
        raise EdgelinError("bad bench arguments", "positions, batch and iters must be >= 1",
                           "e.g. --positions 1,1024,8192")
    if baseline not in (None, "kv"):
        raise EdgelinError(f"unknown baseline {baseline!r}", "the one baseline is a KV-cache model", "use --baseline kv")
    runner = open_runner(folder, threads)
    report = BenchReport(str(folder), runner.manifest.target, batch, threads)
    measure(runner, "edgelin", positions, batch, warmup, iters, prefill_chunk, report, seed, on_progress)
    if prefill_tokens:
        if on_progress:
            on_progress(f"prefill vs steps over {prefill_tokens} tokens")
        report.prefill_tokens = prefill_tokens
        pf, st = prefill_throughput(runner, prefill_tokens, batch, prefill_chunk, seed)
        report.prefill_tokens_per_s["edgelin"], report.steps_tokens_per_s["edgelin"] = pf, st
    if baseline == "kv":
        workdir = Path(tempfile.mkdtemp(prefix="edgelin-kv-"))
        try:
            if on_progress:
                on_progress("exporting the KV-cache baseline")
            kv = open_runner(kv_baseline(Path(folder), workdir), threads)
            # Full attention over a growing cache: smaller prefill pieces bound the score matrix.
            measure(kv, "kv-baseline", positions, batch, warmup, iters, min(prefill_chunk, 1024), report, seed,
                    on_progress)
        finally:
            shutil.rmtree(workdir, ignore_errors=True)
    report.peak_rss_bytes = peak_rss_bytes()
    return report

