"""The quality figures' records, torch-free: what the fp32 reference recorded (QualityReference, the
`quality/*` arrays of reference.npz), the figures measured against it (QualityFigures), the bounds they
are held to per precision and the checks (QualityCheck), and the export gate's record in manifest.json
extra["quality"] (GateResult). The measurement itself runs on a runner (edgelin/quality.py); the text it
scores comes from edgelin/data.py.

Two figures, both against the fp32 PyTorch reference:

  top-1 agreement   the reference decodes greedily (GREEDY_STEPS tokens after a GREEDY_PROMPT-token
                    prompt); the artifact is teacher-forced on the reference's tokens (prefill the
                    prompt, then one step per token) and each of its argmaxes is compared with the
                    token the reference chose there. Teacher forcing keeps one early disagreement
                    from derailing every later step, so the figure is a per-step fraction.
  perplexity        exp(mean negative log-likelihood) of a held-out token window, step graph only:
                    from the empty state, one step per token, each step's logits scoring the next
                    token (so T tokens give T-1 scores). Reported for the artifact and the
                    reference, with the relative change `ppl_artifact / ppl_reference - 1`.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from edgelin.artifact.manifest import Manifest

GREEDY_PROMPT = 16  # tokens of prompt before the greedy rollout
GREEDY_STEPS = 512  # the bound is stated over 512 greedy steps
# The export decodes those steps one token at a time through the float32 PyTorch model, each reading every weight:
# a 2 B-parameter model's 512 would take ~15 min of a 2-core CPU. Past GREEDY_BUDGET parameter-steps the rollout is
# shorter (at least MIN_GREEDY_STEPS); reference.npz records how many, and validate measures over as many.
GREEDY_BUDGET = 100_000_000_000
MIN_GREEDY_STEPS = 64


def greedy_steps_for(parameters: int) -> int:
    """The greedy rollout's length for a model of `parameters`: GREEDY_STEPS up to 195 M parameters, then fewer."""
    return max(MIN_GREEDY_STEPS, min(GREEDY_STEPS, GREEDY_BUDGET // max(parameters, 1)))
# The parity threshold's key (reference_vectors.THRESHOLDS) of a weight-quantised export whose products round their
# activations to int8 blocks, whatever its weights' bits (threshold_key)
ROUNDED_ACTIVATIONS = "int8-activations"
TEXT_TOKENS = 512  # held-out tokens kept by default (reference.npz stays a few KiB larger)
RANDOM_SOURCE = "random tokens"


@dataclass(frozen=True)
class Bounds:
    min_top1: float | None = None  # lowest allowed top-1 agreement (a fraction)
    max_ppl_change: float | None = None  # largest allowed relative perplexity increase (0.05 = +5%)


# Default bounds per export precision (docs/precision.md#validation-thresholds-and-quality-figures has the measurements:
# the shipped model's int4 export loses 1.6% perplexity, fp16/int8 under 0.1%, all 100% greedy top-1).
# fp32 exports are held to the tight logit threshold instead; an explicit --min-top1 or
# --max-ppl-change applies to any precision.
BOUNDS: dict[str, Bounds] = {
    "fp32": Bounds(),
    "fp16": Bounds(min_top1=0.95, max_ppl_change=0.01),
    "bf16": Bounds(min_top1=0.95, max_ppl_change=0.02),
    "int8": Bounds(min_top1=0.95, max_ppl_change=0.02),
    "int4": Bounds(min_top1=0.90, max_ppl_change=0.05),
}
GENTLER = {"fp16": "--precision fp32", "bf16": "--precision fp32", "int8": "--precision fp16 without --quantize",
           "int4": "--quantize int8"}


def quantization_of(extra: dict[str, Any]) -> str | None:
    """The weight quantisation an export's manifest records ("int8"/"int4"/"fp16": --quantize fp16's float16
    weights), or None. Read
    defensively: the quantised export writes `extra["quantization"]` ({"bits": 4, ...}, read off the
    graphs) and `extra["precision"]["quantized_weights"]`; a device entry's `quantize` also counts."""
    candidates: list[Any] = [extra.get("quantization"), extra.get("quantize")]
    for entry in ("precision", "device"):
        if isinstance(extra.get(entry), dict):
            candidates += [extra[entry].get("quantized_weights"), extra[entry].get("quantize")]
    for value in candidates:
        if isinstance(value, dict):
            bits = value.get("bits")
            value = value.get("type") or value.get("name") or ("fp16" if bits == 16 else f"int{bits}" if bits else None)
        if isinstance(value, str) and value in ("int8", "int4", "fp16"):
            return value
    return None


def quantized_weights(entry: dict[str, Any]) -> str:
    """A manifest's extra["quantization"] in words: "4-bit (block 32)", "4-bit (block 32; embedding table and LM
    head 8-bit)", "float16"."""
    if entry.get("bits") == 16:
        return "float16"
    apart = entry.get("embedding_bits")
    return f"{entry['bits']}-bit (block {entry['block_size']}" + (
        f"; embedding table and LM head {apart}-bit)" if apart else ")")


def float16_state(manifest: "Manifest") -> bool:
    """Whether the export keeps a state in float16 that the reference keeps in float32: a static KV cache with
    --kv-dtype fp16, or a float16 state tensor under float32 graphs (Core AI's float16 model state: measured
    1.4e-3..1.6e-3 of the logits' scale on the tiny families, bench/coreai_families.py)."""
    return manifest.kv_dtype == "float16" or any(t.dtype == "float16" for t in manifest.state_inputs)


def precision_key(manifest: "Manifest") -> str:
    """fp32 / fp16 / int8 / int4: what the thresholds and quality bounds are chosen by (float32 graphs with a
    float16 state, float16_state, count as fp16)."""
    key = quantization_of(manifest.extra) or manifest.precision
    return "fp16" if key == "fp32" and float16_state(manifest) else key


def threshold_key(manifest: "Manifest") -> str:
    """What the parity threshold (reference_vectors.THRESHOLDS) is chosen by: precision_key's answer, but fp32 for
    --quantize fp16 on float32 graphs with a float32 cache, whose parity reference carries the export's own float16
    weights while both sides compute in float32 (measured ~1e-5 of the logits' scale: fp16's 2e-2 would not notice a
    wrong kernel), and ROUNDED_ACTIVATIONS for quantised products that round their activations (the manifest's
    quantization records the block). A float16 state (float16_state) rounds what the reference keeps in float32:
    fp16's."""
    weights_only = manifest.precision == "fp32" and not float16_state(manifest)
    if weights_only and quantization_of(manifest.extra) == "fp16":
        return "fp32"
    quantization = manifest.extra.get("quantization")
    if isinstance(quantization, dict) and quantization.get("activation_block"):
        # Products that round their activations to int8 blocks (MatMulNBits' accuracy level 4) differ from the
        # reference, which rounds them too, only where a value within float noise of a rounding tie rounds the
        # other way: one step of its block's largest magnitude, then carried through every later layer. That
        # error is the activations' and the same at 8- and 4-bit weights (the reference holds the export's own
        # weights); measured at 24 layers, docs/precision.md#validation-thresholds-and-quality-figures.
        return ROUNDED_ACTIVATIONS
    return precision_key(manifest)


def resolve_bounds(key: str, min_top1: float | None = None, max_ppl_change: float | None = None) -> Bounds:
    """The precision's default bounds, each replaced by an explicit option when given."""
    default = BOUNDS.get(key, BOUNDS["int4"])  # an unknown low precision: the loosest defaults
    return Bounds(default.min_top1 if min_top1 is None else min_top1,
                  default.max_ppl_change if max_ppl_change is None else max_ppl_change)


def perplexity(logprobs: np.ndarray) -> float:
    """exp(mean negative log-likelihood) of per-token log-probabilities (natural log)."""
    logprobs = np.asarray(logprobs, np.float64)
    return float(math.exp(-logprobs.mean())) if logprobs.size else float("nan")


def log_softmax_at(logits: np.ndarray, token: int) -> float:
    """log p(token) under softmax(logits), in float64 (logits of any float dtype)."""
    row = np.asarray(logits, np.float64).reshape(-1)
    top = row.max()
    return float(row[token] - top - math.log(np.exp(row - top).sum()))


# ---- what the reference recorded -----------------------------------------------------------------
@dataclass(frozen=True, eq=False)  # eq=False: arrays have no single truth value
class QualityReference:
    """The fp32 reference's side of the figures (recorded at export, or computed by --against)."""

    source: str  # where the text came from, for people: "recipe validation split (...)", "text FILE", ...
    greedy_ids: np.ndarray  # int64 [GREEDY_PROMPT + G]: the prompt, then the reference's greedy tokens
    prompt_len: int
    text_ids: np.ndarray | None = None  # int64 [T]: the held-out window (None: random prompt only)
    text_logprob: np.ndarray | None = None  # float64 [T-1]: log p(text_ids[t+1] | text_ids[:t+1])
    text_argmax: np.ndarray | None = None  # int64 [T-1]: the reference's argmax at those positions

    @property
    def has_text(self) -> bool:
        return self.text_ids is not None

    @property
    def greedy_steps(self) -> int:
        return int(self.greedy_ids.shape[0]) - self.prompt_len

    KEYS = ("greedy_ids", "text_ids", "text_logprob", "text_argmax")

    def to_arrays(self, prefix: str) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
        """(arrays under `prefix`, meta) for reference.npz."""
        arrays = {f"{prefix}{k}": getattr(self, k) for k in self.KEYS if getattr(self, k) is not None}
        return arrays, {"source": self.source, "prompt_len": self.prompt_len, "greedy_steps": self.greedy_steps,
                        "text_tokens": 0 if self.text_ids is None else int(self.text_ids.shape[0])}

    @classmethod
    def from_arrays(cls, arrays: dict[str, np.ndarray], prefix: str, meta: dict[str, Any],
                    vocab: int) -> "QualityReference":
        """Read back and check (ValueError on anything inconsistent: the caller says the file is corrupt)."""
        prompt = int(meta["prompt_len"])
        greedy = arrays[f"{prefix}greedy_ids"]
        _check_ids(f"{prefix}greedy_ids", greedy, vocab)
        if not 1 <= prompt < greedy.shape[0] or greedy.shape[0] != prompt + int(meta["greedy_steps"]):
            raise ValueError(f"{prefix}greedy_ids has {greedy.shape[0]} tokens for prompt {prompt}, "
                             f"{meta['greedy_steps']} steps")
        text = arrays.get(f"{prefix}text_ids")
        if text is None:
            return cls(str(meta["source"]), greedy.astype(np.int64), prompt)
        _check_ids(f"{prefix}text_ids", text, vocab)
        logprob, argmax = arrays[f"{prefix}text_logprob"], arrays[f"{prefix}text_argmax"]
        n = text.shape[0] - 1
        if n < 1 or logprob.shape != (n,) or argmax.shape != (n,) or not np.isfinite(logprob).all():
            raise ValueError(f"{prefix}text_logprob/text_argmax do not match {n + 1} text tokens")
        _check_ids(f"{prefix}text_argmax", argmax, vocab)
        return cls(str(meta["source"]), greedy.astype(np.int64), prompt, text.astype(np.int64),
                   logprob.astype(np.float64), argmax.astype(np.int64))


def _check_ids(name: str, ids: np.ndarray, vocab: int) -> None:
    if ids.ndim != 1 or ids.dtype.kind not in "iu" or ids.size == 0 or ids.min() < 0 or ids.max() >= vocab:
        raise ValueError(f"{name} is not a 1-D array of token ids below {vocab}")


# ---- the figures -----------------------------------------------------------------------------------
@dataclass(frozen=True)
class QualityFigures:
    source: str
    greedy_steps: int
    top1: float  # fraction of greedy steps where the artifact's argmax is the reference's token
    text_tokens: int = 0  # scored held-out tokens (0: random prompt, no perplexity)
    text_top1: float | None = None  # argmax agreement on the held-out text (informational)
    perplexity: float | None = None
    reference_perplexity: float | None = None

    @property
    def perplexity_change(self) -> float | None:
        if self.perplexity is None or self.reference_perplexity is None:
            return None
        return self.perplexity / self.reference_perplexity - 1.0

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "perplexity_change": self.perplexity_change}


@dataclass(frozen=True)
class QualityCheck:
    name: str  # "top-1 agreement" or "perplexity change"
    value: float
    bound: float
    kind: str  # "min" (value >= bound) or "max" (value <= bound)

    @property
    def passed(self) -> bool:
        return bool(math.isfinite(self.value)) and (self.value >= self.bound if self.kind == "min"
                                                    else self.value <= self.bound)

    def describe(self) -> str:
        """e.g. "top-1 agreement 91.2% < 95%" (a failure) or "... >= 95%"."""
        op = (">=" if self.passed else "<") if self.kind == "min" else ("<=" if self.passed else ">")
        sign = "+" if self.kind == "max" else ""
        return f"{self.name} {self.value:{sign}.2%} {op} {self.bound:.2%}"

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "passed": self.passed}


def evaluate(figures: QualityFigures, bounds: Bounds) -> list[QualityCheck]:
    """The checks the bounds ask for; perplexity only where it was measured on real text."""
    checks = []
    if bounds.min_top1 is not None:
        checks.append(QualityCheck("top-1 agreement", figures.top1, bounds.min_top1, "min"))
    change = figures.perplexity_change
    if bounds.max_ppl_change is not None and change is not None:
        checks.append(QualityCheck("perplexity change", change, bounds.max_ppl_change, "max"))
    return checks


# ---- the export gate -------------------------------------------------------------------------------
@dataclass(frozen=True)
class GateResult:
    key: str  # fp16 / int8 / int4
    figures: QualityFigures
    checks: tuple[QualityCheck, ...]

    @property
    def passed(self) -> bool:
        return all(c.passed for c in self.checks)

    def to_dict(self, forced: bool = False) -> dict[str, Any]:
        """manifest extra["quality"]: the figures, the bounds they were held to, each check, whether all
        passed, and whether --force exported past a failure."""
        bounds = {c.name: {"bound": c.bound, "kind": c.kind} for c in self.checks}
        return {"precision": self.key, "figures": self.figures.to_dict(), "bounds": bounds,
                "checks": [c.to_dict() for c in self.checks], "passed": self.passed,
                "forced": bool(forced and not self.passed)}

    def warning(self) -> str:
        """The line `export --force` prints for a failed check."""
        failed = "; ".join(c.describe() for c in self.checks if not c.passed)
        return (f"the {self.key} export fails its quality check ({failed}, measured against the fp32 reference on "
                f"{self.figures.source}); exported anyway because of --force (recorded in manifest.json "
                f"extra.quality)")
