"""The step's residual Add + RMSNorm as one com.microsoft::SkipSimplifiedLayerNormalization
(edgelin/export/onnx/skip_norm.py).

The fused graph against a float64 numpy block written from the formula (h = x + f, y = h / sqrt(mean(h^2) + eps) w,
the sum read again by the next residual Add), at batch 1 and 3, one and two tokens; the unfused graph run by
ONNX Runtime agrees too. Refused: a broadcast Add (a bias), an Add of two shapes, a norm whose inner tensor has
another reader. The hybrid's export fuses every block norm that reads a residual Add (test_onnx.py checks that
export's rollout against the reference)."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from edgelin.export.onnx.kernels import float_tensor_names
from edgelin.export.onnx.skip_norm import fuse_skip_norms
from helpers import assert_close, assert_not_fused

D, EPS = 24, 1e-6
# ONNX Runtime's float32 norm (either form) against float64: measured <= 6e-8 RMS-relative here; bound ~16x.
RTOL = 1e-6


def _block(skip_shape=("b", "t", D), bias: bool = False, leak: bool = False, second_reader: bool = True):
    """x + f -> RMSNorm (six nodes, as torch exports it) -> out = sum + norm (the residual stream's next Add)."""
    node = helper.make_node
    weight = np.random.default_rng(0).uniform(0.5, 1.5, D).astype(np.float32)
    constants = [numpy_helper.from_array(weight, "w"), numpy_helper.from_array(np.float32(2.0), "two"),
                 numpy_helper.from_array(np.array([-1], np.int64), "axes"),
                 numpy_helper.from_array(np.float32(EPS), "eps")]
    if bias:
        constants.append(numpy_helper.from_array(np.linspace(-1, 1, D).astype(np.float32), "f"))
    nodes = [node("Add", ["x", "f"], ["h"], name="residual"), node("Pow", ["h", "two"], ["sq"]),
             node("ReduceMean", ["sq", "axes"], ["ms"], keepdims=1), node("Add", ["ms", "eps"], ["ms_eps"]),
             node("Sqrt", ["ms_eps"], ["rms"]), node("Div", ["h", "rms"], ["unit"]), node("Mul", ["unit", "w"], ["y"])]
    value = lambda name, dims: helper.make_tensor_value_info(name, TensorProto.FLOAT, list(dims))  # noqa: E731
    outputs = [value("y", ("b", "t", D))]
    if second_reader:
        nodes.append(node("Add", ["h", "y"], ["out"]))
        outputs = [value("out", ("b", "t", D))]
    if leak:
        outputs.append(value("ms", ("b", "t", 1)))
    inputs = [value("x", ("b", "t", D))] + ([] if bias else [value("f", skip_shape)])
    graph = helper.make_graph(nodes, "block", inputs, outputs, constants,
                              value_info=[value("h", ("b", "t", D)), value("unit", ("b", "t", D))])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])


def _run(model: onnx.ModelProto, feeds: dict) -> list[np.ndarray]:
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)


@pytest.mark.parametrize("second_reader", [True, False], ids=["sum-read-again", "sum-read-by-the-norm-only"])
@pytest.mark.parametrize("batch,tokens", [(1, 1), (3, 1), (3, 2)], ids=lambda v: str(v))
def test_fused_block_matches_float64_and_the_unfused_graph(batch, tokens, second_reader):
    model = _block(second_reader=second_reader)
    fused = onnx.ModelProto()
    fused.CopyFrom(model)
    assert fuse_skip_norms(fused, float_tensor_names(fused)) == 1
    ops = [n.op_type for n in fused.graph.node]
    assert ops == ["SkipSimplifiedLayerNormalization"] + (["Add"] if second_reader else [])
    assert len(fused.graph.node[0].output) == (4 if second_reader else 1)
    rng = np.random.default_rng(batch * 10 + tokens)
    feeds = {name: rng.standard_normal((batch, tokens, D)).astype(np.float32) for name in ("x", "f")}
    h = feeds["x"].astype(np.float64) + feeds["f"]
    weight = numpy_helper.to_array(next(t for t in model.graph.initializer if t.name == "w")).astype(np.float64)
    y = h / np.sqrt((h * h).mean(-1, keepdims=True) + EPS) * weight
    want = h + y if second_reader else y
    (got,), (unfused,) = _run(fused, feeds), _run(model, feeds)
    assert_close(got, want, RTOL, "fused vs float64")
    assert_close(unfused, want, RTOL, "unfused vs float64")


@pytest.mark.parametrize("model", [
    pytest.param(lambda: _block(bias=True), id="a-constant-bias"),
    pytest.param(lambda: _block(skip_shape=("b", "t", 1)), id="a-broadcast-add"),
    pytest.param(lambda: _block(leak=True), id="an-inner-tensor-read-outside"),
])
def test_refused_where_the_pattern_is_not_a_residual_norm(model):
    assert_not_fused(model(), fuse_skip_norms)
