"""flash-linear-attention checkpoints: tiny random models built with fla itself (run on CPU under the
Triton interpreter, tests/upstream_fla.py), saved with save_pretrained, loaded by edgelin; logits
against fla's own forward, then the exported ONNX rollout against the same forward."""

from __future__ import annotations

import importlib.util
import json

import numpy as np
import pytest
import torch

if importlib.util.find_spec("fla") is None:
    pytest.skip("flash-linear-attention is not installed (pip install 'edgelin[dev]')", allow_module_level=True)

from edgelin.checkpoint import load_model  # noqa: E402
from edgelin.errors import EdgelinError  # noqa: E402
from edgelin.export.pipeline import export_checkpoint  # noqa: E402
from edgelin.runtime import open_runner, prefill  # noqa: E402
from helpers import assert_close  # noqa: E402
from upstream_fla import tiny_fla_model  # noqa: E402

TYPES = ["linear_attn", "retnet", "gla", "delta_net", "gated_deltanet", "kda", "mamba2"]
VARIANTS = {  # knobs that real fla checkpoints set, beyond the defaults
    "linear_attn-hedgehog-norm": ("linear_attn", {"feature_map": "hedgehog", "norm_feature_map": True}),
    "gla-conv-clamp": ("gla", {"use_short_conv": True, "clamp_min": -0.1}),
    "gated_deltanet-gva-sigmoid": ("gated_deltanet", {"num_v_heads": 4, "output_gate_activation": "sigmoid",
                                                      "allow_neg_eigval": True}),
    "retnet-nogate": ("retnet", {"use_output_gate": False}),
}
ALL = {**{t: (t, {}) for t in TYPES}, **VARIANTS}


def jitter(model: torch.nn.Module, seed: int = 0) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.05)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    before = torch.get_num_threads()  # (1 under xdist: conftest's; a worker's later files run with it)
    torch.set_num_threads(1)  # interpreted kernels between tiny matmuls: threads only add stalls
    cache = {}

    def build(name, layers=2):
        if (name, layers) not in cache:
            model_type, overrides = ALL[name]
            model, _ = tiny_fla_model(model_type, num_hidden_layers=layers, **overrides)
            jitter(model)
            folder = tmp_path_factory.mktemp(f"{name}-{layers}")
            model.save_pretrained(folder, safe_serialization=True)
            ids = torch.from_numpy(np.random.default_rng(0).integers(0, 100, (2, 33)))
            with torch.no_grad():
                cache[name, layers] = (folder, ids, model(ids).logits)
        return cache[name, layers]

    yield build
    torch.set_num_threads(before)




@pytest.mark.parametrize("name", ALL)
def test_reference_matches_fla_forward(saved, name):
    folder, ids, want = saved(name)
    ours, info = load_model(folder)
    assert info.format in ("fla", "transformers") and info.model_type == ALL[name][0]
    with torch.no_grad():
        got, _ = ours(ids)
    assert_close(got, want, 1e-5)


@pytest.mark.slow  # CI: test_onnx.py exports every family; test_reference_matches_* checks the conversion
@pytest.mark.parametrize("name", TYPES)
def test_onnx_rollout_matches_fla_forward(saved, name, tmp_path):
    """One layer (tracing is CI's largest cost; stacking layers is test_onnx.py's): the converted
    checkpoint's ONNX prefill and steps against fla's own forward."""
    folder, ids, want = saved(name, layers=1)
    runner = open_runner(export_checkpoint(folder, tmp_path / "onnx").folder)
    ids = ids.numpy()
    logits, state = prefill(runner, ids[:, :13])
    got = [logits]
    for t in range(13, 33):
        logits = runner.step(ids[:, t], state, np.full(2, t, np.int64))
        got.append(logits)
    assert_close(np.stack(got, 1), want[:, 12:].numpy(), 1e-4)


def test_hybrid_with_a_torch_stand_in_for_flash_attention(tmp_path):
    """fla's softmax layers call flash-attn (CUDA only). TEST-ONLY STAND-IN: an exact torch
    implementation of flash_attn_func(causal=True, window_size) replaces it, so every other part of
    fla's hybrid (projections, rotary, GQA, block layout) is compared for real."""
    import fla.layers.attn as fla_attn

    def flash_attn_func(q, k, v, causal=True, window_size=(-1, -1)):
        t, groups = q.shape[1], q.shape[2] // k.shape[2]
        k, v = k.repeat_interleave(groups, dim=2), v.repeat_interleave(groups, dim=2)
        scores = torch.einsum("bqhd,bkhd->bhqk", q, k) * q.shape[-1] ** -0.5
        pos = torch.arange(t)
        mask = pos[None, :] <= pos[:, None]
        if window_size[0] >= 0:
            mask &= pos[None, :] >= pos[:, None] - window_size[0]
        return torch.einsum("bhqk,bkhd->bqhd", scores.masked_fill(~mask, float("-inf")).softmax(-1), v)

    saved_fn = fla_attn.flash_attn_func
    fla_attn.flash_attn_func = flash_attn_func
    try:
        for window in (None, 8):
            model, _ = tiny_fla_model("hybrid", attn={"layers": [1], "num_heads": 2, "num_kv_heads": 1,
                                                      "window_size": window})
            jitter(model)
            folder = tmp_path / f"hybrid-{window}"
            model.save_pretrained(folder, safe_serialization=True)
            ids = torch.randint(0, 100, (2, 30))
            with torch.no_grad():
                want = model(ids).logits
                got, _ = load_model(folder)[0](ids)
            assert_close(got, want, 1e-5, str(window))
    finally:
        fla_attn.flash_attn_func = saved_fn


def _with_field(folder, tmp_path, field, value):
    data = json.loads((folder / "config.json").read_text())
    edited = tmp_path / field
    edited.mkdir()
    for f in folder.iterdir():
        (edited / f.name).write_bytes(f.read_bytes())
    (edited / "config.json").write_text(json.dumps({**data, field: value}))
    return edited


def test_fields_edgelin_does_not_implement_are_refused(saved, tmp_path):
    folder, _, _ = saved("kda")
    for field, value, needle in (("lower_bound", -5.0, "lower_bound=-5.0 is not supported"),
                                 ("attnres_block_size", 2, "attnres_block_size=2 is not supported")):
        with pytest.raises(EdgelinError, match=needle):
            load_model(_with_field(folder, tmp_path, field, value))


def test_fields_fla_never_reads_are_inert(saved, tmp_path):
    """fla's KDA model never reads magic_gate (PretrainedConfig just keeps it): it cannot change the
    math, so it is accepted and listed, and the model still matches fla's forward."""
    folder, ids, want = saved("kda")
    model, info = load_model(_with_field(folder, tmp_path, "magic_gate", True))
    assert info.inert_fields == ("magic_gate",)
    with torch.no_grad():
        assert_close(model(ids)[0], want, 1e-5)
