"""transformers checkpoints (Qwen3.5 text and multimodal, Mamba2): edgelin's reference and the
exported ONNX rollout against transformers' own forward, a trained model's greedy generations token
for token, and the refusals `inspect` explains."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from edgelin.checkpoint import load_model
from edgelin.errors import EdgelinError
from edgelin.export.pipeline import export_checkpoint
from edgelin.runtime import open_runner, prefill
from edgelin.validate import validate
from helpers import assert_close
from upstream_hf import jitter, tiny_mamba2, tiny_qwen35, torch_only_modeling

BUILDERS = {"qwen3_5_text": tiny_qwen35, "mamba2": tiny_mamba2}




@pytest.fixture(scope="module")
def upstream(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf")
    return {arch: (build(root / arch), root / arch) for arch, build in BUILDERS.items()}


@pytest.mark.parametrize("arch", BUILDERS)
def test_reference_matches_upstream_forward(upstream, arch):
    model, folder = upstream[arch]
    ours, info = load_model(folder)
    assert info.format == "transformers" and info.model_type == arch
    ids = torch.randint(0, 100, (2, 48))
    with torch.no_grad():
        want = model(ids).logits
        got, _ = ours(ids)
        loop, _ = ours(ids, mode="recurrent")
    assert_close(got, want, 1e-5)
    assert_close(loop, want, 1e-5)


@pytest.mark.slow  # CI: test_onnx.py exports every family; test_reference_matches_* checks the conversion
@pytest.mark.parametrize("arch", BUILDERS)
def test_onnx_rollout_matches_upstream_forward(upstream, arch, tmp_path):
    model, folder = upstream[arch]
    runner = open_runner(export_checkpoint(folder, tmp_path / "onnx").folder)
    ids = np.random.default_rng(1).integers(0, 100, (2, 48))
    with torch.no_grad():
        want = model(torch.from_numpy(ids)).logits.numpy()
    logits, state = prefill(runner, ids[:, :20])
    got = [logits]
    for t in range(20, 47):
        logits = runner.step(ids[:, t], state, np.full(2, t, np.int64))
        got.append(logits)
    err = np.abs(np.stack(got, 1) - want[:, 19:47]).max() / np.abs(want).max()
    assert err < 1e-4, err
    report = validate(tmp_path / "onnx", steps=16, prompt_len=8, batch=1)  # reloads the upstream checkpoint
    assert report.passed, [m.to_dict() for m in report.failures]


def test_qwen35_multimodal_checkpoint_takes_the_text_model(tmp_path):
    from transformers.models.qwen3_5 import Qwen3_5Config

    qwen, _ = torch_only_modeling()
    text = dict(vocab_size=100, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, linear_key_head_dim=8, linear_value_head_dim=8,
                linear_num_key_heads=2, linear_num_value_heads=4, layer_types=["linear_attention", "full_attention"])
    vision = dict(depth=1, hidden_size=32, intermediate_size=32, num_heads=2, out_hidden_size=64, patch_size=4,
                  spatial_merge_size=2, temporal_patch_size=2)
    model = jitter(qwen.Qwen3_5ForConditionalGeneration(Qwen3_5Config(text_config=text, vision_config=vision)).eval())
    model.save_pretrained(tmp_path, safe_serialization=True)
    ours, info = load_model(tmp_path)
    assert info.model_type == "qwen3_5" and not any("visual" in k for k in ours.state_dict())
    ids = torch.randint(0, 100, (1, 30))
    with torch.no_grad():
        assert_close(ours(ids)[0], model(input_ids=ids).logits, 1e-5)


def edit_config(folder, **changes):
    data = json.loads((folder / "config.json").read_text())
    data.update(changes)
    (folder / "config.json").write_text(json.dumps(data))


@pytest.mark.parametrize("model_type, needle", [
    ("qwen3_next", "mixture-of-experts"),
    ("kimi_linear", "multi-head latent attention"),
    ("falcon_h1", "parallel hybrid"),
    ("nemotron_h", "squared-ReLU"),
    ("llama", "supported: edgelin, qwen3_5_text"),
    ("mamba3", "closest: 'mamba2'"),
])
def test_unsupported_architectures_are_explained(tmp_path, model_type, needle):
    tiny_mamba2(tmp_path)
    edit_config(tmp_path, model_type=model_type)
    with pytest.raises(EdgelinError) as err:
        load_model(tmp_path)
    assert needle in err.value.line()


def test_field_upstream_reads_but_edgelin_does_not_implement_is_refused(tmp_path):
    tiny_qwen35(tmp_path)
    edit_config(tmp_path, per_layer_config={"0": {"rms_norm_eps": 1e-3}})  # transformers' heterogeneous layers
    with pytest.raises(EdgelinError, match="does not understand: per_layer_config"):
        load_model(tmp_path)


def test_field_upstream_never_reads_is_inert(tmp_path):
    """Qwen3.5 has no sliding window: transformers keeps use_sliding_window but never reads it."""
    tiny_qwen35(tmp_path)
    edit_config(tmp_path, use_sliding_window=True, sliding_window=4)
    _, info = load_model(tmp_path)
    assert info.inert_fields == ("sliding_window", "use_sliding_window")


def test_unsupported_value_is_refused(tmp_path):
    tiny_mamba2(tmp_path)
    edit_config(tmp_path, use_bias=True)
    with pytest.raises(EdgelinError, match="use_bias=True is not supported"):
        load_model(tmp_path)


def test_weights_that_do_not_fit_the_config(tmp_path):
    tiny_qwen35(tmp_path)
    edit_config(tmp_path, linear_num_value_heads=8)
    with pytest.raises(EdgelinError, match="in_proj_qkv.weight has 64 rows, expected 96"):
        load_model(tmp_path)
