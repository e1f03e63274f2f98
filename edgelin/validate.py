"""`edgelin validate`: multi-step rollout parity of an exported folder against the PyTorch reference.

Checks, every one reported (not just the first failure):
  prefill           exported prefill(prompt) vs the reference: last logits and every state tensor
  rollout           N exported steps fed their own state: logits vs the reference's full-sequence
                    forward at every position, state vs the reference step rollout at every step
  final             state after the rollout vs the reference chunked forward over the whole sequence
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
from edgelin.export.targets import get_target
from edgelin.model.lm import CausalLM

# max |exported - reference| / max |reference|, per output, by the graphs' compute precision
THRESHOLDS = {"fp32": 1e-4, "fp16": 2e-2}


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
            self(check, name.replace("past_key_values.", "present.", 1), got[name], value, step)


def flat_state(state: list[dict[str, torch.Tensor]]) -> dict[str, np.ndarray]:
    return {f"past_key_values.{i}.{name}": t.numpy() for i, layer in enumerate(state) for name, t in layer.items()}


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
    manifest = Manifest.load(folder)
    runner = get_target(manifest.target).runner(Path(folder), manifest)
    model = load_reference(manifest, reference)
    threshold = rtol if rtol is not None else THRESHOLDS.get(manifest.precision, THRESHOLDS["fp16"])
    report = ValidationReport(str(folder), manifest.target, manifest.precision, batch, prompt_len, steps, threshold)
    check = _Checks(threshold)

    rng = np.random.default_rng(seed)
    ids = rng.integers(0, manifest.vocab_size, (batch, prompt_len + steps), dtype=np.int64)
    ids_t, zeros = torch.from_numpy(ids), np.zeros(batch, np.int64)
    total = 2 * prompt_len + steps
    with torch.no_grad():
        full_logits, full_state = model(ids_t)
        ref_logits, ref_state = model(ids_t[:, :prompt_len], last_only=True)
        logits, state = runner.prefill(ids[:, :prompt_len], runner.initial_state(batch), zeros)
        check("prefill", "logits", logits, full_logits[:, prompt_len - 1].numpy())
        check.states("prefill", state, flat_state(ref_state))
        prefill_logits, prefill_state = logits, state
        for t in range(steps):
            pos = prompt_len + t
            position = np.full(batch, pos, np.int64)
            logits, state = runner.step(ids[:, pos], state, position)
            _, ref_state = model(ids_t[:, pos:pos + 1], ref_state, torch.from_numpy(position), mode="recurrent")
            check("rollout", "logits", logits, full_logits[:, pos].numpy(), t)
            check.states("rollout", state, flat_state(ref_state), t)
            if on_progress:
                on_progress(t + 1, total)
        check.states("final", state, flat_state(full_state))

        state = runner.initial_state(batch)
        for t in range(prompt_len):
            logits, state = runner.step(ids[:, t], state, np.full(batch, t, np.int64))
            if on_progress:
                on_progress(steps + t + 1, total)
        check("prefill-vs-steps", "logits", logits, prefill_logits)
        check.states("prefill-vs-steps", state, prefill_state)
    report.metrics = list(check.metrics.values())
    report.seconds = time.perf_counter() - started
    return report
