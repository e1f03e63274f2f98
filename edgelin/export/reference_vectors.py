"""Reference vectors recorded at export: the PyTorch reference runs a seeded random prompt and its decode
steps at batch 1 and 3 and the quality figures' reference, and `reference.npz` keeps them (the format,
what each key holds and why, and its torch-free reading: edgelin/artifact/reference_vectors.py).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from edgelin import __version__
from edgelin.artifact.quality import TEXT_TOKENS, precision_key, threshold_key
# MANIFEST_KEY, manifest_entry and positions_needed: the export pipeline reads them through this module.
from edgelin.artifact.reference_vectors import (BATCHES, FORMAT, FORMAT_VERSION, PROMPT_LEN, QUALITY, REFERENCE_FILE,
                                                STATE_CHECKPOINTS, STEPS, THRESHOLDS, batch_key, max_difference,
                                                noise_floor, state_key, threshold_for)
from edgelin.data import held_out_text
from edgelin.export.targets import weights_reader
from edgelin.reference.parity import (flat_state, parity_reference, reference_quality, rounded_products,
                                      with_float_noise)

if TYPE_CHECKING:
    from edgelin.artifact.manifest import Manifest
    from edgelin.model.lm import CausalLM


def record(model: "CausalLM", folder: Path, manifest: "Manifest", seed: int = 0, text: Path | None = None,
           text_tokens: int = TEXT_TOKENS, consume: bool = False) -> str:
    """Run the reference and write `folder/reference.npz`; returns its file name. `text`: held-out
    text for the quality figures (--text FILE; default: see held_out_text), at most `text_tokens`.
    `manifest` must already hold the weights' account (extra["quantization"]): meta's precision and
    threshold are chosen by it. `consume`: the model is the export's own and nothing needs its float weights
    after this: a quantised export's parity reference takes their place in it (parity.with_dequantized)."""
    import torch

    from edgelin.export.phases import step

    vocab = manifest.vocab_size
    rng = np.random.default_rng(seed)
    arrays: dict[str, np.ndarray] = {}
    # The quality figures measure against fp32 (first: the parity reference may take the float weights' place);
    # the parity against the artifact's weights.
    text_ids, source = held_out_text(manifest, folder, text, text_tokens)
    step("the fp32 reference's quality figures")
    quality, quality_meta = reference_quality(model, vocab, text_ids, source, seed).to_arrays(QUALITY)
    arrays.update(quality)
    step("the reference with the export's weights")
    model, weights = parity_reference(model, folder, manifest, weights_reader(manifest), in_place=consume)
    floor: dict[str, float] = {}
    with torch.no_grad():
        for batch in BATCHES:
            step(f"prefill and {STEPS} steps at batch {batch}")
            ids = rng.integers(0, vocab, (batch, PROMPT_LEN + STEPS), dtype=np.int64)
            start = np.zeros(batch, np.int64)
            arrays[batch_key(batch, "ids")] = ids
            arrays[batch_key(batch, "start")] = start
            recorded = _run(model, ids, start, batch)
            arrays.update(recorded)
            if rounded_products(model):  # products that round their activations: the reference's own noise floor
                step(f"the noise floor at batch {batch}")
                handles = with_float_noise(model, seed)
                floor.update(noise_floor(_run(model, ids, start, batch, against=recorded), recorded))
                for handle in handles:
                    handle.remove()
                floor.update(_prefill_vs_steps(model, ids, start, batch))
    key = precision_key(manifest)  # int8/int4 when the manifest records a quantisation, else its precision
    meta = {
        "format": FORMAT, "version": FORMAT_VERSION, "seed": seed, "prompt_len": PROMPT_LEN, "steps": STEPS,
        "batches": list(BATCHES), "state_checkpoints": {str(b): list(STATE_CHECKPOINTS[b]) for b in BATCHES},
        "precision": key, "threshold": threshold_for(threshold_key(manifest)), "thresholds": THRESHOLDS,
        "quality": quality_meta,
        "reference": "PyTorch: prefill through the chunked form, steps through the recurrent form",
        **({"reference_weights": weights.to_dict()} if weights is not None else {}),
        **({"noise_floor": floor} if floor else {}),
        "edgelin_version": __version__,
    }
    arrays["meta"] = np.array(json.dumps(meta))
    # `folder` is the export's temp folder (renamed into place once complete): no partial file survives.
    np.savez_compressed(Path(folder) / REFERENCE_FILE, **arrays)
    return REFERENCE_FILE


def _run(model: "CausalLM", ids: np.ndarray, start: np.ndarray, batch: int,
         against: dict[str, np.ndarray] | None = None) -> dict[str, Any]:
    """The reference's prefill of the prompt and its STEPS steps: the arrays reference.npz keeps for `batch`; with
    `against` (an earlier run's arrays), each one's largest difference from it instead, taken as the run goes (the
    noise floor's second run holds no second copy of the step logits: 71 MB at batch 3 and a 248k vocabulary)."""
    import torch

    arrays: dict[str, Any] = {}

    def keep(key: str, value: np.ndarray, step: int | None = None) -> None:
        if against is None:
            arrays[key] = value
        else:
            want = against[key] if step is None else against[key][step]
            arrays[key] = max(arrays.get(key, 0.0), max_difference(value, want))

    ids_t = torch.from_numpy(ids)
    logits, state = model(ids_t[:, :PROMPT_LEN], None, torch.from_numpy(start), last_only=True)
    keep(batch_key(batch, "prefill_logits"), logits.numpy().astype(np.float32))
    keep_states = STATE_CHECKPOINTS[batch]
    if "prefill" in keep_states:
        for name, value in flat_state(state).items():
            keep(state_key(batch, "prefill", name), value)
    steps = np.empty((STEPS, batch, logits.shape[-1]), np.float32) if against is None else None
    for t in range(STEPS):
        position = torch.from_numpy(start + PROMPT_LEN + t)
        logits, state = model(ids_t[:, PROMPT_LEN + t:PROMPT_LEN + t + 1], state, position, mode="recurrent")
        if steps is not None:
            steps[t] = logits[:, -1].numpy()
        else:
            keep(batch_key(batch, "step_logits"), logits[:, -1].numpy(), t)
        if f"step{t + 1}" in keep_states:
            for name, value in flat_state(state).items():
                keep(state_key(batch, f"step{t + 1}", name), value)
    if steps is not None:
        arrays[batch_key(batch, "step_logits")] = steps
    return arrays


def _prefill_vs_steps(model: "CausalLM", ids: np.ndarray, start: np.ndarray, batch: int) -> dict[str, float]:
    """The reference's own distance between its chunked prefill of the prompt and a step per prompt token, per
    output (replay's prefill-vs-steps check, which runs the artifact both ways): the two orders of arithmetic tip
    different rounding ties, the floor of that check (edgelin.artifact.reference_vectors.noise_floor)."""
    import torch

    from edgelin.artifact.reference_vectors import metric_key
    from edgelin.artifact.state import output_name_for

    ids_t, first = torch.from_numpy(ids[:, :PROMPT_LEN]), torch.from_numpy(start)
    logits, chunked = model(ids_t, None, first, last_only=True)
    state = None
    for t in range(PROMPT_LEN):
        stepped, state = model(ids_t[:, t:t + 1], state, first + t, mode="recurrent")
    pairs = {"logits": (stepped[:, -1].numpy(), logits.reshape(stepped[:, -1].shape).numpy())}
    steps_state, prefill_state = flat_state(state), flat_state(chunked)
    pairs.update({output_name_for(name): (steps_state[name], value) for name, value in prefill_state.items()})
    return {metric_key("prefill-vs-steps", output, batch):
            float(np.abs(got.astype(np.float64) - want).max(initial=0.0) / max(float(np.abs(want).max(initial=0.0)),
                                                                                1e-12))
            for output, (got, want) in pairs.items()}
