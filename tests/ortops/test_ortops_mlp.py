"""ai.edgelin::SiluGate: a gated MLP's silu(gate) * up from the fused gate/up product in one node
(edgelin/ortops/ops_mlp.c, edgelin/export/onnx/silu_gate.py).

The kernel == a float64 numpy silu(a) * b written from the formula, and == the node's ONNX function (Split, Sigmoid,
Mul, Mul: the fallback) run by ONNX Runtime, at batch 1 and 3, one and two tokens, widths that are and are not a
multiple of the SIMD lanes, AVX2 and portable paths. The fusion takes the exact pattern and refuses an unequal split,
another axis, and a gate read outside the pattern. Exports: tests/ortops/test_ortops_gdn.py and test_ortops_ssd.py count the
fused nodes, and their rollouts run them."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from edgelin import ortops
from edgelin.export.onnx.kernels import float_tensor_names
from edgelin.export.onnx.silu_gate import NAME, fuse_silu_gates, silu_gate_function
from helpers import assert_not_fused
from ortops_fixtures import assert_matches_float64_and_function, kernel_path, library  # noqa: F401 (fixtures)

pytestmark = pytest.mark.skipif(ortops._compiler() is None, reason="no C compiler: edgelin.ortops builds with one")

# float32 SiLU (a polynomial exp on AVX2, expf on the portable path, ONNX Runtime's for the function) against
# float64: measured <= 1.2e-7 RMS-relative here; bound ~80x.
RTOL = 1e-5


def _gate_model(width: int) -> onnx.ModelProto:
    value = lambda name, *dims: helper.make_tensor_value_info(name, TensorProto.FLOAT, list(dims))  # noqa: E731
    graph = helper.make_graph([helper.make_node(NAME, ["x"], ["y"], domain=ortops.DOMAIN)], "g",
                              [value("x", "b", "t", 2 * width)], [value("y", "b", "t", width)])
    opsets = [helper.make_opsetid("", 18), helper.make_opsetid(ortops.DOMAIN, 1)]
    return helper.make_model(graph, opset_imports=opsets, functions=[silu_gate_function({"": 18})])


@pytest.mark.parametrize("width", [37, 64], ids=["F37", "F64"])
@pytest.mark.parametrize("batch,tokens", [(1, 1), (3, 1), (3, 2)], ids=lambda v: str(v))
def test_the_kernel_matches_float64_and_its_onnx_function(library, width, batch, tokens, kernel_path):
    x = (np.random.default_rng(width + batch * 10 + tokens).standard_normal((batch, tokens, 2 * width)) * 3
         ).astype(np.float32)
    gate, up = x[..., :width].astype(np.float64), x[..., width:].astype(np.float64)
    want = gate / (1 + np.exp(-gate)) * up
    assert_matches_float64_and_function(_gate_model(width), {"x": x}, (want,), library, 1, RTOL,
                                        f"F={width} B={batch} T={tokens} {kernel_path}")


def _mlp(sizes=(16, 16), axis: int = -1, leak: bool = False) -> onnx.ModelProto:
    """Split(x) -> gate, up; Mul(Mul(gate, Sigmoid(gate)), up): the pattern a fused gate/up product leaves."""
    node = helper.make_node
    nodes = [node("Split", ["x", "sizes"], ["gate", "up"], axis=axis), node("Sigmoid", ["gate"], ["sig"]),
             node("Mul", ["gate", "sig"], ["silu"]), node("Mul", ["silu", "up"], ["y"])]
    value = lambda name, *dims: helper.make_tensor_value_info(name, TensorProto.FLOAT, list(dims))  # noqa: E731
    outputs = [value("y", "b", 1, sizes[0])] + ([value("gate", "b", 1, sizes[0])] if leak else [])
    graph = helper.make_graph(nodes, "mlp", [value("x", "b", 1, sum(sizes))], outputs,
                              [numpy_helper.from_array(np.array(sizes, np.int64), "sizes")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])


def test_the_pattern_fuses_to_one_node_with_the_same_numbers():
    import onnxruntime as ort

    model = _mlp()
    fused = onnx.ModelProto()
    fused.CopyFrom(model)
    assert fuse_silu_gates(fused, float_tensor_names(fused)) == 1
    assert [(n.op_type, n.domain) for n in fused.graph.node] == [(NAME, ortops.DOMAIN)]
    x = np.random.default_rng(0).standard_normal((2, 1, 32)).astype(np.float32)
    run = lambda m: ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"]).run(  # noqa: E731
        None, {"x": x})[0]
    assert np.array_equal(run(fused), run(model))  # without the library: the function body, the same ONNX ops


@pytest.mark.parametrize("model", [
    pytest.param(lambda: _mlp(sizes=(16, 24)), id="unequal-halves"),
    pytest.param(lambda: _mlp(axis=1), id="another-axis"),
    pytest.param(lambda: _mlp(leak=True), id="the-gate-read-outside"),
])
def test_refused_where_the_pattern_is_not_exact(model):
    assert_not_fused(model(), fuse_silu_gates)
