"""edgelin.artifact.state_file: a saved conversation loads into its own export, or an equal one, and every other
file is refused in one line before a runner sees it (another model, other weights, precision or state tensors,
a corrupted, truncated or foreign file, a header that disagrees with its tensors); saving never overwrites a file
edgelin did not write."""

from __future__ import annotations

import dataclasses
import shutil

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from edgelin.artifact import state_file
from edgelin.conversation import Conversation
from edgelin.errors import EdgelinError
from edgelin.runtime import open_runner
from helpers import export_family, export_growing_hybrid


@pytest.fixture(scope="module")
def exports(tmp_path_factory):
    root = tmp_path_factory.mktemp("state-file")
    return {"mamba2": export_family(root, "mamba2"), "hybrid": export_growing_hybrid(root)}


def _saved(folder, path, steps: int = 6, **save):
    conv = Conversation(open_runner(folder))
    conv.prefill(np.arange(7))
    for t in range(steps):
        conv.step(t + 3)
    return conv, conv.save(path, **save)


def test_the_file_holds_the_state_position_tokens_and_identity(exports, tmp_path):
    conv, path = _saved(exports["mamba2"], tmp_path / "a.edgestate")
    saved = state_file.read(path)
    assert (saved.position, saved.batch) == (13, 1)
    np.testing.assert_array_equal(saved.tokens, [[0, 1, 2, 3, 4, 5, 6, 3, 4, 5, 6, 7, 8]])
    for name, value in conv.read_state().items():
        np.testing.assert_array_equal(saved.state[name], value)
    manifest = conv.runner.manifest
    assert saved.meta["source"] == manifest.source["sha256"] and saved.meta["target"] == "onnx"
    assert saved.meta["artifact"] == state_file.manifest_identity(manifest)
    assert state_file.check_fits(saved, manifest) == "the same export"
    # the same export copied elsewhere is the same export; one equal in weights, precision and state: accepted
    copy = shutil.copytree(exports["mamba2"], tmp_path / "copy")
    assert state_file.check_fits(saved, open_runner(copy).manifest) == "the same export"
    other = dataclasses.replace(manifest, edgelin_version="0.0.1")
    assert state_file.check_fits(saved, other) == "another export of the same model"


def _refused_against(saved, manifest, match):
    with pytest.raises(EdgelinError, match=match):
        state_file.check_fits(saved, manifest)


def test_another_model_weights_precision_or_state_layout_is_refused(exports, tmp_path):
    conv, path = _saved(exports["mamba2"], tmp_path / "a.edgestate")
    saved, manifest = state_file.read(path), conv.runner.manifest
    _refused_against(saved, dataclasses.replace(manifest, source={**manifest.source, "sha256": "f" * 64}),
                     "another model")
    _refused_against(saved, dataclasses.replace(manifest, precision="fp16"), "precision fp32, this export has fp16")
    quantized = {**manifest.extra, "quantization": {"bits": 4, "block_size": 32}}
    _refused_against(saved, dataclasses.replace(manifest, extra=quantized), "weights as the graphs, this export has "
                     "4-bit")
    hybrid = open_runner(exports["hybrid"]).manifest  # another state layout, made to agree on the rest
    _refused_against(saved, dataclasses.replace(hybrid, source=manifest.source, extra=manifest.extra),
                     "state tensors differ")
    with pytest.raises(EdgelinError, match="another model"):  # through the conversation: one line, nothing loaded
        Conversation.load(open_runner(exports["hybrid"]), path)


def test_a_corrupted_truncated_or_foreign_file_is_refused(exports, tmp_path):
    _, path = _saved(exports["mamba2"], tmp_path / "a.edgestate")
    runner = open_runner(exports["mamba2"])
    data = bytearray(path.read_bytes())
    flipped = tmp_path / "flipped.edgestate"
    data[-5] ^= 0x10  # a bit of the last tensor's data
    flipped.write_bytes(bytes(data))
    truncated = tmp_path / "cut.edgestate"
    truncated.write_bytes(path.read_bytes()[:-100])
    foreign = tmp_path / "weights.safetensors"
    save_file({"x": np.zeros(3, np.float32)}, str(foreign))
    text = tmp_path / "notes.txt"
    text.write_text("hello")
    newer = tmp_path / "newer.edgestate"
    from safetensors import safe_open

    with safe_open(str(path), framework="np") as handle:
        meta = dict(handle.metadata())
    save_file(load_file(str(path)), str(newer), metadata={**meta, "version": "2"})
    for bad, match in ((flipped, "do not match the digest"), (truncated, "cannot be read"),
                       (foreign, "not an edgelin state file"), (text, "cannot be read"),
                       (newer, "state file version 2"), (tmp_path / "none.edgestate", "does not exist")):
        with pytest.raises(EdgelinError, match=match):
            Conversation.load(runner, bad)


def test_a_kv_cache_that_disagrees_with_the_position_is_refused(exports, tmp_path):
    _, path = _saved(exports["hybrid"], tmp_path / "a.edgestate")
    from safetensors import safe_open

    with safe_open(str(path), framework="np") as handle:
        meta = dict(handle.metadata())
    tensors = load_file(str(path))
    tensors.pop(state_file.TOKENS)
    lied = tmp_path / "lied.edgestate"
    save_file(tensors, str(lied), metadata={**meta, "position": "20",
                                             "content_sha256": state_file._content_digest(tensors)})
    with pytest.raises(EdgelinError, match="KV cache does not hold its position's 20 rows"):
        Conversation.load(open_runner(exports["hybrid"]), lied)
    resumed = Conversation.load(open_runner(exports["hybrid"]), path)  # the honest file loads
    assert resumed.position == 13


def test_saving_never_overwrites_a_file_edgelin_did_not_write(exports, tmp_path):
    mine = tmp_path / "mine.txt"
    mine.write_text("the user's")
    with pytest.raises(EdgelinError, match="exists and is not an edgelin state file"):
        _saved(exports["mamba2"], mine)
    assert mine.read_text() == "the user's" and sorted(p.name for p in tmp_path.iterdir()) == ["mine.txt"]
    conv, path = _saved(exports["mamba2"], tmp_path / "a.edgestate")
    conv.step(1)
    conv.save(path)  # an earlier state file is replaced
    assert state_file.read(path).position == 14
    conv.save(mine, overwrite=True)  # the user said so for this path
    assert state_file.read(mine).position == 14


def test_without_tokens_the_conversation_continues_but_cannot_re_prefill(exports, tmp_path):
    _, path = _saved(exports["mamba2"], tmp_path / "a.edgestate", tokens=False)
    assert state_file.read(path).tokens is None
    conv = Conversation.load(open_runner(exports["mamba2"]), path)
    assert conv.position == 13 and (conv.tokens == -1).all()
    conv.step(5)
    conv.step(6)
    conv.rewind(2)  # kept checkpoints: exact, no tokens needed
    assert conv.position == 13
    with pytest.raises(EdgelinError, match="were not saved with the state"):
        conv.rewind(1)
    assert conv.position == 13
