"""edgelin.conversation on the other targets that run here: the torch reference (CPU) and Apple's Core AI runtime
(its Linux CPU runtime): a conversation saved and resumed in a fresh runner continues as if never stopped, and a
snapshot restored after drafted tokens is as if they never ran (bit for bit: the same runner and batch shape).
ONNX Runtime: tests/test_conversation.py."""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest

from edgelin.conversation import Conversation
from edgelin.devices import ExportSettings
from edgelin.export.pipeline import export_checkpoint
from edgelin.runtime import open_runner
from helpers import make_checkpoint

STEPS = 60


def _export(root, target: str):
    ckpt = make_checkpoint(root / "ckpt", "hybrid", tokenizer=False)
    if target == "coreai":
        if importlib.util.find_spec("coreai_torch") is None:
            pytest.skip("coreai-torch is not installed (pip install -e '.[coreai]')")
        from edgelin.export.coreai.target import CoreaiOptions

        return export_checkpoint(ckpt, root / "out", "coreai", options=CoreaiOptions((4,)),
                                 settings=ExportSettings(precision="fp32", state_dtype="float32")).folder
    return export_checkpoint(ckpt, root / "out", target).folder


@pytest.fixture(scope="module", params=["torch", "coreai"])
def folder(request, tmp_path_factory):
    return _export(tmp_path_factory.mktemp(f"conversation-{request.param}"), request.param)


def _roll(conv: Conversation, ids: np.ndarray) -> np.ndarray:
    return np.stack([conv.step(ids[:, t]) for t in range(ids.shape[1])])


@pytest.mark.parametrize("batch", [1, 2])
def test_save_load_and_restore_on_this_target(folder, batch, tmp_path):
    rng = np.random.default_rng(batch)
    prompt, steps, draft = (rng.integers(0, 97, (batch, n)) for n in (9, STEPS, 5))
    whole = Conversation(open_runner(folder), batch)
    whole.prefill(prompt)
    want = _roll(whole, steps)

    conv = Conversation(open_runner(folder), batch)
    conv.prefill(prompt)
    _roll(conv, steps[:, :20])
    snap = conv.snapshot()
    _roll(conv, draft)
    conv.restore(snap)
    np.testing.assert_array_equal(_roll(conv, steps[:, 20:30]), want[20:30])
    path = conv.save(tmp_path / "c.edgestate")
    resumed = Conversation.load(open_runner(folder), path)
    assert resumed.position == 9 + 30
    np.testing.assert_array_equal(_roll(resumed, steps[:, 30:]), want[30:])


def test_a_state_saved_on_onnx_runtime_continues_on_the_torch_reference(tmp_path):
    """Another export of the same checkpoint (same weights, precision and state tensors): the file loads there, and
    the conversation continues within float rounding of the uninterrupted run (another runtime: not bit for bit)."""
    from edgelin.artifact import state_file
    from helpers import assert_close

    ckpt = make_checkpoint(tmp_path / "ckpt", "hybrid", tokenizer=False)
    onnx, torch_folder = (export_checkpoint(ckpt, tmp_path / t, t).folder for t in ("onnx", "torch"))
    rng = np.random.default_rng(5)
    prompt, steps = rng.integers(0, 97, (2, 9)), rng.integers(0, 97, (2, 40))
    whole = Conversation(open_runner(onnx), 2)
    whole.prefill(prompt)
    want = _roll(whole, steps)
    conv = Conversation(open_runner(onnx), 2)
    conv.prefill(prompt)
    _roll(conv, steps[:, :15])
    path = conv.save(tmp_path / "c.edgestate")
    runner = open_runner(torch_folder)
    assert state_file.check_fits(state_file.read(path), runner.manifest) == "another export of the same model"
    resumed = Conversation.load(runner, path)
    assert_close(_roll(resumed, steps[:, 15:]), want[15:], 1e-4, "ONNX Runtime's state continued by torch")
