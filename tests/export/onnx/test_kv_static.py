"""ONNX Runtime's in-place, fixed-capacity KV cache (`edgelin export --kv-cache static --context N`): a
tiny hybrid with a full-context attention layer (Qwen3.5's: grouped kv heads, q/k norm, partial rotary,
output gate) exported with the static cache and with the default growing one, against each other and
the PyTorch reference; the buffer is written in place; a call past the capacity is refused."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from conftest import tiny_config
from helpers import assert_close, qwen_attention_checkpoint
from edgelin.checkpoint import save_checkpoint
from edgelin.devices import ExportSettings
from edgelin.errors import EdgelinError
from edgelin.artifact.manifest import Manifest
from edgelin.export.onnx.options import OnnxOptions
from edgelin.export.pipeline import export_checkpoint
from edgelin.model.lm import CausalLM
from edgelin.replay import replay
from edgelin.runtime import open_runner, prefill
from edgelin.validate import validate

CAPACITY = 600  # replay's quality figures step 16 + 512 tokens
KEY = "past_key_values.1.key"  # layer 1 is the attention layer


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("kv-static")
    ckpt = qwen_attention_checkpoint(root / "ckpt")
    static = export_checkpoint(ckpt, root / "static", options=OnnxOptions(kv_cache="static", context=CAPACITY))
    growing = export_checkpoint(ckpt, root / "growing")
    return static.folder, growing.folder


@pytest.mark.slow
def test_manifest_records_the_capacity(folders):
    static, growing = (Manifest.load(f) for f in folders)
    assert static.kv_capacity == CAPACITY and growing.kv_capacity is None
    data = json.loads((folders[0] / "manifest.json").read_text())
    assert {e["input"]: e.get("capacity") for e in data["state"]}[KEY] == CAPACITY
    assert [t.dims for t in static.state_inputs] == [t.dims for t in growing.state_inputs]  # the same contract


@pytest.mark.slow
def test_validate_against_the_checkpoint(folders):
    """Batch 2 against the PyTorch reference (batch 1 and 3: test_recorded_reference_replays)."""
    report = validate(folders[0], steps=24, prompt_len=13, batch=2)
    assert report.passed, [m.to_dict() for m in report.failures]
    assert {m.check for m in report.metrics} == {"prefill", "rollout", "final", "prefill-vs-steps"}
    assert max(m.max_rel for m in report.metrics) < 1e-5


@pytest.mark.parametrize("batch", [1, 2])
@pytest.mark.slow
def test_rollout_matches_the_growing_export(folders, batch):
    static, growing = (open_runner(f) for f in folders)
    rng = np.random.default_rng(batch)
    ids = rng.integers(0, 97, (batch, 40), dtype=np.int64)
    states = [r.new_state(batch) for r in (static, growing)]
    # two prefill pieces (at batch 2 the second runs one call per sequence), then steps
    for lo, hi in ((0, 9), (9, 20)):
        got = [prefill(r, ids[:, lo:hi], s, start=lo)[0] for r, s in zip((static, growing), states)]
        np.testing.assert_allclose(got[0], got[1], rtol=1e-5, atol=1e-5)
    for t in range(20, 40):
        pos = np.full(batch, t, np.int64)
        got = [r.step(ids[:, t], s, pos) for r, s in zip((static, growing), states)]
        np.testing.assert_allclose(got[0], got[1], rtol=1e-5, atol=1e-5)
    a, b = static.read_state(states[0]), growing.read_state(states[1])
    assert a[KEY].shape == b[KEY].shape == (batch, 2, 40, 16)
    for name in b:
        np.testing.assert_allclose(a[name], b[name], rtol=1e-5, atol=1e-6)


@pytest.fixture(scope="module")
def fp16_static(folders, tmp_path_factory):
    """The same checkpoint as fp16 graphs with the static cache (float32 inside the graphs)."""
    root = tmp_path_factory.mktemp("kv-static-fp16")
    return export_checkpoint(folders[0].parent / "ckpt", root / "static", settings=ExportSettings(precision="fp16"),
                             options=OnnxOptions(kv_cache="static", context=CAPACITY)).folder


@pytest.mark.slow
def test_fp16_graphs_keep_the_static_cache_float32_and_uncast(fp16_static):
    """An fp16 graph casts its growing cache to fp16 and back every call (a copy of all of it); with the
    static cache the GroupQueryAttention node reads the bound float32 buffer itself: no Cast of it."""
    import onnx

    names = {KEY, KEY[:-3] + "value"}
    graph = onnx.load(fp16_static / "step.onnx", load_external_data=False).graph
    assert {i.name: i.type.tensor_type.elem_type for i in graph.input if i.name in names} == dict.fromkeys(
        names, onnx.TensorProto.FLOAT)
    readers = [n.op_type for n in graph.node if names & set(n.input)]
    assert "GroupQueryAttention" in readers and "Cast" not in readers, readers
    assert Manifest.load(fp16_static).kv_capacity == CAPACITY


@pytest.mark.parametrize("batch", [1, 2])
@pytest.mark.slow
def test_fp16_rollout_with_the_static_cache_matches_fp32(fp16_static, folders, batch):
    """fp16 graphs on the static cache against the fp32 (growing-cache) export: logits to fp16 rounding over
    a two-piece prefill and 19 steps; the cache read back is float32 and holds every token."""
    half, exact = open_runner(fp16_static), open_runner(folders[1])
    rng = np.random.default_rng(10 + batch)
    ids = rng.integers(0, 97, (batch, 30), dtype=np.int64)
    states = [r.new_state(batch) for r in (half, exact)]
    for lo, hi in ((0, 5), (5, 11)):
        got = [prefill(r, ids[:, lo:hi], s, start=lo)[0] for r, s in zip((half, exact), states)]
        assert_close(got[0], got[1], 2e-2, f"fp16 static vs fp32, prefill to {hi}")
    for t in range(11, 30):
        pos = np.full(batch, t, np.int64)
        got = [r.step(ids[:, t], s, pos) for r, s in zip((half, exact), states)]
        assert_close(got[0], got[1], 2e-2, f"fp16 static vs fp32, step {t}")
    cache = half.read_state(states[0])[KEY]
    assert cache.dtype == np.float32 and cache.shape == (batch, 2, 30, 16)


@pytest.mark.slow
def test_the_buffer_is_updated_in_place(folders):
    runner = open_runner(folders[0])
    state = runner.new_state(1)
    buffer = state._value.arrays[0][runner.state_names.index(KEY)]
    assert buffer.shape == (1, 2, CAPACITY, 16)
    address = buffer.ctypes.data
    prefill(runner, np.arange(5, dtype=np.int64)[None], state)
    runner.step(np.array([7]), state, np.array([5]))
    assert state._value.arrays[0][runner.state_names.index(KEY)] is buffer and buffer.ctypes.data == address
    assert np.abs(buffer[0, :, :6]).min(axis=-1).max() > 0 and not buffer[0, :, 6:].any()  # rows 0..5 written
    np.testing.assert_array_equal(runner.read_state(state)[KEY], buffer[:, :, :6])
    fork = runner.fork(state)  # a fork owns its buffers
    runner.step(np.array([3]), fork, np.array([6]))
    assert not buffer[0, :, 6].any() and runner.read_state(fork)[KEY].shape[2] == 7


@pytest.mark.slow
def test_a_call_past_the_capacity_is_refused(folders):
    runner = open_runner(folders[0])
    state = runner.new_state(2)
    full = {k: np.zeros((2, *v.shape[1:]), v.dtype) for k, v in runner.manifest.initial_state(1, CAPACITY).items()}
    runner.write_state(state, full)
    with pytest.raises(EdgelinError, match=f"holds {CAPACITY} tokens.*larger --context"):
        runner.step(np.array([1, 2]), state, np.full(2, CAPACITY, np.int64))
    longer = {k: np.zeros((2, *v.shape[1:]), v.dtype)
              for k, v in runner.manifest.initial_state(1, CAPACITY + 1).items()}
    with pytest.raises(EdgelinError, match="at least 601"):
        runner.write_state(state, longer)
    fresh = runner.new_state(1)
    with pytest.raises(EdgelinError, match=f"holds {CAPACITY} tokens"):
        runner.prefill(np.zeros((1, CAPACITY + 1), np.int64), fresh, np.zeros(1, np.int64))
    with pytest.raises(EdgelinError, match="must continue the cache"):
        runner.step(np.array([1]), fresh, np.array([3]))


@pytest.mark.slow
def test_recorded_reference_replays(folders):
    """What `edgelin validate DIR` runs: the PyTorch reference recorded at export, batch 1 and 3."""
    report = replay(folders[0])
    assert report.passed, [m.to_dict() for m in report.failures]
    assert max(m.max_rel for m in report.metrics) < 1e-5


def test_options_are_checked():
    with pytest.raises(EdgelinError, match="without --context"):
        OnnxOptions(kv_cache="static")
    with pytest.raises(EdgelinError, match="without --kv-cache static"):
        OnnxOptions(context=128)
    with pytest.raises(EdgelinError, match="growing, static"):
        OnnxOptions(kv_cache="ring", context=128)


@pytest.mark.parametrize(("args", "needle"), [
    (["--kv-cache", "static"], "--kv-cache static without --context"),
    (["--context", "64"], "--context 64 without --kv-cache static"),
    (["--kv-cache", "static", "--context", "64", "--target", "coreml"], "--kv-cache applies to --target onnx only"),
])
@pytest.mark.slow
def test_cli_refuses_bad_cache_options_in_one_line(folders, tmp_path, args, needle):
    from typer.testing import CliRunner

    from edgelin.cli import app

    result = CliRunner().invoke(app, ["export", str(folders[0].parent / "ckpt"), "--out", str(tmp_path / "x"), *args])
    assert result.exit_code == 2, result.output
    errors = [ln for ln in result.stderr.splitlines() if ln.startswith("error:")]
    assert len(errors) == 1 and needle in errors[0] and "Fix:" in errors[0], result.stderr
    assert not (tmp_path / "x").exists()


def test_a_model_without_a_growing_cache_is_refused(tmp_path):
    torch.manual_seed(0)
    ckpt = save_checkpoint(CausalLM(tiny_config(("gla", "softmax"))), tmp_path / "ckpt", None)  # window 8: a ring
    with pytest.raises(EdgelinError, match="without a growing KV cache"):
        export_checkpoint(ckpt, tmp_path / "out", options=OnnxOptions(kv_cache="static", context=64))
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_rotary_over_the_whole_head_fuses_and_matches_the_reference(tmp_path):
    """Rotary over the whole head (edgelin's own attention without rotary_dim), static cache: q and k are one
    RotaryEmbedding each (edgelin.export.onnx.rotary, its no-partial form), and the export matches the PyTorch
    reference (batch 2). Slow: its own trace (the partial form runs in CI: test_ortops_attention.py)."""
    import onnx

    from edgelin.model.config import AttentionConfig

    torch.manual_seed(0)
    attention = AttentionConfig(num_heads=2, num_kv_heads=1, head_dim=16, window=None)
    ckpt = save_checkpoint(CausalLM(tiny_config(("gla", "softmax"), attention=attention)), tmp_path / "ckpt", None)
    folder = export_checkpoint(ckpt, tmp_path / "out", options=OnnxOptions(kv_cache="static", context=CAPACITY)).folder
    ops = [n.op_type for n in onnx.load(str(folder / "step.onnx"), load_external_data=False).graph.node]
    assert ops.count("RotaryEmbedding") == 2 and not {"Sin", "Cos", "Neg"} & set(ops), sorted(ops)
    report = validate(folder, steps=24, prompt_len=13, batch=2)
    assert report.passed, [m.to_dict() for m in report.failures]
    assert max(m.max_rel for m in report.metrics) < 1e-5
