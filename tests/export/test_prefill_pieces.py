"""How edgelin.runtime.prefill cuts a prompt: pieces of at most CONSTANT_PIECE (256) tokens whatever chunk is
asked for (the prefill graph's activations, which ONNX Runtime keeps in its arena, scale with the piece: issue 13's
peak RSS, issue 46's 2B hybrid), at most `chunk` below that; a growing KV cache's shrink further with the context
(tests/test_runtime_checks.py)."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np

from edgelin.runtime import CONSTANT_PIECE, prefill


class _Recorder:
    """A runner stand-in that records the pieces and positions it is handed."""

    prefill_piece = CONSTANT_PIECE  # Runner's default

    def __init__(self, constant_memory: bool = True):
        self.manifest = SimpleNamespace(constant_memory=constant_memory, kv_capacity=None)
        self.calls: list[tuple[int, int]] = []

    def new_state(self, batch: int) -> object:
        return object()

    def prefill(self, ids: np.ndarray, state: object, start: np.ndarray) -> np.ndarray:
        self.calls.append((ids.shape[1], int(start[0])))
        return np.full((ids.shape[0], 3), float(ids[0, -1]))


def test_constant_memory_prompt_goes_in_pieces_of_256():
    runner = _Recorder()
    ids = np.arange(1000, dtype=np.int64)[None]
    logits, _ = prefill(runner, ids)  # the default chunk (2048) used to send the whole prompt at once
    assert CONSTANT_PIECE == 256
    assert runner.calls == [(256, 0), (256, 256), (256, 512), (232, 768)]
    assert logits[0, 0] == 999  # the last piece's logits


def test_smaller_chunk_and_start_are_kept():
    runner = _Recorder()
    prefill(runner, np.zeros((2, 250), np.int64), start=40, chunk=100)
    assert runner.calls == [(100, 40), (100, 140), (50, 240)]
    runner = _Recorder()
    prefill(runner, np.zeros((1, 600), np.int64), chunk=4096)
    assert runner.calls == [(256, 0), (256, 256), (88, 512)]


def test_a_runner_may_take_longer_pieces():
    """A runner that pays per call rather than per token held (the torch runner on a GPU) says so."""
    runner = _Recorder()
    runner.prefill_piece = 1024
    prefill(runner, np.zeros((1, 2500), np.int64))
    assert runner.calls == [(1024, 0), (1024, 1024), (452, 2048)]
    runner = _Recorder()
    runner.prefill_piece = 1024
    prefill(runner, np.zeros((1, 700), np.int64), chunk=300)  # the caller's chunk still caps it
    assert runner.calls == [(300, 0), (300, 300), (100, 600)]


def test_a_growing_kv_cache_starts_at_the_same_pieces():
    """A hybrid with full-attention layers (a growing KV cache) went in whole 2,048-token chunks from an empty
    cache; its arena then kept that piece's activations (Qwen3.5-2B's shapes, int4: 2,552 MiB peak RSS instead of
    1,663). Now the runner's piece caps it too, and the attention bound still shrinks later pieces."""
    runner = _Recorder(constant_memory=False)
    prefill(runner, np.zeros((1, 600), np.int64))
    assert runner.calls == [(256, 0), (256, 256), (88, 512)]
    runner = _Recorder(constant_memory=False)
    prefill(runner, np.zeros((1, 300), np.int64), start=40000)  # 208 x (40,000 + 208) <= 2^23 < 209 x 40,209
    assert runner.calls == [(208, 40000), (92, 40208)]
