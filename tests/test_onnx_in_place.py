"""States updated in place by the ONNX step graph (edgelin.export.onnx_in_place): which graphs pass the test
(hand-built graphs, each hazard on its own), that every family's exported step lists its states, and that
the runner binds one buffer both ways (the rollout parity of every family through that binding is
test_onnx.py's)."""

from __future__ import annotations

import numpy as np
import onnx
import onnx.helper as oh
import pytest
from onnx import TensorProto

from edgelin.export.onnx_in_place import IN_PLACE_KEY, in_place_states
from edgelin.runtime import open_runner
from helpers import export_family

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
