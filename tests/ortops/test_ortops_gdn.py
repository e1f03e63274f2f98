"""ai.edgelin::GatedDeltaRecurrence: a Gated DeltaNet layer's step into its recurrence in one node, and
ai.edgelin::GatedRmsNorm, its gated output norm (edgelin/ortops/ops_gdn.c, edgelin/export/onnx/gdn.py,
onnx_gated_norm.py).

The chain of trust: the kernel == a float64 numpy step written from the formulas (independent of both the kernel and
the ONNX function), and == the node's ONNX function (the fallback) run by ONNX Runtime, at batch 1 and 3, several
tokens per call, one and two key heads per value head, 1 and 2 threads, AVX2 and portable paths, the state updated
in place; a gated_deltanet --step-ops edgelin export fuses every layer, leaves a layer alone when an inner tensor has
another reader, validates with and without the library, and its step rollout without the library is bit for bit
the contrib export's (the function computes what the unfused nodes computed)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from edgelin import ortops
from edgelin.export.onnx import gated_norm as onnx_gated_norm
from edgelin.export.onnx.gdn import INPUTS, NAME, fuse_gated_delta_steps, gdn_function
from edgelin.export.onnx.kernels import float_tensor_names
from edgelin.replay import replay
from helpers import assert_close
from ortops_fixtures import (assert_matches_float64_and_function, assert_state_in_place, float_gdn_exports,
                             kernel_path, library, rollouts, session)  # noqa: F401 (fixtures)

pytestmark = pytest.mark.skipif(ortops._compiler() is None, reason="no C compiler: edgelin.ortops builds with one")

# The recurrence is linear_attention.c's (<= 2e-6 against ONNX Runtime's, tests/ortops/test_ortops.py); the norms, softplus
# and sigmoid add float32 roundings: measured <= 1.4e-7 RMS-relative (kernel and function against float64, kernel
# against the function) here. Bound ~70x.
GDN_RTOL = 1e-5
H, DK, DV, EPS = 4, 8, 12, 1e-6 / 8


def _gdn_model(groups: int, scale: float = 1.0) -> onnx.ModelProto:
    rng = np.random.default_rng(groups)
    constants = [numpy_helper.from_array((rng.standard_normal((H, 1)) * 0.5).astype(np.float32), "dt_bias"),
                 numpy_helper.from_array(-np.exp(rng.standard_normal((H, 1))).astype(np.float32), "A"),
                 numpy_helper.from_array((rng.uniform(0.5, 1.5, DK) * DK**-1).astype(np.float32), "q_scale"),
                 numpy_helper.from_array((rng.uniform(0.5, 1.5, DK) * DK**-0.5).astype(np.float32), "k_scale")]
    node = helper.make_node(NAME, list(INPUTS), ["output", "present"], domain=ortops.DOMAIN, q_num_heads=groups,
                            kv_num_heads=H, scale=scale, epsilon=EPS)
    value = lambda name, *dims: helper.make_tensor_value_info(name, TensorProto.FLOAT, list(dims))  # noqa: E731
    graph = helper.make_graph([node], "g", [value("q", "b", "t", groups * DK), value("k", "b", "t", groups * DK),
                                            value("v", "b", "t", H * DV), value("dt", "b", "t", H),
                                            value("b", "b", "t", H), value("past_state", "b", H, DK, DV)],
                              [value("output", "b", "t", H * DV), value("present", "b", H, DK, DV)], constants)
    opsets = [helper.make_opsetid(domain, 1) for domain in ("com.microsoft", ortops.DOMAIN)]
    opsets.append(helper.make_opsetid("", 18))
    return helper.make_model(graph, opset_imports=opsets, functions=[gdn_function({"": 18})])


def _feeds(batch: int, tokens: int, groups: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(batch * 10 + tokens)
    shapes = {"q": (batch, tokens, groups * DK), "k": (batch, tokens, groups * DK), "v": (batch, tokens, H * DV),
              "dt": (batch, tokens, H), "b": (batch, tokens, H), "past_state": (batch, H, DK, DV)}
    feeds = {name: rng.standard_normal(shape).astype(np.float32) for name, shape in shapes.items()}
    feeds["past_state"] *= np.float32(0.3)
    return feeds


def _reference(model: onnx.ModelProto, feeds: dict, groups: int) -> tuple[np.ndarray, np.ndarray]:
    """The step from its formulas, float64: n(x, w) = x / sqrt(mean(x^2) + eps) w per head; q, k = n(q, q_scale),
    n(k, k_scale) of the head's group; S = exp(A softplus(dt + dt_bias)) S; u = sigmoid(b) (v - S^T k); S += k u^T;
    o = scale S^T q."""
    const = {t.name: numpy_helper.to_array(t).astype(np.float64).reshape(-1) for t in model.graph.initializer}
    scale = next(a.f for a in model.graph.node[0].attribute if a.name == "scale")
    f = {k: v.astype(np.float64) for k, v in feeds.items()}
    batch, tokens = f["v"].shape[:2]

    def norm(x: np.ndarray, w: np.ndarray) -> np.ndarray:
        return x / np.sqrt((x * x).mean(-1, keepdims=True) + EPS) * w

    state, out = f["past_state"].copy(), np.zeros((batch, tokens, H, DV))
    for t in range(tokens):
        q = norm(f["q"][:, t].reshape(batch, groups, DK), const["q_scale"])
        k = norm(f["k"][:, t].reshape(batch, groups, DK), const["k_scale"])
        decay = np.exp(const["A"] * np.logaddexp(0.0, f["dt"][:, t] + const["dt_bias"]))  # [B, H]
        beta = 1.0 / (1.0 + np.exp(-f["b"][:, t]))
        v = f["v"][:, t].reshape(batch, H, DV)
        for h in range(H):
            g = h // (H // groups)
            s = decay[:, h, None, None] * state[:, h]
            u = beta[:, h, None] * (v[:, h] - np.einsum("bkv,bk->bv", s, k[:, g]))
            state[:, h] = s + k[:, g, :, None] * u[:, None, :]
            out[:, t, h] = scale * np.einsum("bkv,bk->bv", state[:, h], q[:, g])
    return out.reshape(batch, tokens, H * DV), state


CASES = [(1, 1, 2), (3, 1, 2), (2, 3, 2), (3, 1, 4), (2, 3, 1)]


@pytest.mark.parametrize("batch,tokens,groups", CASES, ids=[f"B{b}-T{t}-G{g}" for b, t, g in CASES])
@pytest.mark.parametrize("threads", [1, 2], ids=["t1", "t2"])
def test_the_fused_step_matches_float64_and_its_onnx_function(library, batch, tokens, groups, threads, kernel_path):
    model = _gdn_model(groups)
    feeds = _feeds(batch, tokens, groups)
    assert_matches_float64_and_function(model, feeds, _reference(model, feeds, groups), library, threads, GDN_RTOL,
                                        f"B={batch} T={tokens} G={groups}")


def test_the_fused_step_updates_its_state_in_place(library, kernel_path):
    assert_state_in_place(_gdn_model(2), _feeds(3, 1, 2), library, "output")


def test_a_shape_the_kernel_does_not_take_is_refused_in_one_line(library):
    model = _gdn_model(2)
    model.graph.input[4].type.tensor_type.shape.dim[2].dim_param = "h"  # b's heads not fixed by the graph
    feeds = _feeds(1, 1, 2)
    feeds["b"] = feeds["b"][..., :H - 1]
    with pytest.raises(Exception, match="edgelin GatedDeltaRecurrence: expected"):
        session(model, library).run(None, feeds)


def _gated_norm_model(width: int, epsilon: float = 1e-6, group: int | None = None) -> onnx.ModelProto:
    """GatedRmsNorm, or with `group` GateThenRmsNorm over groups of `group` values."""
    weight = np.random.default_rng(width).uniform(0.5, 1.5, width).astype(np.float32)
    name, function = ((onnx_gated_norm.GATE_FIRST, onnx_gated_norm.gate_then_norm_function) if group
                      else (onnx_gated_norm.NAME, onnx_gated_norm.gated_norm_function))
    node = helper.make_node(name, ["x", "z", "weight"], ["y"], domain=ortops.DOMAIN, epsilon=epsilon,
                            **({"group_size": group} if group else {}))
    value = lambda name: helper.make_tensor_value_info(name, TensorProto.FLOAT, ["b", "t", "n"])  # noqa: E731
    graph = helper.make_graph([node], "g", [value("x"), value("z")], [value("y")],
                              [numpy_helper.from_array(weight, "weight")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid(ortops.DOMAIN, 1),
                                                   helper.make_opsetid("", 18)],
                             functions=[function({"": 18})])


@pytest.mark.parametrize("batch,tokens", [(1, 1), (3, 2)], ids=["B1-T1", "B3-T2"])
def test_the_gated_norm_matches_float64_and_its_onnx_function(library, batch, tokens):
    model = _gated_norm_model(DV)
    rng = np.random.default_rng(batch)
    feeds = {name: (rng.standard_normal((batch, tokens, H * DV)) * 2).astype(np.float32) for name in ("x", "z")}
    weight = numpy_helper.to_array(model.graph.initializer[0]).astype(np.float64)
    x, z = (feeds[n].astype(np.float64).reshape(batch, tokens, H, DV) for n in ("x", "z"))
    want = x / np.sqrt((x * x).mean(-1, keepdims=True) + 1e-6) * weight * z / (1.0 + np.exp(-z))
    assert_matches_float64_and_function(model, feeds, (want.reshape(batch, tokens, H * DV),), library, 1, GDN_RTOL,
                                        f"B={batch} T={tokens}")


@pytest.mark.parametrize("group", [H * DV, DV, 4], ids=["one-group", "a-group-per-head", "groups-of-4"])
@pytest.mark.parametrize("batch,tokens", [(1, 1), (3, 2)], ids=["B1-T1", "B3-T2"])
def test_the_gate_then_norm_matches_float64_and_its_onnx_function(library, batch, tokens, group):
    """Mamba2's gated norm, the gate first: RMSNorm(x * silu(z)) * w over groups of the width, w spanning it."""
    width = H * DV
    model = _gated_norm_model(width, 1e-5, group=group)
    rng = np.random.default_rng(batch)
    feeds = {name: (rng.standard_normal((batch, tokens, width)) * 2).astype(np.float32) for name in ("x", "z")}
    weight = numpy_helper.to_array(model.graph.initializer[0]).astype(np.float64)
    x, z = (feeds[n].astype(np.float64) for n in ("x", "z"))
    gated = (x * z / (1.0 + np.exp(-z))).reshape(batch, tokens, width // group, group)
    unit = (gated / np.sqrt((gated * gated).mean(-1, keepdims=True) + 1e-5)).reshape(batch, tokens, width)
    assert_matches_float64_and_function(model, feeds, (unit * weight,), library, 1, GDN_RTOL,
                                        f"B={batch} T={tokens} group {group}")


def _unfused_gate_then_norm(width: int, extra_output: str | None = None, group: int | None = None) -> onnx.ModelProto:
    """Mamba2's gated norm as its step graph writes it: SiLU as Sigmoid and Mul, the gate's Mul, then the norm's six
    (Pow, ReduceMean, Add, Sqrt, Div, Mul w); with `group`, the norm's core between a Reshape into [B, 1, groups,
    group] and one back to [B, 1, width], as edgelin's own Mamba2 writes it (transformers' with n_groups 1: none)."""
    node = helper.make_node
    consts = [numpy_helper.from_array(np.array(2.0, np.float32), "two"),
              numpy_helper.from_array(np.array([-1]), "last"),
              numpy_helper.from_array(np.array(1e-5, np.float32), "eps"),
              numpy_helper.from_array(np.random.default_rng(1).uniform(0.5, 1.5, width).astype(np.float32), "w"),
              numpy_helper.from_array(np.array([-1, 1, width // (group or width), group or width]), "into"),
              numpy_helper.from_array(np.array([-1, 1, width]), "back")]
    nodes = [node("Sigmoid", ["z"], ["sig"]), node("Mul", ["z", "sig"], ["silu"]), node("Mul", ["x", "silu"], ["g"])]
    nodes += [node("Reshape", ["g", "into"], ["g4"])] if group else []
    base = "g4" if group else "g"
    nodes += [node("Pow", [base, "two"], ["sq"]), node("ReduceMean", ["sq", "last"], ["ms"]),
              node("Add", ["ms", "eps"], ["e"]), node("Sqrt", ["e"], ["rms"]), node("Div", [base, "rms"], ["unit"])]
    nodes += [node("Reshape", ["unit", "back"], ["unit3"])] if group else []
    nodes += [node("Mul", ["unit3" if group else "unit", "w"], ["y"])]
    value = lambda name: helper.make_tensor_value_info(name, TensorProto.FLOAT, ["b", 1, width])  # noqa: E731
    outputs = [value("y")] + ([value(extra_output)] if extra_output else [])
    graph = helper.make_graph(nodes, "g", [value("x"), value("z")], outputs, consts)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])


@pytest.mark.parametrize("group", [None, 8], ids=["one-group", "groups-of-8"])
def test_mambas_gated_norm_becomes_one_node_that_computes_the_same(library, group):
    model = _unfused_gate_then_norm(48, group=group)
    fused = onnx.ModelProto()
    fused.CopyFrom(model)
    assert onnx_gated_norm.fuse_gated_norms(fused, float_tensor_names(fused)) == 1
    (node,) = fused.graph.node
    assert (node.op_type, node.domain) == (onnx_gated_norm.GATE_FIRST, ortops.DOMAIN)
    attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    assert attrs["epsilon"] == pytest.approx(1e-5) and attrs["group_size"] == (group or 48)
    feeds = {n: np.random.default_rng(i).standard_normal((2, 1, 48)).astype(np.float32) for i, n in enumerate("xz")}
    want = session(model).run(None, feeds)[0]
    assert_close(session(fused, library).run(None, feeds)[0], want, GDN_RTOL, "kernel vs the unfused nodes")
    assert_close(session(fused).run(None, feeds)[0], want, GDN_RTOL, "function vs the unfused nodes")


def test_mambas_gated_norm_with_an_inner_tensor_read_elsewhere_is_left_alone():
    model = _unfused_gate_then_norm(48, extra_output="g")  # the gated value is also a graph output
    assert onnx_gated_norm.fuse_gated_norms(model, float_tensor_names(model)) == 0
    assert len(model.graph.node) == 9


def test_a_gated_norm_whose_width_does_not_divide_is_refused_in_one_line(library):
    feeds = {name: np.ones((1, 1, H * DV + 1), np.float32) for name in ("x", "z")}
    with pytest.raises(Exception, match="edgelin GatedRmsNorm: expected"):
        session(_gated_norm_model(DV), library).run(None, feeds)


# ---- a gated_deltanet --step-ops edgelin export ------------------------------------------------------------------
@pytest.fixture(scope="module")
def gdn_exports(tmp_path_factory) -> dict[str, Path]:
    """Two Gated DeltaNet layers around an attention one, float32, --step-ops edgelin and contrib (the same export as
    tests/ortops/test_ortops_matmul.py's: traced once per test run)."""
    return float_gdn_exports(tmp_path_factory.mktemp("step-ops-gdn"))


def _step(folder: Path) -> onnx.ModelProto:
    return onnx.load(str(folder / "step.onnx"), load_external_data=False)


def test_every_gated_deltanet_layer_is_one_fused_step_and_one_fused_norm(gdn_exports):
    plain, fused = _step(gdn_exports["contrib"]), _step(gdn_exports["edgelin"])
    layers = sum(n.op_type == "LinearAttention" for n in plain.graph.node)
    assert layers == 2
    nodes = [n for n in fused.graph.node if n.op_type == NAME and n.domain == ortops.DOMAIN]
    assert len(nodes) == layers and not any(n.op_type == "LinearAttention" for n in fused.graph.node)
    assert [f.name for f in fused.functions].count(NAME) == 1
    norms = [n for n in fused.graph.node if n.op_type == onnx_gated_norm.NAME and n.domain == ortops.DOMAIN]
    assert len(norms) == layers and [f.name for f in fused.functions].count(onnx_gated_norm.NAME) == 1
    # 26 nodes per layer fewer: q's and k's reshapes and six-node norms, the key broadcast, the decay path, beta's
    # sigmoid and the reshapes into the recurrence; 11 more for the output norm (the reshapes, the norm, the SiLU, the
    # gate); 3 per gated MLP (every layer's, the attention one's too: one SiluGate for Split, SiLU and Mul)
    gates = sum(n.op_type == "SiluGate" and n.domain == ortops.DOMAIN for n in fused.graph.node)
    assert gates == layers + 1
    assert len(plain.graph.node) - len(fused.graph.node) == (26 + 11) * layers + 3 * gates
    epsilon = [helper.get_attribute_value(a) for n in nodes for a in n.attribute if a.name == "epsilon"]
    assert epsilon == [pytest.approx(1e-6 / 8)] * layers  # edgelin.export.lowering's l2_normalize: eps / head size


def test_a_layer_whose_inner_tensor_has_another_reader_is_left_alone(gdn_exports):
    proto = _step(gdn_exports["contrib"])
    sigmoid = next(n for n in proto.graph.node if n.op_type == "Sigmoid"
                   and any(r.op_type == "Reshape" for r in proto.graph.node if n.output[0] in r.input))
    proto.graph.output.append(helper.make_tensor_value_info(sigmoid.output[0], TensorProto.FLOAT, None))
    assert fuse_gated_delta_steps(proto, float_tensor_names(proto)) == 1
    assert sum(n.op_type == "LinearAttention" for n in proto.graph.node) == 1


def test_keys_tiled_across_the_heads_instead_of_repeated_are_left_alone(gdn_exports):
    """Unsqueeze before the groups' axis tiles the key heads (head h reads group h % groups), not the kernel's order
    (h // (heads / groups)): not fused."""
    proto = _step(gdn_exports["contrib"])
    floats = float_tensor_names(proto)
    for node in proto.graph.node:
        if node.op_type == "Unsqueeze" and any(r.op_type == "Expand" for r in proto.graph.node
                                               if node.output[0] in r.input):
            node.input[1] = "tiling_axis"
    proto.graph.initializer.append(numpy_helper.from_array(np.array([2], np.int64), "tiling_axis"))
    assert fuse_gated_delta_steps(proto, floats) == 0


def test_a_gated_norm_whose_inner_tensor_has_another_reader_is_left_alone(gdn_exports):
    proto = _step(gdn_exports["contrib"])
    floats = float_tensor_names(proto)
    assert onnx_gated_norm.fuse_gated_norms(_step(gdn_exports["contrib"]), floats) == 2
    assert fuse_gated_delta_steps(proto, floats) == 2
    made_by = {out: n for n in proto.graph.node for out in n.output}
    recurrence_outputs = {n.output[0] for n in proto.graph.node if n.op_type == NAME}
    div = next(n for n in proto.graph.node if n.op_type == "Div" and n.input[0] in made_by
               and made_by[n.input[0]].input[0] in recurrence_outputs)  # the output norm's, after a Reshape
    proto.graph.output.append(helper.make_tensor_value_info(div.output[0], TensorProto.FLOAT, None))
    assert onnx_gated_norm.fuse_gated_norms(proto, floats) == 1


@pytest.mark.parametrize("setting", ["library", "off"])
def test_a_fused_gated_deltanet_export_validates_with_and_without_the_library(gdn_exports, library, setting,
                                                                               monkeypatch):
    monkeypatch.setenv(ortops.ENV, str(library) if setting == "library" else "0")
    report = replay(gdn_exports["edgelin"])
    assert report.passed, (report.failures, report.quality_failures)


@pytest.mark.parametrize("batch", [1, 3])
def test_the_fused_step_rollout_matches_the_unfused_graphs(gdn_exports, library, batch, monkeypatch):
    """30 teacher-forced steps after an 11-token prefill, at 2 threads: without the library the function computes
    what the contrib export's nodes compute, bit for bit; with it, within the kernel's bound."""
    logits = rollouts(gdn_exports, library, batch, 2, monkeypatch)
    assert np.array_equal(logits["fallback"], logits["contrib"])
    assert_close(logits["library"], logits["contrib"], GDN_RTOL, f"batch {batch}")

