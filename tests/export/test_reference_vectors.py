"""edgelin.export.reference_vectors: the noise floor's second run of the reference compares with the first as it goes
(the largest difference per recorded array, no second copy of the step logits) and gives the floor the two whole
runs give."""

from __future__ import annotations

import numpy as np
import torch

from conftest import tiny_config
from edgelin.artifact.reference_vectors import PROMPT_LEN, STEPS, noise_floor
from edgelin.export.reference_vectors import _run
from edgelin.model.lm import CausalLM


def test_a_run_against_another_gives_the_floor_of_both_whole_runs():
    torch.manual_seed(0)
    model = CausalLM(tiny_config(("gated_deltanet", "softmax"))).eval()
    rng = np.random.default_rng(1)
    for batch in (1, 3):
        ids = rng.integers(0, model.config.vocab_size, (batch, PROMPT_LEN + STEPS), dtype=np.int64)
        start = np.zeros(batch, np.int64)
        with torch.no_grad():
            recorded = _run(model, ids, start, batch)
            for parameter in model.parameters():  # another run of "the same" model, a little off
                parameter.add_(torch.randn_like(parameter) * 1e-4)
            whole = _run(model, ids, start, batch)
            taken = _run(model, ids, start, batch, against=recorded)
        assert set(taken) == set(recorded) == set(whole)
        assert all(isinstance(value, float) for value in taken.values())
        assert all(value > 0 for value in taken.values())  # every array moved: the comparison is not vacuous
        assert noise_floor(taken, recorded) == noise_floor(whole, recorded)
