"""edgelin.ortops' decode attention (ai.edgelin::GroupQueryAttention, the step over --kv-cache static's cache).

The chain of trust: the C kernel inside an ONNX Runtime session == ONNX Runtime's own
com.microsoft::GroupQueryAttention (an independent implementation) on the same cache, at grouped and ungrouped
heads, head sizes of one and more 64-column blocks, sequences of different lengths in one batch, more than one new
token, lengths past one piece of rows, both kernel paths and thread counts; written in place == two buffers; the
routed node's function fallback == ONNX Runtime's op bit for bit; the float16 kernel (--kv-dtype fp16) == ONNX
Runtime's float16 op to one fp16 rounding; a --kv-cache static export (float32 and float16 cache) routes its
step's attention and its rollout with the library == without it, and the float16 cache follows the float32 one."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

from edgelin import ortops
from edgelin.errors import EdgelinError
from edgelin.export.onnx.kernels import ATTENTION, fallback_function
from edgelin.export.onnx.options import OnnxOptions
from edgelin.export.pipeline import export_checkpoint
from edgelin.runtime import open_runner, prefill
from helpers import assert_close, qwen_attention_checkpoint
from ortops_fixtures import kernel_path, library, session  # noqa: F401 (fixtures)

pytestmark = pytest.mark.skipif(ortops._compiler() is None, reason="no C compiler: edgelin.ortops builds with one")

# Both sum the same float32 products in different orders (the softmax over thousands of rows): measured <= 4e-6
# max-relative at 32k rows, ~1e-6 RMS here. Bound ~10x that.
ATTENTION_RTOL = 1e-5
INPUTS = ["q", "k", "v", "past_key", "past_value", "seqlens", "total"]


def _attention_model(domain: str, heads: int, kv_heads: int, dim: int, **attributes) -> onnx.ModelProto:
    node = helper.make_node("GroupQueryAttention", INPUTS, ["out", "present_key", "present_value"], domain=domain,
                            num_heads=heads, kv_num_heads=kv_heads, scale=dim ** -0.5, do_rotary=0,
                            local_window_size=-1, **attributes)
    tensor = helper.make_tensor_value_info
    graph = helper.make_graph(
        [node], "attention",
        [tensor("q", TensorProto.FLOAT, ["B", "S", heads * dim]), tensor("k", TensorProto.FLOAT, ["B", "S", kv_heads * dim]),
         tensor("v", TensorProto.FLOAT, ["B", "S", kv_heads * dim]),
         tensor("past_key", TensorProto.FLOAT, ["B", kv_heads, "P", dim]),
         tensor("past_value", TensorProto.FLOAT, ["B", kv_heads, "P", dim]),
         tensor("seqlens", TensorProto.INT32, ["B"]), tensor("total", TensorProto.INT32, [1])],
        [tensor("out", TensorProto.FLOAT, ["B", "S", heads * dim]),
         tensor("present_key", TensorProto.FLOAT, ["B", kv_heads, "L", dim]),
         tensor("present_value", TensorProto.FLOAT, ["B", kv_heads, "L", dim])])
    opsets = [helper.make_opsetid("", 18), helper.make_opsetid("com.microsoft", 1)]
    model = helper.make_model(graph, opset_imports=opsets)
    if domain == ortops.DOMAIN:
        model.opset_import.append(helper.make_opsetid(ortops.DOMAIN, 1))
        model.functions.append(fallback_function(ATTENTION, {"": 18}))
    return model


def _feeds(batch: int, new: int, lengths: list[int], capacity: int, kv_heads: int, heads: int, dim: int, seed: int):
    """A cache of `capacity` rows per sequence whose first lengths[b] - new rows are filled, and `new` tokens."""
    rng = np.random.default_rng(seed)
    past = rng.standard_normal((2, batch, kv_heads, capacity, dim)).astype(np.float32)
    return {"q": rng.standard_normal((batch, new, heads * dim)).astype(np.float32),
            "k": rng.standard_normal((batch, new, kv_heads * dim)).astype(np.float32),
            "v": rng.standard_normal((batch, new, kv_heads * dim)).astype(np.float32),
            "past_key": past[0], "past_value": past[1],
            "seqlens": np.array([n - 1 for n in lengths], np.int32), "total": np.array([max(lengths)], np.int32)}


def _in_place(sess: ort.InferenceSession, feeds: dict) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """One run with each past bound as its present (the runner's static cache): (out, keys, values) after it."""
    caches = {name: ort.OrtValue.ortvalue_from_numpy(feeds[f"past_{name}"].copy()) for name in ("key", "value")}
    binding = sess.io_binding()
    for name in INPUTS[:3] + INPUTS[5:]:
        binding.bind_cpu_input(name, feeds[name])
    for name, value in caches.items():
        binding.bind_ortvalue_input(f"past_{name}", value)
    binding.bind_output("out")
    for name, value in caches.items():
        binding.bind_ortvalue_output(f"present_{name}", value)
    sess.run_with_iobinding(binding)
    return binding.copy_outputs_to_cpu()[0], caches["key"].numpy().copy(), caches["value"].numpy().copy()


def _valid_rows(cache: np.ndarray, lengths: list[int]) -> list[np.ndarray]:
    return [cache[b, :, :n] for b, n in enumerate(lengths)]


# (query heads, kv heads, head size; ONNX Runtime takes multiples of 8): grouped (Qwen3.5's 4 / 2 of 64), one kv
# head for 8 query heads of 16, ungrouped of 40 (5 lane groups), 72 (a second 64-column block of one group)
HEADS = [(4, 2, 64), (8, 1, 16), (3, 3, 40), (2, 1, 72)]
# (batch, new tokens, each sequence's length after them): lengths past a 4,096-row piece and 256-row chunks,
# unequal in one batch; three new tokens at once; a prompt into an empty past
CALLS = [(1, 1, [4501]), (3, 1, [4501, 257, 1]), (1, 3, [700]), (1, 5, [5])]


@pytest.mark.parametrize("heads,kv_heads,dim", HEADS, ids=[f"q{h}-kv{k}-d{d}" for h, k, d in HEADS])
@pytest.mark.parametrize("batch,new,lengths", CALLS, ids=["B1-S1", "B3-S1-unequal", "B1-S3", "prompt"])
@pytest.mark.parametrize("threads", [1, 2], ids=["t1", "t2"])
def test_attention_matches_onnxruntimes_group_query_attention(library, heads, kv_heads, dim, batch, new, lengths,
                                                             threads, kernel_path):
    capacity = 0 if lengths == [new] else max(lengths) + 3  # the prompt: no past rows at all
    feeds = _feeds(batch, new, lengths, capacity, kv_heads, heads, dim, seed=heads * dim + batch + new)
    want = session(_attention_model("com.microsoft", heads, kv_heads, dim)).run(None, feeds)
    mine = session(_attention_model(ortops.DOMAIN, heads, kv_heads, dim), library, threads)
    got = mine.run(None, feeds)
    what = f"{heads}/{kv_heads} heads of {dim}, lengths {lengths}, {new} new"
    assert_close(got[0], want[0], ATTENTION_RTOL, what)
    assert np.abs(got[0] - want[0]).max() <= ATTENTION_RTOL * np.abs(want[0]).max()
    for mine_cache, their_cache in zip(got[1:], want[1:]):  # the rows each sequence holds, exactly
        assert mine_cache.shape == their_cache.shape
        for a, b in zip(_valid_rows(mine_cache, lengths), _valid_rows(their_cache, lengths)):
            assert np.array_equal(a, b)
    if capacity:
        out, keys, values = _in_place(mine, feeds)
        assert np.array_equal(out, got[0])
        for a, b in zip(_valid_rows(keys, lengths) + _valid_rows(values, lengths),
                        _valid_rows(got[1], lengths) + _valid_rows(got[2], lengths)):
            assert np.array_equal(a, b)


def _half(model: onnx.ModelProto) -> onnx.ModelProto:
    """The same node on float16 tensors (the step graph of --kv-cache static --kv-dtype fp16)."""
    for value in [*model.graph.input[:5], *model.graph.output]:
        value.type.tensor_type.elem_type = TensorProto.FLOAT16
    return model


# One fp16 rounding of the output (2^-11 relative) on top of the float32 arithmetic both do: measured <= 2.9e-4
# max-relative against ONNX Runtime's float16 kernel (one ulp of a few outputs).
HALF_RTOL = 1e-3


@pytest.mark.parametrize("heads,kv_heads,dim", HEADS, ids=[f"q{h}-kv{k}-d{d}" for h, k, d in HEADS])
@pytest.mark.parametrize("batch,new,lengths", CALLS[:3], ids=["B1-S1", "B3-S1-unequal", "B1-S3"])
def test_the_float16_kernel_matches_onnxruntimes_float16_op(library, heads, kv_heads, dim, batch, new, lengths,
                                                           kernel_path):
    feeds = _feeds(batch, new, lengths, max(lengths) + 3, kv_heads, heads, dim, seed=heads * dim + batch + new)
    feeds = {name: (value.astype(np.float16) if value.dtype == np.float32 else value) for name, value in feeds.items()}
    want = session(_half(_attention_model("com.microsoft", heads, kv_heads, dim))).run(None, feeds)
    mine = session(_half(_attention_model(ortops.DOMAIN, heads, kv_heads, dim)), library)
    got = mine.run(None, feeds)
    assert got[0].dtype == np.float16
    what = f"float16, {heads}/{kv_heads} heads of {dim}, lengths {lengths}, {new} new"
    assert_close(got[0], want[0], HALF_RTOL, what)
    assert np.abs(got[0] - want[0].astype(np.float32)).max() <= HALF_RTOL * np.abs(want[0].astype(np.float32)).max()
    for mine_cache, their_cache in zip(got[1:], want[1:]):
        for a, b in zip(_valid_rows(mine_cache, lengths), _valid_rows(their_cache, lengths)):
            assert np.array_equal(a, b)
    out, keys, _ = _in_place(mine, feeds)
    assert np.array_equal(out, got[0]) and all(np.array_equal(a, b) for a, b in zip(
        _valid_rows(keys, lengths), _valid_rows(got[1], lengths)))


def test_the_function_fallback_is_onnxruntimes_op_bit_for_bit():
    feeds = _feeds(2, 1, [300, 41], 310, 2, 4, 64, seed=5)
    want = session(_attention_model("com.microsoft", 4, 2, 64)).run(None, feeds)
    got = session(_attention_model(ortops.DOMAIN, 4, 2, 64)).run(None, feeds)
    assert all(np.array_equal(a, b) for a, b in zip(got, want))


def test_a_node_the_kernel_does_not_take_is_refused_in_one_line(library):
    model = _attention_model(ortops.DOMAIN, 4, 2, 64, softcap=30.0)
    with pytest.raises(Exception, match="without rotary, local window, softcap or smooth softmax"):
        session(model, library).run(None, _feeds(1, 1, [10], 12, 2, 4, 64, seed=0))


def test_a_position_outside_the_cache_is_refused(library):
    feeds = _feeds(1, 1, [10], 12, 2, 4, 64, seed=0)
    feeds["seqlens"] = np.array([20], np.int32)  # past the total length
    with pytest.raises(Exception, match="seqlens_k must hold each sequence's last position"):
        session(_attention_model(ortops.DOMAIN, 4, 2, 64), library).run(None, feeds)


# ---- a --kv-cache static export -------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def static_exports(tmp_path_factory) -> dict[str, Path]:
    """Qwen3.5's attention layer (grouped kv heads, q/k norm, partial rotary, output gate) in a tiny hybrid, on a
    float32 and on a float16 static cache (--kv-dtype fp16)."""
    root = tmp_path_factory.mktemp("ortops-static")
    ckpt = qwen_attention_checkpoint(root / "ckpt", seed=1)
    return {dtype: export_checkpoint(ckpt, root / dtype, options=OnnxOptions(kv_cache="static", context=600,
                                                                              kv_dtype=dtype)).folder
            for dtype in ("fp32", "fp16")}


@pytest.mark.parametrize("dtype", ["fp32", "fp16"])
def test_the_static_export_routes_the_steps_attention_only(static_exports, dtype):
    step = onnx.load(str(static_exports[dtype] / "step.onnx"), load_external_data=False)
    prefill = onnx.load(str(static_exports[dtype] / "prefill.onnx"), load_external_data=False)
    assert [n.domain for n in step.graph.node if n.op_type == "GroupQueryAttention"] == [ortops.DOMAIN]
    assert [n.domain for n in prefill.graph.node if n.op_type == "GroupQueryAttention"] == ["com.microsoft"]
    cache = {TensorProto.FLOAT: "fp32", TensorProto.FLOAT16: "fp16"}
    kinds = {cache[i.type.tensor_type.elem_type] for i in step.graph.input if i.name.endswith((".key", ".value"))}
    assert kinds == {dtype}
    manifest = json.loads((static_exports[dtype] / "manifest.json").read_text())
    assert manifest["extra"]["kv_cache"]["dtype"] == {"fp32": "float32", "fp16": "float16"}[dtype]


@pytest.mark.parametrize("dtype", ["fp32", "fp16"])
def test_the_static_steps_partial_rotary_is_two_rotary_embedding_nodes(static_exports, dtype):
    """q's and k's partial rotary (8 of 16 channels) as com.microsoft::RotaryEmbedding over cos / sin tables of the
    cache's 600 positions (edgelin.export.onnx.rotary): no Sin, Cos or Neg left in the step."""
    step = onnx.load(str(static_exports[dtype] / "step.onnx"), load_external_data=False)
    ops = [n.op_type for n in step.graph.node]
    assert ops.count("RotaryEmbedding") == 2 and not {"Sin", "Cos", "Neg"} & set(ops), sorted(ops)
    rotary = [n for n in step.graph.node if n.op_type == "RotaryEmbedding"]
    assert {helper.get_attribute_value(a) for n in rotary for a in n.attribute if a.name == "rotary_embedding_dim"} \
        == {8}
    tables = {t.name: list(t.dims) for t in step.graph.initializer if t.name in rotary[0].input}
    assert sorted(tables.values()) == [[600, 4], [600, 4]]


def test_the_static_export_with_rotary_embedding_matches_the_reference(static_exports):
    """The float32-cache export against the PyTorch reference (validate: prefill, 24-step rollout, batch 2)."""
    from edgelin.validate import validate

    report = validate(static_exports["fp32"], steps=24, prompt_len=13, batch=2)
    assert report.passed, [m.to_dict() for m in report.failures]
    assert max(m.max_rel for m in report.metrics) < 1e-5


@pytest.mark.parametrize("batch", [1, 2])
@pytest.mark.parametrize("dtype", ["fp32", "fp16"])
def test_the_static_rollout_with_the_library_matches_onnxruntimes_kernels(static_exports, library, batch, dtype,
                                                                         monkeypatch):
    """An 8-token prefill, then 60 teacher-forced steps on the in-place cache: library vs function fallback."""
    ids = np.random.default_rng(batch).integers(0, 97, (batch, 68))
    logits = {}
    for setting in (str(library), "0"):
        monkeypatch.setenv(ortops.ENV, setting)
        runner = open_runner(static_exports[dtype], threads=1)
        state = runner.new_state(batch)
        runner.prefill(ids[:, :8], state, np.zeros(batch, np.int64))
        logits[setting] = np.stack([runner.step(ids[:, t], state, np.full(batch, t)) for t in range(8, 68)])
    assert_close(logits[str(library)], logits["0"], ATTENTION_RTOL if dtype == "fp32" else HALF_RTOL, f"batch {batch}")


@pytest.mark.parametrize("batch", [1, 2])
def test_a_float16_cache_follows_the_float32_one(static_exports, batch):
    """--kv-dtype fp16 against the float32 cache, same checkpoint: 40 steps after a 9-token prefill (measured
    6.8e-5 max-relative on the logits); the export's own reference check passed with the fp16 threshold."""
    half, exact = (open_runner(static_exports[d], threads=1) for d in ("fp16", "fp32"))
    ids = np.random.default_rng(7 + batch).integers(0, 97, (batch, 49))
    states = [r.new_state(batch) for r in (half, exact)]
    got = [[r.prefill(ids[:, :9], s, np.zeros(batch, np.int64))] for r, s in zip((half, exact), states)]
    for t in range(9, 49):
        for out, r, s in zip(got, (half, exact), states):
            out.append(r.step(ids[:, t], s, np.full(batch, t)))
    assert_close(np.stack(got[0]), np.stack(got[1]), 1e-3, f"fp16 vs fp32 KV cache, batch {batch}")
    assert half.read_state(states[0])["past_key_values.1.key"].dtype == np.float16


def test_a_float16_cache_prefills_in_short_pieces(static_exports):
    # ONNX Runtime's float16 GroupQueryAttention holds float32 [heads, piece, capacity] scores per prefill call
    # (442 vs 191 MiB peak RSS at 32k tokens on the Qwen3.5 peer, pieces of 256 vs 64): short pieces there only.
    half, exact = (open_runner(static_exports[d], threads=1) for d in ("fp16", "fp32"))
    assert (half.prefill_piece, exact.prefill_piece) == (64, 256)
    ids = np.random.default_rng(3).integers(0, 97, (1, 150))
    pieces, whole = half.new_state(1), half.new_state(1)
    got = prefill(half, ids, pieces, start=0)[0]  # three calls: 64 + 64 + 22 tokens
    want = half.prefill(ids, whole, np.zeros(1, np.int64))  # one call of 150
    assert_close(got, want, HALF_RTOL, "last logits, pieces vs one call")
    assert_close(half.read_state(pieces)["past_key_values.1.key"].astype(np.float32),
                 half.read_state(whole)["past_key_values.1.key"].astype(np.float32), HALF_RTOL, "cached keys")


def test_kv_dtype_needs_the_static_cache():
    with pytest.raises(EdgelinError, match="--kv-dtype fp16 without --kv-cache static"):
        OnnxOptions(kv_dtype="fp16")
    with pytest.raises(EdgelinError, match="--kv-dtype bf16"):
        OnnxOptions(kv_cache="static", context=600, kv_dtype="bf16")
