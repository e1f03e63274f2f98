"""--quantize fp16: float16 weights, float32 arithmetic, through ai.edgelin::MatMulF16 (edgelin/ortops/f16_gemm.c,
ops_matmul.c; edgelin.export.quantize's float16 pass).

The chain of trust: the kernel inside an ONNX Runtime session == a float64 product of the same (float16-rounded)
numbers, and == the op's function body (Cast + ONNX Runtime's MatMul), at shapes that take every path: decoding
(1-5 rows of A: slices of weight rows, whole passes of eight and a remainder) and prefill pieces (6 rows and more:
register tiles of 6 tokens x 16 columns, a partial last tile of tokens and of columns, K over two packed panels of
256 rows), one and two threads, the AVX2 and the portable paths; an fp16 export stores every matmul weight as
float16 (weights.bin about half the float32 export's), records its quantisation, validates with and without the
library, and its step rollout with the library == without it."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from edgelin import ortops
from edgelin.artifact.quantized import F16_OP
from edgelin.environment import environment
from edgelin.export.quantize import _float16_weights
from edgelin.replay import replay
from helpers import assert_close
from ortops_fixtures import gdn_exports, kernel_path, library, rollouts, session  # noqa: F401 (fixtures)

pytestmark = pytest.mark.skipif(ortops._compiler() is None, reason="no C compiler: edgelin.ortops builds with one")

# float32 sums of float16-exact products in another order than float64's: measured <= 4e-7 RMS-relative on these
# shapes (both paths); bound ~25x.
PRODUCT_RTOL = 1e-5

# K: past one 256-row panel (300), a 64-row task slice plus one (65), not a multiple of 8 (7); N: 16k + 12 (the
# Mamba2 input projection's 1676), a multiple of 16 (384), below 16 (9), 1
SHAPES = [(384, 1676), (300, 384), (65, 37), (7, 9), (33, 1)]
# rows of A: decoding (1, 3), a prefill piece of exactly one token tile (6), of tiles and a remainder of 2 (2 x 7)
# and of 5 (11)
A_SHAPES = [(1, 1), (3, 1), (1, 6), (2, 7), (1, 11)]


def _f16_matmul(K: int, N: int) -> tuple[onnx.ModelProto, np.ndarray]:
    """A MatMul graph on a [K, N] float32 weight after the float16 pass, and the weight rounded to float16 [K, N];
    checks that the pass stored it in column panels: [ceil(N / 16), K, 16], panel p holding columns 16p.., zeros
    past N."""
    weight = (np.random.default_rng(K * N).standard_normal((K, N)) * 0.05).astype(np.float32)
    graph = helper.make_graph([helper.make_node("MatMul", ["x", "W"], ["y"])], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["b", "t", K])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
                              [numpy_helper.from_array(weight, "W")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    _float16_weights(model, embeddings=True)
    (node,) = model.graph.node
    (half,) = model.graph.initializer
    assert (node.op_type, node.domain, half.data_type) == (F16_OP, ortops.DOMAIN, TensorProto.FLOAT16)
    assert [(a.name, a.i) for a in node.attribute] == [("n", N)]
    panels, rounded = numpy_helper.to_array(half), weight.astype(np.float16)
    assert panels.shape == (-(-N // 16), K, 16)
    for p in range(panels.shape[0]):
        columns = rounded[:, 16 * p:16 * p + 16]
        np.testing.assert_array_equal(panels[p, :, :columns.shape[1]], columns)
        assert not panels[p, :, columns.shape[1]:].any()
    return model, rounded


@pytest.mark.parametrize("K,N", SHAPES, ids=[f"K{k}-N{n}" for k, n in SHAPES])
@pytest.mark.parametrize("a_shape", A_SHAPES, ids=[f"{b}x{t}" for b, t in A_SHAPES])
@pytest.mark.parametrize("threads", [1, 2], ids=["t1", "t2"])
def test_the_product_matches_float64_and_its_function_body(library, K, N, a_shape, threads, kernel_path):
    model, half = _f16_matmul(K, N)
    x = np.random.default_rng(K + N).standard_normal((*a_shape, K)).astype(np.float32)
    got = session(model, library, threads).run(None, {"x": x})[0]
    assert got.shape == (*a_shape, N)
    assert_close(got, x.astype(np.float64) @ half.astype(np.float64), PRODUCT_RTOL, f"K={K} N={N} vs float64")
    assert_close(got, session(model).run(None, {"x": x})[0], PRODUCT_RTOL, f"K={K} N={N} vs the function body")


@pytest.mark.parametrize("a_shape", [(1, 1), (3, 1), (2, 7)], ids=["1x1", "3x1", "2x7"])
def test_a_weight_in_onnx_layout_still_runs(library, a_shape, kernel_path):
    """Exports made before the packed panels store MatMulF16's weight as ONNX's [K, N]; the library still takes it
    (slices of its rows for decoding, of its columns for a prefill piece)."""
    K, N = 300, 37
    half = (np.random.default_rng(5).standard_normal((K, N)) * 0.05).astype(np.float16)
    graph = helper.make_graph([helper.make_node(F16_OP, ["x", "W"], ["y"], domain=ortops.DOMAIN)], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["b", "t", K])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
                              [numpy_helper.from_array(half, "W")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18), helper.make_opsetid(ortops.DOMAIN, 1)])
    x = np.random.default_rng(6).standard_normal((*a_shape, K)).astype(np.float32)
    got = session(model, library, 2).run(None, {"x": x})[0]
    assert_close(got, x.astype(np.float64) @ half.astype(np.float64), PRODUCT_RTOL, f"{a_shape} vs float64")


def test_the_pass_converts_each_weight_once_and_leaves_other_graphs_alone():
    """Two MatMuls on one weight share one float16 copy; a MatMul of two activations and a float16 graph's MatMul
    (already float16: --precision fp16) stay ONNX's."""
    w = numpy_helper.from_array(np.ones((4, 3), np.float32), "W")
    nodes = [helper.make_node("MatMul", ["x", "W"], ["a"]), helper.make_node("MatMul", ["x", "W"], ["b"]),
             helper.make_node("MatMul", ["x", "v"], ["c"])]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info(n, TensorProto.FLOAT, [1, 4]) for n in "xv"],
                              [helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in "abc"], [w])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    _float16_weights(model, embeddings=True)
    assert [n.op_type for n in model.graph.node] == [F16_OP, F16_OP, "MatMul"]
    assert [t.name for t in model.graph.initializer] == ["W_f16p"]
    assert [f.name for f in model.functions] == [F16_OP]


@pytest.mark.parametrize("kv_dtype, want", [("float32", "fp32"), ("float16", "fp16")])
def test_float16_weights_take_fp32s_parity_threshold_unless_the_cache_is_float16(kv_dtype, want):
    """The parity reference carries the export's own float16 weights, so both sides compute in float32; a float16
    KV cache rounds what the reference keeps in float32 (Qwen3.5's fp16-cache export: 1.8e-3 of the keys' scale)."""
    from types import SimpleNamespace

    from edgelin.artifact.quality import precision_key, threshold_key

    manifest = SimpleNamespace(precision="fp32", kv_dtype=kv_dtype, state_inputs=[],
                               extra={"quantization": {"bits": 16, "block_size": None}})
    assert (precision_key(manifest), threshold_key(manifest)) == ("fp16", want)
    graph = SimpleNamespace(precision="fp16", kv_dtype=None, state_inputs=[], extra={})  # an fp16 graph: fp16's threshold
    assert threshold_key(graph) == "fp16"


@pytest.mark.parametrize("state_dtype, want", [("float32", "fp32"), ("float16", "fp16")])
def test_a_float16_state_under_float32_graphs_takes_fp16s_bounds(state_dtype, want):
    """Core AI's float16 model state under fp32 compute rounds what the reference keeps in float32 (1.4e-3..1.6e-3
    of the logits' scale on the tiny families, bench/coreai_families.py): fp16's threshold, not fp32's 1e-4."""
    from types import SimpleNamespace

    from edgelin.artifact.quality import precision_key, threshold_key

    manifest = SimpleNamespace(precision="fp32", kv_dtype=None, extra={},
                               state_inputs=[SimpleNamespace(dtype="float32"), SimpleNamespace(dtype=state_dtype)])
    assert (precision_key(manifest), threshold_key(manifest)) == (want, want)


@pytest.mark.parametrize("bits, block, want", [(8, 32, "int8-activations"), (4, 32, "int8-activations"),
                                               (8, None, "int8"), (4, None, "int4")])
def test_products_that_round_their_activations_take_one_threshold_whatever_the_weights_bits(bits, block, want):
    """The parity reference holds the export's own weights and rounds the activations as the products do: what is
    left is the activations' (a rounding tie tipped by float noise), the same at 8- and 4-bit weights. Weights
    quantised without that rounding (the manifest records no activation block: Core AI's) keep their bits' own."""
    from types import SimpleNamespace

    from edgelin.artifact.quality import precision_key, threshold_key
    from edgelin.artifact.reference_vectors import threshold_for

    entry = {"bits": bits, "block_size": 32, **({"activation_block": block} if block else {})}
    manifest = SimpleNamespace(precision="fp32", kv_dtype=None, state_inputs=[], extra={"quantization": entry})
    assert (precision_key(manifest), threshold_key(manifest)) == (f"int{bits}", want)
    assert threshold_for(want) == {"int8-activations": 0.25, "int8": 5e-2, "int4": 0.25}[want]


# ---- a --quantize fp16 export -----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def f16_exports(tmp_path_factory) -> dict[str, Path]:
    return gdn_exports(tmp_path_factory.mktemp("quantize-fp16"), {"edgelin": ("edgelin", "fp16"),
                                                                  "contrib": ("contrib", "fp16"),
                                                                  "fp32": ("edgelin", None)})


def test_the_export_stores_every_matmul_weight_as_float16(f16_exports):
    folder = f16_exports["edgelin"]
    for kind in ("step", "prefill"):
        proto = onnx.load(str(folder / f"{kind}.onnx"), load_external_data=False)
        inits = {t.name: t for t in proto.graph.initializer}
        products = [n for n in proto.graph.node if n.op_type in ("MatMul", F16_OP, "Gemm") and len(n.input) > 1
                    and n.input[1] in inits]
        assert len(products) >= 7 and all(n.op_type == F16_OP and n.domain == ortops.DOMAIN for n in products), kind
        assert all(inits[n.input[1]].data_type == TensorProto.FLOAT16 for n in products)
        gathers = [n for n in proto.graph.node if n.op_type == "Gather" and n.input[0] in inits]
        assert gathers and all(inits[n.input[0]].data_type == TensorProto.FLOAT16 for n in gathers)
    manifest = json.loads((folder / "manifest.json").read_text())
    quantization = manifest["extra"]["quantization"]
    assert (quantization["bits"], quantization["block_size"]) == (16, None)
    assert "lm_head" in quantization["matrices"] and "model.embed_tokens" in quantization["matrices"]
    assert manifest["extra"]["precision"]["quantized_weights"] == "fp16"
    assert manifest["extra"]["ort_ops"]["prefill_nodes"] >= 7 and manifest["extra"]["ort_ops"]["packed_products"] == 0
    half, full = ((f16_exports[k] / "weights.bin").stat().st_size for k in ("edgelin", "fp32"))
    assert 0.45 < half / full < 0.6, (half, full)  # float16 matrices; norms and convs stay float32
    # a result's environment block names the weights in words (it said "int16 (block None)" here)
    block = environment("bench", folder, "onnxruntime", 1, None, command="edgelin bench")
    assert (block["precision"], block["quantization"]) == ("fp32", "float16")
    assert environment("bench", f16_exports["fp32"], "onnxruntime", 1, None, command="x")["quantization"] is None


@pytest.mark.parametrize("setting", ["library", "off"])
def test_an_fp16_export_validates_with_and_without_the_library(f16_exports, library, setting, monkeypatch):
    monkeypatch.setenv(ortops.ENV, str(library) if setting == "library" else "0")
    report = replay(f16_exports["edgelin"])
    assert report.passed, (report.failures, report.quality_failures)
    # parity at fp32's threshold (the reference carries the export's own float16 weights), quality at fp16's bounds
    assert (report.precision, report.threshold) == ("fp16", 1e-4)


@pytest.mark.parametrize("batch", [1, 3])
def test_the_fp16_rollout_with_the_library_matches_the_function_bodies(f16_exports, library, batch, monkeypatch):
    """30 teacher-forced steps after an 11-token prefill (a prefill piece on the tiled path), at 2 threads."""
    logits = rollouts(f16_exports, library, batch, 2, monkeypatch)
    assert_close(logits["library"], logits["fallback"], PRODUCT_RTOL, f"batch {batch}")
    assert_close(logits["library"], logits["contrib"], PRODUCT_RTOL, f"batch {batch} vs the contrib export")
