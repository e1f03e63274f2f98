"""The exported artifact: every family and a hybrid export to ONNX, the saved graphs keep their
dynamic axes, and the ONNX Runtime rollout matches the PyTorch reference at every step."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
import torch

from conftest import HYBRID, ZOO
from edgelin.checkpoint import load_model
from edgelin.artifact.manifest import Manifest
from edgelin.runtime import open_runner
from edgelin.replay import replay
from edgelin.validate import validate
from helpers import TOKENIZER_VOCAB, export_family

# Gated DeltaNet-2's ONNX export is checked in test_gdn2_clvr.py with its gates moved off their init (a
# stronger check than this table's fresh weights). The hybrid (Gated DeltaNet, sliding-window softmax, GLA: the
# tokenizer-less twin of the hybrid a dozen other files export, so its graphs are traced once a run) covers its
# two linear families; every other family is one layer of one model, the "zoo" (tracing has a fixed cost per
# graph: one 8-layer export takes about half of eight 1-layer ones), and each family's test reads its own
# layer's states.
FAMILIES_AND_HYBRID = [*ZOO, "hybrid"]


def model_of(family: str) -> str:
    return "hybrid" if family == "hybrid" else "zoo"


@pytest.fixture(scope="module")
def exports(tmp_path_factory):
    root = tmp_path_factory.mktemp("onnx")
    return {"zoo": export_family(root, "zoo", layers=ZOO),
            "hybrid": export_family(root, "hybrid", vocab_size=TOKENIZER_VOCAB)}


@pytest.fixture(scope="module")
def reports(exports):
    done = {}

    def report(model: str, batch: int):
        if (model, batch) not in done:
            done[model, batch] = validate(exports[model], steps=40, prompt_len=21, batch=batch)
        return done[model, batch]

    return report


@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("family", FAMILIES_AND_HYBRID)
def test_onnx_rollout_matches_reference(reports, family, batch):
    """Batch 1 and 3: the graphs were traced at batch 2, so both are sizes the exporter never saw. The
    family's own layer: its states after the prompt, at every rollout step, at the end and prefilled
    against stepped."""
    report = reports(model_of(family), batch)
    assert report.passed, [m.to_dict() for m in report.failures]
    rollout = next(m for m in report.metrics if (m.check, m.output) == ("rollout", "logits"))
    assert rollout.max_rel < 1e-5 and rollout.ref_scale > 0
    layers = range(len(HYBRID)) if family == "hybrid" else [ZOO.index(family)]
    mine = [m for m in report.metrics if any(m.output.startswith(f"present.{i}.") for i in layers)]
    assert {m.check for m in mine} == {m.check for m in report.metrics} == {"prefill", "rollout", "final",
                                                                         "prefill-vs-steps"}
    assert all(m.max_rel < 1e-5 and m.ref_scale > 0 for m in mine), [m.to_dict() for m in mine]


@pytest.mark.parametrize("model", ["zoo", "hybrid"])
def test_recorded_reference_vectors_replay(exports, model):
    """What `edgelin validate DIR` runs on a device: the vectors recorded at export, batch 1 and 3."""
    report = replay(exports[model])
    assert report.passed, [m.to_dict() for m in report.failures]
    assert {m.batch for m in report.metrics} == {1, 3}
    assert max(m.max_rel for m in report.metrics) < 1e-5


@pytest.mark.parametrize("model", ["zoo", "hybrid"])
def test_every_state_is_updated_in_place(exports, model):
    """Every family's step writes each state over its past (edgelin.export.onnx.in_place), so the runner
    binds one buffer per state; the rollout tests above run through those bindings."""
    runner = open_runner(exports[model])
    assert sorted(runner.state_names[i] for i in runner._in_place) == sorted(runner.state_names)


@pytest.mark.parametrize("family", ["zoo", "hybrid"])
def test_saved_graphs_keep_named_dynamic_axes(exports, family):
    """The axes in the saved files against what the torch model computes (not against the manifest,
    which wrote them): batch symbolic, every other state dim the size the reference's state has."""
    manifest = Manifest.load(exports[family])
    model = load_model(exports[family].parent / f"{family}-ckpt")[0]
    with torch.no_grad():
        _, state = model(torch.zeros(2, 5, dtype=torch.long))
    expected = {f"past_key_values.{i}.{name}": ["batch", *t.shape[1:]] for i, layer in enumerate(state)
                for name, t in layer.items()}
    for kind, entry in manifest.graphs.items():
        proto = onnx.load(str(exports[family] / entry.file))
        dims = {v.name: [d.dim_param or d.dim_value for d in v.type.tensor_type.shape.dim] for v in proto.graph.input}
        assert dims.pop("input_ids") == (["batch"] if kind == "step" else ["batch", "sequence"])
        assert dims.pop("position_ids", ["batch"]) == ["batch"]
        assert dims == expected, kind


@pytest.mark.parametrize("family", ["zoo", "hybrid"])
def test_runs_at_batch_one_and_single_token_prompt(exports, family):
    """Shapes the exporter never saw (batch 1, T = 1, T not a multiple of the chunk)."""
    runner = open_runner(exports[family])
    for length in (1, 17, 70):
        logits = runner.prefill(np.zeros((1, length), np.int64), runner.new_state(1), np.zeros(1, np.int64))
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
    # By hand, fp32 (tiny_config: 2 heads of 8x8, conv 4, window 8, one KV head of 16):
    # gated_deltanet 2*8*8 + (16+16+16)*3 = 272; softmax key+value 2*8*16 = 256; gla 2*8*8 = 128.
    assert data["source"]["sha256"] and data["model"]["state_bytes_per_sequence"] == (272 + 256 + 128) * 4


def test_the_hybrids_step_fuses_its_gated_delta_layer_and_both_gated_norms(exports):
    """--step-ops edgelin (the default): the Gated DeltaNet layer's step into its recurrence is one node, and its
    output norm and GLA's (the same RMSNorm(o) w silu(g) in the graph) one each; the rollout test above checks
    these exports against the reference (tests/ortops/test_ortops_gdn.py checks the ops themselves)."""
    ops = [n.op_type for n in onnx.load(str(exports["hybrid"] / "step.onnx"), load_external_data=False).graph.node]
    assert ops.count("GatedDeltaRecurrence") == 1 and ops.count("GatedRmsNorm") == 2
    assert ops.count("LinearAttention") == 1  # GLA's recurrence (per-key decay) stays the routed op


def test_onnx_runtime_fuses_every_rmsnorm_of_the_step(exports, tmp_path):
    """The model writes RMSNorm as x / sqrt(mean(x^2) + eps) * w, the form ONNX Runtime's optimiser
    fuses into one SimplifiedLayerNormalization node (x * rsqrt(...) stays six nodes): the block norms
    (2 per layer), the final norm and the mixers' output norms of the hybrid's step graph. The export has already
    made each block norm that reads a residual Add one SkipSimplifiedLayerNormalization with that Add (all but the
    first, which reads the embedding; edgelin.export.onnx.skip_norm)."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.optimized_model_filepath = str(tmp_path / "step-optimized.onnx")
    ort.InferenceSession(str(exports["hybrid"] / "step.onnx"), options, providers=["CPUExecutionProvider"])
    ops = [n.op_type for n in onnx.load(str(tmp_path / "step-optimized.onnx"), load_external_data=False).graph.node]
    layers = len(Manifest.load(exports["hybrid"]).layers)
    assert ops.count("SkipSimplifiedLayerNormalization") == 2 * layers - 1, sorted(ops)
    assert ops.count("SimplifiedLayerNormalization") + ops.count("SkipSimplifiedLayerNormalization") >= 2 * layers + 1, \
        sorted(set(ops))



def test_rotary_feeding_a_transpose_is_left_alone(exports):
    """edgelin.export.onnx.rotary fuses rotary where a --kv-cache static step reshapes q and k to [B, T, H x D] for
    GroupQueryAttention (tests/ortops/test_ortops_attention.py, test_kv_static.py); this growing export's attention
    transposes them to [B, H, T, D] instead, and its positions have no bound for the tables: nothing fuses."""
    from edgelin.export.onnx.kernels import float_tensor_names
    from edgelin.export.onnx.rotary import fuse_rotary

    proto = onnx.load(str(exports["hybrid"] / "step.onnx"), load_external_data=False)
    before = [n.op_type for n in proto.graph.node]
    assert before.count("Neg") == 2  # q and k of the softmax layer
    assert fuse_rotary(proto, 64, float_tensor_names(proto)) == 0
    assert [n.op_type for n in proto.graph.node] == before
