"""Weights beyond float16's range (±65504) in an fp16 export: never a raw numpy `RuntimeWarning: overflow
encountered in cast` on stderr (its lines are error:/warning:/progress: only) and never an inf weight. The export
refuses them (exit 2, nothing written) unless --force, which stores them saturated and says so in a warning line."""

from __future__ import annotations

import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper
from typer.testing import CliRunner

from edgelin.cli import app
from edgelin.devices import ExportSettings
from edgelin.export.onnx.target import OnnxTarget
from edgelin.model.lm import with_compute_dtype
from helpers import make_checkpoint

F16_MAX = 65504.0  # float16's largest finite value, written out


@pytest.fixture(autouse=True)
def warnings_are_errors():
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # what `python -W error` would make of a raw warning
        yield


def _big_model():
    from conftest import tiny_config
    from edgelin.model.lm import CausalLM

    torch.manual_seed(0)
    model = CausalLM(tiny_config(("gla", "gla"), vocab_size=64))
    with torch.no_grad():
        model.model.layers[0].mlp.up_proj.weight[0, 0] = 1e6
        model.model.embed_tokens.weight[5, 3] = -2e5
    return model


def test_float16_copy_saturates_instead_of_inf():
    low = with_compute_dtype(_big_model(), torch.float16)
    assert low.model.layers[0].mlp.up_proj.weight[0, 0].item() == F16_MAX
    assert low.model.embed_tokens.weight[5, 3].item() == -F16_MAX
    assert all(torch.isfinite(p).all() for p in low.parameters())


def test_quantize_fp16_pass_saturates_without_a_raw_warning(tmp_path: Path):
    """The float16 pass of --quantize fp16 (matmul panels and the embedding table's float16 copy), and reading the
    stored weights back (the weights' check of validate --against), on a graph whose weights overflow float16."""
    from edgelin.artifact.quantized import read_quantized
    from edgelin.export.quantize import quantize_graph

    weight = np.full((4, 3), 0.5, np.float32)
    weight[1, 2] = 1e6
    table = np.full((8, 4), 0.25, np.float32)
    table[2, 0] = -3e5
    graph = helper.make_graph(
        [helper.make_node("Gather", ["table", "ids"], ["x"], axis=0), helper.make_node("MatMul", ["x", "W"], ["y"])],
        "g", [helper.make_tensor_value_info("ids", TensorProto.INT64, ["t"])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        [numpy_helper.from_array(weight, "W"), numpy_helper.from_array(table, "table")])
    import onnx

    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)]), str(tmp_path / "g.onnx"))
    quantize_graph(tmp_path / "g.onnx", "fp16", 32, embeddings=True)
    stored = [numpy_helper.to_array(t) for t in onnx.load(str(tmp_path / "g.onnx")).graph.initializer]
    halves = [a for a in stored if a.dtype == np.float16]
    assert len(halves) == 2 and all(np.isfinite(a).all() for a in halves)
    assert sorted(float(a.max()) if a.max() > 1 else float(a.min()) for a in halves) == [-F16_MAX, F16_MAX]
    for tensor in read_quantized(tmp_path, ["g.onnx"]):
        assert np.isfinite(tensor.bound).all()  # the top value's rounding step is 32, not inf


def test_export_refuses_overflowing_fp16_weights_unless_forced(tmp_path: Path):
    from safetensors.numpy import load_file, save_file

    ckpt = make_checkpoint(tmp_path / "ckpt", "gla", tokenizer=False)
    weights = load_file(ckpt / "model.safetensors")
    weights["model.layers.0.mlp.up_proj.weight"][0, 0] = 1e6
    save_file(weights, ckpt / "model.safetensors")
    for flags in (["--precision", "fp16"], ["--quantize", "fp16"], ["--precision", "fp16", "--target", "torch"]):
        result = CliRunner().invoke(app, ["export", str(ckpt), "--out", str(tmp_path / "out"), *flags])
        assert result.exit_code == 2, result.output
        assert ("error: 1 weight value beyond float16's range (largest 1e+06, in model.layers.0.mlp.up_proj.weight): "
                f"a {' '.join(flags[:2])} export would store them saturated at ±65504") in result.output, result.output
        assert not (tmp_path / "out").exists()


def test_forced_export_says_what_it_saturated():
    from edgelin.export.pipeline import float16_saturation

    model = _big_model()
    target = OnnxTarget()
    forced = ExportSettings(precision="fp16", force=True)
    assert float16_saturation(model, target, forced, None) == (
        "2 weight values beyond float16's range (largest 1e+06, in model.layers.0.mlp.up_proj.weight): the "
        "--precision fp16 export stores them saturated at ±65504 (--force)",)
    quantized = ExportSettings(quantize="fp16", force=True)
    assert float16_saturation(model, target, quantized, None)[0].startswith("2 weight values")
    assert float16_saturation(model, target, ExportSettings(force=True), None) == ()  # fp32: nothing converted
