"""--step-ops edgelin, Mamba2: each layer's SSD step around the recurrence as one `ai.edgelin::SsdRecurrence` node.

The step graph writes Mamba2's recurrence as com.microsoft `LinearAttention` (gated, one decay per head) wrapped in
~20 small nodes: the dt path (Reshape, Add dt_bias, Softplus, Mul A), the value x * softplus (Reshapes, Mul), the
key group broadcast to every head (Reshape, Unsqueeze, Expand, Reshape), and the skip y + D x (Reshapes, Mul, Add).
ONNX Runtime pays a kernel launch for each; edgelin's library computes the lot in one (edgelin/ortops/ops_ssd.c).
The fused node carries the recurrence's attributes and reads the same tensors (the Split pieces, the constants, the
state), writes the same present state and the same output tensor; its ONNX function (the fallback, for a runtime
without the library) computes it with the same ONNX ops and the com.microsoft op, so it gives what the unfused graph
gives.

A recurrence is fused only when its neighbourhood is exactly that pattern (the Mamba2 family's step as edgelin
exports it) and no intermediate tensor has another reader; anything else is left as it was.

Export-side module: imports onnx inside its functions.
"""

from __future__ import annotations

from edgelin.export.onnx.patterns import (GraphIndex, add_fused, broadcast_body, decay_body, head_constants,
                                          key_broadcast, recurrence_node, recurrences, reshape_shape, softplus_decay)
from edgelin.ortops import DOMAIN

NAME = "SsdRecurrence"
INPUTS = ("q", "k", "x", "dt", "past_state", "dt_bias", "A", "D")
OUTPUTS = ("y", "present_state")


def ssd_function(opsets: dict[str, int]):
    """ai.edgelin::SsdRecurrence as ONNX ops around com.microsoft::LinearAttention (ops_ssd.c says what it
    computes), in the unfused graph's order of operations."""
    from onnx import helper

    node = helper.make_node
    body = [
        *head_constants(), node("Constant", [], ["three"], value_ints=[3]),
        *decay_body(),
        node("Shape", ["dt4"], ["dt4_shape"]),
        node("Slice", ["dt4_shape", "zero", "three"], ["bth"]),
        node("Concat", ["bth", "minus1"], ["heads_shape"], axis=0),            # [B, T, H, -1]
        node("Reshape", ["x", "heads_shape"], ["x4"]),
        node("Mul", ["x4", "sp"], ["v4"]),
        node("Reshape", ["v4", "flat"], ["v"]),
        node("Reshape", ["k", "group_shape"], ["k_groups"]),                   # [B, T, G, dk]
        *broadcast_body("k_groups"),
        recurrence_node(["q", "k_heads", "v", "past_state", "decay"], ["o", "present_state"], "gated"),
        node("Reshape", ["o", "heads_shape"], ["o4"]),
        node("Mul", ["D", "x4"], ["skip"]),
        node("Add", ["o4", "skip"], ["y4"]),
        node("Reshape", ["y4", "flat"], ["y"]),
    ]
    imports = [helper.make_opsetid("com.microsoft", 1), helper.make_opsetid("", opsets.get("", 18))]
    return helper.make_function(DOMAIN, NAME, list(INPUTS), list(OUTPUTS), body, imports,
                                attributes=["q_num_heads", "kv_num_heads", "scale"])


def _match(graph: GraphIndex, la, groups: int, heads: int):
    """The fused node's inputs, its output tensor and the nodes it replaces, or None."""
    reshape_q = graph.made_by(la.input[0], "Reshape")
    reshape_v = graph.made_by(la.input[2], "Reshape")
    decay = softplus_decay(graph, la.input[4], heads)
    keys = key_broadcast(graph, la.input[1], groups, heads)
    mul_v = reshape_v and graph.made_by(reshape_v.input[0], "Mul")
    if None in (reshape_q, decay, keys) or not mul_v:
        return None
    dt, dt_bias, a, softplus, decay_nodes = decay
    key_nodes = keys[1]
    if len(key_nodes) > 1:  # the key groups: Reshape [.., groups, dk] before the broadcast
        reshape_groups = graph.made_by(keys[0], "Reshape")
        if not reshape_groups or (reshape_shape(graph, reshape_groups) or [])[2:3] != [groups]:
            return None
        keys, key_nodes = (reshape_groups.input[0], [*key_nodes, reshape_groups])
    else:
        keys = keys[0]
    x4 = [i for i in mul_v.input if i != softplus.output[0]]
    reshape_x = len(x4) == 1 and graph.made_by(x4[0], "Reshape")
    if not reshape_x:
        return None
    # the output side: o -> Reshape -> Add(., Mul(D, x4)) -> Reshape -> y
    reshape_o = graph.only_reader(la.output[0], "Reshape")
    add_skip = reshape_o and graph.only_reader(reshape_o.output[0], "Add")
    if not add_skip:
        return None
    skip = [i for i in add_skip.input if i != reshape_o.output[0]]
    mul_skip = len(skip) == 1 and graph.made_by(skip[0], "Mul")
    pair = mul_skip and graph.pair(mul_skip, heads)
    reshape_y = pair and pair[1] == x4[0] and graph.only_reader(add_skip.output[0], "Reshape")
    if not reshape_y:
        return None
    replaced = [reshape_q, reshape_v, *decay_nodes, mul_v, *key_nodes, reshape_x, la, reshape_o, add_skip, mul_skip,
                reshape_y]
    if not graph.closed(replaced, {la.output[1], reshape_y.output[0]}):
        return None  # an intermediate tensor has a reader outside the pattern
    inputs = [reshape_q.input[0], keys, reshape_x.input[0], dt, la.input[3], dt_bias, a, pair[0]]
    return inputs, reshape_y.output[0], replaced


def fuse_ssd_steps(proto, float_tensors: set[str]) -> int:
    """Replace, in the step graph `proto` (in place), every Mamba2 SSD step around a float32 gated per-head
    com.microsoft LinearAttention with one ai.edgelin::SsdRecurrence node, and add its function once. Returns how
    many it fused."""
    from onnx import helper

    graph = GraphIndex(proto.graph)
    fused: dict[int, object] = {}  # id(the recurrence node) -> the fused node that takes its place
    dropped: set[int] = set()
    for la, attrs in recurrences(proto, "gated", 5, float_tensors):
        found = _match(graph, la, int(attrs.get("q_num_heads", 0)), int(attrs.get("kv_num_heads", 0)))
        if found is None:
            continue
        inputs, output, replaced = found
        fused[id(la)] = helper.make_node(NAME, inputs, [output, la.output[1]], name=f"{la.name}.ssd", domain=DOMAIN,
                                         q_num_heads=attrs["q_num_heads"], kv_num_heads=attrs["kv_num_heads"],
                                         scale=float(attrs["scale"]))
        dropped |= {id(n) for n in replaced}
    return add_fused(proto, fused, dropped, ssd_function)
