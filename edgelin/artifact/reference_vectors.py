"""Reference vectors: what `edgelin validate DIR` replays on a device, with no checkpoint and no torch.

At export, the PyTorch reference runs a seeded random prompt and N decode steps at batch 1 and at
batch 3 (prefill through the chunked form, steps through the recurrent form, as `validate --against`
does), and the folder keeps, in one compressed `reference.npz`:

  meta                             JSON: format, seed, prompt_len, steps, batches, state checkpoints,
                                   the threshold by precision, the edgelin version; where the products
                                   round their activations, "noise_floor": {check: the reference's own
                                   distance under float noise} (noise_floor, FLOOR_FACTOR)
  b{B}/ids     int64 [B, P+N]      the prompt (first P) then the token fed at each step
  b{B}/start   int64 [B]           position of the first prompt token
  b{B}/prefill_logits  f32 [B, V]  the reference's last logits after the prompt
  b{B}/step_logits  f32 [N, B, V]  the reference's logits after each step
  b{B}/state/prefill/NAME          every state tensor (past_key_values.* names) after the prompt
  b{B}/state/step{t}/NAME          ... after step t, for the recorded checkpoints t
  quality/greedy_ids   int64 [16+G]   the quality figures' reference (edgelin/quality.py): a prompt,
                                   then the reference's G = 512 greedy tokens
  quality/text_ids     int64 [T]      held-out text (T <= 512 by default), when there is some
  quality/text_logprob f64 [T-1]      the reference's log p(next token) at every text position
  quality/text_argmax  int64 [T-1]    ... and its argmax there
  (meta["quality"] says where the text came from; files written before it have no quality/* keys
  and replay without the quality figures)

Which state checkpoints are kept is a size decision (the file ships with every export): float32
logits and states barely compress, and a real model's state dominates (the shipped model's is
about 240 KiB per sequence compressed, its logits 8 KiB per sequence and step). Batch 1 keeps the
state after the prompt, half-way and at the end; batch 3 at the end (its prefill state is checked
against its own steps over the prompt, and every step's logits against the reference). The shipped
model's file is about 2.2 MB.

This module is the format (names, keys, thresholds) and its reading, torch-free: edgelin.replay reads
it on a device; edgelin/export/reference_vectors.py records it at export (torch). meta's precision and
threshold are the export's, weight quantisation included (edgelin.artifact.quality.precision_key: "int4"
for an int4 export); replay picks its own from the saved manifest. A weight-quantised export records its
logits and states from the reference carrying the export's own dequantised weights
(edgelin/reference/parity.py, meta["reference_weights"]); its quality figures stay against the fp32
reference.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from edgelin.artifact.quality import GREEDY_PROMPT, GREEDY_STEPS, TEXT_TOKENS, QualityReference
from edgelin.integrity import sha256_of

REFERENCE_FILE = "reference.npz"
MANIFEST_KEY = "reference_vectors"  # manifest.extra[MANIFEST_KEY] = {"file": ..., "sha256": ...}
FORMAT = "edgelin-reference-vectors"
FORMAT_VERSION = 1
PROMPT_LEN = 15  # odd: a chunked prefill with a partial last chunk
STEPS = 24
BATCHES = (1, 3)
# Where every state tensor is recorded, per batch (see the module docstring): "prefill" (after the
# prompt) or "step{t}" (after rollout step t, 1-based).
STATE_CHECKPOINTS = {1: ("prefill", f"step{STEPS // 2}", f"step{STEPS}"), 3: (f"step{STEPS}",)}
QUALITY = "quality/"  # key prefix of the quality figures' reference
# max |exported - reference| / max |reference|, per output, by the graphs' precision (fp32, fp16) or
# weight quantisation (int8, int4; edgelin.artifact.quality.precision_key). README ("validate: quality figures")
# has the measured errors behind them.
# bf16 (the coreai target's --precision bf16): 8 significant bits to fp16's 11; measured on the shipped model on Apple's
# runtime: logits 3.0e-2, the softmax layer's bf16 KV cache 5.3e-2 of their scale (docs/targets/coreai.md#precision).
# int8-activations (edgelin.artifact.quality.ROUNDED_ACTIVATIONS): 8- or 4-bit weights whose products round their
# activations to int8 blocks as the reference does, apart where float noise tips a rounding tie (threshold_key).
THRESHOLDS = {"fp32": 1e-4, "fp16": 2e-2, "bf16": 0.1, "int8": 5e-2, "int4": 0.25, "int8-activations": 0.25}


# A check's bound where the reference records its noise floor: at least this many times the largest floor of its
# output (replay.Checks). The floor is one draw of the noise (edgelin.reference.parity.with_float_noise); a runtime's
# own order of the arithmetic tips other ties: GLA-1.3B int4 at 24 layers, the artifact's errors at most 1.34x
# (prefill), 1.05x (rollout), 1.28x (prefill-vs-steps) that floor, median 0.80x (docs/precision.md, "Products that
# round their activations").
FLOOR_FACTOR = 3.0


def metric_key(check: str, output: str, batch: int | None) -> str:
    """How a check is named in failure lists and in meta["noise_floor"]: "prefill/logits@1"."""
    return f"{check}/{output}@{batch}"


def max_difference(got: np.ndarray, want: np.ndarray, piece: int = 1 << 20) -> float:
    """max |got - want| in float64, `piece` values at a time: the step logits of a 248k-token vocabulary at batch 3
    are 71 MB in float32, and their whole difference in float64 (with its absolute value) was 0.4 GB more at the
    export's peak."""
    got, want = np.ravel(got), np.ravel(want)
    if got.shape != want.shape:
        raise ValueError(f"{got.shape} against {want.shape}")
    return max((float(np.abs(got[i:i + piece].astype(np.float64) - want[i:i + piece]).max())
                for i in range(0, got.size, piece)), default=0.0)


def noise_floor(noisy: dict[str, Any], recorded: dict[str, np.ndarray]) -> dict[str, float]:
    """max |noisy - recorded| / max |recorded| per check of replay (prefill: the logits and each state after the
    prompt; rollout: every step's logits, each state at its recorded steps), from two runs of the reference keyed
    as reference.npz is: the second with float noise before its rounding products (meta["noise_floor"]). A value of
    `noisy` is that run's array, or its largest difference from the recorded one already taken (a float)."""
    from edgelin.artifact.state import output_name_for

    worst: dict[str, list[float]] = {}
    for key, want in recorded.items():
        parts = key.split("/")  # b{B}/prefill_logits | b{B}/step_logits | b{B}/state/{checkpoint}/{name}
        batch = int(parts[0][1:])
        if parts[1] == "state":
            check, output = ("prefill" if parts[2] == "prefill" else "rollout"), output_name_for(parts[3])
        else:
            check, output = ("prefill" if parts[1] == "prefill_logits" else "rollout"), "logits"
        error, scale = worst.setdefault(metric_key(check, output, batch), [0.0, 0.0])
        worst[metric_key(check, output, batch)] = [
            max(error, noisy[key] if isinstance(noisy[key], float) else max_difference(noisy[key], want)),
            max(scale, float(np.abs(want).max(initial=0.0)))]
    return {key: error / max(scale, 1e-12) for key, (error, scale) in worst.items()}


def positions_needed(text_tokens: int = TEXT_TOKENS, prompt_len: int = PROMPT_LEN, steps: int = STEPS,
                     greedy: tuple[int, int] = (GREEDY_PROMPT, GREEDY_STEPS)) -> int:
    """The most tokens one sequence holds while `edgelin validate DIR` replays what `record` writes: the
    prompt and its steps (prompt_len + steps), the quality figures' greedy rollout (a prefill of its prompt,
    then a step for every greedy token but the last: prompt + G - 1) and the text pass (a step for every
    text token but the last: T - 1). A fixed-capacity KV cache (`--kv-cache static --context N`) must hold
    this many: with the defaults, 16 + 512 - 1 = 527."""
    return max(prompt_len + steps, greedy[0] + greedy[1] - 1, text_tokens - 1)


def threshold_for(precision: str) -> float:
    return THRESHOLDS.get(precision, THRESHOLDS["int4"])


def batch_key(batch: int, what: str) -> str:
    return f"b{batch}/{what}"


def state_key(batch: int, checkpoint: str, name: str) -> str:
    """checkpoint: "prefill" or "step{t}"; name: a past_key_values.* input name."""
    return f"b{batch}/state/{checkpoint}/{name}"


def manifest_entry(folder: Path, name: str = REFERENCE_FILE) -> dict[str, str]:
    """What the manifest records: the file and its sha256 (replay refuses a file that differs)."""
    return {"file": name, "sha256": sha256_of(Path(folder) / name)}


def read_quality(path: Path, vocab: int) -> QualityReference | None:
    """The quality reference a reference.npz holds (None for a file recorded before it existed)."""
    with np.load(path, allow_pickle=False) as npz:
        meta = json.loads(str(npz["meta"]))
        if "quality" not in meta:
            return None
        arrays = {key: npz[key] for key in npz.files if key.startswith(QUALITY)}
    return QualityReference.from_arrays(arrays, QUALITY, meta["quality"], vocab)


