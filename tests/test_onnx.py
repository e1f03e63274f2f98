"""The exported artifact: every family and a hybrid export to ONNX, the saved graphs keep their
dynamic axes, and the ONNX Runtime rollout matches the PyTorch reference at every step."""

from __future__ import annotations

import numpy as np
import onnx
import pytest

from conftest import ALL_FAMILIES
from edgelin.export.manifest import Manifest
from edgelin.runtime import open_runner
from edgelin.validate import validate
from helpers import export_family

FAMILIES_AND_HYBRID = ALL_FAMILIES + ["hybrid"]


@pytest.fixture(scope="module")
def exports(tmp_path_factory):
    root = tmp_path_factory.mktemp("onnx")
    return {family: export_family(root, family) for family in FAMILIES_AND_HYBRID}


@pytest.mark.parametrize("family", FAMILIES_AND_HYBRID)
def test_onnx_rollout_matches_reference(exports, family):
    report = validate(exports[family], steps=40, prompt_len=21, batch=2)
    assert report.passed, [m.to_dict() for m in report.failures]
    rollout = next(m for m in report.metrics if (m.check, m.output) == ("rollout", "logits"))
    assert rollout.max_rel < 1e-5 and rollout.ref_scale > 0
    checks = {m.check for m in report.metrics}
    assert checks == {"prefill", "rollout", "final", "prefill-vs-steps"}


@pytest.mark.parametrize("family", FAMILIES_AND_HYBRID)
def test_saved_graphs_keep_named_dynamic_axes(exports, family):
    manifest = Manifest.load(exports[family])
    for kind, entry in manifest.graphs.items():
        proto = onnx.load(str(exports[family] / entry.file))
        dims = {v.name: [d.dim_param or d.dim_value for d in v.type.tensor_type.shape.dim] for v in proto.graph.input}
        assert dims["input_ids"] == (["batch"] if kind == "step" else ["batch", "sequence"])
        for t in entry.inputs:
            assert dims[t.name] == list(t.dims)


@pytest.mark.parametrize("family", ["gated_deltanet", "hybrid"])
def test_runs_at_batch_one_and_single_token_prompt(exports, family):
    """Shapes the exporter never saw (batch 1, T = 1, T not a multiple of the chunk)."""
    runner = open_runner(exports[family])
    for length in (1, 17, 70):
        logits, state = runner.prefill(np.zeros((1, length), np.int64), runner.initial_state(1), np.zeros(1, np.int64))
        assert logits.shape == (1, runner.manifest.vocab_size) and np.isfinite(logits).all()


def test_manifest_contract(exports):
    manifest = Manifest.load(exports["hybrid"])
    data = manifest.to_dict()
    assert data["model"]["constant_memory"] is True
    assert [layer["type"] for layer in data["model"]["layers"]] == ["gated_deltanet", "softmax", "gla"]
    pairs = {s["input"]: s["output"] for s in data["state"]}
    assert pairs["past_key_values.1.key"] == "present.1.key"
    step_outputs = {t.name: t for t in manifest.graphs["step"].outputs}
    assert step_outputs["present.0.recurrent_state"].feeds == "past_key_values.0.recurrent_state"
    assert data["source"]["sha256"] and data["model"]["state_bytes_per_sequence"] == manifest.state_bytes(1)
