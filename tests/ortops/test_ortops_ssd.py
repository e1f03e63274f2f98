"""ai.edgelin::SsdRecurrence: Mamba2's step around its recurrence in one node (edgelin/ortops/ops_ssd.c,
edgelin/export/onnx/ssd.py).

The chain of trust: the kernel == a float64 numpy step written from the formulas (independent of both the kernel and
the ONNX function), and == the node's ONNX function (the fallback) run by ONNX Runtime, at batch 1 and 3, several
tokens per call, one and two key groups, 1 and 2 threads, AVX2 and portable paths, the state updated in place; a
Mamba2 --step-ops edgelin export fuses every layer, leaves a layer alone when an inner tensor has another reader,
validates with and without the library, and its step rollout without the library is bit for bit the contrib
export's (the function computes what the unfused nodes computed)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from edgelin import ortops
from edgelin.export.onnx import gated_norm as onnx_gated_norm
from edgelin.devices import export_settings
from edgelin.export.onnx.kernels import float_tensor_names
from edgelin.export.onnx.ssd import INPUTS, NAME, fuse_ssd_steps, ssd_function
from edgelin.export.onnx.options import OnnxOptions
from edgelin.export.pipeline import export_checkpoint
from edgelin.replay import replay
from helpers import assert_close, make_checkpoint
from ortops_fixtures import (assert_matches_float64_and_function, assert_state_in_place, kernel_path,  # noqa: F401
                             library, rollouts, session)

pytestmark = pytest.mark.skipif(ortops._compiler() is None, reason="no C compiler: edgelin.ortops builds with one")

# The recurrence is linear_attention.c's (<= 2e-6 against ONNX Runtime's, tests/ortops/test_ortops.py); softplus and the
# skip add float32 roundings: measured <= 1.6e-7 RMS-relative (kernel and function against float64, kernel against
# the function) here. Bound ~60x.
SSD_RTOL = 1e-5
H, DK, DV = 4, 8, 12


def _ssd_model(groups: int, scale: float = 0.35) -> onnx.ModelProto:
    rng = np.random.default_rng(groups)
    constants = [numpy_helper.from_array((rng.standard_normal((H, 1)) * 0.5).astype(np.float32), "dt_bias"),
                 numpy_helper.from_array(-np.exp(rng.standard_normal((1, 1, H, 1))).astype(np.float32), "A"),
                 numpy_helper.from_array(rng.standard_normal((H, 1)).astype(np.float32), "D")]
    node = helper.make_node(NAME, list(INPUTS), ["y", "present"], domain=ortops.DOMAIN, q_num_heads=groups,
                            kv_num_heads=H, scale=scale)
    value = lambda name, *dims: helper.make_tensor_value_info(name, TensorProto.FLOAT, list(dims))  # noqa: E731
    graph = helper.make_graph([node], "g", [value("q", "b", "t", groups * DK), value("k", "b", "t", groups * DK),
                                            value("x", "b", "t", H * DV), value("dt", "b", "t", H),
                                            value("past_state", "b", H, DK, DV)],
                              [value("y", "b", "t", H * DV), value("present", "b", H, DK, DV)], constants)
    opsets = [helper.make_opsetid(domain, 1) for domain in ("com.microsoft", ortops.DOMAIN)]
    opsets.append(helper.make_opsetid("", 18))
    return helper.make_model(graph, opset_imports=opsets, functions=[ssd_function({"": 18})])


def _feeds(model: onnx.ModelProto, batch: int, tokens: int, groups: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(batch * 10 + tokens)
    shapes = {"q": (batch, tokens, groups * DK), "k": (batch, tokens, groups * DK), "x": (batch, tokens, H * DV),
              "dt": (batch, tokens, H), "past_state": (batch, H, DK, DV)}
    return {name: rng.standard_normal(shape).astype(np.float32) for name, shape in shapes.items()}


def _reference(model: onnx.ModelProto, feeds: dict, groups: int) -> tuple[np.ndarray, np.ndarray]:
    """The SSD step from its formulas, float64: sp = softplus(dt + dt_bias); S = exp(A sp) S + k_g (x sp)^T;
    y = scale S^T q_g + D x, g the head's group."""
    const = {t.name: numpy_helper.to_array(t).astype(np.float64).reshape(H) for t in model.graph.initializer}
    scale = next(a.f for a in model.graph.node[0].attribute if a.name == "scale")
    f = {k: v.astype(np.float64) for k, v in feeds.items()}
    batch, tokens = f["x"].shape[:2]
    state, y = f["past_state"].copy(), np.zeros((batch, tokens, H, DV))
    for t in range(tokens):
        sp = np.logaddexp(0.0, f["dt"][:, t] + const["dt_bias"])  # [B, H]
        x = f["x"][:, t].reshape(batch, H, DV)
        for h in range(H):
            g = h // (H // groups)
            k, q = f["k"][:, t, g * DK:(g + 1) * DK], f["q"][:, t, g * DK:(g + 1) * DK]
            state[:, h] = np.exp(const["A"][h] * sp[:, h])[:, None, None] * state[:, h] \
                + k[:, :, None] * (x[:, h] * sp[:, h, None])[:, None, :]
            y[:, t, h] = scale * np.einsum("bkv,bk->bv", state[:, h], q) + const["D"][h] * x[:, h]
    return y.reshape(batch, tokens, H * DV), state


CASES = [(1, 1, 1), (3, 1, 1), (2, 3, 1), (3, 1, 2), (2, 3, 2)]


@pytest.mark.parametrize("batch,tokens,groups", CASES, ids=[f"B{b}-T{t}-G{g}" for b, t, g in CASES])
@pytest.mark.parametrize("threads", [1, 2], ids=["t1", "t2"])
def test_the_fused_step_matches_float64_and_its_onnx_function(library, batch, tokens, groups, threads, kernel_path):
    model = _ssd_model(groups)
    feeds = _feeds(model, batch, tokens, groups)
    assert_matches_float64_and_function(model, feeds, _reference(model, feeds, groups), library, threads, SSD_RTOL,
                                        f"B={batch} T={tokens} G={groups}")


def test_the_fused_step_updates_its_state_in_place(library, kernel_path):
    model = _ssd_model(2)
    assert_state_in_place(model, _feeds(model, 3, 1, 2), library, "y")


def test_a_shape_the_kernel_does_not_take_is_refused_in_one_line(library):
    model = _ssd_model(1)
    model.graph.input[3].type.tensor_type.shape.dim[2].dim_param = "h"  # dt's heads not fixed by the graph
    feeds = _feeds(model, 1, 1, 1)
    feeds["dt"] = feeds["dt"][..., :H - 1]
    with pytest.raises(Exception, match="edgelin SsdRecurrence: expected"):
        session(model, library).run(None, feeds)


# ---- a Mamba2 --step-ops edgelin export ---------------------------------------------------------------------
@pytest.fixture(scope="module")
def mamba2_exports(tmp_path_factory) -> dict[str, Path]:
    """A tiny Mamba2 (two layers), float32, --step-ops edgelin and contrib."""
    root = tmp_path_factory.mktemp("step-ops-ssd")
    ckpt = make_checkpoint(root / "ckpt", "mamba2", tokenizer=False)
    settings = export_settings(None, "onnx", "fp32", None, 32)
    return {ops: export_checkpoint(ckpt, root / ops, settings=settings, options=OnnxOptions(step_ops=ops)).folder
            for ops in ("edgelin", "contrib")}


def _step(folder: Path) -> onnx.ModelProto:
    return onnx.load(str(folder / "step.onnx"), load_external_data=False)


def test_every_mamba2_layer_is_one_fused_node(mamba2_exports):
    plain, fused = _step(mamba2_exports["contrib"]), _step(mamba2_exports["edgelin"])
    layers = sum(n.op_type == "LinearAttention" for n in plain.graph.node)
    assert layers == 2
    assert sum(n.op_type == NAME and n.domain == ortops.DOMAIN for n in fused.graph.node) == layers
    assert not any(n.op_type == "LinearAttention" for n in fused.graph.node)
    assert [f.name for f in fused.functions].count(NAME) == 1
    # 14 nodes per layer fewer here (the dt path, the value, the skip, their reshapes; 3 more where fewer key groups
    # than heads are broadcast, as in the Mamba2 peer), and 3 per gated MLP (one SiluGate for Split, SiLU and Mul)
    # and 10 per gated norm (one GateThenRmsNorm for SiLU, the gate, the groups' two Reshapes and the norm's six)
    gates = sum(n.op_type == "SiluGate" and n.domain == ortops.DOMAIN for n in fused.graph.node)
    assert gates == layers  # this tiny Mamba2 has an MLP per layer (transformers' Mamba2 has none)
    norms = [n for n in fused.graph.node if n.op_type == onnx_gated_norm.GATE_FIRST and n.domain == ortops.DOMAIN]
    assert len(norms) == layers and all(a.i == 8 for n in norms for a in n.attribute if a.name == "group_size")
    assert len(plain.graph.node) - len(fused.graph.node) == 14 * layers + 3 * gates + 10 * layers


def test_a_layer_whose_inner_tensor_has_another_reader_is_left_alone(mamba2_exports):
    proto = _step(mamba2_exports["contrib"])
    softplus = next(n for n in proto.graph.node if n.op_type == "Softplus")
    proto.graph.output.append(helper.make_tensor_value_info(softplus.output[0], TensorProto.FLOAT, None))
    assert fuse_ssd_steps(proto, float_tensor_names(proto)) == 1
    assert sum(n.op_type == "LinearAttention" for n in proto.graph.node) == 1


@pytest.mark.parametrize("setting", ["library", "off"])
def test_a_fused_mamba2_export_validates_with_and_without_the_library(mamba2_exports, library, setting, monkeypatch):
    monkeypatch.setenv(ortops.ENV, str(library) if setting == "library" else "0")
    report = replay(mamba2_exports["edgelin"])
    assert report.passed, (report.failures, report.quality_failures)


@pytest.mark.parametrize("batch", [1, 3])
def test_the_fused_step_rollout_matches_the_unfused_graphs(mamba2_exports, library, batch, monkeypatch):
    """30 teacher-forced steps after an 11-token prefill, at 2 threads: without the library the function computes
    what the contrib export's nodes compute, bit for bit; with it, within the kernel's bound."""
    logits = rollouts(mamba2_exports, library, batch, 2, monkeypatch)
    assert np.array_equal(logits["fallback"], logits["contrib"])
    assert_close(logits["library"], logits["contrib"], SSD_RTOL, f"batch {batch}")


def test_a_constant_memory_export_prefills_in_pieces_of_64(mamba2_exports, library, monkeypatch):
    """ONNX Runtime's arena keeps the largest piece's activations; 64-token pieces (onnx_runtime's
    CONSTANT_MEMORY_PREFILL_PIECE) give the logits of one whole-prompt piece."""
    from edgelin.export.onnx.runner import CONSTANT_MEMORY_PREFILL_PIECE
    from edgelin.runtime import open_runner, prefill

    monkeypatch.setenv(ortops.ENV, str(library))
    runner = open_runner(mamba2_exports["edgelin"], threads=1)
    assert runner.prefill_piece == CONSTANT_MEMORY_PREFILL_PIECE == 64
    pieces = []
    inner = runner.prefill
    runner.prefill = lambda ids, state, start: pieces.append(ids.shape[1]) or inner(ids, state, start)
    ids = np.random.default_rng(3).integers(0, runner.manifest.vocab_size, (2, 300))
    logits, _ = prefill(runner, ids)
    assert pieces == [64, 64, 64, 64, 44]
    runner.prefill_piece = 300
    whole, _ = prefill(runner, ids)
    assert pieces[5:] == [300]
    assert_close(logits, whole, SSD_RTOL, "64-token pieces vs one piece")
