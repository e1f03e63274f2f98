"""`edgelin validate DIR --against CKPT`: multi-step rollout parity of an exported folder against the
PyTorch reference loaded from the checkpoint (any batch, prompt length and step count).

Without --against, validate replays the reference vectors recorded at export instead, with no
checkpoint and no torch (edgelin/replay.py, which also holds the report types).

Checks, every one reported (not just the first failure):
  prefill           exported prefill(prompt) vs the reference: last logits and every state tensor
  rollout           N exported steps fed their own state: logits vs the reference's chunked forward
                    at every position, state vs the reference step rollout at every step
  final             state after the rollout vs the reference chunked forward over the whole sequence
  prefill-vs-steps  exported steps from the empty state over the prompt vs exported prefill
  quality           top-1 agreement over the reference's greedy rollout and perplexity on held-out
                    text (--text FILE, else the checkpoint's recipe validation split, else random
                    tokens: top-1 only), the reference computed here (edgelin/quality.py)

A weight-quantised export's parity checks run against the reference carrying the export's own
dequantised weights (edgelin/reference/parity.py), its quality figures against the fp32 one: the
first says whether the runtime computes the artifact right, the second what the quantisation costs.

Torch and the checkpoint are imported inside the functions that run the reference: importing this
module (as the CLI's validate does) pulls no torch.

The rollout streams: the reference's chunked forward runs window by window carrying its state, so
memory stays flat however many steps are validated.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Callable

import numpy as np

from edgelin.artifact.manifest import Manifest
from edgelin.artifact.quality import TEXT_TOKENS, precision_key, threshold_key
from edgelin.artifact.reference_vectors import positions_needed, threshold_for
from edgelin.data import held_out_text
from edgelin.environment import environment
from edgelin.errors import EdgelinError
from edgelin.quality import measure
from edgelin.reference.parity import flat_state, parity_reference, reference_quality
from edgelin.replay import Checks, ValidationReport
from edgelin.export.targets import weights_reader
from edgelin.runtime import check_room, open_runner, runner_label

if TYPE_CHECKING:
    from edgelin.model.lm import CausalLM

# The rollout is compared window by window: reference logits for at most this many bytes (and
# positions) at a time, whatever the step count.
WINDOW_LOGITS_BYTES = 8 << 20
MAX_WINDOW = 256
STEP_POINTS = 512  # per-step error series keep at most 2x this many points (steps merged by max beyond)


class StepSeries:
    """The worst relative error at every rollout step, in flat memory: past 2 * STEP_POINTS points,
    neighbouring buckets merge (their max) and each point then covers twice as many steps."""

    def __init__(self) -> None:
        self.width, self.values, self.pending = 1, [], 0.0
        self.filled = 0  # steps in the pending bucket

    def add(self, value: float) -> None:
        self.pending, self.filled = max(self.pending, value), self.filled + 1
        if self.filled == self.width:
            self.values.append(self.pending)
            self.pending, self.filled = 0.0, 0
            if len(self.values) >= 2 * STEP_POINTS:
                self.values = [max(a, b) for a, b in zip(self.values[::2], self.values[1::2])]
                self.width *= 2

    def to_dict(self) -> dict:
        values = self.values + ([self.pending] if self.filled else [])
        return {"steps_per_point": self.width, "max_rel": values}


def step_error(got: np.ndarray, want: np.ndarray) -> float:
    """max |got - want| / max |want| at one step (inf when the shapes differ or got is not finite)."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    if got.shape != want.shape or not np.isfinite(got).all():
        return float("inf")
    return float(np.abs(got - want).max(initial=0.0) / max(float(np.abs(want).max(initial=0.0)), 1e-12))


@dataclass
class AgainstReport(ValidationReport):
    """validate --against's report: the parity checks plus the worst error at every rollout step (logits,
    and state over every state tensor) and what it ran on."""

    step_errors: dict = field(default_factory=dict)
    environment: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return {"environment": self.environment, **super().to_dict(), "step_errors": self.step_errors}


def load_reference(manifest: Manifest, against: Path | None) -> "CausalLM":
    from edgelin.checkpoint import checkpoint_hash, load_model

    path = Path(against) if against else Path(manifest.source["path"])
    if not path.exists():
        raise EdgelinError(f"the source checkpoint {path} is gone", "validate --against compares with it",
                           "pass --against CHECKPOINT_DIR, or validate without --against (the recorded reference "
                           "vectors)")
    if checkpoint_hash(path) != manifest.source.get("sha256"):
        raise EdgelinError(f"checkpoint {path} differs from the one exported", "its sha256 changed since export",
                           "re-export, or pass --against with the original checkpoint")
    return load_model(path)[0]


def check_capacity(manifest: Manifest, prompt_len: int, steps: int, text_ids: np.ndarray | None) -> None:
    """Refuse, before anything runs, a plan longer than a fixed-capacity KV cache (`--kv-cache static
    --context N`) holds: the rollout feeds prompt_len + steps tokens, the quality figures a greedy rollout
    (positions_needed: 527 tokens) and a text pass (a step for every text token but the last)."""
    capacity = manifest.kv_capacity
    if capacity is None:
        return
    rollout = prompt_len + steps
    check_room(manifest, rollout, f"--prompt-len {prompt_len} with --steps {steps} feeds {rollout} tokens",
               f"pass --steps {capacity - prompt_len} or fewer" if prompt_len < capacity else
               f"pass --prompt-len {capacity // 2} --steps {capacity - capacity // 2} or fewer")
    greedy = positions_needed(text_tokens=0, prompt_len=0, steps=0)  # the greedy rollout's alone
    check_room(manifest, greedy, f"the quality figures' greedy rollout feeds {greedy} tokens",
               f"re-export with --kv-cache static --context {max(greedy, rollout)} or more")
    text = 0 if text_ids is None else len(text_ids)
    check_room(manifest, text - 1, f"the perplexity pass over {text} held-out tokens feeds {text - 1}",
               f"pass --text-tokens {capacity + 1} or fewer")


def validate(
    folder: Path,
    steps: int = 512,
    prompt_len: int = 32,
    batch: int = 2,
    seed: int = 0,
    rtol: float | None = None,
    against: Path | None = None,
    on_progress: Callable[[int, int], None] | None = None,
    text: Path | None = None,
    text_tokens: int = TEXT_TOKENS,
    min_top1: float | None = None,
    max_ppl_change: float | None = None,
) -> ValidationReport:
    """The full check against the checkpoint `against` (None: the one the manifest names). `text`:
    held-out text for the perplexity (at most `text_tokens` tokens); `min_top1`/`max_ppl_change`:
    quality bounds (default: the precision's, edgelin.artifact.quality.BOUNDS)."""
    import torch  # edgelin.cli refuses --against in one line where torch is missing

    if steps < 1 or prompt_len < 1 or batch < 1:
        raise EdgelinError("--steps, --prompt-len and --batch must be >= 1", "nothing to compare otherwise",
                           "pass positive values")
    started = time.perf_counter()
    # One runtime thread: validate alternates runtime and torch calls, and a runtime's spinning
    # worker threads would take the cores torch is about to use (3x slower on 2 cores).
    runner = open_runner(folder, threads=1)
    manifest = runner.manifest
    source = str(against) if against else str(manifest.source["path"])
    # --text is read (and refused) before the long part
    text_ids, text_source = held_out_text(manifest, Path(folder), text, text_tokens, Path(source))
    check_capacity(manifest, prompt_len, steps, text_ids)  # before the long part, too
    fp32 = load_reference(manifest, against)
    # The fp32 side of the quality figures first: a quantised artifact's parity reference then takes the place of
    # the float weights in the same model (one model in memory, not two: 3 GB each at 0.75 B parameters).
    reference = reference_quality(fp32, manifest.vocab_size, text_ids, text_source, seed)
    model, weights = parity_reference(fp32, Path(folder), manifest, weights_reader(manifest), in_place=True)
    del fp32
    key = precision_key(manifest)
    threshold = rtol if rtol is not None else threshold_for(threshold_key(manifest))
    report = AgainstReport(str(folder), manifest.target, key, source, [batch], prompt_len, steps, threshold,
                           reference_weights=weights.to_dict() if weights is not None else None)
    check = Checks(threshold)
    logits_errors, state_errors = StepSeries(), StepSeries()

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
        handle = runner.new_state(batch)
        prefill_logits = runner.prefill(prompt, handle, np.zeros(batch, np.int64))
        prefill_state = runner.read_state(handle)
        check("prefill", "logits", prefill_logits, ref_logits.numpy(), batch=batch)
        check.states("prefill", prefill_state, flat_state(ref_state), batch=batch)
        if on_progress:  # the prefill counts as prompt_len of the total
            on_progress(prompt_len, total)
        chunk_state, step_state = ref_state, ref_state  # the chunked forward ("final"), the step rollout
        for lo in range(0, steps, window):
            ids = rng.integers(0, vocab, (batch, min(window, steps - lo)), dtype=np.int64)
            ids_t, first = torch.from_numpy(ids), prompt_len + lo
            ref_logits, chunk_state = model(ids_t, chunk_state, torch.full((batch,), first), mode="chunked")
            for j in range(ids.shape[1]):
                t, position = lo + j, np.full(batch, first + j, np.int64)
                logits = runner.step(ids[:, j], handle, position)
                _, step_state = model(ids_t[:, j:j + 1], step_state, torch.from_numpy(position), mode="recurrent")
                want = ref_logits[:, j].numpy()
                check("rollout", "logits", logits, want, t, batch)
                got_state, want_state = runner.read_state(handle), flat_state(step_state)
                check.states("rollout", got_state, want_state, t, batch)
                logits_errors.add(step_error(logits, want))
                state_errors.add(max((step_error(got_state.get(name, np.full(1, np.inf)), value)
                                      for name, value in want_state.items()), default=0.0))
                if on_progress:
                    on_progress(prompt_len + t + 1, total)
        check.states("final", runner.read_state(handle), flat_state(chunk_state), batch=batch)

        handle = runner.new_state(batch)
        for t in range(prompt_len):
            logits = runner.step(prompt[:, t], handle, np.full(batch, t, np.int64))
            if on_progress:
                on_progress(prompt_len + steps + t + 1, total)
        check("prefill-vs-steps", "logits", logits, prefill_logits, batch=batch)
        check.states("prefill-vs-steps", runner.read_state(handle), prefill_state, batch=batch)
    report.metrics = list(check.metrics.values())
    report.set_quality(measure(runner, reference), min_top1, max_ppl_change)
    report.seconds = time.perf_counter() - started
    report.runner = runner_label(runner)
    report.step_errors = {"logits": logits_errors.to_dict(), "state": state_errors.to_dict()}
    report.environment = environment("validate", Path(folder), report.runner, 1, None)
    return report

