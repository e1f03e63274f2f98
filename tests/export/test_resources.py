"""An export the machine lacks the memory or disk for is refused in one line, before the weights load and before
anything is written (edgelin.export.resources); the estimate counts every weight."""

from __future__ import annotations

import json
import struct

import pytest

from edgelin.checkpoint import float32_footprint, model_config
from edgelin.errors import EdgelinError
from edgelin.export import pipeline, resources
from edgelin.export.targets import get_target
from helpers import make_checkpoint


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("ckpt") / "ckpt", "hybrid", tokenizer=False)


def _stored_bytes(folder) -> int:
    """The float32 bytes the checkpoint file itself holds (its safetensors header's offsets)."""
    data = (folder / "model.safetensors").read_bytes()
    header = json.loads(data[8:8 + struct.unpack("<Q", data[:8])[0]])
    return sum(end - start for name, entry in header.items() if name != "__metadata__"
               for start, end in [entry["data_offsets"]])


def test_the_estimate_counts_the_checkpoints_weights(ckpt):
    parameters, weights = float32_footprint(model_config(ckpt))
    stored = _stored_bytes(ckpt)  # saved float32, the tied head once
    assert stored <= weights <= stored * 1.01  # plus buffers (rotary frequencies), no more
    needs = resources.estimate(model_config(ckpt), get_target("onnx"), _settings())
    assert needs.memory > weights and needs.disk >= weights


def _settings(force: bool = False):
    from edgelin.devices import export_settings

    return export_settings(None, "onnx", force=force)


def _never_loaded(*args, **kwargs):
    raise AssertionError("the checkpoint was loaded before the refusal")


def test_too_little_memory_is_refused_before_the_weights_load(tmp_path, ckpt, monkeypatch):
    monkeypatch.setattr(resources, "available_memory", lambda: 1 << 30)
    monkeypatch.setattr(pipeline, "load_model", _never_loaded)
    out = tmp_path / "out"
    with pytest.raises(EdgelinError) as refused:
        pipeline.export_checkpoint(ckpt, out, "onnx", include_tokenizer=False)
    line = str(refused.value)
    assert "needs about" in line and "1.0 GiB available" in line and "\n" not in line
    assert not out.exists() and list(tmp_path.iterdir()) == []


def test_a_refusal_names_the_quantisation_that_would_fit(tmp_path, ckpt, monkeypatch):
    """Between the float export's estimate and the int4 one's, the refusal names the most precise weight
    quantisation this machine would hold, with its estimate; with no room even for that, none."""
    from edgelin.devices import export_settings

    config, target = model_config(ckpt), get_target("onnx")
    factors = {None: 3.0, "fp16": 2.0, "int8": 1.5, "int4": 1.2}  # a target whose quantised exports need less
    monkeypatch.setattr(type(target), "export_memory_factor", lambda self, settings: factors[settings.quantize])
    estimates = {mode: resources.estimate(config, target, export_settings(None, "onnx", quantize=mode)).memory
                 for mode in factors}
    assert estimates[None] > estimates["fp16"] > estimates["int8"] > estimates["int4"]
    monkeypatch.setattr(pipeline, "load_model", _never_loaded)
    monkeypatch.setattr(resources, "available_memory", lambda: estimates["fp16"] + 1)
    with pytest.raises(EdgelinError) as refused:
        pipeline.export_checkpoint(ckpt, tmp_path / "out", "onnx", include_tokenizer=False)
    assert f"export with --quantize fp16 (about {estimates['fp16'] / 2**30:.1f} GiB)" in refused.value.line()
    monkeypatch.setattr(resources, "available_memory", lambda: estimates["int4"] - 1)
    with pytest.raises(EdgelinError) as refused:
        pipeline.export_checkpoint(ckpt, tmp_path / "out", "onnx", include_tokenizer=False,
                                   settings=export_settings(None, "onnx", quantize="int8"))
    assert "--quantize" not in refused.value.line()
    assert list(tmp_path.iterdir()) == []


def test_too_little_disk_is_refused_even_with_force(tmp_path, ckpt, monkeypatch):
    monkeypatch.setattr(resources, "free_disk", lambda out: 1000)
    monkeypatch.setattr(pipeline, "load_model", _never_loaded)
    for force in (False, True):
        with pytest.raises(EdgelinError, match="writes about .* GiB.* has 0.0 GiB free"):
            pipeline.export_checkpoint(ckpt, tmp_path / "out", "onnx", include_tokenizer=False,
                                       settings=_settings(force))
    assert list(tmp_path.iterdir()) == []


def test_force_lets_a_memory_estimate_pass(ckpt, monkeypatch, tmp_path):
    monkeypatch.setattr(resources, "available_memory", lambda: 1 << 30)
    needs = resources.estimate(model_config(ckpt), get_target("onnx"), _settings(True))
    resources.check_resources(needs, tmp_path / "out", "onnx", force=True)  # no refusal
    with pytest.raises(EdgelinError):
        resources.check_resources(needs, tmp_path / "out", "onnx", force=False)


def test_a_large_models_greedy_rollout_is_shorter_and_recorded():
    from edgelin.artifact.quality import GREEDY_STEPS, MIN_GREEDY_STEPS, greedy_steps_for

    assert greedy_steps_for(3_300_000) == GREEDY_STEPS == 512  # the shipped model: the full rollout
    assert greedy_steps_for(150_000_000) == 512
    assert greedy_steps_for(752_393_024) == 132  # Qwen3.5-0.8B's shapes: 100e9 / 752e6
    assert greedy_steps_for(1_881_825_088) == MIN_GREEDY_STEPS == 64  # 2B: the floor


def test_the_models_weights_are_released_before_the_quality_gate(tmp_path, ckpt, monkeypatch):
    """export_checkpoint's own model holds the float32 weights (the export's largest holding at real sizes): once
    the reference vectors are written nothing reads them, and the gate runs the artifact without them."""
    from edgelin.devices import export_settings
    from edgelin.export import quality_gate

    seen = []
    gate = quality_gate.check_export_quality

    def spy(model, folder, manifest, settings):
        seen.append({p.device.type for p in model.parameters()})
        return gate(model, folder, manifest, settings)

    monkeypatch.setattr(quality_gate, "check_export_quality", spy)
    pipeline.export_checkpoint(ckpt, tmp_path / "out", "onnx", include_tokenizer=False,
                               settings=export_settings(None, "onnx", quantize="int4", force=True))
    assert seen == [{"meta"}]
    manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert manifest["extra"]["quality"]["checks"]  # the gate measured the artifact
