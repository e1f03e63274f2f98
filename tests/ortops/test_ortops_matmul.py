"""edgelin's float32 weight products: ai.edgelin::MatMulF32 on weights packed in column panels (what exports write;
edgelin/ortops/panels.c, ops_matmul.c) and ai.edgelin::MatMul on ONNX's [K, N] (exports made before; f32_gemv.c).

The chain of trust: the kernel inside an ONNX Runtime session == a float64 product of the same numbers (an
independent reference) and == ONNX Runtime's own MatMul (MLAS) or the op's function body, at shapes that take every
path (decoding rows and prefill tiles, remainders of K and of N's 16 columns, one and several tasks), at several
batch shapes and thread counts; the legacy op's function fallback == ONNX's MatMul bit for bit; a float32
--step-ops edgelin export packs every product of both graphs, validates with and without the library, and its step
rollout with the library == without it."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from edgelin import ortops
from edgelin.export.onnx.kernels import RoutedOp, fallback_function
from edgelin.export.panels import F32_OP, pack_products
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


# ai.edgelin::MatMul as exports made before the packed panels wrote it: ONNX's MatMul on [K, N], same inputs
LEGACY_MATMUL = RoutedOp("MatMul", ("A", "B"), ("Y",), (), domain="")


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
    routed.functions.append(fallback_function(LEGACY_MATMUL, {"": 18}))
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


# rows of A: decoding (1, 3: a token at a time down each panel), prefill pieces (6: one token tile; 2 x 7 and 11:
# tiles and a remainder of 2 and of 5)
PANEL_A_SHAPES = [(1, 1), (3, 1), (1, 6), (2, 7), (1, 11)]
# K past one 256-row pass of the tokens (300) and the step's shapes; N 16k + 12, a multiple of 16, below 16, 1
PANEL_SHAPES = [(384, 1676), (300, 384), (65, 37), (7, 9), (33, 1)]


@pytest.mark.parametrize("K,N", PANEL_SHAPES, ids=[f"K{k}-N{n}" for k, n in PANEL_SHAPES])
@pytest.mark.parametrize("a_shape", PANEL_A_SHAPES, ids=[f"{b}x{t}" for b, t in PANEL_A_SHAPES])
@pytest.mark.parametrize("threads", [1, 2], ids=["t1", "t2"])
def test_the_packed_product_matches_float64_and_its_function_body(library, K, N, a_shape, threads, kernel_path):
    """ai.edgelin::MatMulF32 on the weight packed in panels (edgelin.export.panels) == float64 on the weight as it
    was, and == its function body (the panels unpacked for ONNX Runtime's MatMul)."""
    model = _matmul(K, N, ["b", "t", K])
    weight = numpy_helper.to_array(model.graph.initializer[0])
    assert pack_products(model) == 1
    (packed,) = model.graph.initializer
    assert list(packed.dims) == [-(-N // 16), K, 16] and model.graph.node[0].op_type == F32_OP
    x = np.random.default_rng(K + N).standard_normal((*a_shape, K)).astype(np.float32)
    got = session(model, library, threads).run(None, {"x": x})[0]
    assert got.shape == (*a_shape, N)
    assert_close(got, x.astype(np.float64) @ weight.astype(np.float64), PRODUCT_RTOL, f"K={K} N={N} vs float64")
    assert_close(got, session(model).run(None, {"x": x})[0], PRODUCT_RTOL, f"K={K} N={N} vs the function body")


def test_a_packed_weight_of_the_wrong_shape_is_refused_in_one_line(library):
    """A MatMulF32 whose B is not [ceil(n / 16), K, 16] for A's K: the op's one-line error, not a wrong product."""
    graph = helper.make_graph([helper.make_node(F32_OP, ["x", "W"], ["y"], domain=ortops.DOMAIN, n=20)], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, "k"]),
                               helper.make_tensor_value_info("W", TensorProto.FLOAT, ["p", "k", 16])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18), helper.make_opsetid(ortops.DOMAIN, 1)])
    run = session(model, library)
    with pytest.raises(Exception, match="expected A .* and B packed as"):
        run.run(None, {"x": np.ones((1, 8), np.float32), "W": np.ones((2, 9, 16), np.float32)})
    with pytest.raises(Exception, match="expected A .* and B packed as"):  # n = 20 needs 2 panels, not 3
        run.run(None, {"x": np.ones((1, 9), np.float32), "W": np.ones((3, 9, 16), np.float32)})
    good = run.run(None, {"x": np.ones((1, 9), np.float32), "W": np.ones((2, 9, 16), np.float32)})[0]
    np.testing.assert_array_equal(good, np.full((1, 20), 9.0, np.float32))


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


def test_the_export_packs_every_float_product_of_both_graphs(float_exports):
    """Each ONNX MatMul by a float32 weight is ai.edgelin::MatMulF32 on that weight packed in panels, in the step and
    the prefill, which read the same packed tensor (one copy in weights.bin)."""
    packed = {}
    for kind in ("step", "prefill"):
        routed = onnx.load(str(float_exports["edgelin"] / f"{kind}.onnx"), load_external_data=False)
        plain = onnx.load(str(float_exports["contrib"] / f"{kind}.onnx"), load_external_data=False)
        weights = {t.name: list(t.dims) for t in plain.graph.initializer if len(t.dims) == 2}
        products = [n for n in plain.graph.node if n.op_type == "MatMul" and n.input[1] in weights]
        assert len(products) >= 6, kind  # per layer at least the input and output projections
        inits = {t.name: t for t in routed.graph.initializer}
        ours = [n for n in routed.graph.node if n.domain == ortops.DOMAIN and n.op_type == F32_OP]
        assert len(ours) == len(products), kind
        assert not any(n.op_type == "MatMul" and n.domain == "" and n.input[1] in inits for n in routed.graph.node)
        for node in ours:
            (n,) = [a.i for a in node.attribute if a.name == "n"]
            dims = list(inits[node.input[1]].dims)
            assert dims[0] == -(-n // 16) and dims[2] == 16 and inits[node.input[1]].data_type == TensorProto.FLOAT
        assert sorted([dims_k_n(inits, node) for node in ours]) == sorted(weights[n.input[1]] for n in products)
        assert f"{ortops.DOMAIN}::{F32_OP}" in {f"{f.domain}::{f.name}" for f in routed.functions}
        places = [{e.key: e.value for e in inits[node.input[1]].external_data} for node in ours]
        packed[kind] = {(place["location"], place["offset"]) for place in places}
    assert packed["step"] == packed["prefill"]  # the same bytes of weights.bin
    manifest = json.loads((float_exports["edgelin"] / "manifest.json").read_text())
    step = onnx.load(str(float_exports["edgelin"] / "step.onnx"), load_external_data=False)
    assert manifest["extra"]["ort_ops"]["step_nodes"] == sum(n.domain == ortops.DOMAIN for n in step.graph.node)


def dims_k_n(inits: dict, node) -> list[int]:
    """[K, N] of a MatMulF32 node: its packed weight's K and its attribute n."""
    return [inits[node.input[1]].dims[1], next(a.i for a in node.attribute if a.name == "n")]


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
