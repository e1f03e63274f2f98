"""Quality that users feel, measured on a runner: top-1 agreement with the fp32 reference and perplexity
on held-out text (the figures, bounds and records: edgelin/artifact/quality.py).

The logit/state checks of validate bound the *numerical* error of an export; an fp16 or int4 export
is expected to differ, and what matters is whether it still picks the same tokens and predicts text
as well.

Held-out text, in this order: `--text FILE`; the checkpoint's recipe validation split (whole
held-out stdlib files, edgelin.data.split_files) when the checkpoint folder holds its recipe.toml;
otherwise a seeded random-token prompt, for which only top-1 agreement is reported (the perplexity of
random tokens says nothing about a model). edgelin/data.py reads it.

The reference side is recorded at export (edgelin/export/reference_vectors.py: the `quality/*` arrays
of reference.npz) so `validate DIR` measures the artifact on the device with no torch; `validate
--against CKPT` computes the same reference live (edgelin/reference/parity.py). This module imports no
torch: the measurement runs wherever the runner runs.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

import numpy as np

from edgelin.artifact.quality import QualityFigures, QualityReference, log_softmax_at, perplexity

if TYPE_CHECKING:
    from edgelin.export.base import Runner


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
