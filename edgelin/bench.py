"""`edgelin bench`: per-token step latency at context positions, prefill throughput, memory.

Position p is reached by (piecewise) prefill, never by p steps. The steps are then timed on forks of
that state (runner.fork: the state reached stays at p for the next position). A constant-memory
model's step does the same work at every position: the timed steps run on one fork that advances
as it goes (timed step i sits at p + i). A growing KV cache's step cost grows with the position:
every timed step starts from a fresh fork of the state at p, so every one sits exactly at p.
`baseline="kv"` measures, the same way
and in the same run, the same-size softmax-attention model with a growing KV cache that
`edgelin export --baseline kv` wrote into the folder (DIR/baseline-kv: nothing is exported here).

Before anything runs, every position is checked against what this machine can do: the state at
that position plus a prefill call's working memory must fit in the available memory, and the
prefill to reach it (timed on one piece) must finish within `max_seconds`. Prompt ids are drawn
piece by piece, so no [batch, position] array is ever allocated.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Iterator

import numpy as np

from edgelin.devices import DeviceProfile
from edgelin.environment import available_memory, environment
from edgelin.errors import EdgelinError
from edgelin.export.base import Runner, StateHandle
from edgelin.artifact.manifest import Manifest
from edgelin.runtime import open_runner, peak_rss_bytes, prefill, rss_bytes, runner_label

MAX_SECONDS = 3600.0  # a bench plan estimated to take longer is refused before it starts


@dataclass
class PositionResult:
    model: str
    position: int
    p50_ms: float
    p90_ms: float
    p99_ms: float
    state_bytes: int
    rss_bytes: int
    # None: state_bytes is the state held at the position. A fixed-capacity KV cache (export --kv-cache static
    # --context N): N, and state_bytes is the state as allocated from new_state on (N positions), whatever the
    # position: what the sequence takes in memory.
    state_capacity: int | None = None


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
    disk_bytes: dict[str, int] = field(default_factory=dict)  # every file of the folder (disk_usage)
    runtime_bytes: int = 0  # what the runner loads: graphs + weights file (the manifest's graphs and weights)
    load_rss_bytes: int = 0  # resident memory added by opening the runner and a first step + prefill
    load_pss_bytes: int | None = None  # the same as PSS (Linux): a page mapped twice counts once
    runner: str = ""  # which runtime ran it (edgelin.runtime.runner_label)
    iters: int = 0  # timed steps per position
    warmup: int = 0
    environment: dict = field(default_factory=dict)  # what it ran on (edgelin.environment)

    def footprint_line(self) -> str:
        """One line for people: bytes on disk and in memory (method in load_memory's docstring), and what the
        state column means for a fixed-capacity KV cache."""
        pss = f", PSS +{human(self.load_pss_bytes)}" if self.load_pss_bytes is not None else ""
        capacities = sorted({r.state_capacity for r in self.positions if r.state_capacity is not None})
        static = (f"; state: allocated at the fixed KV cache capacity ({', '.join(f'{c:,}' for c in capacities)} "
                  "tokens), whatever the position" if capacities else "")
        return (f"on disk: {human(self.runtime_bytes)} loaded by the runner (graphs + weights), "
                f"{human(sum(self.disk_bytes.values()))} in the folder; in memory after loading and a first step "
                f"+ prefill: RSS +{human(self.load_rss_bytes)}{pss}; peak RSS {human(self.peak_rss_bytes)}{static}")

    def to_dict(self) -> dict:
        data = asdict(self)
        return {"environment": data.pop("environment"), **data}  # first: what a reader checks first

    def latency(self, model: str, position: int) -> float:
        return next(r.p50_ms for r in self.positions if r.model == model and r.position == position)


def time_steps(runner: Runner, state: StateHandle, position: int, batch: int, warmup: int, iters: int
               ) -> np.ndarray:
    """Milliseconds per step, `state` itself left at `position`. A constant-memory state: `warmup`
    untimed steps on a fork, then `iters` timed steps on another fork, step i at position + i (the
    work per step does not depend on the position). A growing cache, whose step cost does: every
    step starts from a fresh fork of `state` (made outside the clock; for ONNX Runtime a fork of a
    growing cache shares its buffers, nothing is copied), so every timed step sits exactly at `position`."""
    token = np.zeros(batch, np.int64)
    exact = not runner.manifest.constant_memory
    positions = [np.full(batch, position + (0 if exact else i), np.int64) for i in range(max(warmup, iters))]
    warm = runner.fork(state)
    for i in range(warmup):
        runner.step(token, runner.fork(state) if exact else warm, positions[i])
    del warm
    timed = runner.fork(state)
    times = np.empty(iters)
    for i in range(iters):
        if exact:
            timed = runner.fork(state)
        t0 = time.perf_counter()
        runner.step(token, timed, positions[i])
        times[i] = time.perf_counter() - t0
    return times * 1e3


def random_pieces(seed: int, vocab: int, batch: int, tokens: int, chunk: int) -> Iterator[tuple[int, np.ndarray]]:
    """(offset, ids [batch, <= chunk]) covering `tokens` random ids, drawn piece by piece (the same
    pieces for the same seed) so a long prompt never exists as one array."""
    rng = np.random.default_rng(seed)
    for lo in range(0, tokens, chunk):
        yield lo, rng.integers(0, vocab, (batch, min(chunk, tokens - lo)), dtype=np.int64)


def measure(runner: Runner, label: str, positions: list[int], batch: int, warmup: int, iters: int,
            prefill_chunk: int, report: BenchReport, seed: int,
            on_progress: Callable[[str], None] | None, on_done: Callable[[], None] | None = None) -> None:
    state, reached = runner.new_state(batch), 0
    for p in sorted(positions):
        if p > reached:  # continue the prefill from the last position reached
            if on_progress:
                on_progress(f"{label}: prefill to position {p}")
            for lo, ids in random_pieces(seed + reached, runner.manifest.vocab_size, batch, p - reached,
                                         prefill_chunk):
                prefill(runner, ids, state, start=reached + lo, chunk=prefill_chunk)  # advances `state`
            reached = p
        if on_progress:
            on_progress(f"{label}: {iters} steps at position {p}")
        ms = time_steps(runner, state, p, batch, warmup, iters)
        # a growing cache holds p positions here; a fixed-capacity one holds its capacity from new_state on
        capacity = runner.manifest.kv_capacity
        nbytes = runner.manifest.state_bytes(batch, past=p if capacity is None else capacity)
        report.positions.append(PositionResult(label, p, *np.percentile(ms, [50, 90, 99]).tolist(), nbytes,
                                               rss_bytes(), capacity))
        if on_done:
            on_done()


def disk_usage(folder: Path) -> dict[str, int]:
    """Bytes on disk of every file under an export folder, by path relative to it."""
    folder = Path(folder)
    return {str(p.relative_to(folder)): p.stat().st_size for p in sorted(folder.rglob("*")) if p.is_file()}


def files_bytes(disk: dict[str, int], names: list[str]) -> int:
    """Bytes of the named files in `disk` (disk_usage), a named folder (a Core ML .mlpackage, a Core AI asset)
    counting every file under it."""
    return sum(size for path, size in disk.items() if any(path == n or path.startswith(n + "/") for n in names))


def runtime_files(manifest: Manifest) -> list[str]:
    """The files a runner loads: the graphs and, where the export shares one, the weights file."""
    weights = manifest.extra.get("weights", {}).get("file")
    return sorted({g.file for g in manifest.graphs.values()} | ({weights} if weights else set()))


def pss_bytes() -> int | None:
    """Proportional set size (Linux /proc/self/smaps_rollup; None elsewhere): like RSS, but a page
    mapped several times (one weights file mapped by two sessions) counts once."""
    try:
        with open("/proc/self/smaps_rollup") as fh:
            for line in fh:
                if line.startswith("Pss:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def load_memory(folder: Path, threads: int | None, device: "DeviceProfile | None") -> tuple[Runner, int, int | None]:
    """(runner, RSS delta, PSS delta): resident memory added by opening the runner on `folder` and
    running one step and one 16-token prefill (mapped weights are paged in as they are first read, so
    a first call is needed to count them), measured as process RSS / PSS after minus before. The
    runtime library is imported before the first reading: its code pages are not the model's."""
    import contextlib
    import gc
    import importlib

    for module in ("onnxruntime",):  # the ONNX family's runtime (a missing one is refused by open_runner)
        with contextlib.suppress(ImportError):
            importlib.import_module(module)
    gc.collect()  # garbage of earlier work freed now, not during the load (it would count against it)
    rss, pss = rss_bytes(), pss_bytes()
    runner = open_runner(folder, threads, device)  # refused here if this machine cannot run the target
    state = runner.new_state(1)
    position = np.zeros(1, np.int64) if runner.manifest.needs_position else None
    runner.step(np.zeros(1, np.int64), state, position)
    runner.prefill(np.zeros((1, 16), np.int64), state, None if position is None else position + 1)
    after = pss_bytes()
    return runner, rss_bytes() - rss, (after - pss) if after is not None and pss is not None else None


def prefill_throughput(runner: Runner, tokens: int, batch: int, prefill_chunk: int, seed: int) -> tuple[float, float]:
    """(prefill tokens/s, token-by-token steps tokens/s) over the same `tokens`-long prompt."""
    vocab = runner.manifest.vocab_size

    def run_prefill() -> None:
        state = runner.new_state(batch)
        for lo, ids in random_pieces(seed, vocab, batch, tokens, prefill_chunk):
            prefill(runner, ids, state, start=lo, chunk=prefill_chunk)

    run_prefill()  # warm-up at the timed shapes: the runtime plans per shape
    runs = []
    for _ in range(3):
        t0 = time.perf_counter()
        run_prefill()
        runs.append(time.perf_counter() - t0)
    prefill_s = float(np.median(runs))
    state = runner.new_state(batch)
    first = next(random_pieces(seed, vocab, batch, tokens, prefill_chunk))[1]
    for t in range(min(first.shape[1], 16)):  # warm up the step session too (on a state then dropped)
        runner.step(first[:, t], state, np.full(batch, t, np.int64))
    state = runner.new_state(batch)
    t0 = time.perf_counter()
    for lo, ids in random_pieces(seed, vocab, batch, tokens, prefill_chunk):
        for t in range(ids.shape[1]):
            runner.step(ids[:, t], state, np.full(batch, lo + t, np.int64))
    steps_s = time.perf_counter() - t0
    return batch * tokens / prefill_s, batch * tokens / steps_s


# ---- what this machine can reach -----------------------------------------------------------------
def memory_needed(manifest: Manifest, position: int, batch: int, chunk: int) -> int:
    """Bytes a prefill piece ending at `position` needs, estimated from the manifest: the state fed in
    and the state returned (a growing KV cache at its length), the ids piece and the last logits,
    and for a growing cache the attention scores of one layer at a time ([batch, heads, piece,
    past + piece] floats, and the softmax of them; the cache's kv heads stand in for the heads)."""
    piece = min(chunk, position)
    state = manifest.state_bytes(batch, past=position if manifest.kv_capacity is None else manifest.kv_capacity)
    scores = max((batch * int(t.dims[1]) * piece * position * 4 for t in manifest.state_inputs
                  if "past_sequence" in t.dims and (t.state_role or t.state_name) == "key"), default=0)
    return 2 * state + 2 * scores + batch * piece * 8 + batch * manifest.vocab_size * 4


def check_memory(manifest: Manifest, label: str, positions: list[int], batch: int, chunk: int,
                 available: int | None) -> None:
    if available is None:
        return
    for p in positions:
        need = memory_needed(manifest, p, batch, chunk)
        if need > available:
            raise EdgelinError(f"{label}: position {p} does not fit in memory",
                               f"the state at that position plus a prefill piece need about {human(need)}, and "
                               f"{human(available)} is available", "pick smaller --positions (or a smaller --batch)")


PROBE_STEPS = 4  # steps check_time times (after one untimed) to estimate a plan's run time


def check_time(runner: Runner, positions: list[int], prefill_tokens: int, batch: int, chunk: int,
               timed_steps: int, max_seconds: float, kv: bool) -> None:
    """Time one prefill piece and a few steps, and refuse a plan whose prefill would outlast max_seconds."""
    vocab, piece = runner.manifest.vocab_size, min(chunk, max(positions[-1], prefill_tokens, 1))
    if runner.manifest.kv_capacity is not None:  # the piece and the probe's steps fit the fixed-capacity cache
        piece = max(1, min(piece, runner.manifest.kv_capacity - 1 - PROBE_STEPS))
    ids = np.random.default_rng(0).integers(0, vocab, (batch, piece), dtype=np.int64)
    zeros = np.zeros(batch, np.int64)
    runner.prefill(ids, runner.new_state(batch), zeros)  # the first call at a shape plans it: not timed
    state = runner.new_state(batch)
    t0 = time.perf_counter()
    runner.prefill(ids, state, zeros)
    prefill_rate = piece / max(time.perf_counter() - t0, 1e-9)
    runner.step(ids[:, 0], state, np.full(batch, piece, np.int64))
    t0 = time.perf_counter()
    for i in range(PROBE_STEPS):
        runner.step(ids[:, 0], state, np.full(batch, piece + 1 + i, np.int64))
    step_rate = PROBE_STEPS / max(time.perf_counter() - t0, 1e-9)
    # the prefill to the last position, the timed steps, then prefill_throughput: 4 prefills and
    # one token-by-token pass over prefill_tokens
    seconds = (positions[-1] / prefill_rate + len(positions) * timed_steps / step_rate
               + prefill_tokens * (4 / prefill_rate + 1 / step_rate))
    if kv:
        seconds *= 2  # the KV baseline prefills as far again, more slowly (a lower bound)
    if seconds > max_seconds:
        raise EdgelinError(
            f"this bench would take about {duration(seconds)}",
            f"prefill to position {positions[-1]:,}, {timed_steps:,} timed steps per position and "
            f"--prefill-tokens {prefill_tokens:,}, at the {prefill_rate:,.0f} prefill tok/s and "
            f"{step_rate:,.0f} steps/s just measured; the limit is {duration(max_seconds)}",
            "pick smaller --positions, --iters or --prefill-tokens")


def check_capacity(manifest: Manifest, label: str, positions: list[int], prefill_tokens: int) -> None:
    """A fixed-capacity KV cache (export --kv-cache static --context N) holds N tokens: a step timed at
    position p needs p + 1 (the largest position is N - 1), the prefill-vs-steps pass --prefill-tokens.
    Refused before anything is timed, naming every option to change."""
    capacity = manifest.kv_capacity
    if capacity is None:
        return
    over = [p for p in positions if p + 1 > capacity]
    what, fixes = [], []
    if over:
        example = ",".join(str(p) for p in sorted({1, capacity // 2, capacity - 1}) if p >= 1)
        what.append(f"--positions {','.join(str(p) for p in over)}")
        fixes.append(f"pass --positions up to {capacity - 1} (e.g. --positions {example})")
    if prefill_tokens > capacity:
        what.append(f"--prefill-tokens {prefill_tokens}")
        fixes.append(f"pass --prefill-tokens {capacity} or fewer (0 skips it)")
    if what:
        raise EdgelinError(f"{label}: {' and '.join(what)} on an export whose fixed-capacity KV cache holds "
                           f"{capacity} tokens", f"a step timed at position p needs p + 1 tokens of cache and the "
                           f"prefill-vs-steps pass --prefill-tokens (exported with {manifest.kv_flag(capacity)})", f"{' and '.join(fixes)}, or re-export with a larger --context")


def human(nbytes: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB"):
        if nbytes < 1024 or unit == "PiB":
            return f"{nbytes:.1f} {unit}" if unit != "B" else f"{int(nbytes)} B"
        nbytes /= 1024
    raise AssertionError


def duration(seconds: float) -> str:
    for unit, size in (("days", 86400), ("h", 3600), ("min", 60)):
        if seconds >= size:
            return f"{seconds / size:,.1f} {unit}"
    return f"{seconds:.1f} s"


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
    max_seconds: float = MAX_SECONDS,
    device: "DeviceProfile | None" = None,
    on_count: Callable[[int, int], None] | None = None,
) -> BenchReport:
    """`on_progress(message)` says what runs; `on_count(done, total)` counts the measurements (one per
    position and model, one for the prefill throughput)."""
    positions = sorted(set(int(p) for p in positions))
    for name, value, least in (("--batch", batch, 1), ("--iters", iters, 1), ("--warmup", warmup, 0),
                               ("--prefill-tokens", prefill_tokens, 0), ("prefill chunk", prefill_chunk, 1)):
        if value < least:
            raise EdgelinError(f"{name} {value}", f"it must be >= {least}", f"pass {name} {least} or more")
    if not positions or positions[0] < 1:
        raise EdgelinError(f"--positions {positions[0] if positions else '(none)'}",
                           "a position counts tokens of context and must be >= 1", "e.g. --positions 1,1024,8192")
    if baseline not in (None, "kv"):
        raise EdgelinError(f"unknown baseline {baseline!r}", "the one baseline is a KV-cache model", "use --baseline kv")
    kv_chunk = min(prefill_chunk, 1024)  # full attention over a growing cache: smaller pieces bound the scores
    runner, load_rss, load_pss = load_memory(folder, threads, device)
    check_capacity(runner.manifest, "edgelin", positions, prefill_tokens)
    available = available_memory()
    check_memory(runner.manifest, "edgelin", positions, batch, prefill_chunk, available)
    report = BenchReport(str(folder), runner.manifest.target, batch, threads, iters=iters, warmup=warmup)
    report.disk_bytes = disk_usage(folder)
    # A runner that loads other files than the graphs names them (Core AI: the asset compiled for this platform)
    report.runtime_bytes = files_bytes(report.disk_bytes, list(getattr(runner, "loaded_files", ()))
                                       or runtime_files(runner.manifest))
    report.load_rss_bytes, report.load_pss_bytes = load_rss, load_pss
    kv = None
    if baseline == "kv":  # exported with the folder (export --baseline kv); its memory checked up front
        from edgelin.artifact.baselines import baseline_folder

        kv = open_runner(baseline_folder(folder, runner.manifest, "kv"), threads)
        check_capacity(kv.manifest, "kv-baseline", positions, 0)  # it runs no prefill-vs-steps pass
        check_memory(kv.manifest, "kv-baseline", positions, batch, kv_chunk, available)
    if on_progress:
        on_progress("estimating the time to reach each position")
    check_time(runner, positions, prefill_tokens, batch, prefill_chunk, warmup + iters, max_seconds,
               kv is not None)
    total = len(positions) * (2 if kv is not None else 1) + (1 if prefill_tokens else 0)

    def count() -> None:
        if on_count:
            on_count(len(report.positions) + (1 if report.prefill_tokens else 0), total)

    count()
    measure(runner, "edgelin", positions, batch, warmup, iters, prefill_chunk, report, seed, on_progress, count)
    if prefill_tokens:
        if on_progress:
            on_progress(f"prefill vs steps over {prefill_tokens} tokens")
        report.prefill_tokens = prefill_tokens
        pf, st = prefill_throughput(runner, prefill_tokens, batch, prefill_chunk, seed)
        report.prefill_tokens_per_s["edgelin"], report.steps_tokens_per_s["edgelin"] = pf, st
        count()
    if kv is not None:
        measure(kv, "kv-baseline", positions, batch, warmup, iters, kv_chunk, report, seed, on_progress, count)
    # getrusage's peak and /proc's current RSS are read differently (a row's RSS could show above the "peak"):
    # the peak is at least every RSS this run recorded
    report.peak_rss_bytes = max([peak_rss_bytes(), *(row.rss_bytes for row in report.positions)])
    report.runner = runner_label(runner)
    report.environment = environment("bench", Path(folder), report.runner, threads,
                                     device.name if device is not None else None)
    return report
