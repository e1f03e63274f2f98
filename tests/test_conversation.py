"""edgelin.conversation: restore-and-continue equals uninterrupted decoding, snapshots and rewinds equal never having
drafted, forks are independent rows, and a saved conversation resumes in a fresh runner - on a hybrid whose KV cache
grows (part of every snapshot) and a constant-memory Mamba2, at batch 1 and 3. Same runner and batch shape: bit for
bit; a state re-advanced by prefill instead of steps: within the export's prefill-vs-steps tolerance."""

from __future__ import annotations

import numpy as np
import pytest

from edgelin.conversation import Conversation
from edgelin.errors import EdgelinError
from edgelin.runtime import open_runner
from helpers import assert_close, export_family, export_growing_hybrid

PREFILL_VS_STEPS = 1e-4  # replay's prefill-vs-steps check at fp32 (docs/checks.md)


@pytest.fixture(scope="module")
def exports(tmp_path_factory):
    root = tmp_path_factory.mktemp("conversation")
    return {"hybrid": export_growing_hybrid(root), "mamba2": export_family(root, "mamba2")}


def _ids(rng: np.random.Generator, vocab: int, *shape: int) -> np.ndarray:
    return rng.integers(0, vocab, shape, dtype=np.int64)


def _roll(conv: Conversation, ids: np.ndarray) -> np.ndarray:
    """Step each column of ids [batch, n]; the logits [n, batch, vocab]."""
    return np.stack([conv.step(ids[:, t]) for t in range(ids.shape[1])])


@pytest.mark.parametrize("family", ["hybrid", "mamba2"])
@pytest.mark.parametrize("batch", [1, 3])
def test_a_saved_conversation_continues_in_a_new_runner_as_if_never_stopped(exports, family, batch, tmp_path):
    runner = open_runner(exports[family])
    vocab = runner.manifest.vocab_size
    rng = np.random.default_rng(batch)
    prompt, steps = _ids(rng, vocab, batch, 13), _ids(rng, vocab, batch, 1000)
    whole = Conversation(runner, batch)
    whole.prefill(prompt)
    want = _roll(whole, steps)

    first = Conversation(runner, batch)
    first.prefill(prompt)
    _roll(first, steps[:, :400])
    path = first.save(tmp_path / "chat.edgestate")
    resumed = Conversation.load(open_runner(exports[family]), path)  # a fresh runner: as a new process has
    assert (resumed.position, resumed.batch) == (13 + 400, batch)
    np.testing.assert_array_equal(resumed.tokens, np.concatenate([prompt, steps[:, :400]], axis=1))
    np.testing.assert_array_equal(_roll(resumed, steps[:, 400:]), want[400:])
    assert resumed.position == 1013


@pytest.mark.parametrize("family", ["hybrid", "mamba2"])
def test_restoring_a_snapshot_is_as_if_the_drafted_tokens_never_ran(exports, family):
    runner = open_runner(exports[family])
    rng = np.random.default_rng(7)
    prompt, real, draft = _ids(rng, 97, 3, 9), _ids(rng, 97, 3, 12), _ids(rng, 97, 3, 5)
    plain = Conversation(runner, 3)
    plain.prefill(prompt)
    want = _roll(plain, real)
    conv = Conversation(runner, 3)
    conv.prefill(prompt)
    snap = conv.snapshot()
    _roll(conv, draft)
    conv.restore(snap)
    assert conv.position == 9 and conv.logits is None
    np.testing.assert_array_equal(_roll(conv, real), want)
    conv.restore(snap)  # a snapshot stays usable after a restore
    np.testing.assert_array_equal(_roll(conv, real[:, :4]), want[:4])


@pytest.mark.parametrize("family", ["hybrid", "mamba2"])
def test_rewind_to_a_kept_checkpoint_is_exact_and_beyond_it_re_advances(exports, family):
    runner = open_runner(exports[family])
    rng = np.random.default_rng(11)
    prompt, real, draft = _ids(rng, 97, 1, 10), _ids(rng, 97, 1, 8), _ids(rng, 97, 1, 6)
    plain = Conversation(runner)
    plain.prefill(prompt)
    want = _roll(plain, real)

    conv = Conversation(runner, keep=8)
    conv.prefill(prompt)
    _roll(conv, draft)
    conv.rewind(6)  # six single-token steps back: the checkpoint before the first draft token
    assert conv.position == 10
    np.testing.assert_array_equal(conv.tokens, prompt)
    np.testing.assert_array_equal(_roll(conv, real), want)

    # a checkpoint before the target (a prefill call spans it): restored, and the 2 tokens between prefilled again
    span = Conversation(runner, keep=8)
    span.prefill(prompt)
    span.prefill(real[:, :4])
    _roll(span, draft[:, :2])
    span.rewind(4)
    assert span.position == 12
    np.testing.assert_array_equal(span.tokens, np.concatenate([prompt, real[:, :2]], axis=1))
    assert_close(_roll(span, real[:, 2:]), want[2:], PREFILL_VS_STEPS, "re-advanced by prefill vs stepped")

    # no checkpoints kept: back to the empty state and the prompt prefilled again, as the plain run did
    bare = Conversation(runner, keep=0)
    bare.prefill(prompt)
    _roll(bare, draft[:, :3])
    bare.rewind(3)
    np.testing.assert_array_equal(_roll(bare, real), want)


def test_fork_rows_are_independent(exports):
    runner = open_runner(exports["hybrid"])
    rng = np.random.default_rng(3)
    prompt = _ids(rng, 97, 1, 11)
    conv = Conversation(runner)
    conv.prefill(prompt)
    branches = conv.fork(3)
    assert (branches.batch, branches.position, conv.batch) == (3, 11, 1)
    ids = _ids(rng, 97, 3, 10)
    got = _roll(branches, ids)
    perturbed = ids.copy()
    perturbed[1, 2] = (perturbed[1, 2] + 1) % 97  # another token in row 1 only
    again = conv.fork(3)
    other = _roll(again, perturbed)
    np.testing.assert_array_equal(other[:, [0, 2]], got[:, [0, 2]])  # the other rows, bit for bit
    assert not np.array_equal(other[3:, 1], got[3:, 1])
    alone = Conversation(runner)  # row 2 as a batch-1 conversation: the same within float rounding
    alone.prefill(prompt)
    assert_close(_roll(alone, ids[2:3]), got[:, 2:3], 1e-5, "a fork row vs the sequence alone")
    np.testing.assert_array_equal(conv.tokens, prompt)  # the forked conversation is left as it was


def test_bad_calls_are_refused_and_change_nothing(exports):
    runner = open_runner(exports["mamba2"])
    conv = Conversation(runner, keep=0)
    conv.prefill(np.arange(5))
    before = conv.read_state()
    for call, match in ((lambda: conv.rewind(6), "rewind 6"), (lambda: conv.step([1, 2]), "step ids"),
                        (lambda: conv.prefill(np.zeros((2, 3), np.int64)), "prefill ids"),
                        (lambda: conv.fork(0), "fork"), (lambda: conv.prefill(np.array([1.5, 2.0])), "dtype float64"),
                        (lambda: conv.step(np.array([1.5])), "dtype float64"), (lambda: Conversation(runner, keep=-1), "keep"),
                        # a bad id in the prefill's last piece (pieces of 256): refused before the first piece runs
                        (lambda: conv.prefill(np.r_[np.arange(600) % 97, 97]), "token id out of range")):
        with pytest.raises(EdgelinError, match=match):
            call()
    assert conv.position == 5
    for name, value in conv.read_state().items():
        np.testing.assert_array_equal(value, before[name])
    with pytest.raises(EdgelinError, match="fork of a conversation of batch 2"):
        conv.fork(2).fork(2)
    with pytest.raises(EdgelinError, match="batch 2"):
        conv.restore(conv.fork(2).snapshot())
