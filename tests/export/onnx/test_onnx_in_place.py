"""States updated in place by the ONNX step graph (edgelin.export.onnx.in_place): which graphs pass the test
(hand-built graphs, each hazard on its own), that every family's exported step lists its states, and that
the runner binds one buffer both ways (the rollout parity of every family through that binding is
test_onnx.py's)."""

from __future__ import annotations

import numpy as np
import onnx
import onnx.helper as oh
import pytest
from onnx import TensorProto

from edgelin.export.onnx.in_place import in_place_states
from edgelin.export.onnx.metadata import IN_PLACE_KEY
from edgelin.runtime import open_runner
from helpers import export_family, run_state_in_place

FEEDS = {"present": "past"}


def graph(nodes: list, outputs: tuple[str, ...] = ("present",)) -> onnx.GraphProto:
    inputs = [oh.make_tensor_value_info(n, TensorProto.FLOAT, [2, 2]) for n in ("past", "past2", "a", "kv", "q")]
    return oh.make_graph(nodes, "g", inputs, [oh.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in outputs])


def test_an_update_through_an_op_is_in_place():
    """present = past * a + kv: the Mul reads the past and has finished before the Add writes."""
    nodes = [oh.make_node("Mul", ["past", "a"], ["decayed"]), oh.make_node("Add", ["decayed", "kv"], ["present"]),
             oh.make_node("MatMul", ["q", "present"], ["out"])]
    assert in_place_states(graph(nodes, ("present", "out")), FEEDS) == ["past"]


def test_a_writer_reading_the_past_is_in_place_only_when_elementwise():
    """present = past + kv (linear attention) reads each element before writing it; a MatMul, a Concat or
    an Identity writing the present from the past may write before they have read it all."""
    for op in ("Add", "Sub", "Mul", "Div"):
        assert in_place_states(graph([oh.make_node(op, ["past", "kv"], ["present"])]), FEEDS) == ["past"]
    ring = [oh.make_node("Cast", ["a"], ["mask"], to=TensorProto.BOOL), oh.make_node("Where", ["mask", "kv", "past"],
                                                                                    ["present"])]
    assert in_place_states(graph(ring), FEEDS) == ["past"]  # a sliding window's ring buffer
    for node in (oh.make_node("MatMul", ["q", "past"], ["present"]), oh.make_node("Identity", ["past"], ["present"]),
                 oh.make_node("Concat", ["past", "kv"], ["present"], axis=0)):
        assert in_place_states(graph([node]), FEEDS) == [], node.op_type
    foreign = oh.make_node("Add", ["past", "kv"], ["present"], domain="com.example")
    assert in_place_states(graph([foreign]), FEEDS) == []


@pytest.mark.parametrize("rule, per_key, query_heads", [("linear", False, 6), ("gated", False, 1), ("gated", True, 6),
                                                       ("delta", False, 6), ("gated_delta", False, 3),
                                                       ("gated_delta", True, 6)])
def test_linear_attention_gives_the_same_outputs_with_its_past_and_present_in_one_buffer(rule, per_key, query_heads):
    """ONNX Runtime's LinearAttention (the step's recurrence) is trusted in place (onnx_in_place.IN_PLACE_CONTRIB):
    with its past and present bound to one buffer it must give what it gives with two, for every update rule
    (per-head and per-key decay, grouped query heads), batch 3 - and the present must differ from the past."""
    import onnxruntime as ort

    batch, heads, d_k, d_v = 3, 6, 16, 24
    names = ["q", "k", "v", "past", "g" if "gated" in rule else "", "beta" if "delta" in rule else ""]
    while not names[-1]:
        names.pop()
    shapes = {"q": [batch, 1, query_heads * d_k], "k": [batch, 1, heads * d_k], "v": [batch, 1, heads * d_v],
              "past": [batch, heads, d_k, d_v], "g": [batch, 1, heads * (d_k if per_key else 1)], "beta": [batch, 1, heads]}
    node = oh.make_node("LinearAttention", names, ["out", "present"], domain="com.microsoft", update_rule=rule,
                        q_num_heads=query_heads, kv_num_heads=heads, scale=1.0)
    model = oh.make_model(oh.make_graph([node], "la", [oh.make_tensor_value_info(n, TensorProto.FLOAT, shapes[n])
                                                      for n in names if n],
                                        [oh.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in ("out", "present")]),
                          opset_imports=[oh.make_opsetid("", 18), oh.make_opsetid("com.microsoft", 1)])
    assert in_place_states(model.graph, FEEDS) == ["past"]
    rng = np.random.default_rng(5)
    feeds = {n: rng.standard_normal(shapes[n]).astype(np.float32) for n in names if n}
    if "g" in feeds:
        feeds["g"] = -np.abs(feeds["g"])
    if "beta" in feeds:
        feeds["beta"] = 1 / (1 + np.exp(-feeds["beta"]))
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    out, present = session.run(None, feeds)
    got_out, got_present = run_state_in_place(session, feeds, "out")
    np.testing.assert_array_equal(got_out, out)
    np.testing.assert_array_equal(got_present, present)
    assert not np.allclose(present, feeds["past"])


@pytest.mark.parametrize("bias", [True, False])
def test_causal_conv_gives_the_same_outputs_with_its_past_and_present_in_one_buffer(bias):
    """ONNX Runtime's CausalConvWithState (the step's short conv) is trusted in place too: one buffer for its past
    and present window must give what two give (batch 3, window 3, with and without a bias)."""
    import onnxruntime as ort
    from onnx import numpy_helper

    batch, channels, width = 3, 40, 4
    rng = np.random.default_rng(6)
    weights = [numpy_helper.from_array(rng.standard_normal((channels, 1, width)).astype(np.float32), "w")]
    weights += [numpy_helper.from_array(rng.standard_normal(channels).astype(np.float32), "b")] if bias else []
    node = oh.make_node("CausalConvWithState", ["x", "w", "b" if bias else "", "past"], ["out", "present"],
                        domain="com.microsoft", activation="silu", ndim=1)
    model = oh.make_model(oh.make_graph([node], "conv", [oh.make_tensor_value_info("x", TensorProto.FLOAT, [batch, channels, 1]),
                                                        oh.make_tensor_value_info("past", TensorProto.FLOAT,
                                                                                  [batch, channels, width - 1])],
                                        [oh.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in ("out", "present")],
                                        weights),
                          opset_imports=[oh.make_opsetid("", 18), oh.make_opsetid("com.microsoft", 1)])
    assert in_place_states(model.graph, FEEDS) == ["past"]
    feeds = {"x": rng.standard_normal((batch, channels, 1)).astype(np.float32),
             "past": rng.standard_normal((batch, channels, width - 1)).astype(np.float32)}
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    out, present = session.run(None, feeds)
    np.testing.assert_array_equal(present, np.concatenate([feeds["past"], feeds["x"]], -1)[..., 1:])  # the shift
    got_out, got_present = run_state_in_place(session, feeds, "out")
    np.testing.assert_array_equal(got_out, out)
    np.testing.assert_array_equal(got_present, present)


def test_a_view_of_the_past_is_the_past():
    """A Reshape's output may be the past's own buffer: a MatMul writing the present from it, or a late reader
    of it, makes the state unsafe; elementwise from the view and early readers of it do not."""
    shape = oh.make_node("Constant", [], ["shape"], value=oh.make_tensor("s", TensorProto.INT64, [2], [2, 2]))
    view = oh.make_node("Reshape", ["past", "shape"], ["view"])
    assert in_place_states(graph([shape, view, oh.make_node("MatMul", ["q", "view"], ["present"])]), FEEDS) == []
    assert in_place_states(graph([shape, view, oh.make_node("Add", ["view", "kv"], ["present"])]), FEEDS) == ["past"]
    late = [shape, view, oh.make_node("Mul", ["past", "a"], ["present"]), oh.make_node("Neg", ["view"], ["out"])]
    assert in_place_states(graph(late, ("present", "out")), FEEDS) == []
    early = [shape, view, oh.make_node("Neg", ["view"], ["neg"]), oh.make_node("Mul", ["neg", "a"], ["present"])]
    assert in_place_states(graph(early), FEEDS) == ["past"]


def test_reading_the_shape_is_not_reading_the_data():
    nodes = [oh.make_node("Shape", ["past"], ["shape"]), oh.make_node("Add", ["past", "kv"], ["present"])]
    assert in_place_states(graph(nodes, ("present", "shape")), FEEDS) == ["past"]
    late = [oh.make_node("Add", ["past", "kv"], ["present"]), oh.make_node("Neg", ["past"], ["out"])]
    assert in_place_states(graph(late, ("present", "out")), FEEDS) == []


def test_a_read_of_the_past_that_may_run_after_the_write_is_not():
    """out = q @ past does not feed the present: ONNX Runtime may run it after the present is written."""
    nodes = [oh.make_node("Mul", ["past", "a"], ["decayed"]), oh.make_node("Relu", ["decayed"], ["present"]),
             oh.make_node("MatMul", ["q", "past"], ["out"])]
    assert in_place_states(graph(nodes, ("present", "out")), FEEDS) == []
    ordered = [oh.make_node("MatMul", ["q", "past"], ["out"]), oh.make_node("Add", ["out", "kv"], ["mixed"]),
               oh.make_node("Mul", ["past", "mixed"], ["pre"]), oh.make_node("Relu", ["pre"], ["present"])]
    assert in_place_states(graph(ordered, ("present", "out")), FEEDS) == ["past"]  # the same read, as an ancestor


def test_a_subgraph_reading_the_past_counts_as_a_reader():
    """An If whose branch captures the past from the outer scope reads it, though its inputs do not say so."""
    branch = oh.make_graph([oh.make_node("Mul", ["past", "q"], ["y"])], "branch", [],
                           [oh.make_tensor_value_info("y", TensorProto.FLOAT, None)])
    cond = oh.make_node("Constant", [], ["cond"], value=oh.make_tensor("c", TensorProto.BOOL, [], [True]))
    late = oh.make_node("If", ["cond"], ["out"], then_branch=branch, else_branch=branch)
    nodes = [cond, oh.make_node("Mul", ["past", "a"], ["decayed"]), oh.make_node("Add", ["decayed", "kv"], ["present"]),
             late]
    assert in_place_states(graph(nodes, ("present", "out")), FEEDS) == []
    writer = oh.make_node("If", ["cond"], ["present"], then_branch=branch, else_branch=branch)
    assert in_place_states(graph([cond, writer]), FEEDS) == []


def test_each_state_is_judged_on_its_own():
    nodes = [oh.make_node("Mul", ["past", "a"], ["decayed"]), oh.make_node("Add", ["decayed", "kv"], ["present"]),
             oh.make_node("Concat", ["past2", "kv"], ["present2"], axis=0)]  # a growing cache: Concat
    assert in_place_states(graph(nodes, ("present", "present2")), {"present": "past", "present2": "past2"}) == ["past"]


@pytest.fixture(scope="module")
def mamba2(tmp_path_factory):
    return export_family(tmp_path_factory.mktemp("in-place"), "mamba2")


@pytest.mark.slow
def test_an_exported_step_updates_its_states_in_place(mamba2):
    """Mamba2's recurrent and conv states are all listed; the runner binds each to one buffer, which a
    step writes (same object, same address, new contents) while a prefill still ping-pongs; the logits
    equal those of ping-pong buffers bit for bit."""
    runner = open_runner(mamba2)
    listed = onnx.load(str(mamba2 / "step.onnx"), load_external_data=False).metadata_props
    recorded = {p.key: p.value for p in listed}[IN_PLACE_KEY].split(",")
    assert sorted(recorded) == sorted(runner.state_names) and len(recorded) == 4
    assert runner._in_place == frozenset(range(4))
    plain = open_runner(mamba2)
    plain._in_place = frozenset()  # every state ping-pongs, as before
    ids = np.random.default_rng(4).integers(0, runner.manifest.vocab_size, (2, 16))
    handles = [r.new_state(2) for r in (runner, plain)]
    got = [[r.prefill(ids[:, :5], h, np.zeros(2, np.int64))] for r, h in zip((runner, plain), handles)]
    buffers = handles[0]._value
    for t in range(5, 16):
        before = [(v, v.data_ptr(), v.numpy().copy()) for v in buffers.current]
        for r, h, out in zip((runner, plain), handles, got):
            out.append(r.step(ids[:, t], h, np.full(2, t, np.int64)))
        for (value, address, old), now in zip(before, buffers.current):
            assert now is value and now.data_ptr() == address and not np.array_equal(now.numpy(), old)
        if t == 9:  # a prefill on a handle whose step bindings exist: the states move; the bindings follow
            for r, h, out in zip((runner, plain), handles, got):
                out.append(r.prefill(ids[:, 9:11], h, np.full(2, 9, np.int64)))
    for a, b in zip(*got):
        np.testing.assert_array_equal(a, b)
    for name, value in runner.read_state(handles[0]).items():
        np.testing.assert_array_equal(value, plain.read_state(handles[1])[name])
