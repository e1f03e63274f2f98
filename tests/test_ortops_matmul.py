"""ai.edgelin::MatMul, the step graph's float32 weight products (edgelin/ortops/f32_gemv.c, ops_matmul.c).

The chain of trust: the kernel inside an ONNX Runtime session == a float64 product of the same numbers (an
independent reference) and == ONNX Runtime's own MatMul (MLAS), at shapes that take every path (whole passes of
eight weight rows and a remainder, N's last columns past a multiple of 16, one and several row slices per task),
at two batch shapes and thread counts; the export's function fallback == ONNX's MatMul bit for bit; a float32
--step-ops edgelin export routes every step product, validates with and without the library, and its step
rollout with the library == without it."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from edgelin import ortops
from edgelin.export.onnx_kernels import FLOAT_MATMUL, fallback_function
from edgelin.replay import replay
from helpers import assert_close
from ortops_fixtures import float_gdn_exports, kernel_path, library, rollouts, session  # noqa: F401 (fixtures)

pytestmark = pytest.mark.skipif(ortops._compiler() is None, reason="no C compiler: edgelin.ortops builds with one")

# Float32 sums in another order than MLAS's (slices of 64 weight rows summed after, pairs of rows per chain):
# measured <= 1.4e-7 RMS-relative against float64 and <= 3.3e-7 against ONNX Runtime's MatMul on these shapes;
# bound ~30x.
PRODUCT_RTOL = 1e-5

# K: a multiple of the 64-row task slice (384: 6 tasks), one row past it (65: a lone-row task), not a multiple of
# the 8-row pass (100, 7); N: a multiple of 16, 16k + 12 (1676: the fused Mamba2 input projection), below 16, 1
SHAPES = [(384, 1676), (768, 384), (65, 17), (100, 37), (7, 1)]


def _matmul(K: int, N: int, a_shape: list) -> onnx.ModelProto:
    weight = (np.random.default_rng(K * N).standard_normal((K, N)) * 0.05).astype(np.float32)
    graph = helper.make_graph([helper.make_node("MatMul", ["x", "W"], ["y"])], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, a_shape)],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
                              [numpy_helper.from_array(weight, "W")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])


def _routed(model: onnx.ModelProto) -> onnx.ModelProto:
    routed = onnx.ModelProto()
    routed.CopyFrom(model)
    routed.graph.node[0].domain = ortops.DOMAIN
    routed.opset_import.append(helper.make_opsetid(ortops.DOMAIN, 1))
    routed.functions.append(fallback_function(FLOAT_MATMUL, {"": 18}))
    return routed


@pytest.mark.parametrize("K,N", SHAPES, ids=[f"K{k}-N{n}" for k, n in SHAPES])
@pytest.mark.parametrize("a_shape", [(1, 1), (3, 1)], ids=["B1", "B3"])
@pytest.mark.parametrize("threads", [1, 2], ids=["t1", "t2"])
def test_the_product_matches_float64_and_onnxruntimes_matmul(library, K, N, a_shape, threads, kernel_path):
    model = _matmul(K, N, ["b", "t", K])
    weight = numpy_helper.to_array(model.graph.initializer[0])
    x = np.random.default_rng(K + N).standard_normal((*a_shape, K)).astype(np.float32)
    got = session(_routed(model), library, threads).run(None, {"x": x})[0]
    assert got.shape == (*a_shape, N)
    assert_close(got, x.astype(np.float64) @ weight.astype(np.float64), PRODUCT_RTOL, f"K={K} N={N} vs float64")
    assert_close(got, session(model).run(None, {"x": x})[0], PRODUCT_RTOL, f"K={K} N={N} vs ONNX Runtime")


def test_the_function_fallback_is_onnxs_matmul_bit_for_bit():
    """Without the library the routed node runs its function body: ONNX Runtime's MatMul, same bytes."""
    model = _matmul(384, 200, ["b", 384])
    x = np.random.default_rng(0).standard_normal((2, 384)).astype(np.float32)
    assert np.array_equal(session(_routed(model)).run(None, {"x": x})[0], session(model).run(None, {"x": x})[0])


def test_a_weight_of_the_wrong_shape_is_refused_in_one_line(library):
    """B fed at run time with a K that is not A's: the op's one-line error, not a crash or a wrong product."""
    graph = helper.make_graph([helper.make_node("MatMul", ["x", "W"], ["y"], domain=ortops.DOMAIN)], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 8]),
                               helper.make_tensor_value_info("W", TensorProto.FLOAT, [9, 4])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18), helper.make_opsetid(ortops.DOMAIN, 1)])
    with pytest.raises(Exception, match="edgelin MatMul: expected A"):
        session(model, library).run(None, {"x": np.ones((1, 8), np.float32), "W": np.ones((9, 4), np.float32)})


# ---- a float32 --step-ops edgelin export --------------------------------------------------------------------
@pytest.fixture(scope="module")
def float_exports(tmp_path_factory) -> dict[str, Path]:
    return float_gdn_exports(tmp_path_factory.mktemp("step-ops-edgelin-fp32"))


def test_the_export_routes_every_float_step_product(float_exports):
    routed = onnx.load(str(float_exports["edgelin"] / "step.onnx"), load_external_data=False)
    plain = onnx.load(str(float_exports["contrib"] / "step.onnx"), load_external_data=False)
    weights = {t.name for t in plain.graph.initializer if len(t.dims) == 2}
    products = sum(n.op_type == "MatMul" and n.input[1] in weights for n in plain.graph.node)
    assert products >= 6  # per layer at least the input and output projections
    assert sum(n.domain == ortops.DOMAIN and n.op_type == "MatMul" for n in routed.graph.node) == products
    assert not any(n.op_type == "MatMul" and n.domain == "" and n.input[1] in weights for n in routed.graph.node)
    assert f"{ortops.DOMAIN}::MatMul" in {f"{f.domain}::{f.name}" for f in routed.functions}
    prefill = onnx.load(str(float_exports["edgelin"] / "prefill.onnx"), load_external_data=False)
    assert not any(n.domain == ortops.DOMAIN for n in prefill.graph.node)
    manifest = json.loads((float_exports["edgelin"] / "manifest.json").read_text())
    assert manifest["extra"]["ort_ops"]["step_nodes"] == sum(n.domain == ortops.DOMAIN for n in routed.graph.node)


@pytest.mark.parametrize("setting", ["library", "off"])
def test_a_float_step_ops_edgelin_export_validates_with_and_without_the_library(float_exports, library, setting,
                                                                                monkeypatch):
    monkeypatch.setenv(ortops.ENV, str(library) if setting == "library" else "0")
    report = replay(float_exports["edgelin"])
    assert report.passed, (report.failures, report.quality_failures)


@pytest.mark.parametrize("batch", [1, 3])
def test_the_float_step_rollout_with_the_library_matches_onnxruntimes_kernels(float_exports, library, batch,
                                                                             monkeypatch):
    """30 teacher-forced steps after an 11-token prefill, at 2 threads: library vs function fallback vs contrib."""
    logits = rollouts(float_exports, library, batch, 2, monkeypatch)
    assert np.array_equal(logits["fallback"], logits["contrib"])
    assert_close(logits["library"], logits["contrib"], PRODUCT_RTOL, f"batch {batch}")
