"""edgelin.checkpoint.describe_model (issue 46: `edgelin inspect` of a real-size checkpoint): the model load_model
builds, from config.json and the safetensors headers alone. Same names, shapes, dtypes and parameter count as the
loaded model, the same refusals of weights that disagree with the config, nothing read past the headers (a data
region overwritten with NaN: load_model refuses it, describe_model does not read it)."""

from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from edgelin.checkpoint import describe_model, load_model, weight_files
from edgelin.cli import app
from edgelin.errors import EdgelinError
from conftest import ZOO
from helpers import make_checkpoint
from upstream_hf import tiny_mamba2, tiny_qwen35


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    """edgelin's own format (the hybrid: Gated DeltaNet, softmax, GLA; the zoo: one layer of every other family,
    Performer's fixed feature projection among its tensors) and two transformers checkpoints (Qwen3.5's text model,
    Mamba2) that go through their converters."""
    root = tmp_path_factory.mktemp("describe")
    tiny_qwen35(root / "qwen3_5_text")
    tiny_mamba2(root / "mamba2")
    return {"edgelin": make_checkpoint(root / "edgelin", "hybrid"), "qwen3_5_text": root / "qwen3_5_text",
            "mamba2": root / "mamba2", "zoo": make_checkpoint(root / "zoo", tokenizer=False, layers=ZOO)}


def _fill_data_with_nan(folder: Path) -> None:
    """Every float32/bf16/fp16 tensor's bytes overwritten with NaN in place (the header and the file size kept)."""
    nan = {"F32": struct.pack("<f", float("nan")), "BF16": b"\xc0\x7f", "F16": b"\x00\x7e"}
    for file in weight_files(folder):
        raw = bytearray(file.read_bytes())
        size = struct.unpack("<Q", raw[:8])[0]
        header = json.loads(raw[8:8 + size])
        for name, entry in header.items():
            if name == "__metadata__" or entry["dtype"] not in nan:
                continue
            lo, hi = (8 + size + offset for offset in entry["data_offsets"])
            pattern = nan[entry["dtype"]]
            raw[lo:hi] = pattern * ((hi - lo) // len(pattern))
        file.write_bytes(bytes(raw))


@pytest.mark.parametrize("kind", ["edgelin", "zoo", "qwen3_5_text", "mamba2"])
def test_the_described_model_is_the_loaded_one_on_the_meta_device(checkpoints, kind):
    loaded, info = load_model(checkpoints[kind])
    described, shapes = describe_model(checkpoints[kind])
    assert described.config == loaded.config
    assert described.num_parameters() == loaded.num_parameters() > 0
    want = {n: (tuple(p.shape), p.dtype) for n, p in loaded.named_parameters()}
    got = {n: (tuple(p.shape), p.dtype) for n, p in described.named_parameters()}
    assert got == want
    assert all(p.is_meta for p in described.parameters())  # nothing allocated for the weights
    assert (shapes.format, shapes.model_type, shapes.tokenizer, shapes.inert_fields) == \
        (info.format, info.model_type, info.tokenizer, info.inert_fields)
    assert shapes.sha256 == "" and len(info.sha256) == 64  # hashing reads every byte: load_model's
    assert [[t.name for t in layer] for layer in described.state_tensors()] == \
        [[t.name for t in layer] for layer in loaded.state_tensors()]


@pytest.mark.parametrize("kind", ["edgelin", "qwen3_5_text"])
def test_nothing_past_the_headers_is_read(checkpoints, kind, tmp_path):
    folder = tmp_path / kind
    shutil.copytree(checkpoints[kind], folder)
    _fill_data_with_nan(folder)
    with pytest.raises(EdgelinError, match="has NaN or Inf"):
        load_model(folder)
    model, _ = describe_model(folder)
    assert model.num_parameters() == load_model(checkpoints[kind])[0].num_parameters()
    result = CliRunner().invoke(app, ["inspect", str(folder), "--json"])  # inspect describes; export refuses values
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["supported"] is True


@pytest.mark.parametrize("kind", ["edgelin", "qwen3_5_text"])
def test_weights_that_disagree_with_the_config_are_refused_as_load_model_refuses_them(checkpoints, kind, tmp_path):
    folder = tmp_path / kind
    shutil.copytree(checkpoints[kind], folder)
    config = json.loads((folder / "config.json").read_text())
    config["intermediate_size"] = config["intermediate_size"] + 32
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(EdgelinError) as loaded:
        load_model(folder)
    with pytest.raises(EdgelinError) as described:
        describe_model(folder)
    assert str(described.value) == str(loaded.value)
    assert "intermediate_size" in str(described.value) or "mlp" in str(described.value)


def test_an_integer_weight_is_refused_without_reading_it(checkpoints, tmp_path):
    from safetensors.torch import load_file, save_file

    folder = tmp_path / "ints"
    shutil.copytree(checkpoints["qwen3_5_text"], folder)
    (file,) = weight_files(folder)
    tensors = load_file(str(file))
    name = next(n for n in tensors if n.endswith("mlp.down_proj.weight"))
    tensors[name] = tensors[name].to(torch.int32)
    save_file(tensors, str(file), metadata={"format": "pt"})
    with pytest.raises(EdgelinError, match=f"{name} has dtype int32"):
        describe_model(folder)


def test_a_typos_size_is_refused_by_the_bytes_of_the_weight_files(checkpoints, tmp_path):
    """intermediate_size = 10**11 (2.4e12 parameters): load_model refuses it by this machine's memory, describe_model
    (which needs none) because the weight files hold fewer bytes than that many parameters; both before building
    anything. A size the files can hold but the weights do not match is their shape mismatch (above)."""
    folder = tmp_path / "typo"
    shutil.copytree(checkpoints["edgelin"], folder)
    config = json.loads((folder / "config.json").read_text())
    config["intermediate_size"] = 10**11
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(EdgelinError, match="more than this machine's"):
        load_model(folder)
    with pytest.raises(EdgelinError, match=r"asks for [\d,]+ parameters .*its weight files hold 0.00 GiB"):
        describe_model(folder)
