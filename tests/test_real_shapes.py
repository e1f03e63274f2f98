"""bench/real_shapes.py: the published shapes give the published parameter counts (the upstream classes laid
out on the meta device, against the counts worked out by hand from the config fields), and a toy-sized
variant writes a sharded checkpoint that transformers and edgelin both load to the same logits."""

from __future__ import annotations

import importlib.util
import json
import math
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from edgelin.checkpoint import load_model
from upstream_hf import torch_only_modeling

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def real_shapes():
    spec = importlib.util.spec_from_file_location("real_shapes", ROOT / "bench" / "real_shapes.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["real_shapes"] = module  # dataclasses resolve their annotations through sys.modules
    spec.loader.exec_module(module)
    return module


def qwen35_count(f: dict) -> int:
    h, layers = f["hidden_size"], f["layer_types"]
    kh, kd, vh, vd = (f[k] for k in ("linear_num_key_heads", "linear_key_head_dim", "linear_num_value_heads",
                                     "linear_value_head_dim"))
    qh, kvh, hd = f["num_attention_heads"], f["num_key_value_heads"], f["head_dim"]
    conv_width = 2 * kh * kd + vh * vd
    linear = h * conv_width + h * vh * vd + 2 * h * vh + vh * vd * h + conv_width * 4 + 2 * vh + vd
    full = h * 2 * qh * hd + 2 * h * kvh * hd + qh * hd * h + 2 * hd  # q+gate, k, v, o, q/k norms
    per_layer = [2 * h + 3 * h * f["intermediate_size"] + (linear if t == "linear_attention" else full)
                 for t in layers]
    return f["vocab_size"] * h + h + sum(per_layer)  # tied head


def mamba2_count(f: dict) -> int:
    h, heads, groups, state = f["hidden_size"], f["num_heads"], f["n_groups"], f["state_size"]
    inner = f["expand"] * h
    conv = inner + 2 * groups * state
    layer = h + h * (2 * inner + 2 * groups * state + heads) + conv * 4 + conv + 3 * heads + inner + inner * h
    return f["vocab_size"] * h + h + f["num_hidden_layers"] * layer  # tied head


def gla_count(f: dict) -> int:
    h, key, value = f["hidden_size"], int(f["hidden_size"] * f["expand_k"]), int(f["hidden_size"] * f["expand_v"])
    mlp = 256 * math.ceil(int(h * f["hidden_ratio"] * 2 / 3) / 256)  # fla's GatedMLP rounding
    attn = 2 * h * key + 2 * h * value + (h * 16 + 16 * key + key) + value * h + value // f["num_heads"]
    return 2 * f["vocab_size"] * h + h + f["num_hidden_layers"] * (2 * h + 3 * h * mlp + attn)  # untied head


# name -> (count by hand, what upstream calls the model: a band around its nominal size)
EXPECTED = {"qwen3.5-0.8b": (qwen35_count, (0.70e9, 0.90e9)), "qwen3.5-2b": (qwen35_count, (1.7e9, 2.1e9)),
            "mamba2-1.3b": (mamba2_count, (1.25e9, 1.40e9)), "gla-1.3b": (gla_count, (1.25e9, 1.45e9))}


def test_published_shapes_have_the_published_parameter_counts(real_shapes):
    pytest.importorskip("fla")  # GLA's layout is fla's class (tests/conftest.py imports it the CPU way)
    torch_only_modeling()
    assert {s.name for s in real_shapes.SHAPES} == set(EXPECTED)
    for shape in real_shapes.SHAPES:
        count, (low, high) = EXPECTED[shape.name]
        params = sum(math.prod(dims) for _, dims in real_shapes.layout(shape))
        assert params == count(shape.fields), shape.name
        assert low <= params <= high, (shape.name, params)
    assert sum(math.prod(d) for _, d in real_shapes.layout(real_shapes.shape("qwen3.5-0.8b"))) == 752_393_024


def test_tiny_variant_writes_a_sharded_checkpoint_transformers_and_edgelin_load_alike(real_shapes, tmp_path):
    qwen, _ = torch_only_modeling()
    shape = real_shapes.shape("qwen3.5-0.8b").tiny()
    done = real_shapes.write_checkpoint(shape, tmp_path / "ckpt", seed=3, max_shard_bytes=100_000,
                                        progress=lambda line: None,
                                        tokenizer_kwargs={"trained": 300, "corpus_chars": 100_000})
    folder = tmp_path / "ckpt"
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    assert len(done["files"]) > 1 and sorted(set(index["weight_map"].values())) == done["files"]
    assert done["files"][0] == f"model.safetensors-00001-of-{len(done['files']):05d}.safetensors"
    for file in done["files"]:
        with safe_open(str(folder / file), "pt") as handle:
            assert {handle.get_slice(k).get_dtype() for k in handle.keys()} == {"BF16"}

    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    assert tok.get_vocab_size() == shape.fields["vocab_size"]
    assert tok.token_to_id("<|endoftext|>") == shape.fields["eos_token_id"]

    upstream = qwen.Qwen3_5ForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    ours, info = load_model(folder)
    assert info.format == "transformers" and info.tokenizer is not None
    ids = torch.tensor([tok.encode("def main():\n    return x").ids])
    with torch.no_grad():
        want = upstream(ids).logits
        got, _ = ours(ids)
    assert torch.isfinite(got).all() and want.abs().max() > 0
    assert (got - want).abs().max() <= 1e-4 * want.abs().max()


@pytest.mark.parametrize("name, tensor, centre", [
    ("qwen3.5-0.8b", "model.layers.0.input_layernorm.weight", 0.0),  # Qwen3.5's (1 + w) RMSNorm
    ("qwen3.5-0.8b", "model.layers.0.linear_attn.norm.weight", 1.0),  # its gated RMSNorm multiplies by w
    ("mamba2-1.3b", "backbone.layers.0.norm.weight", 1.0),
    ("gla-1.3b", "model.layers.0.attn_norm.weight", 1.0)])
def test_norm_weights_spread_about_their_identity_as_trained_ones_do(real_shapes, name, tensor, centre):
    """All equal (the init), a quantised table's normed rows would sit on a lattice whose int8 activation blocks
    hold exact ties: the runtime's float order and the reference's would round them apart (real_shapes.draw)."""
    values = real_shapes.draw(real_shapes.shape(name), tensor, (1024,), seed=0).float()
    assert abs(values.mean().item() - centre) < 0.02
    assert 0.08 < values.std().item() < 0.12
    assert len(set(values.tolist())) > 50  # channels differ (near 1, bf16 steps 2^-7 apart: ~90 values)
