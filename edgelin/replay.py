"""`edgelin validate DIR`: replay the reference vectors recorded at export through the runner.

No checkpoint and no torch: this is the check that runs where the model ships (a Jetson, a phone, a
board with `pip install edgelin[runtime]`). `reference.npz` (edgelin/artifact/reference_vectors.py)
holds a seeded prompt and N steps at batch 1 and at batch 3 with the PyTorch reference's logits at
every step and its state tensors at a few checkpoints. Checks, per batch, every one reported:

  prefill           runner prefill(prompt): last logits, and every state tensor where recorded
  rollout           N runner steps fed their own state: logits at every step, and every state
                    tensor at the recorded steps
  prefill-vs-steps  runner steps from the empty state over the prompt vs the runner's prefill
  quality           top-1 agreement over the reference's greedy rollout and perplexity on held-out
                    text, artifact vs the recorded fp32 reference (edgelin/artifact/quality.py), checked
                    against bounds for fp16 and quantised exports

A weight-quantised export's logits and states were recorded from the reference carrying its own
dequantised weights (meta["reference_weights"]): parity is the runtime's, quality the quantisation's.

Errors are max |runner - reference| / max |reference| per output (as `validate --against`, which
reloads the checkpoint and runs torch: edgelin/validate.py). The report types live here so that the
torch-free path imports nothing of the torch side.
"""

from __future__ import annotations

import json
import math
import time
import zipfile
import zlib
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np

from edgelin.artifact.manifest import MANIFEST, Manifest
from edgelin.artifact.quality import (QualityCheck, QualityFigures, QualityReference, evaluate, precision_key,
                                      resolve_bounds, threshold_key)
from edgelin.artifact.reference_vectors import (FLOOR_FACTOR, FORMAT, FORMAT_VERSION, MANIFEST_KEY, QUALITY,
                                                batch_key, metric_key, positions_needed, state_key, threshold_for)
from edgelin.artifact.state import output_name_for
from edgelin.errors import EdgelinError
from edgelin.integrity import sha256_of
from edgelin.quality import measure

FIX = "re-export, or validate against the checkpoint with --against CKPT"


@dataclass
class Metric:
    check: str
    output: str
    batch: int | None = None
    max_abs: float = 0.0
    ref_scale: float = 0.0
    worst_step: int | None = None
    threshold: float = 0.0
    noise_floor: float = 0.0  # the reference's own distance under float noise (0: not recorded; Checks)

    @property
    def max_rel(self) -> float:
        return self.max_abs / max(self.ref_scale, 1e-12)

    @property
    def passed(self) -> bool:
        return bool(np.isfinite(self.max_abs)) and self.max_rel <= self.threshold

    def update(self, got: np.ndarray, want: np.ndarray, step: int | None) -> None:
        got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
        if got.shape != want.shape:  # e.g. a runtime that returns another batch: a failure, not a crash
            err = float("inf")
        else:
            err = float(np.abs(got - want).max(initial=0.0)) if np.isfinite(got).all() else float("inf")
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
    against: str  # "reference vectors" (the recorded file) or the checkpoint's path
    batches: list[int]
    prompt_len: int
    steps: int
    threshold: float
    metrics: list[Metric] = field(default_factory=list)
    seconds: float = 0.0
    quality: QualityFigures | None = None  # None: not measured (quality_note says why)
    quality_checks: list[QualityCheck] = field(default_factory=list)
    quality_note: str | None = None
    runner: str = ""  # which runtime ran it (edgelin.runtime.runner_label)
    # A weight-quantised export: the parity reference carried the export's dequantised weights
    # (edgelin/reference/parity.py's account); None: the checkpoint's own weights.
    reference_weights: dict | None = None

    @property
    def passed(self) -> bool:
        return all(m.passed for m in self.metrics) and all(c.passed for c in self.quality_checks)

    @property
    def failures(self) -> list[Metric]:
        return [m for m in self.metrics if not m.passed]

    @property
    def quality_failures(self) -> list[QualityCheck]:
        return [c for c in self.quality_checks if not c.passed]

    def set_quality(self, figures: QualityFigures, min_top1: float | None, max_ppl_change: float | None) -> None:
        """Record the figures and check them against the bounds (the precision's defaults, or the options)."""
        bounds = resolve_bounds(self.precision, min_top1, max_ppl_change)
        self.quality, self.quality_checks = figures, evaluate(figures, bounds)
        if figures.perplexity is None:
            self.quality_note = (f"perplexity: not measured on {figures.source}, whose perplexity says nothing "
                                 "about a model (held-out text: export from a recipe checkpoint, or validate "
                                 "--against CKPT --text FILE)")

    def to_dict(self) -> dict:
        data = {k: v for k, v in asdict(self).items() if k not in ("metrics", "quality", "quality_checks")}
        quality = None if self.quality is None else {**self.quality.to_dict(),
                                                     "checks": [c.to_dict() for c in self.quality_checks]}
        return {**data, "passed": self.passed, "metrics": [m.to_dict() for m in self.metrics], "quality": quality}


class Checks:
    """Accumulates one Metric per (check, output, batch) over every step it is fed. `floors`: the reference's own
    noise floor per check (reference.npz's meta["noise_floor"], by metric_key): a check's bound is then at least
    FLOOR_FACTOR times the largest floor recorded for its output at its batch. Each floor is one draw of how far
    tipped rounding ties carry that layer's output; the checks of one output see the same layer, so the largest of
    their draws is the steadier estimate (GLA-1.3B int4: the artifact's prefill-vs-steps error reached 2.9x that
    check's own floor, 1.3x the output's largest)."""

    def __init__(self, threshold: float, floors: dict[str, float] | None = None):
        self.threshold = threshold
        self.floors: dict[str, float] = {}  # "output@batch" -> the largest floor of its checks
        for key, floor in (floors or {}).items():
            where = key.split("/", 1)[-1]
            self.floors[where] = max(self.floors.get(where, 0.0), float(floor))
        self.metrics: dict[tuple[str, str, int | None], Metric] = {}

    def __call__(self, check: str, output: str, got, want, step: int | None = None, batch: int | None = None) -> None:
        key = (check, output, batch)
        if key not in self.metrics:
            floor = self.floors.get(metric_key(check, output, batch).split("/", 1)[-1], 0.0)
            self.metrics[key] = Metric(check, output, batch, threshold=max(self.threshold, FLOOR_FACTOR * floor),
                                       noise_floor=floor)
        self.metrics[key].update(got, want, step)

    def states(self, check: str, got: dict[str, np.ndarray], want: dict[str, np.ndarray], step: int | None = None,
               batch: int | None = None) -> None:
        for name, value in want.items():
            self(check, output_name_for(name), got.get(name, np.full(1, np.inf)), value, step, batch)


# ---- the recorded file ----------------------------------------------------------------------------
@dataclass(frozen=True)
class ReferenceVectors:
    path: Path
    meta: dict[str, Any]
    arrays: dict[str, np.ndarray]
    quality: QualityReference | None = None  # None: recorded before the quality figures existed

    @property
    def prompt_len(self) -> int:
        return int(self.meta["prompt_len"])

    @property
    def steps(self) -> int:
        return int(self.meta["steps"])

    @property
    def batches(self) -> list[int]:
        return [int(b) for b in self.meta["batches"]]

    @property
    def noise_floor(self) -> dict[str, float]:
        """meta["noise_floor"] (by metric_key; empty where none was recorded), finite non-negative figures only."""
        recorded = self.meta.get("noise_floor")
        return {key: float(value) for key, value in recorded.items()
                if isinstance(value, (int, float)) and math.isfinite(value) and value >= 0} \
            if isinstance(recorded, dict) else {}

    def checkpoints(self, batch: int) -> list[str]:
        return list(self.meta["state_checkpoints"][str(batch)])

    def state(self, batch: int, checkpoint: str, names: list[str]) -> dict[str, np.ndarray]:
        return {name: self.arrays[state_key(batch, checkpoint, name)] for name in names}


def load_vectors(folder: Path, manifest: Manifest) -> ReferenceVectors:
    """The folder's reference vectors, checked against the manifest's sha256 and the graphs' I/O;
    an EdgelinError naming the file otherwise (the fix: re-export, or --against)."""
    entry = manifest.extra.get(MANIFEST_KEY)
    if not (isinstance(entry, dict) and isinstance(entry.get("file"), str) and isinstance(entry.get("sha256"), str)):
        raise EdgelinError(f"{Path(folder) / MANIFEST} records no reference vectors",
                           f"validate replays the reference vectors an export records (extra.{MANIFEST_KEY}); "
                           "this folder was exported without them or its manifest was edited", FIX)
    name = entry["file"]
    if Path(name).name != name or name in ("", ".", ".."):
        raise EdgelinError(f"{Path(folder) / MANIFEST} is malformed",
                           f"its reference vectors file {name!r} escapes the export folder", FIX)
    path = Path(folder) / name
    if not path.is_file():
        raise EdgelinError(f"reference vectors {path} are missing", "validate replays the prompt, logits and states "
                           "recorded at export, and the manifest lists this file", FIX)
    if sha256_of(path) != entry["sha256"]:
        raise EdgelinError(f"reference vectors {path} differ from the ones exported",
                           "the file's sha256 does not match the manifest's (changed, truncated or replaced)", FIX)
    try:
        with np.load(path, allow_pickle=False) as npz:
            arrays = {key: npz[key] for key in npz.files}
        meta = json.loads(str(arrays.pop("meta")))
        if meta.get("format") != FORMAT or meta.get("version") != FORMAT_VERSION:
            raise ValueError(f"format {meta.get('format')!r} version {meta.get('version')!r}, expected {FORMAT!r} "
                             f"version {FORMAT_VERSION}")
        quality = (QualityReference.from_arrays(arrays, QUALITY, meta["quality"], manifest.vocab_size)
                   if "quality" in meta else None)
        vectors = ReferenceVectors(path, meta, arrays, quality)
        _check_shapes(vectors, manifest)
    except (KeyError, TypeError, ValueError, EOFError, zipfile.BadZipFile, zlib.error) as exc:
        raise EdgelinError(f"reference vectors {path} are corrupt", f"{type(exc).__name__}: {exc}", FIX) from exc
    return vectors


def _check_shapes(vectors: ReferenceVectors, manifest: Manifest) -> None:
    """Every array the replay reads exists with the shape the graphs take (ValueError otherwise)."""
    prompt, steps, vocab = vectors.prompt_len, vectors.steps, manifest.vocab_size
    if prompt < 1 or steps < 1 or not vectors.batches:
        raise ValueError(f"prompt_len {prompt}, steps {steps}, batches {vectors.batches}")
    specs = {t.name: t for t in manifest.state_inputs}
    for batch in vectors.batches:
        want = {"ids": (batch, prompt + steps), "start": (batch,), "prefill_logits": (batch, vocab),
                "step_logits": (steps, batch, vocab)}
        for what, shape in want.items():
            value = vectors.arrays[batch_key(batch, what)]
            if value.shape != shape:
                raise ValueError(f"{batch_key(batch, what)} has shape {list(value.shape)}, expected {list(shape)}")
        for what, limit in (("ids", vocab), ("start", None)):
            value = vectors.arrays[batch_key(batch, what)]
            if value.dtype.kind not in "iu" or value.min() < 0 or (limit is not None and value.max() >= limit):
                raise ValueError(f"{batch_key(batch, what)} holds {value.dtype} values out of range")
        for checkpoint in vectors.checkpoints(batch):
            if checkpoint != "prefill" and not (checkpoint.startswith("step") and checkpoint[4:].isdigit()
                                                and 1 <= int(checkpoint[4:]) <= steps):
                raise ValueError(f"state checkpoint {checkpoint!r}")
            for name, value in vectors.state(batch, checkpoint, list(specs)).items():
                if value.ndim != len(specs[name].dims) or value.shape[0] != batch:
                    raise ValueError(f"{state_key(batch, checkpoint, name)} has shape {list(value.shape)}, the graphs "
                                     f"take {list(specs[name].dims)} at batch {batch}")


# ---- the replay ------------------------------------------------------------------------------------
def _runner(folder: Path, threads: int | None):
    """(runner, what it replays against): the folder's runner; where its target cannot run here but can
    check its conversion (Core ML off macOS: the package's MIL program in numpy), that check's runner."""
    from edgelin.export.targets import get_target
    from edgelin.runtime import load_artifact, open_runner

    artifact = load_artifact(folder)
    target = get_target(artifact.manifest.target)
    check = getattr(target, "conversion_runner", None)
    if check is not None and not target.can_run().ok:
        return check(artifact), ("reference vectors, through the converted program evaluated in numpy (a check of "
                                 "the conversion, not of the target's runtime)")
    return open_runner(folder, threads=threads), "reference vectors"


def check_capacity(manifest: Manifest, vectors: ReferenceVectors, measured: bool = True) -> None:
    """Refuse, before anything runs, a fixed-capacity KV cache (`--kv-cache static --context N`) too short for
    the longest sequence the replay feeds (the recorded prompt and steps, and where `measured`, the quality
    figures' greedy rollout and text pass). Exports refuse such a --context since the check existed; a folder
    exported before it is refused here in one line, naming the --context it needs."""
    capacity = manifest.kv_capacity
    if capacity is None:
        return
    quality = vectors.quality if measured else None
    need = positions_needed(
        text_tokens=int(quality.text_ids.shape[0]) if quality is not None and quality.has_text else 0,
        prompt_len=vectors.prompt_len, steps=vectors.steps,
        greedy=(quality.prompt_len, quality.greedy_steps) if quality is not None else (0, 0))
    from edgelin.runtime import check_room

    check_room(manifest, need, f"cannot validate: the replay (reference vectors and quality figures) feeds "
               f"sequences of up to {need} tokens", f"re-export with {manifest.kv_flag(need)} or more")


def replay(folder: Path, rtol: float | None = None, threads: int | None = None,
           on_progress: Callable[[str], None] | None = None, min_top1: float | None = None,
           max_ppl_change: float | None = None) -> ValidationReport:
    """Replay the recorded prompt and steps at every recorded batch size, then measure the quality
    figures; never raises for a mismatch (the report says which checks failed), only for a folder or
    file it cannot use. `min_top1`/`max_ppl_change`: quality bounds (default: the precision's)."""
    from edgelin.export.targets import get_target
    from edgelin.runtime import runner_label

    started = time.perf_counter()
    runner, against = _runner(folder, threads)
    manifest = runner.manifest
    vectors = load_vectors(folder, manifest)
    check_capacity(manifest, vectors, measured=get_target(manifest.target).can_run().ok)
    # By the saved manifest's precision and quantisation (what the folder is), not the recorded meta.
    key = precision_key(manifest)
    threshold = rtol if rtol is not None else threshold_for(threshold_key(manifest))
    report = ValidationReport(str(folder), manifest.target, key, against, vectors.batches,
                              vectors.prompt_len, vectors.steps, threshold)
    check = Checks(threshold, vectors.noise_floor)
    names = [t.name for t in manifest.state_inputs]
    prompt_len, steps = vectors.prompt_len, vectors.steps
    for batch in vectors.batches:
        if on_progress:
            on_progress(f"replaying batch {batch}: prompt {prompt_len}, {steps} steps")
        ids, start = (vectors.arrays[batch_key(batch, what)].astype(np.int64) for what in ("ids", "start"))
        kept = vectors.checkpoints(batch)
        state = runner.new_state(batch)
        prefill_logits = runner.prefill(ids[:, :prompt_len], state, start)
        prefill_state = runner.read_state(state)
        check("prefill", "logits", prefill_logits, vectors.arrays[batch_key(batch, "prefill_logits")], batch=batch)
        if "prefill" in kept:
            check.states("prefill", prefill_state, vectors.state(batch, "prefill", names), batch=batch)
        step_logits = vectors.arrays[batch_key(batch, "step_logits")]
        for t in range(steps):
            logits = runner.step(ids[:, prompt_len + t], state, start + prompt_len + t)
            check("rollout", "logits", logits, step_logits[t], t, batch)
            if f"step{t + 1}" in kept:
                check.states("rollout", runner.read_state(state), vectors.state(batch, f"step{t + 1}", names), t, batch)

        state = runner.new_state(batch)
        for t in range(prompt_len):
            logits = runner.step(ids[:, t], state, start + t)
        check("prefill-vs-steps", "logits", logits, prefill_logits, batch=batch)
        check.states("prefill-vs-steps", runner.read_state(state), prefill_state, batch=batch)
    report.metrics = list(check.metrics.values())
    report.reference_weights = vectors.meta.get("reference_weights")
    if vectors.quality is None:
        report.quality_note = ("quality figures not recorded: this folder was exported before edgelin recorded "
                               "them; re-export, or validate --against CKPT")
    elif not get_target(manifest.target).can_run().ok:  # a numpy conversion check: 1,000 steps would crawl
        report.quality_note = ("quality figures: not measured by the conversion check; validate on the device "
                               "that runs the target measures them")
    else:
        report.set_quality(measure(runner, vectors.quality, on_progress), min_top1, max_ppl_change)
    report.seconds = time.perf_counter() - started
    report.runner = runner_label(runner)  # after the run: a TensorRT runner's label says how its steps went
    return report
