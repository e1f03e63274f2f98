"""The reference's noise floor (edgelin.artifact.reference_vectors.noise_floor, recorded at export where the products
round their activations) and replay's bounds from it (edgelin.replay.Checks): at least FLOOR_FACTOR times the floor
of the same check, the precision's threshold elsewhere."""

from __future__ import annotations

import numpy as np
import pytest

from edgelin.artifact.reference_vectors import FLOOR_FACTOR, metric_key, noise_floor
from edgelin.replay import Checks


def test_noise_floor_names_each_check_as_replay_does_and_takes_the_worst_step():
    rng = np.random.default_rng(0)
    recorded = {"b1/prefill_logits": rng.standard_normal((1, 8)).astype(np.float32),
                "b1/step_logits": rng.standard_normal((4, 1, 8)).astype(np.float32),
                "b1/state/prefill/past_key_values.0.recurrent_state": np.full((1, 2, 2), 2.0, np.float32),
                "b1/state/step2/past_key_values.0.recurrent_state": np.full((1, 2, 2), 4.0, np.float32),
                "b1/state/step4/past_key_values.0.recurrent_state": np.full((1, 2, 2), 1.0, np.float32),
                "b3/step_logits": np.ones((4, 3, 8), np.float32)}
    noisy = {k: v.copy() for k, v in recorded.items()}
    noisy["b1/step_logits"][2, 0, 5] += 0.5  # one step off: the rollout's logits, over the worst scale of all steps
    noisy["b1/state/step4/past_key_values.0.recurrent_state"][0, 1, 1] += 0.2
    floor = noise_floor(noisy, recorded)
    assert set(floor) == {"prefill/logits@1", "rollout/logits@1", "prefill/present.0.recurrent_state@1",
                          "rollout/present.0.recurrent_state@1", "rollout/logits@3"}
    assert floor["prefill/logits@1"] == 0 and floor["rollout/logits@3"] == 0
    assert floor["rollout/logits@1"] == pytest.approx(0.5 / np.abs(recorded["b1/step_logits"]).max())
    assert floor["rollout/present.0.recurrent_state@1"] == pytest.approx(0.2 / 4.0, rel=1e-6)  # scale of step 2's
    # the export's second run hands over each array's largest difference, taken as it went: the same floor
    from edgelin.artifact.reference_vectors import max_difference

    taken = {key: max(max_difference(noisy[key][t], value[t]) for t in range(len(value))) for key, value in
             recorded.items()}
    assert all(isinstance(v, float) for v in taken.values()) and noise_floor(taken, recorded) == floor


def test_a_checks_bound_is_the_threshold_or_factor_times_its_own_floor():
    key = metric_key("prefill", "logits", 1)
    check = Checks(0.05, {key: 0.1, metric_key("prefill", "logits", 3): 0.001})
    want = np.array([[1.0, -1.0]])
    for batch in (1, 3, 2):  # floored; floor below the threshold; no floor recorded
        check("prefill", "logits", want + 0.2, want, batch=batch)
    floored, small, plain = check.metrics.values()
    assert floored.threshold == pytest.approx(FLOOR_FACTOR * 0.1) and floored.noise_floor == 0.1 and floored.passed
    assert (small.threshold, plain.threshold) == (0.05, 0.05) and not small.passed and not plain.passed


def test_the_checks_of_one_output_share_its_largest_floor():
    """Each floor is one draw for that output's layer: prefill-vs-steps takes the rollout's larger one, and a check
    whose own floor was not recorded takes its output's; another output or batch keeps its own."""
    check = Checks(0.05, {metric_key("prefill-vs-steps", "present.3.key", 1): 0.02,
                          metric_key("rollout", "present.3.key", 1): 0.1,
                          metric_key("rollout", "present.3.key", 3): 0.01})
    want = np.array([[2.0, -2.0]])
    for check_name, batch in (("prefill-vs-steps", 1), ("prefill", 1), ("prefill-vs-steps", 3)):
        check(check_name, "present.3.key", want + 0.5, want, batch=batch)  # 0.25 of the scale
    steps, prefill, other_batch = check.metrics.values()
    assert steps.threshold == prefill.threshold == pytest.approx(FLOOR_FACTOR * 0.1) and steps.passed and prefill.passed
    assert other_batch.threshold == pytest.approx(0.05) and not other_batch.passed


def test_max_difference_in_pieces_equals_the_whole():
    """The floor's distance taken a piece at a time (no float64 copy of a 248k-vocabulary run's step logits) is
    the whole array's, wherever the largest difference lies; empty arrays are 0."""
    from edgelin.artifact.reference_vectors import max_difference

    rng = np.random.default_rng(3)
    want = rng.standard_normal((24, 3, 1001)).astype(np.float32)
    got = want + rng.standard_normal(want.shape).astype(np.float32) * 1e-6
    got[23, 2, 1000] += 0.5  # the last value of the last piece
    whole = float(np.abs(got.astype(np.float64) - want).max())
    assert whole > 0.49
    for piece in (7, 1000, 1 << 20):
        assert max_difference(got, want, piece) == whole
    assert max_difference(np.zeros(0, np.float32), np.zeros(0, np.float32)) == 0.0
    with pytest.raises(ValueError):
        max_difference(got, want[:1])
