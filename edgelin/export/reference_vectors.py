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

Which state checkpoints are kept is a size decision (the file ships with every export): float32
logits and states barely compress, and a real model's state dominates (the shipped model's is
about 240 KiB per sequence compressed, its logits 8 KiB per sequence and step). Batch 1 keeps the
state after the prompt, half-way and at the end; batch 3 at the end (its prefill state is checked
against its own steps over the prompt, and every step's logits against the reference). The shipped
model's file is about 2.2 MB.

This module imports torch only inside `record`: the format (names, keys) is read torch-free by
edgelin.replay.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from edgelin import __version__
from edgelin.export.state import state_input_name

if TYPE_CHECKING:
    from edgelin.export.manifest import Manifest
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
# max |exported - reference| / max |reference|, per output, by the graphs' compute precision
THRESHOLDS = {"fp32": 1e-4, "fp16": 2e-2}


def threshold_for(precision: str) -> float:
    return THRESHOLDS.get(precision, THRESHOLDS["fp16"])


def batch_key(batch: int, what: str) -> str:
    return f"b{batch}/{what}"


def state_key(batch: int, checkpoint: str, name: str) -> str:
    """checkpoint: "prefill" or "step{t}"; name: a past_key_values.* input name."""
    return f"b{batch}/state/{checkpoint}/{name}"


def flat_state(state: list[dict[str, Any]]) -> dict[str, np.ndarray]:
    """The reference's per-layer state as {past_key_values.{layer}.{name}: numpy array}."""
    return {state_input_name(i, name): t.detach().cpu().numpy() for i, layer in enumerate(state)
            for name, t in layer.items()}


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def manifest_entry(folder: Path, name: str = REFERENCE_FILE) -> dict[str, str]:
    """What the manifest records: the file and its sha256 (replay refuses a file that differs)."""
    return {"file": name, "sha256": sha256_of(Path(folder) / name)}


def record(model: "CausalLM", folder: Path, manifest: "Manifest", seed: int = 0) -> str:
    """Run the reference and write `folder/reference.npz`; returns its file name."""
    import torch

    vocab = manifest.vocab_size
    rng = np.random.default_rng(seed)
    arrays: dict[str, np.ndarray] = {}
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
    meta = {
        "format": FORMAT, "version": FORMAT_VERSION, "seed": seed, "prompt_len": PROMPT_LEN, "steps": STEPS,
        "batches": list(BATCHES), "state_checkpoints": {str(b): list(STATE_CHECKPOINTS[b]) for b in BATCHES},
        "precision": manifest.precision, "threshold": threshold_for(manifest.precision), "thresholds": THRESHOLDS,
        "reference": "PyTorch: prefill through the chunked form, steps through the recurrent form",
        "edgelin_version": __version__,
    }
    arrays["meta"] = np.array(json.dumps(meta))
    # `folder` is the export's temp folder (renamed into place once complete): no partial file survives.
    np.savez_compressed(Path(folder) / REFERENCE_FILE, **arrays)
    return REFERENCE_FILE
