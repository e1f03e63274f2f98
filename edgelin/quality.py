"""Quality that users feel: top-1 agreement with the fp32 reference and perplexity on held-out text.

The logit/state checks of validate bound the *numerical* error of an export; an fp16 or int4 export
is expected to differ, and what matters is whether it still picks the same tokens and predicts text
as well. Two figures, both against the fp32 PyTorch reference:

  top-1 agreement   the reference decodes greedily (GREEDY_STEPS tokens after a GREEDY_PROMPT-token
                    prompt); the artifact is teacher-forced on the reference's tokens (prefill the
                    prompt, then one step per token) and each of its argmaxes is compared with the
                    token the reference chose there. Teacher forcing keeps one early disagreement
                    from derailing every later step, so the figure is a per-step fraction.
  perplexity        exp(mean negative log-likelihood) of a held-out token window, step graph only:
                    from the empty state, one step per token, each step's logits scoring the next
                    token (so T tokens give T-1 scores). Reported for the artifact and the
                    reference, with the relative change `ppl_artifact / ppl_reference - 1`.

Held-out text, in this order: `--text FILE`; the checkpoint's recipe validation split (whole
held-out stdlib files, edgelin.train.split_files) when the checkpoint folder holds its recipe.toml;
otherwise a seeded random-token prompt, for which only top-1 agreement is reported (the perplexity of
random tokens says nothing about a model).

The reference side is recorded at export (edgelin/export/reference_vectors.py: the `quality/*` arrays
of reference.npz) so `validate DIR` measures the artifact on the device with no torch; `validate
--against CKPT` computes the same reference live. This module imports no torch at module level: the
measurement runs wherever the runner runs.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

import numpy as np

from edgelin.errors import EdgelinError

if TYPE_CHECKING:
    from edgelin.devices import ExportSettings
    from edgelin.export.base import Runner
    from edgelin.artifact.manifest import Manifest
    from edgelin.model.lm import CausalLM

GREEDY_PROMPT = 16  # tokens of prompt before the greedy rollout
GREEDY_STEPS = 512  # the bound is stated over 512 greedy steps
TEXT_TOKENS = 512  # held-out tokens kept by default (reference.npz stays a few KiB larger)
MIN_TEXT_TOKENS = 64  # fewer scored tokens make the perplexity mostly noise
TEXT_READ_BYTES = 64  # bytes read from a --text file per wanted token (a BPE token is ~3-4 bytes)
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
    "int8": Bounds(min_top1=0.95, max_ppl_change=0.02),
    "int4": Bounds(min_top1=0.90, max_ppl_change=0.05),
}
GENTLER = {"fp16": "--precision fp32", "int8": "--precision fp16 without --quantize",
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


def precision_key(manifest: "Manifest") -> str:
    """fp32 / fp16 / int8 / int4: what the thresholds and quality bounds are chosen by (float32 graphs on an fp16
    static KV cache, --kv-dtype fp16, count as fp16)."""
    key = quantization_of(manifest.extra) or manifest.precision
    return "fp16" if key == "fp32" and manifest.kv_dtype == "float16" else key


def threshold_key(manifest: "Manifest") -> str:
    """What the parity threshold (reference_vectors.THRESHOLDS) is chosen by: precision_key's answer, but fp32 for
    --quantize fp16 on float32 graphs with a float32 cache, whose parity reference carries the export's own float16
    weights while both sides compute in float32 (measured ~1e-5 of the logits' scale: fp16's 2e-2 would not notice a
    wrong kernel). A float16 KV cache (--kv-dtype fp16) rounds what the reference keeps in float32: fp16's."""
    weights_only = manifest.precision == "fp32" and manifest.kv_dtype != "float16"
    return "fp32" if weights_only and quantization_of(manifest.extra) == "fp16" else precision_key(manifest)


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


def measure(runner: "Runner", reference: QualityReference,
            on_progress: Callable[[str], None] | None = None) -> QualityFigures:
    """The artifact's figures against `reference` (batch 1, positions from 0)."""
    if on_progress:
        on_progress(f"quality: top-1 agreement over {reference.greedy_steps} greedy steps")
    prompt, wanted = reference.greedy_ids[:reference.prompt_len], reference.greedy_ids[reference.prompt_len:]
    state = runner.new_state(1)
    logits = runner.prefill(prompt[None], state, np.zeros(1, np.int64))
    hits = 0
    for t, token in enumerate(wanted):
        hits += int(np.argmax(logits[0]) == token)
        if t + 1 < len(wanted):  # teacher-forced: feed the reference's token, whatever the artifact chose
            logits = runner.step(wanted[t:t + 1], state, np.array([reference.prompt_len + t], np.int64))
    top1 = hits / len(wanted)
    if not reference.has_text:
        return QualityFigures(reference.source, len(wanted), top1)

    assert reference.text_ids is not None and reference.text_logprob is not None
    ids = reference.text_ids
    if on_progress:
        on_progress(f"quality: perplexity over {len(ids)} held-out tokens")
    state = runner.new_state(1)
    logprob = np.empty(len(ids) - 1)
    agree = 0
    for t in range(len(ids) - 1):  # step graph only: each step's logits score the next token
        logits = runner.step(ids[t:t + 1], state, np.array([t], np.int64))
        logprob[t] = log_softmax_at(logits[0], int(ids[t + 1]))
        agree += int(np.argmax(logits[0]) == reference.text_argmax[t])
    return QualityFigures(reference.source, len(wanted), top1, len(ids) - 1, agree / (len(ids) - 1),
                          perplexity(logprob), perplexity(reference.text_logprob))


# ---- held-out text -----------------------------------------------------------------------------------
TEXT_FIX = "pass --text with a UTF-8 text file of at least a few hundred words (e.g. held-out source code or prose)"


def read_text(path: Path, tokens: int = TEXT_TOKENS) -> str:
    """The start of a UTF-8 text file (enough bytes for `tokens` tokens), or one line saying why not:
    a missing or unreadable file, an empty one, a binary or non-UTF-8 one. Needs no tokenizer and no
    model, so `export --text` checks the file before the checkpoint loads."""
    path = Path(path)
    if not path.is_file():
        raise EdgelinError(f"--text {path}", "no such file" if not path.exists() else "it is not a regular file",
                           TEXT_FIX)
    try:
        with open(path, "rb") as fh:
            raw = fh.read(max(1 << 16, tokens * TEXT_READ_BYTES))
            truncated = bool(fh.read(1))
    except OSError as exc:
        raise EdgelinError(f"cannot read --text {path}", exc.strerror or str(exc), TEXT_FIX) from exc
    if not raw.strip():
        raise EdgelinError(f"--text {path} is empty", "perplexity needs held-out text", TEXT_FIX)
    if b"\0" in raw:
        raise EdgelinError(f"--text {path} is not text", "it holds NUL bytes (a binary file)", TEXT_FIX)
    return _decode(path, raw, truncated, TEXT_FIX)


def read_text_tokens(path: Path, tokenizer: Path | None, vocab: int, tokens: int = TEXT_TOKENS) -> np.ndarray:
    """The first `tokens` tokens of a UTF-8 text file, or one line saying why not: what read_text
    refuses, a file that tokenises to fewer than MIN_TEXT_TOKENS tokens, or no tokenizer (or one whose
    ids do not fit the model's `vocab`)."""
    from edgelin.tokenizer import TextTokenizer

    path = Path(path)
    if tokenizer is None:
        raise EdgelinError(f"--text {path} cannot be tokenised", "the export has no tokenizer.json (exported with "
                           "--no-tokenizer, or the checkpoint had none)", "re-export with the checkpoint's tokenizer")
    text = read_text(path, tokens)
    ids = np.asarray(TextTokenizer(tokenizer).encode(text)[:tokens], np.int64)
    if ids.size and ids.max() >= vocab:
        raise EdgelinError(f"tokenizer {tokenizer} does not fit the model", f"--text {path} tokenises to id "
                           f"{int(ids.max())}, but the model's vocab_size is {vocab}", "re-export with the "
                           "checkpoint's own tokenizer")
    if len(ids) < MIN_TEXT_TOKENS:
        raise EdgelinError(f"--text {path} is too short", f"it tokenises to {len(ids)} tokens; perplexity needs at "
                           f"least {MIN_TEXT_TOKENS}", TEXT_FIX)
    return ids


def _decode(path: Path, raw: bytes, truncated: bool, fix: str) -> str:
    """UTF-8 text; when the read stopped early it may have cut the last character in two, so up to
    3 trailing bytes may be dropped."""
    for cut in range(4 if truncated else 1):
        try:
            return raw[:len(raw) - cut].decode("utf-8")
        except UnicodeDecodeError as exc:
            error = exc
    raise EdgelinError(f"--text {path} is not UTF-8 text", f"byte {error.start} is not valid UTF-8", fix)


def recipe_held_out(checkpoint: Path, tokens: int = TEXT_TOKENS) -> tuple[np.ndarray, str] | None:
    """The first `tokens` tokens of a recipe checkpoint's validation split (whole held-out stdlib
    files, as edgelin.train splits them), tokenised with its own tokenizer; None when the folder
    holds no recipe.toml and tokenizer.json, or they do not give a split. Imports the trainer
    (torch): an export-side helper."""
    from edgelin.train import RECIPE_COPY, SEPARATOR, Recipe, _encode, split_files, stdlib_files
    from tokenizers import Tokenizer

    recipe_path, tokenizer = Path(checkpoint) / RECIPE_COPY, Path(checkpoint) / "tokenizer.json"
    if not (recipe_path.is_file() and tokenizer.is_file()):
        return None
    try:
        recipe = Recipe.load(recipe_path)
        _, held_out = split_files(stdlib_files(recipe.data.max_bytes), recipe.data.val_fraction)
    except (EdgelinError, OSError):  # a recipe this machine cannot reproduce: no held-out text here
        return None
    tok = Tokenizer.from_file(str(tokenizer))
    if tok.token_to_id(SEPARATOR) is not None:  # as the trainer streams them: files joined by its separator
        ids = _encode(tok, held_out)[:tokens].astype(np.int64)
    else:  # a tokenizer trained elsewhere, without the separator: the files back to back
        ids = np.asarray([i for text in held_out for i in tok.encode(text, add_special_tokens=False).ids][:tokens],
                         np.int64)
    if len(ids) < MIN_TEXT_TOKENS:
        return None
    return ids, f"recipe validation split ({len(held_out)} held-out stdlib files)"


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


def check_export_quality(model: "CausalLM", folder: Path, manifest: "Manifest",
                         settings: "ExportSettings") -> GateResult | None:
    """The export's quality gate, for fp16 and quantised exports (None for fp32: nothing to check).

    Runs the freshly written artifact in `folder` (the export's temp folder) against the fp32
    reference figures that reference_vectors.record has just written there (computed from `model`,
    which is only re-run if they are absent) and refuses the export with the figures unless
    `settings.force`. A target that cannot run on this machine (Core ML off macOS) is not measured:
    `validate` measures it on the device; nor is the `--baseline kv` model (random weights)."""
    from edgelin.export import reference_vectors
    from edgelin.export.base import Artifact
    from edgelin.export.baselines import BASELINE_SOURCE
    from edgelin.export.targets import get_target

    key = settings.quantize or settings.precision
    if key == "fp32" or manifest.source.get("path") == BASELINE_SOURCE["path"]:
        return None  # fp32: the logit threshold is the check; a random-weight latency baseline has no quality
    target = get_target(manifest.target)
    if not target.can_run(None).ok:
        return None
    reference = reference_vectors.read_quality(Path(folder) / reference_vectors.REFERENCE_FILE, manifest.vocab_size)
    if reference is None:
        reference = reference_vectors.reference_quality(model, manifest.vocab_size)
    files = {kind: entry.file for kind, entry in manifest.graphs.items()}
    runner = target.runner(Artifact(Path(folder), manifest, files), None, settings.threads or None)
    figures = measure(runner, reference)
    result = GateResult(key, figures, tuple(evaluate(figures, resolve_bounds(key))))
    if not result.passed and not settings.force:
        failed = "; ".join(c.describe() for c in result.checks if not c.passed)
        raise EdgelinError(f"the {key} export fails its quality check", f"{failed} (the bound), measured against the "
                           f"fp32 reference on {figures.source}",
                           f"pass --force to export anyway (validate will report the same figures), or export "
                           f"with a gentler precision ({GENTLER.get(key, '--precision fp32')})")
    return result
