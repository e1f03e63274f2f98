"""Reference vectors: what `edgelin validate DIR` replays on a device, with no checkpoint and no torch.

At export, the PyTorch reference runs a seeded random prompt and N decode steps at batch 1 and at
batch 3 (prefill through the chunked form, steps through the recurrent form, as `validate --against`
does), and the folder keeps, in one compressed `reference.npz`:

  meta                             JSON: format, seed, prompt_len, steps, batches, state checkpoints,
                                   the threshold by precision, the edgelin version
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

This module imports torch only inside `record` and `reference_quality`: the format (names, keys) is
read torch-free by edgelin.replay. meta's precision and threshold are the export's, weight quantisation
included (edgelin.quality.precision_key: "int4" for an int4 export); replay picks its own from the
saved manifest. A weight-quantised export records its logits and states from the reference carrying
the export's own dequantised weights (edgelin/export/dequantized.py, meta["reference_weights"]); its
quality figures stay against the fp32 reference.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from edgelin import __version__
from edgelin.artifact.state import state_input_name
from edgelin.integrity import sha256_of  # noqa: F401 (replay.py imports it from here)
from edgelin.quality import (GREEDY_PROMPT, GREEDY_STEPS, RANDOM_SOURCE, TEXT_TOKENS, QualityReference,
                             precision_key, read_text_tokens, recipe_held_out, threshold_key)

if TYPE_CHECKING:
    from edgelin.artifact.manifest import Manifest
    from edgelin.model.lm import CausalLM

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
# weight quantisation (int8, int4; edgelin.quality.precision_key). README ("validate: quality figures")
# has the measured errors behind them.
THRESHOLDS = {"fp32": 1e-4, "fp16": 2e-2, "int8": 5e-2, "int4": 0.25}


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


def flat_state(state: list[dict[str, Any]]) -> dict[str, np.ndarray]:
    """The reference's per-layer state as {past_key_values.{layer}.{name}: numpy array}."""
    return {state_input_name(i, name): t.detach().cpu().numpy() for i, layer in enumerate(state)
            for name, t in layer.items()}


def manifest_entry(folder: Path, name: str = REFERENCE_FILE) -> dict[str, str]:
    """What the manifest records: the file and its sha256 (replay refuses a file that differs)."""
    return {"file": name, "sha256": sha256_of(Path(folder) / name)}


def held_out_text(manifest: "Manifest", folder: Path, text: Path | None = None, tokens: int = TEXT_TOKENS,
                  checkpoint: Path | None = None) -> tuple[np.ndarray | None, str]:
    """(token ids, where they came from) for the quality figures: `text` (--text FILE, tokenised with
    the export's tokenizer in `folder`, else the checkpoint's), else the checkpoint's recipe validation
    split, else (None, "random tokens"). `checkpoint`: default, the one the manifest names."""
    source = manifest.source.get("path")
    checkpoint = checkpoint or (Path(source) if isinstance(source, str) else None)
    if text is not None:
        fallback = checkpoint / "tokenizer.json" if checkpoint is not None else None
        tokenizer = (Path(folder) / manifest.tokenizer if manifest.tokenizer else
                     fallback if fallback is not None and fallback.is_file() else None)
        return read_text_tokens(text, tokenizer, manifest.vocab_size, tokens), f"text {Path(text).name}"
    found = recipe_held_out(checkpoint, tokens) if checkpoint is not None and checkpoint.is_dir() else None
    return found if found is not None else (None, RANDOM_SOURCE)


def reference_quality(model: "CausalLM", vocab: int, text_ids: np.ndarray | None = None,
                      source: str = RANDOM_SOURCE, seed: int = 0, greedy_steps: int = GREEDY_STEPS,
                      window_bytes: int = 8 << 20) -> QualityReference:
    """The fp32 reference's side of the quality figures (edgelin/quality.py): its greedy rollout from
    the text's first GREEDY_PROMPT tokens (seeded random ones without text), through the recurrent
    form, token by token as a decoder runs; and its log p(next) and argmax over the text (chunked
    forward in windows of at most `window_bytes` of float64 log-probs, carrying the state, so memory
    stays flat for any vocabulary and text length)."""
    import torch

    rng = np.random.default_rng(seed)
    prompt = (text_ids[:GREEDY_PROMPT] if text_ids is not None and len(text_ids) > GREEDY_PROMPT
              else rng.integers(0, vocab, GREEDY_PROMPT, dtype=np.int64))
    feed = np.concatenate([prompt, np.zeros(greedy_steps - 1, np.int64)])  # the prompt, then each greedy token
    greedy = np.empty(greedy_steps, np.int64)
    state = None
    with torch.no_grad():
        for t in range(len(feed)):
            logits, state = model(torch.from_numpy(feed[None, t:t + 1]), state, torch.tensor([t]), mode="recurrent")
            if t + 1 >= len(prompt):
                greedy[t + 1 - len(prompt)] = int(logits.reshape(-1).argmax())
                if t + 1 < len(feed):
                    feed[t + 1] = greedy[t + 1 - len(prompt)]
        if text_ids is None:
            return QualityReference(source, np.concatenate([prompt, greedy]), len(prompt))
        scored = len(text_ids) - 1
        window = max(1, min(256, window_bytes // (vocab * 8)))
        logprob, argmax, state = np.empty(scored), np.empty(scored, np.int64), None
        for lo in range(0, scored, window):
            ids = torch.from_numpy(text_ids[None, lo:min(lo + window, scored)])
            logits, state = model(ids, state, torch.tensor([lo]), mode="chunked")
            logp = torch.log_softmax(logits[0].double(), -1)
            nxt = torch.from_numpy(text_ids[lo + 1:lo + 1 + ids.shape[1]])
            logprob[lo:lo + ids.shape[1]] = logp.gather(-1, nxt[:, None])[:, 0].numpy()
            argmax[lo:lo + ids.shape[1]] = logits[0].argmax(-1).numpy()
    return QualityReference(source, np.concatenate([prompt, greedy]), len(prompt), np.asarray(text_ids, np.int64),
                            logprob, argmax)


def read_quality(path: Path, vocab: int) -> QualityReference | None:
    """The quality reference a reference.npz holds (None for a file recorded before it existed)."""
    with np.load(path, allow_pickle=False) as npz:
        meta = json.loads(str(npz["meta"]))
        if "quality" not in meta:
            return None
        arrays = {key: npz[key] for key in npz.files if key.startswith(QUALITY)}
    return QualityReference.from_arrays(arrays, QUALITY, meta["quality"], vocab)


def record(model: "CausalLM", folder: Path, manifest: "Manifest", seed: int = 0, text: Path | None = None,
           text_tokens: int = TEXT_TOKENS) -> str:
    """Run the reference and write `folder/reference.npz`; returns its file name. `text`: held-out
    text for the quality figures (--text FILE; default: see held_out_text), at most `text_tokens`.
    `manifest` must already hold the weights' account (extra["quantization"]): meta's precision and
    threshold are chosen by it."""
    import torch

    from edgelin.export.dequantized import parity_reference

    vocab = manifest.vocab_size
    rng = np.random.default_rng(seed)
    arrays: dict[str, np.ndarray] = {}
    quality_model = model  # the quality figures measure against fp32; the parity against the artifact's weights
    model, weights = parity_reference(model, folder, manifest)
    with torch.no_grad():
        for batch in BATCHES:
            ids = rng.integers(0, vocab, (batch, PROMPT_LEN + STEPS), dtype=np.int64)
            start = np.zeros(batch, np.int64)
            ids_t = torch.from_numpy(ids)
            logits, state = model(ids_t[:, :PROMPT_LEN], None, torch.from_numpy(start), last_only=True)
            arrays[batch_key(batch, "ids")] = ids
            arrays[batch_key(batch, "start")] = start
            arrays[batch_key(batch, "prefill_logits")] = logits.numpy().astype(np.float32)
            keep = STATE_CHECKPOINTS[batch]
            if "prefill" in keep:
                arrays.update({state_key(batch, "prefill", n): v for n, v in flat_state(state).items()})
            steps = np.empty((STEPS, batch, vocab), np.float32)
            for t in range(STEPS):
                position = torch.from_numpy(start + PROMPT_LEN + t)
                logits, state = model(ids_t[:, PROMPT_LEN + t:PROMPT_LEN + t + 1], state, position, mode="recurrent")
                steps[t] = logits[:, -1].numpy()
                if f"step{t + 1}" in keep:
                    arrays.update({state_key(batch, f"step{t + 1}", n): v for n, v in flat_state(state).items()})
            arrays[batch_key(batch, "step_logits")] = steps
    text_ids, source = held_out_text(manifest, folder, text, text_tokens)
    quality, quality_meta = reference_quality(quality_model, vocab, text_ids, source, seed).to_arrays(QUALITY)
    arrays.update(quality)
    key = precision_key(manifest)  # int8/int4 when the manifest records a quantisation, else its precision
    meta = {
        "format": FORMAT, "version": FORMAT_VERSION, "seed": seed, "prompt_len": PROMPT_LEN, "steps": STEPS,
        "batches": list(BATCHES), "state_checkpoints": {str(b): list(STATE_CHECKPOINTS[b]) for b in BATCHES},
        "precision": key, "threshold": threshold_for(threshold_key(manifest)), "thresholds": THRESHOLDS,
        "quality": quality_meta,
        "reference": "PyTorch: prefill through the chunked form, steps through the recurrent form",
        **({"reference_weights": weights.to_dict()} if weights is not None else {}),
        "edgelin_version": __version__,
    }
    arrays["meta"] = np.array(json.dumps(meta))
    # `folder` is the export's temp folder (renamed into place once complete): no partial file survives.
    np.savez_compressed(Path(folder) / REFERENCE_FILE, **arrays)
    return REFERENCE_FILE
