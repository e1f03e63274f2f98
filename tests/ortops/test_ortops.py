"""edgelin's ONNX Runtime operator library (edgelin.ortops) and --step-ops edgelin.

The chain of trust: the C kernel inside an ONNX Runtime session == ONNX Runtime's own com.microsoft::MatMulNBits
on the same packed weights (an independent implementation: MLAS), at odd shapes and batch sizes; the export's
function fallback == that op bit for bit; a --step-ops edgelin export validates with and without the library, and
its step rollout with the library == without it. Needs a C compiler (the library builds at first use)."""

from __future__ import annotations

import ctypes
import os
import shutil
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from edgelin import ortops
from edgelin.export.onnx.kernels import CONV, MATMUL, RECURRENCE, fallback_function
from edgelin.runtime import open_runner, runner_label
from edgelin.replay import replay
from helpers import assert_close, rms_rel, run_state_in_place
from ortops_fixtures import activations, gdn_exports, kernel_path, library, random_codes, rollouts  # noqa: F401
from ortops_fixtures import c_kernel as _c_kernel
from ortops_fixtures import session as _session

pytestmark = pytest.mark.skipif(ortops._compiler() is None, reason="no C compiler: edgelin.ortops builds with one")

# The kernel and MLAS both round the activations to int8 per 32-block (the same bytes); what is left is the
# order of float sums: measured <= 5e-7 max-relative on these shapes. Bound ~20x that.
KERNEL_RTOL = 1e-5
# A whole step's logits when one int8 activation rounds to the neighbouring level (measured 6e-3; the test below)
ROUNDING_FLIP_RTOL = 2e-2


def _onnxruntime_core() -> ctypes.CDLL:
    capi = Path(ort.__file__).parent / "capi"
    (core,) = [p for p in capi.iterdir() if p.name.startswith("libonnxruntime.so")]
    return ctypes.CDLL(str(core))


def test_the_abi_slots_reach_the_installed_runtime(library):
    """ort_abi.h's slot numbers, read against the runtime installed here: a status made through slot
    CreateStatus comes back through GetErrorMessage with its text (a shifted table would not), and a runtime
    this new has KernelContext_ParallelFor."""
    core = _onnxruntime_core()
    core.OrtGetApiBase.restype = ctypes.c_void_p
    check = ctypes.CDLL(str(library)).edgelin_ort_abi_check
    out = ctypes.create_string_buffer(64)
    has_parallel_for = check(ctypes.c_void_p(core.OrtGetApiBase()), out, 64)
    assert out.value == b"edgelin abi check"
    assert has_parallel_for == 1


def _quantized_matmul(K: int, N: int, seed: int, bits: int = 4, block: int = 32) -> onnx.ModelProto:
    """A [m, K] x [K, N] MatMul quantised by ONNX Runtime's own tool (`bits`, `block`, asymmetric, level 4)."""
    from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

    weight = (np.random.default_rng(seed).standard_normal((K, N)) * 0.05).astype(np.float32)
    graph = helper.make_graph([helper.make_node("MatMul", ["x", "W"], ["y"])], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["m", K])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["m", N])],
                              [numpy_helper.from_array(weight, "W")])
    tool = MatMulNBitsQuantizer(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)]), bits=bits,
                                block_size=block, is_symmetric=False, accuracy_level=4)
    tool.process()
    return tool.model.model


def _routed(model: onnx.ModelProto) -> onnx.ModelProto:
    routed = onnx.ModelProto()
    routed.CopyFrom(model)
    for node in routed.graph.node:
        if node.op_type == "MatMulNBits":
            node.domain = ortops.DOMAIN
    routed.opset_import.append(helper.make_opsetid(ortops.DOMAIN, 1))
    routed.functions.append(fallback_function(MATMUL, {"": 18}))
    return routed


# K: whole pairs of blocks, an odd block count (a lone last block), K not a multiple of 32 (padded); N: rows in
# fours and a remainder
SHAPES = [(384, 1676), (768, 37), (96, 5), (100, 70), (64, 1)]


@pytest.mark.parametrize("K,N", SHAPES, ids=[f"K{k}-N{n}" for k, n in SHAPES])
@pytest.mark.parametrize("rows", [1, 3, 9], ids=["M1", "M3", "M9"])  # M9: the token path's fours and a remainder
@pytest.mark.parametrize("threads", [1, 2], ids=["t1", "t2"])
@pytest.mark.parametrize("bits", [4, 8], ids=["int4", "int8"])
def test_kernel_matches_onnxruntimes_matmulnbits(library, K, N, rows, threads, bits, kernel_path):
    model = _quantized_matmul(K, N, seed=K + N, bits=bits)
    x = np.random.default_rng(rows).standard_normal((rows, K)).astype(np.float32)
    want = _session(model).run(None, {"x": x})[0]
    got = _session(_routed(model), library, threads).run(None, {"x": x})[0]
    assert_close(got, want, KERNEL_RTOL, f"{bits} bits, K={K} N={N} M={rows}")
    assert np.abs(got - want).max() <= KERNEL_RTOL * np.abs(want).max()


@pytest.mark.parametrize("bits", [4, 8], ids=["int4", "int8"])
def test_the_function_fallback_is_onnxruntimes_op_bit_for_bit(bits):
    """Without the library the routed node runs its function body: ONNX Runtime's own kernel, same bytes."""
    model = _quantized_matmul(384, 200, seed=1, bits=bits)
    x = np.random.default_rng(0).standard_normal((2, 384)).astype(np.float32)
    assert np.array_equal(_session(_routed(model)).run(None, {"x": x})[0], _session(model).run(None, {"x": x})[0])


def test_a_node_the_kernel_does_not_take_is_refused_in_one_line(library):
    """A node of 16-weight blocks routed by hand: the library refuses it when the session is made, saying what it
    takes."""
    model = _routed(_quantized_matmul(64, 8, seed=2, bits=4, block=16))
    with pytest.raises(Exception, match="only bits 4 or 8 with block_size 32"):
        _session(model, library).run(None, {"x": np.ones((1, 64), np.float32)})


# K: quads of blocks (the AVX-512 path's 4-block steps), a pair left after the quads, an odd block count, K not a
# multiple of 32 (padded)
@pytest.mark.parametrize("K", [384, 448, 352, 100], ids=["K384", "K448-quad-and-pair", "K352-odd-blocks",
                                                         "K100-padded"])
@pytest.mark.parametrize("zero_points", [True, False], ids=["zero-points", "default"])
@pytest.mark.parametrize("path", ["avx512-vnni", "avx2"])
@pytest.mark.parametrize("bits", [4, 8], ids=["int4", "int8"])
def test_the_quantized_paths_agree(library, K, zero_points, path, bits):
    """The AVX2 and AVX-512 VNNI paths each quantise the activations to the portable path's bytes and give its
    products (to float sum order); and the portable products equal those of the dequantised weights, (q - zero
    point) x scale (4 bits: codes and zero points two per byte, default 8; 8 bits: one per byte, default 128),
    with those int8 activations in float64."""
    lib = _c_kernel(library)
    lib.edgelin_q4_path.restype = ctypes.c_char_p
    if lib.edgelin_kernel_path() != b"avx2":
        pytest.skip("this CPU has no AVX2: only the portable path runs here")
    lib.edgelin_use_avx512(int(path == "avx512-vnni"))
    if lib.edgelin_q4_path().decode() != path:
        lib.edgelin_use_avx512(1)
        pytest.skip("this CPU has no AVX-512 VNNI (test ...-avx2 covers its path)")
    quantize, rows = (lib.edgelin_q8_quantize, lib.edgelin_q8_rows) if bits == 8 else \
        (lib.edgelin_q4_quantize, lib.edgelin_q4_rows)
    rng = np.random.default_rng(K + bits)
    N = 45
    weights, scales, points, dequantised = random_codes(rng, N, K, bits, zero_points)
    x = rng.standard_normal(K).astype(np.float32)
    size = lib.edgelin_q4_scratch_bytes(K)
    results = {}
    for portable in (0, 1):
        lib.edgelin_use_portable(portable)
        scratch, y = np.full(size, 0xAB, np.uint8), np.empty(N, np.float32)  # garbage in the scratch
        quantize(x.ctypes.data, K, scratch.ctypes.data)
        rows(scratch.ctypes.data, K, weights.ctypes.data, scales.ctypes.data,
             points.ctypes.data if zero_points else None, 0, N, y.ctypes.data)
        results[lib.edgelin_q4_path().decode()] = (scratch, y)
    lib.edgelin_use_portable(0)
    lib.edgelin_use_avx512(1)
    assert sorted(results) == sorted([path, "portable"])
    (s_path, y_path), (s_portable, y_portable) = results[path], results["portable"]
    assert np.array_equal(s_path, s_portable)
    assert_close(y_path, y_portable, 1e-6, f"{path} vs portable")
    want = np.einsum("nbj,bj->n", dequantised, activations(s_portable, K, bits))
    assert_close(y_portable, want, 1e-6, "portable vs float64")


# ---- ai.edgelin::CausalConvWithState ------------------------------------------------------------------------
def _conv_model(channels: int, width: int, bias: bool, domain: str) -> onnx.ModelProto:
    node = helper.make_node(CONV.name, ["x", "w", "b" if bias else "", "past"], ["y", "present"], domain=domain,
                            activation="silu", ndim=1)
    graph = helper.make_graph([node], "conv", [
        helper.make_tensor_value_info("x", TensorProto.FLOAT, ["B", channels, "T"]),
        helper.make_tensor_value_info("w", TensorProto.FLOAT, [channels, 1, width]),
        helper.make_tensor_value_info("b", TensorProto.FLOAT, [channels]),
        helper.make_tensor_value_info("past", TensorProto.FLOAT, ["B", channels, width - 1])], [
        helper.make_tensor_value_info("y", TensorProto.FLOAT, None),
        helper.make_tensor_value_info("present", TensorProto.FLOAT, None)])
    if not bias:
        del graph.input[2]
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18), helper.make_opsetid("com.microsoft", 1),
                                                    helper.make_opsetid(ortops.DOMAIN, 1)])
    if domain == ortops.DOMAIN:
        model.functions.append(fallback_function(CONV, {"": 18}))
    return model


CONVS = [(1, 896, 4, 1, True), (3, 37, 4, 1, True), (2, 20, 2, 5, False), (1, 9, 4, 70, True)]


@pytest.mark.parametrize("batch,channels,width,steps,bias", CONVS,
                         ids=[f"B{b}-C{c}-W{w}-T{t}-{'bias' if bias else 'nobias'}" for b, c, w, t, bias in CONVS])
def test_conv_matches_onnxruntimes_causal_conv(library, batch, channels, width, steps, bias, kernel_path):
    rng = np.random.default_rng(channels + steps)
    feeds = {"x": rng.standard_normal((batch, channels, steps)).astype(np.float32) * 3,
             "w": rng.standard_normal((channels, 1, width)).astype(np.float32),
             "past": rng.standard_normal((batch, channels, width - 1)).astype(np.float32)}
    if bias:
        feeds["b"] = rng.standard_normal(channels).astype(np.float32)
    want = _session(_conv_model(channels, width, bias, "com.microsoft")).run(None, feeds)
    fallback = _session(_conv_model(channels, width, bias, ortops.DOMAIN)).run(None, feeds)
    got = _session(_conv_model(channels, width, bias, ortops.DOMAIN), library).run(None, feeds)
    assert all(np.array_equal(a, b) for a, b in zip(fallback, want))
    assert np.array_equal(got[1], want[1])  # the shifted window: copied values
    assert_close(got[0], want[0], 1e-6, "conv output")  # the SiLU's exp: a polynomial here
    assert np.abs(got[0] - want[0]).max() <= 1e-6 * np.abs(want[0]).max()


def test_conv_updates_its_state_in_place(library, kernel_path):
    """past and present bound to one buffer (as the runner binds them): the same outputs as two buffers."""
    rng = np.random.default_rng(7)
    feeds = {"x": rng.standard_normal((2, 64, 1)), "w": rng.standard_normal((64, 1, 4)), "b": rng.standard_normal(64),
             "past": rng.standard_normal((2, 64, 3))}
    feeds = {name: value.astype(np.float32) for name, value in feeds.items()}
    session = _session(_conv_model(64, 4, True, ortops.DOMAIN), library)
    want_y, want_state = session.run(None, feeds)
    got_y, got_state = run_state_in_place(session, feeds, "y")
    assert np.array_equal(got_y, want_y) and np.array_equal(got_state, want_state)


def test_conv_refuses_what_it_does_not_compute(library):
    model = _conv_model(8, 4, True, ortops.DOMAIN)
    model.graph.node[0].attribute[0].s = b"none"
    with pytest.raises(Exception, match="only ndim 1 with activation silu"):
        _session(model, library)


# ---- ai.edgelin::LinearAttention ----------------------------------------------------------------------------
def _recurrence_model(rule: str, q_heads: int, heads: int, dk: int, dv: int, per_key: bool, domain: str):
    gated, delta = rule in ("gated", "gated_delta"), rule in ("delta", "gated_delta")
    names = ["q", "k", "v", "past", "g" if gated else "", "beta" if delta else ""]
    while not names[-1]:
        names.pop()
    node = helper.make_node(RECURRENCE.name, names, ["o", "present"], domain=domain, update_rule=rule,
                            q_num_heads=q_heads, kv_num_heads=heads, scale=0.5)
    shapes = {"q": ["B", "T", q_heads * dk], "k": ["B", "T", heads * dk], "v": ["B", "T", heads * dv],
              "past": ["B", heads, dk, dv], "g": ["B", "T", heads * (dk if per_key else 1)], "beta": ["B", "T", heads]}
    graph = helper.make_graph([node], "recurrence",
                              [helper.make_tensor_value_info(n, TensorProto.FLOAT, shapes[n]) for n in names if n],
                              [helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in ("o", "present")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18), helper.make_opsetid("com.microsoft", 1),
                                                    helper.make_opsetid(ortops.DOMAIN, 1)])
    if domain == ortops.DOMAIN:
        model.functions.append(fallback_function(RECURRENCE, {"": 18}))
    return model, [n for n in names if n]


RECURRENCES = [(rule, per_key, q_heads, batch, steps) for rule in ("linear", "gated", "delta", "gated_delta")
               for per_key in ((False, True) if "gated" in rule else (False,))
               for q_heads, batch, steps in ((1, 1, 1), (2, 3, 3))]


@pytest.mark.parametrize("rule,per_key,q_heads,batch,steps", RECURRENCES, ids=[
    f"{r}-{'per_key' if pk else 'per_head'}-Hq{hq}-B{b}-T{t}" for r, pk, hq, b, t in RECURRENCES])
@pytest.mark.parametrize("threads", [1, 2], ids=["t1", "t2"])
def test_recurrence_matches_onnxruntimes_linear_attention(library, rule, per_key, q_heads, batch, steps, threads,
                                                          kernel_path):
    heads, dk, dv = 6, 16, 24
    rng = np.random.default_rng(len(rule) + 10 * q_heads + steps)
    data = {"q": rng.standard_normal((batch, steps, q_heads * dk)), "k": rng.standard_normal((batch, steps, heads * dk)) / 4,
            "v": rng.standard_normal((batch, steps, heads * dv)), "past": rng.standard_normal((batch, heads, dk, dv)),
            "g": -rng.uniform(0.01, 1.0, (batch, steps, heads * (dk if per_key else 1))),
            "beta": rng.uniform(0.1, 0.9, (batch, steps, heads))}
    runs = {}
    for name, domain, lib in (("ort", "com.microsoft", None), ("fallback", ortops.DOMAIN, None),
                              ("edgelin", ortops.DOMAIN, library)):
        model, inputs = _recurrence_model(rule, q_heads, heads, dk, dv, per_key, domain)
        runs[name] = _session(model, lib, threads).run(None, {n: data[n].astype(np.float32) for n in inputs})
    assert all(np.array_equal(a, b) for a, b in zip(runs["fallback"], runs["ort"]))
    for got, want, what in zip(runs["edgelin"], runs["ort"], ("output", "state")):
        assert_close(got, want, 1e-6, f"{rule} {what}")
        assert np.abs(got - want).max() <= 2e-6 * np.abs(want).max()


@pytest.mark.parametrize("rule", ["gated", "gated_delta"])
def test_recurrence_updates_its_state_in_place(library, rule, kernel_path):
    model, inputs = _recurrence_model(rule, 1, 4, 8, 16, True, ortops.DOMAIN)
    rng = np.random.default_rng(3)
    shapes = {"q": (2, 1, 8), "k": (2, 1, 32), "v": (2, 1, 64), "past": (2, 4, 8, 16), "g": (2, 1, 32), "beta": (2, 1, 4)}
    feeds = {n: (rng.standard_normal(shapes[n]) * (0.1 if n == "g" else 1)).astype(np.float32) for n in inputs}
    feeds["g"] = -np.abs(feeds["g"])
    session = _session(model, library)
    want_o, want_state = session.run(None, feeds)
    got_o, got_state = run_state_in_place(session, feeds, "o")
    assert np.array_equal(got_o, want_o) and np.array_equal(got_state, want_state)


# ---- --step-ops edgelin ---------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def exports(tmp_path_factory) -> dict[str, Path]:
    """ortops_fixtures.gdn_checkpoint (hidden 96: three 32-blocks per row, the lone-block path), block 32: int4 and
    int8 with --step-ops edgelin and contrib; int4 with its embedding table and LM head at 8 bits
    (--embeddings-bits 8); float32 (contrib), the quantised rollouts' reference."""
    return gdn_exports(tmp_path_factory.mktemp("step-ops-edgelin"), {
        "edgelin": ("edgelin", "int4"), "contrib": ("contrib", "int4"), "edgelin-int8": ("edgelin", "int8"),
        "contrib-int8": ("contrib", "int8"), "edgelin-int4-e8": ("edgelin", "int4", {"embedding_bits": 8}),
        "float": ("contrib", None)})


def _quantized(exports: dict[str, Path], bits: int) -> dict[str, Path]:
    """The fixture's names for one precision: "edgelin" and "contrib" are its two exports."""
    suffix = "" if bits == 4 else "-int8"
    return {"edgelin": exports["edgelin" + suffix], "contrib": exports["contrib" + suffix], "float": exports["float"]}


@pytest.mark.parametrize("bits", [4, 8], ids=["int4", "int8"])
def test_the_export_routes_every_quantized_step_product_and_conv_and_only_those(exports, bits):
    """Each Gated DeltaNet recurrence arrives fused with what feeds it (GatedDeltaRecurrence, test_ortops_gdn.py)
    and its gated output norm as one GatedRmsNorm; each layer's gated MLP as one SiluGate (test_ortops_mlp.py)."""
    exports = _quantized(exports, bits)
    routed = onnx.load(str(exports["edgelin"] / "step.onnx"), load_external_data=False)
    plain = onnx.load(str(exports["contrib"] / "step.onnx"), load_external_data=False)
    products = sum(n.op_type == "MatMulNBits" for n in plain.graph.node)
    convs = sum(n.op_type == "CausalConvWithState" for n in plain.graph.node)
    recurrences = sum(n.op_type == "LinearAttention" for n in plain.graph.node)
    assert products > 0 and convs > 0 and recurrences > 0
    assert {helper.get_attribute_value(a) for n in plain.graph.node for a in n.attribute
            if n.op_type == "MatMulNBits" and a.name == "bits"} == {bits}
    mlps = 3  # ortops_fixtures.gdn_checkpoint: three layers, each with a gated MLP
    fused = (("GatedDeltaRecurrence", recurrences), ("GatedRmsNorm", recurrences), ("SiluGate", mlps))
    for op, count in (("MatMulNBits", products), ("CausalConvWithState", convs), *fused):
        assert sum(n.domain == ortops.DOMAIN and n.op_type == op for n in routed.graph.node) == count
    assert not any(n.op_type == "LinearAttention" for n in routed.graph.node)
    assert sorted(f"{f.domain}::{f.name}" for f in routed.functions) == [
        f"{ortops.DOMAIN}::{op}" for op in ("CausalConvWithState", "GatedDeltaRecurrence", "GatedRmsNorm",
                                            "MatMulNBits", "SiluGate")]
    # the prefill: its quantised products only (each of them), with their function
    prefill = onnx.load(str(exports["edgelin"] / "prefill.onnx"), load_external_data=False)
    plain_prefill = onnx.load(str(exports["contrib"] / "prefill.onnx"), load_external_data=False)
    prefill_products = sum(n.op_type == "MatMulNBits" for n in plain_prefill.graph.node)
    assert prefill_products == products
    assert [n.op_type for n in prefill.graph.node if n.domain == ortops.DOMAIN] == ["MatMulNBits"] * products
    assert not any(n.op_type == "MatMulNBits" and n.domain == "com.microsoft" for n in prefill.graph.node)
    assert [f"{f.domain}::{f.name}" for f in prefill.functions] == [f"{ortops.DOMAIN}::MatMulNBits"]
    import json

    manifest = json.loads((exports["edgelin"] / "manifest.json").read_text())
    assert manifest["extra"]["ort_ops"] == {"library": "edgelin.ortops", "domain": ortops.DOMAIN,
                                            "step_nodes": products + convs + 2 * recurrences + mlps,
                                            "prefill_nodes": products, "packed_products": 0}
    assert "ort_ops" not in json.loads((exports["contrib"] / "manifest.json").read_text())["extra"]


@pytest.mark.parametrize("setting", ["library", "off"])
@pytest.mark.parametrize("bits", [4, 8], ids=["int4", "int8"])
def test_with_the_library_the_quantized_graphs_share_one_mapping_of_the_weights(exports, library, setting, bits,
                                                                                 monkeypatch):
    """Every 4-bit or 8-bit product of both graphs is the library's: no prepacked private copies, and both sessions
    get the weights as views of one read-only mapping of weights.bin. Without the library ONNX Runtime prepacks,
    as before."""
    from edgelin.export.onnx.runner import PREPACK_ENV

    monkeypatch.delenv(PREPACK_ENV, raising=False)
    monkeypatch.setenv(ortops.ENV, str(library) if setting == "library" else "0")
    if setting == "library" and ortops.kernel_path(library) == "none":
        pytest.skip("this CPU has no AVX2: the library registers no kernels, so ONNX Runtime prepacks as before")
    exports = _quantized(exports, bits)
    runner = open_runner(exports["edgelin"], threads=1)
    if setting == "off":
        assert runner.prepack and runner.weights is None
        return
    assert not runner.prepack and runner.weights is not None
    prefill = onnx.load(str(exports["edgelin"] / "prefill.onnx"), load_external_data=False)
    weights = {n.input[1] for n in prefill.graph.node if n.op_type == "MatMulNBits"}
    given = {name: value.data_ptr() for name, value in runner.shared["prefill"]}
    base = runner.weights.ctypes.data
    assert weights <= set(given) and all(base <= given[w] < base + runner.weights.size for w in weights)
    # the packed weights of the two graphs (named apart by each trace): the same pages
    assert {given[w] for w in weights} <= {value.data_ptr() for _, value in runner.shared["step"]}


@pytest.mark.parametrize("setting", ["library", "off"])
@pytest.mark.parametrize("bits", [4, 8], ids=["int4", "int8"])
def test_a_step_ops_edgelin_export_validates_with_and_without_the_library(exports, library, setting, bits,
                                                                          monkeypatch):
    monkeypatch.setenv(ortops.ENV, str(library) if setting == "library" else "0")
    report = replay(_quantized(exports, bits)["edgelin"])
    assert report.passed, (report.failures, report.quality_failures)
    if setting == "library":
        assert report.runner == f"onnxruntime + edgelin ops ({_c_kernel(library).edgelin_kernel_path().decode()})"
    else:
        assert report.runner.startswith("onnxruntime (edgelin ops not loaded: EDGELIN_ORT_OPS=0")


@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("bits", [4, 8], ids=["int4", "int8"])
def test_the_step_rollout_with_the_library_matches_onnxruntimes_kernels(exports, library, batch, bits, monkeypatch):
    """30 teacher-forced steps after an 11-token prefill, library vs function fallback vs a contrib export.

    The fused Gated DeltaNet ops compute the float32 path in another order (~1e-7 apart, tests/ortops/test_ortops_gdn.py),
    and a 4-bit product rounds its input to int8 per block: where a value sits on a rounding boundary the two round
    it to neighbouring levels, and a level's worth enters the logits (and the recurrent state, for later steps).
    Measured here: steps at 1.7-3.3e-7 until the first such flip, then up to 6.3e-3; the export's own int4 error
    against the float export is ~0.1. So the library's int4 rollout must be as accurate as ONNX Runtime's against
    the float export, and never a flip's worth away from it. The same for int8: measured per step at most 3.6e-7
    (batch 1) and 5.4e-3 (batch 3, a flip) from ONNX Runtime's, 0.0176-0.0187 from the float export."""
    exports = _quantized(exports, bits)
    logits = rollouts(exports, library, batch, 1, monkeypatch)
    assert np.array_equal(logits["fallback"], logits["contrib"])
    floats = rollouts({"edgelin": exports["float"], "contrib": exports["float"]}, library, batch, 1, monkeypatch)
    errors = [rms_rel(got, want) for got, want in zip(logits["library"], logits["contrib"])]
    assert max(errors) <= ROUNDING_FLIP_RTOL, f"batch {batch}: per-step {errors}"
    mine, theirs = rms_rel(logits["library"], floats["contrib"]), rms_rel(logits["contrib"], floats["contrib"])
    low, high = (0.02, 0.5) if bits == 4 else (1e-3, 0.05)
    assert low < theirs < high and mine <= 1.05 * theirs, (mine, theirs)


def test_int4_with_8bit_embeddings_runs_both_widths_on_the_library(exports, library, monkeypatch):
    """--embeddings-bits 8: the table's lookup and the LM head at 8 bits, every other product at 4, all of them the
    library's in both graphs (one mapped copy: no prepacking), validated, and closer to the float export than plain
    int4 (measured rms-relative over the rollout: 0.144 / 0.167 at batch 1 / 3, plain int4 0.226 / 0.223)."""
    import json

    from edgelin.export.quantize import HEAD_KEY

    folder = exports["edgelin-int4-e8"]
    entry = json.loads((folder / "manifest.json").read_text())["extra"]
    assert (entry["quantization"]["bits"], entry["quantization"]["embedding_bits"]) == (4, 8)
    assert entry["ort_ops"]["packed_products"] == 0
    for kind in ("step", "prefill"):
        graph = onnx.load(str(folder / f"{kind}.onnx"), load_external_data=False).graph
        bits = {(n.op_type, any(p.key == HEAD_KEY for p in n.metadata_props)):
                {helper.get_attribute_value(a) for a in n.attribute if a.name == "bits"}
                for n in graph.node if n.op_type in ("MatMulNBits", "GatherBlockQuantized")}
        assert bits == {("MatMulNBits", False): {4}, ("MatMulNBits", True): {8}, ("GatherBlockQuantized", False): {8}}
        assert all(n.domain == ortops.DOMAIN for n in graph.node if n.op_type == "MatMulNBits")
    monkeypatch.setenv(ortops.ENV, str(library))
    if ortops.kernel_path(library) != "none":
        assert not open_runner(folder, threads=1).prepack
    report = replay(folder)
    assert report.passed, (report.failures, report.quality_failures)
    floats = rollouts({"edgelin": exports["float"], "contrib": exports["float"]}, library, 3, 1, monkeypatch)
    e8 = rollouts({"edgelin": folder, "contrib": folder}, library, 3, 1, monkeypatch)
    plain = rollouts(exports, library, 3, 1, monkeypatch)
    assert rms_rel(e8["library"], floats["contrib"]) < 0.9 * rms_rel(plain["library"], floats["contrib"])


def test_without_a_compiler_the_runner_says_so_and_runs_onnxruntimes_kernels(exports, monkeypatch, tmp_path):
    monkeypatch.delenv(ortops.ENV, raising=False)
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setattr(ortops.packaged, "find", lambda *args, **kwargs: None)  # a checkout: none packaged
    runner = open_runner(exports["edgelin"], threads=1)
    assert runner_label(runner).startswith("onnxruntime (edgelin ops not loaded: could not build it:")
    assert not list((tmp_path / "cache").rglob("*.so")) and not list((tmp_path / "cache").rglob("*.tmp"))


def test_a_failed_build_leaves_no_partial_library(tmp_path, monkeypatch):
    broken = tmp_path / "cc"
    broken.write_text("#!/bin/sh\necho 'half a library' > \"$(echo \"$@\" | sed 's/.*-o \\([^ ]*\\).*/\\1/')\"\n"
                      "echo 'cc: error: out of cheese' >&2\nexit 1\n")
    broken.chmod(0o755)
    monkeypatch.setenv("CC", str(broken))
    with pytest.raises(RuntimeError, match="out of cheese"):
        ortops.build(tmp_path / "out" / ortops.LIBRARY)
    assert os.listdir(tmp_path / "out") == []


def test_a_library_path_that_is_not_there_is_reported(monkeypatch, tmp_path):
    monkeypatch.setenv(ortops.ENV, str(tmp_path / "missing.so"))
    found = ortops.locate()
    assert found.path is None and "no such file" in found.reason


def test_the_sources_build_with_a_plain_c_compiler_and_strict_warnings(tmp_path):
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no cc/gcc on PATH")
    import subprocess

    sources = [str(Path(ortops.__file__).parent / s) for s in ortops.SOURCES]
    done = subprocess.run([cc, "-std=gnu11", "-Wall", "-Wextra", "-Werror", "-O2", "-fPIC", "-shared",
                           "-o", str(tmp_path / "lib.so"), *sources, "-lm"], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
