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

import math
from collections import defaultdict

from edgelin.ortops import DOMAIN

_INT64 = 7  # onnx.TensorProto.INT64

NAME = "SsdRecurrence"
INPUTS = ("q", "k", "x", "dt", "past_state", "dt_bias", "A", "D")
OUTPUTS = ("y", "present_state")


def ssd_function(opsets: dict[str, int]):
    """ai.edgelin::SsdRecurrence as ONNX ops around com.microsoft::LinearAttention (ops_ssd.c says what it
    computes), in the unfused graph's order of operations."""
    import onnx
    from onnx import helper

    def const(name: str, values: list[int]):
        return helper.make_node("Constant", [], [name], value_ints=values)

    def attr_int(name: str, attribute: str):
        node = helper.make_node("Constant", [], [name])
        ref = onnx.AttributeProto(name="value_int", ref_attr_name=attribute, type=onnx.AttributeProto.INT)
        node.attribute.append(ref)
        return node

    node = helper.make_node
    recurrence = node("LinearAttention", ["q", "k_heads", "v", "past_state", "decay"], ["o", "present_state"],
                      domain="com.microsoft", update_rule="gated")
    recurrence.attribute.extend(helper.make_attribute_ref(name, kind) for name, kind in (
        ("q_num_heads", onnx.AttributeProto.INT), ("kv_num_heads", onnx.AttributeProto.INT),
        ("scale", onnx.AttributeProto.FLOAT)))
    body = [
        const("flat", [0, 0, -1]), const("per_head", [0, 0, -1, 1]), const("zero", [0]), const("three", [3]),
        const("minus1", [-1]), const("axis3", [3]), const("ones3", [1, 1, 1]), const("one", [1]),
        attr_int("groups", "q_num_heads"), attr_int("heads", "kv_num_heads"),
        node("Unsqueeze", ["groups", "zero"], ["groups1"]), node("Div", ["heads", "groups"], ["per_group"]),
        node("Unsqueeze", ["per_group", "zero"], ["per_group1"]),
        node("Reshape", ["dt", "per_head"], ["dt4"]),                          # [B, T, H, 1]
        node("Add", ["dt4", "dt_bias"], ["dt_biased"]),
        node("Softplus", ["dt_biased"], ["sp"]),
        node("Mul", ["A", "sp"], ["log_decay"]),
        node("Reshape", ["log_decay", "flat"], ["decay"]),                     # [B, T, H]
        node("Shape", ["dt4"], ["dt4_shape"]),
        node("Slice", ["dt4_shape", "zero", "three"], ["bth"]),
        node("Concat", ["bth", "minus1"], ["heads_shape"], axis=0),            # [B, T, H, -1]
        node("Reshape", ["x", "heads_shape"], ["x4"]),
        node("Mul", ["x4", "sp"], ["v4"]),
        node("Reshape", ["v4", "flat"], ["v"]),
        node("Concat", ["zero", "zero", "groups1", "minus1"], ["group_shape"], axis=0),
        node("Reshape", ["k", "group_shape"], ["k_groups"]),                   # [B, T, G, dk]
        node("Unsqueeze", ["k_groups", "axis3"], ["k5"]),                      # [B, T, G, 1, dk]
        node("Concat", ["ones3", "per_group1", "one"], ["expand_shape"], axis=0),
        node("Expand", ["k5", "expand_shape"], ["k_expanded"]),
        node("Reshape", ["k_expanded", "flat"], ["k_heads"]),                  # [B, T, H * dk]
        recurrence,
        node("Reshape", ["o", "heads_shape"], ["o4"]),
        node("Mul", ["D", "x4"], ["skip"]),
        node("Add", ["o4", "skip"], ["y4"]),
        node("Reshape", ["y4", "flat"], ["y"]),
    ]
    imports = [helper.make_opsetid("com.microsoft", 1), helper.make_opsetid("", opsets.get("", 18))]
    return helper.make_function(DOMAIN, NAME, list(INPUTS), list(OUTPUTS), body, imports,
                                attributes=["q_num_heads", "kv_num_heads", "scale"])


class _Graph:
    """Producers and readers of a graph's tensors, and its constants' element counts."""

    def __init__(self, graph):
        self.producer = {out: n for n in graph.node for out in n.output}
        self.readers: dict[str, list] = defaultdict(list)
        for n in graph.node:
            for name in n.input:
                self.readers[name].append(n)
        self.outputs = {o.name for o in graph.output}
        self.constants = {t.name: math.prod(t.dims) for t in graph.initializer}
        self.shapes = {t.name: t for t in graph.initializer  # int64 vectors stored in the graph (Reshape shapes)
                       if t.data_type == _INT64 and len(t.dims) == 1 and (t.raw_data or t.int64_data)}

    def made_by(self, name: str, op: str):
        node = self.producer.get(name)
        return node if node is not None and node.op_type == op and node.domain in ("", "ai.onnx") else None


def _pair(graph: _Graph, node, constant_count: int):
    """(the constant, the other input) of a two-input node with one constant of `constant_count` values."""
    a, b = node.input
    if graph.constants.get(a) == constant_count and b not in graph.constants:
        return a, b
    if graph.constants.get(b) == constant_count and a not in graph.constants:
        return b, a
    return None


def _key_groups(graph: _Graph, reshape_k, groups: int, heads: int):
    """(the key groups' tensor, the nodes that broadcast it to every head) feeding the recurrence's key: Reshape
    <- Expand <- Unsqueeze <- Reshape [.., groups, dk] <- key groups, or (one group per head) Reshape <- keys."""
    from onnx import numpy_helper

    expand = graph.made_by(reshape_k.input[0], "Expand")
    if expand is None:
        return (reshape_k.input[0], []) if groups == heads else None
    unsqueeze = graph.made_by(expand.input[0], "Unsqueeze")
    reshape_groups = unsqueeze and graph.made_by(unsqueeze.input[0], "Reshape")
    shape = reshape_groups and graph.shapes.get(reshape_groups.input[1])
    if shape is None or numpy_helper.to_array(shape).tolist()[2:3] != [groups]:
        return None
    return reshape_groups.input[0], [expand, unsqueeze, reshape_groups]


def _match(graph: _Graph, la, groups: int, heads: int):
    """The fused node's inputs, its output tensor and the nodes it replaces, or None."""
    reshape_q = graph.made_by(la.input[0], "Reshape")
    reshape_k = graph.made_by(la.input[1], "Reshape")
    reshape_v = graph.made_by(la.input[2], "Reshape")
    reshape_decay = graph.made_by(la.input[4], "Reshape")
    if None in (reshape_q, reshape_k, reshape_v, reshape_decay):
        return None
    mul_decay = graph.made_by(reshape_decay.input[0], "Mul")
    keys = _key_groups(graph, reshape_k, groups, heads)
    mul_v = graph.made_by(reshape_v.input[0], "Mul")
    if mul_decay is None or keys is None or mul_v is None or (pair := _pair(graph, mul_decay, heads)) is None:
        return None
    a, softplus_out = pair
    softplus = graph.made_by(softplus_out, "Softplus")
    add_bias = softplus and graph.made_by(softplus.input[0], "Add")
    if add_bias is None or (pair := _pair(graph, add_bias, heads)) is None:
        return None
    dt_bias, dt4 = pair
    reshape_dt = graph.made_by(dt4, "Reshape")
    x4 = [i for i in mul_v.input if i != softplus_out]
    reshape_x = len(x4) == 1 and graph.made_by(x4[0], "Reshape")
    if reshape_dt is None or not reshape_x:
        return None
    # the output side: o -> Reshape -> Add(., Mul(D, x4)) -> Reshape -> y
    (reshape_o, *more) = graph.readers[la.output[0]] or [None]
    if more or reshape_o is None or reshape_o.op_type != "Reshape" or la.output[0] in graph.outputs:
        return None
    (add_skip, *more) = graph.readers[reshape_o.output[0]] or [None]
    if more or add_skip is None or add_skip.op_type != "Add":
        return None
    skip = [i for i in add_skip.input if i != reshape_o.output[0]]
    mul_skip = len(skip) == 1 and graph.made_by(skip[0], "Mul")
    pair = mul_skip and _pair(graph, mul_skip, heads)
    if not pair or pair[1] != x4[0]:
        return None
    (reshape_y, *more) = graph.readers[add_skip.output[0]] or [None]
    if more or reshape_y is None or reshape_y.op_type != "Reshape":
        return None
    replaced = [reshape_q, reshape_k, reshape_v, reshape_decay, mul_decay, mul_v, softplus, add_bias, *keys[1],
                reshape_dt, reshape_x, la, reshape_o, add_skip, mul_skip, reshape_y]
    inside = {out for n in replaced for out in n.output} - {la.output[1], reshape_y.output[0]}
    ids = {id(n) for n in replaced}
    if any(t in graph.outputs or not all(id(r) in ids for r in graph.readers[t]) for t in inside):
        return None  # an intermediate tensor has a reader outside the pattern
    inputs = [reshape_q.input[0], keys[0], reshape_x.input[0], reshape_dt.input[0], la.input[3],
              dt_bias, a, pair[0]]
    return inputs, reshape_y.output[0], replaced


def fuse_ssd_steps(proto, float_tensors: set[str]) -> int:
    """Replace, in the step graph `proto` (in place), every Mamba2 SSD step around a float32 gated per-head
    com.microsoft LinearAttention with one ai.edgelin::SsdRecurrence node, and add its function once. Returns how
    many it fused."""
    from onnx import helper

    graph = _Graph(proto.graph)
    fused: dict[int, object] = {}  # id(the recurrence node) -> the fused node that takes its place
    dropped: set[int] = set()
    for la in proto.graph.node:
        attrs = {a.name: helper.get_attribute_value(a) for a in la.attribute}
        if la.op_type != "LinearAttention" or la.domain != "com.microsoft" or attrs.get("update_rule") not in (
                "gated", b"gated") or len(la.input) != 5 or la.input[0] not in float_tensors:
            continue
        found = _match(graph, la, int(attrs.get("q_num_heads", 0)), int(attrs.get("kv_num_heads", 0)))
        if found is None:
            continue
        inputs, output, replaced = found
        fused[id(la)] = helper.make_node(NAME, inputs, [output, la.output[1]], name=f"{la.name}.ssd", domain=DOMAIN,
                                         q_num_heads=attrs["q_num_heads"], kv_num_heads=attrs["kv_num_heads"],
                                         scale=float(attrs["scale"]))
        dropped |= {id(n) for n in replaced}
    if not fused:
        return 0
    # in the recurrence's place: every input it takes was made before the recurrence's own inputs, and the output's
    # readers came after the pattern's last reshape
    nodes = [fused.get(id(n), n) for n in proto.graph.node if id(n) in fused or id(n) not in dropped]
    del proto.graph.node[:]
    proto.graph.node.extend(nodes)
    opsets = {o.domain: o.version for o in proto.opset_import}
    proto.functions.append(ssd_function(opsets))
    return len(fused)
