"""edgelin.serve.sequences: many sequences over one runner, each exactly as if alone, on real exports: ONNX (a
constant-state hybrid whose sliding window takes positions, and a hybrid whose KV cache grows) and the torch
reference (what the Python backend runs on a GPU; on CUDA where there is one). The reference
for every sequence is the same conversation run alone (edgelin.conversation, batch 1); nothing here is computed
by the pool."""

from __future__ import annotations

import numpy as np
import pytest

from edgelin.conversation import Conversation
from edgelin.runtime import open_runner
from edgelin.serve.sequences import Call, SequencePool
from helpers import assert_close, export_family, export_growing_hybrid, make_checkpoint

TOLERANCE = 1e-5  # a row of a batch vs the sequence alone (the runtime's batched products differ in rounding)


class Exports(dict):
    """The exports, each made the first time a test asks for it (a test that is left out costs no export)."""

    def __init__(self, root):
        super().__init__()
        self.root = root

    def __missing__(self, model: str):
        from edgelin.export.pipeline import export_checkpoint

        if model == "window":
            folder = export_family(self.root, "hybrid")
        elif model == "growing":
            folder = export_growing_hybrid(self.root)
        else:
            ckpt = make_checkpoint(self.root / "torch-ckpt", "hybrid", tokenizer=False)
            folder = export_checkpoint(ckpt, self.root / "torch-out", "torch").folder
        self[model] = folder
        return folder


@pytest.fixture(scope="module")
def exports(tmp_path_factory):
    return Exports(tmp_path_factory.mktemp("pool"))


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _alone(folder, tokens: list[int]) -> list[np.ndarray]:
    """Each call's logits for one sequence run alone: the prompt prefilled, then one step per further token."""
    conv = Conversation(open_runner(folder), keep=0)
    prompt, *rest = tokens
    out = [conv.prefill(np.asarray(prompt))[0]]
    out += [conv.step(int(t))[0] for t in rest]
    return out


@pytest.mark.parametrize("model", ["window", "growing", pytest.param("torch", marks=pytest.mark.slow)])
def test_interleaved_sequences_each_equal_the_sequence_alone(exports, model):
    """8 sequences with different prompts (1 to 8 tokens), stepped in changing subsets and orders (the batch is
    gathered and scattered again and again), one sequence restarted and one ended midway: every answer equals the
    same conversation run alone, and each greedy token too."""
    folder = exports[model]
    runner = open_runner(folder)
    vocab = runner.manifest.vocab_size
    rng = np.random.default_rng(7)
    pool = SequencePool(runner, capacity=8, idle_seconds=60)
    ids = [101 + 17 * s for s in range(8)]  # correlation ids, not row numbers
    sent: dict[int, list] = {s: [rng.integers(0, vocab, size=1 + i)] for i, s in enumerate(ids)}
    got: dict[int, list[np.ndarray]] = {s: [] for s in ids}
    results = pool.run([Call(s, sent[s][0], start=True) for s in ids])
    for s, r in zip(ids, results):
        assert r.error is None
        got[s].append(r.logits)
    batch_sizes = set()
    for round_ in range(12):
        live = [s for s in ids if s in pool.live]
        chosen = [int(s) for s in rng.permutation(live)[: rng.integers(1, len(live) + 1)]]
        if round_ == 9 and ids[3] not in chosen:
            chosen.append(ids[3])  # ended in this round
        batch_sizes.add(len(chosen))
        calls = [Call(int(s), np.array([int(np.argmax(got[s][-1]))]), end=round_ == 9 and s == ids[3])
                 for s in chosen]
        for call, r in zip(calls, pool.run(calls)):
            assert r.error is None, r.error
            sent[call.sequence].append(call.ids)
            got[call.sequence].append(r.logits)
    assert len(batch_sizes) > 2 and ids[3] not in pool.live
    for s in ids:
        tokens = [sent[s][0], *[int(t[0]) for t in sent[s][1:]]]
        want = _alone(folder, tokens)
        assert len(want) == len(got[s])
        for i, (g, w) in enumerate(zip(got[s], want)):
            assert_close(g, w, TOLERANCE, f"{model} sequence {s} call {i}")
            assert int(np.argmax(g)) == int(np.argmax(w))


def test_a_restart_and_a_prompt_later_in_the_sequence(exports):
    """A START on a live id begins again from zero; a later request of several tokens (the next turn) is
    prefilled from the sequence's own state."""
    folder = exports["growing"]
    pool = SequencePool(open_runner(folder), capacity=4, idle_seconds=60)
    pool.run([Call(5, np.array([3, 4, 5]), start=True), Call(6, np.array([9]), start=True)])
    pool.run([Call(5, np.array([7])), Call(6, np.array([8]))])
    again = pool.run([Call(5, np.array([11, 12]), start=True)])[0]
    assert_close(again.logits, _alone(folder, [np.array([11, 12])])[0], TOLERANCE, "restarted")
    turn = pool.run([Call(6, np.array([20, 21, 22]))])[0]
    conv = Conversation(open_runner(folder), keep=0)
    conv.prefill(np.array([9]))
    conv.step(8)
    assert_close(turn.logits, conv.prefill(np.array([20, 21, 22]))[0], TOLERANCE, "next turn")
    assert pool.position(6) == 5 and pool.position(5) == 2


def test_refused_requests_change_no_sequence(exports):
    """Unknown or ended ids, a token outside the vocabulary, two requests of one sequence in one batch, a start
    beyond the capacity: each refused with its own line, and the live sequences' answers are still those alone."""
    folder = exports["window"]
    runner = open_runner(folder)
    vocab = runner.manifest.vocab_size
    pool = SequencePool(runner, capacity=2, idle_seconds=60)
    pool.run([Call(1, np.array([5, 6]), start=True), Call(2, np.array([7]), start=True)])
    refused = pool.run([Call(3, np.array([1])), Call(1, np.array([vocab])), Call(4, np.array([1]), start=True),
                        Call(2, np.array([9])), Call(2, np.array([10]))])
    assert "sequence 3 is not live" in refused[0].error
    assert refused[1].error.startswith(f"sequence 1: token id out of range: ids must be in [0, {vocab})")
    assert "holds 2 live sequences, its capacity" in refused[2].error
    assert refused[3].error is None and "two requests of one sequence" in refused[4].error
    assert pool.live == (1, 2)
    after = pool.run([Call(1, np.array([8])), Call(2, np.array([11]), end=True)])
    assert_close(after[0].logits, _alone(folder, [np.array([5, 6]), 8])[1], TOLERANCE, "sequence 1")
    assert_close(after[1].logits, _alone(folder, [np.array([7]), 9, 11])[2], TOLERANCE, "sequence 2")
    assert pool.live == (1,)  # END freed the slot: a new sequence fits
    assert pool.run([Call(4, np.array([1]), start=True)])[0].error is None
    assert "sequence 2 is not live" in pool.run([Call(2, np.array([1]))])[0].error


def test_an_idle_sequence_is_dropped_and_the_others_go_on(exports):
    """A client that died mid-sequence: its sequence is dropped once idle longer than the timeout, its id refused
    afterwards, and the sequence that kept going answers as if alone."""
    folder = exports["window"]
    clock = Clock()
    pool = SequencePool(open_runner(folder), capacity=4, idle_seconds=5, clock=clock)
    pool.run([Call(1, np.array([5]), start=True), Call(2, np.array([6]), start=True)])
    tokens = [np.array([5])]
    for t in range(1, 5):
        clock.now += 2
        assert pool.run([Call(1, np.array([t]))])[0].error is None
        tokens.append(t)
    assert pool.live == (1,)  # sequence 2 was last seen 8 s ago
    assert "sequence 2 is not live" in pool.run([Call(2, np.array([1]))])[0].error
    clock.now += 1
    last = pool.run([Call(1, np.array([9]))])[0]
    assert_close(last.logits, _alone(folder, [*tokens, 9])[-1], TOLERANCE, "the sequence that went on")


def test_rows_read_and_written_back_are_as_they_were(exports):
    """read_rows / write_rows (what a step inside the batch uses): rows put back after a step equal, bit for bit,
    the rows before it, the stepped row moved on; a state whose rows share a KV cache length is refused."""
    from edgelin.errors import EdgelinError
    from edgelin.runtime import prefill

    runner = open_runner(exports["window"])
    ids = np.random.default_rng(5).integers(0, runner.manifest.vocab_size, (3, 4))
    _, handle = prefill(runner, ids)
    before = runner.read_state(handle)
    kept = runner.read_rows(handle, [0, 2])
    runner.step(np.array([1, 2, 3]), handle, np.full(3, 4))
    runner.write_rows(handle, [0, 2], kept)
    after = runner.read_state(handle)
    for name in before:
        np.testing.assert_array_equal(after[name][[0, 2]], before[name][[0, 2]])
    assert any(not np.array_equal(after[n][1], before[n][1]) for n in before)
    growing = open_runner(exports["growing"])
    with pytest.raises(EdgelinError, match="only for a constant-size state"):
        growing.read_rows(growing.new_state(2), [0])
