"""`edgelin validate`: multi-step rollout parity of an exported folder against the PyTorch reference.

Checks, every one reported (not just the first failure):
  prefill           exported prefill(prompt) vs the reference: last logits and every state tensor
  rollout           N exported steps fed their own state: logits vs the reference's chunked forward
                    at every position, state vs the reference step rollout at every step
  final             state after the rollout vs the reference chunked forward over the whole sequence

The rollout streams: the reference's chunked forward runs window by window carrying its state, so
memory stays flat however many steps are validated.
  prefill-vs-steps  exported steps from the empty state over the prompt vs exported prefill
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from edgelin.checkpoint import checkpoint_hash, load_model
from edgelin.errors import EdgelinError
from edgelin.export.manifest import Manifest
from edgelin.export.state import output_name_for, state_input_name
from edgelin.model.lm import CausalLM
from edgelin.runtime import open_runner

# max |exported - reference| / max |reference|, per output, by the graphs' compute precision
THRESHOLDS = {"fp32": 1e-4, "fp16": 2e-2}
# The rollout is compared window by window: reference logits for at most this many bytes (and
# positions) at a time, whatever the step count.
WINDOW_LOGITS_BYTES = 8 << 20
MAX_WINDOW = 256


@dataclass
class Metric:
    check: str
    output: str
    max_abs: float = 0.0
    ref_scale: float = 0.0
    worst_step: int | None = None
    threshold: float = 0.0

    @property
    def max_rel(self) -> float:
        return self.max_abs / max(self.ref_scale, 1e-12)

    @property
    def passed(self) -> bool:
        return bool(np.isfinite(self.max_abs)) and self.max_rel <= self.threshold

    def update(self, got: np.ndarray, want: np.ndarray, step: int | None) -> None:
        got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
        err = float(np.abs(got - want).max()) if np.isfinite(got).all() else float("inf")
        self.ref_scale = max(self.ref_scale, float(np.abs(want).max(initial=0.0)))
        if self.worst_step is None or err > self.max_abs:
            self.max_abs, self.worst_step = err, step

    def to_dict(self) -> dict:
        return {**asdict(self), "max_rel": self.max_rel, "passed": self.passed}


@dataclass
class ValidationReport:
    folder: str
    target: str
    precision: str
    batch: int
    prompt_len: int
    steps: int
    threshold: float
    metrics: list[Metric] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def passed(self) -> bool:
        return all(m.passed for m in self.metrics)

    @property
    def failures(self) -> list[Metric]:
        return [m for m in self.metrics if not m.passed]

    def to_dict(self) -> dict:
        data = {k: v for k, v in asdict(self).items() if k != "metrics"}
        return {**data, "passed": self.passed, "metrics": [m.to_dict() for m in self.metrics]}


class _Checks:
    def __init__(self, threshold: float):
        self.threshold, self.metrics = threshold, {}

    def __call__(self, check: str, output: str, got, want, step: int | None = None) -> None:
        key = (check, output)
        if key not in self.metrics:
            self.metrics[key] = Metric(check, output, threshold=self.threshold)
        self.metrics[key].update(got, want, step)

    def states(self, check: str, got: dict[str, np.ndarray], want: dict[str, np.ndarray], step=None) -> None:
        for name, value in want.items():
            self(check, output_name_for(name), got[name], value, step)


def flat_state(state: list[dict[str, torch.Tensor]]) -> dict[str, np.ndarray]:
    return {state_input_name(i, name): t.numpy() for i, layer in enumerate(state) for name, t in layer.items()}


def load_reference(manifest: Manifest, reference: Path | None) -> CausalLM:
    path = Path(reference) if reference else Path(manifest.source["path"])
    if not path.exists():
        raise EdgelinError(f"the source checkpoint {path} is gone", "validate compares against it",
                           "pass --reference CHECKPOINT_DIR")
    if checkpoint_hash(path) != manifest.source.get("sha256"):
        raise EdgelinError(f"checkpoint {path} differs from the one exported", "its sha256 changed since export",
                           "re-export, or pass --reference with the original checkpoint")
    return load_model(path)[0]


def validate(
    folder: Path,
    steps: int = 512,
    prompt_len: int = 32,
    batch: int = 2,
    seed: int = 0,
    rtol: float | None = None,
    reference: Path | None = None,
    on_progress: Callable[[int, int], None] | None = None,
) -> ValidationReport:
    if steps < 1 or prompt_len < 1 or batch < 1:
        raise EdgelinError("--steps, --prompt-len and --batch must be >= 1", "nothing to compare otherwise",
                           "pass positive values")
    started = time.perf_counter()
    # One runtime thread: validate alternates runtime and torch calls, and a runtime's spinning
    # worker threads would take the cores torch is about to use (3x slower on 2 cores).
    runner = open_runner(folder, threads=1)
    manifest = runner.manifest
    model = load_reference(manifest, reference)
    threshold = rtol if rtol is not None else THRESHOLDS.get(manifest.precision, THRESHOLDS["fp16"])
    report = ValidationReport(str(folder), manifest.target, manifest.precision, batch, prompt_len, steps, threshold)
    check = _Checks(threshold)

    # Streamed in windows so memory stays flat in the step count: ids are drawn per window, and the
    # reference's chunked forward runs window by window carrying its state, so at most one window of
    # reference logits [batch, window, vocab] is alive at a time.
    rng = np.random.default_rng(seed)
    vocab = manifest.vocab_size
    prompt = rng.integers(0, vocab, (batch, prompt_len), dtype=np.int64)
    window = max(1, min(MAX_WINDOW, WINDOW_LOGITS_BYTES // (batch * vocab * 4)))
    total = 2 * prompt_len + steps
    with torch.no_grad():
        ref_logits, ref_state = model(torch.from_numpy(prompt), last_only=True)
        logits, state = runner.prefill(prompt, runner.initial_state(batch), np.zeros(batch, np.int64))
        check("prefill", "logits", logits, ref_logits.numpy())
        check.states("prefill", state, flat_state(ref_state))
        prefill_logits, prefill_state = logits, state
        if on_progress:  # the prefill counts as prompt_len of the total
            on_progress(prompt_len, total)
        chunk_state, step_state = ref_state, ref_state  # the chunked forward ("final"), the step rollout
        for lo in range(0, steps, window):
            ids = rng.integers(0, vocab, (batch, min(window, steps - lo)), dtype=np.int64)
            ids_t, first = torch.from_numpy(ids), prompt_len + lo
            ref_logits, chunk_state = model(ids_t, chunk_state, torch.full((batch,), first), mode="chunked")
            for j in range(ids.shape[1]):
                t, position = lo + j, np.full(batch, first + j, np.int64)
                logits, state = runner.step(ids[:, j], state, position)
                _, step_state = model(ids_t[:, j:j + 1], step_state, torch.from_numpy(position), mode="recurrent")
                check("rollout", "logits", logits, ref_logits[:, j].numpy(), t)
                check.states("rollout", state, flat_state(step_state), t)
                if on_progress:
                    on_progress(prompt_len + t + 1, total)
        check.states("final", state, flat_state(chunk_state))

        state = runner.initial_state(batch)
        for t in range(prompt_len):
            logits, state = runner.step(prompt[:, t], state, np.full(batch, t, np.int64))
            if on_progress:
                on_progress(prompt_len + steps + t + 1, total)
        check("prefill-vs-steps", "logits", logits, prefill_logits)
        check.states("prefill-vs-steps", state, prefill_state)
    report.metrics = list(check.metrics.values())
    report.seconds = time.perf_counter() - started
    return report
