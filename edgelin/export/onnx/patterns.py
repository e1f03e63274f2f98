"""What the step-graph fusions (edgelin.export.onnx.ssd, gdn) share: an index of a graph's producers, readers and
constants, the sub-patterns both recurrences' neighbourhoods contain (the softplus decay, the key heads broadcast to
the value heads), the check that a pattern's inner tensors have no outside reader, and the rewrite that puts each
fused node where its recurrence was.

Export-side module: imports onnx inside its functions.
"""

from __future__ import annotations

import math
from collections import defaultdict


_INT64 = 7  # onnx.TensorProto.INT64


class GraphIndex:
    """Producers and readers of a graph's tensors, and its constants (initializers)."""

    def __init__(self, graph):
        self.producer = {out: n for n in graph.node for out in n.output}
        self.readers: dict[str, list] = defaultdict(list)
        for n in graph.node:
            for name in n.input:
                self.readers[name].append(n)
        self.outputs = {o.name for o in graph.output}
        self.initializers = {t.name: t for t in graph.initializer}
        self.constants = {t.name: math.prod(t.dims) for t in graph.initializer}
        self.shapes = {t.name: t for t in graph.initializer  # int64 vectors stored in the graph (Reshape shapes)
                       if t.data_type == _INT64 and len(t.dims) == 1 and (t.raw_data or t.int64_data)}

    def made_by(self, name: str, op: str):
        node = self.producer.get(name)
        return node if node is not None and node.op_type == op and node.domain in ("", "ai.onnx") else None

    def only_reader(self, name: str, op: str):
        """The one node reading `name`, if it is an `op` and `name` is not a graph output; else None."""
        (reader, *more) = self.readers[name] or [None]
        ok = not more and reader is not None and reader.op_type == op and name not in self.outputs
        return reader if ok else None

    def values(self, name: str) -> list[float] | None:
        """A constant's values, flattened (None: not a constant)."""
        from onnx import numpy_helper

        tensor = self.initializers.get(name)
        return None if tensor is None else numpy_helper.to_array(tensor).reshape(-1).tolist()

    def pair(self, node, constant_count: int):
        """(the constant, the other input) of a two-input node with one constant of `constant_count` values."""
        a, b = node.input
        if self.constants.get(a) == constant_count and b not in self.constants:
            return a, b
        if self.constants.get(b) == constant_count and a not in self.constants:
            return b, a
        return None

    def closed(self, replaced: list, kept: set[str]) -> bool:
        """True when no tensor made inside `replaced` (but those in `kept`, the fused node's outputs) is a graph
        output or read by a node outside it."""
        inside = {out for n in replaced for out in n.output} - kept
        ids = {id(n) for n in replaced}
        return not any(t in self.outputs or not all(id(r) in ids for r in self.readers[t]) for t in inside)


def recurrences(proto, update_rule: str, inputs: int, float_tensors: set[str]):
    """(node, its attributes) of each com.microsoft LinearAttention of `update_rule` with `inputs` inputs, all
    given, over float32 queries: the fusions' candidates."""
    from onnx import helper

    for node in proto.graph.node:
        if node.op_type != "LinearAttention" or node.domain != "com.microsoft" or len(node.input) != inputs \
                or not all(node.input) or node.input[0] not in float_tensors:
            continue
        attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        if attrs.get("update_rule") in (update_rule, update_rule.encode()):
            yield node, attrs


def softplus_decay(graph: GraphIndex, decay: str, heads: int):
    """The decay's path into a recurrence, Reshape(Mul(A, Softplus(Add(Reshape(dt), dt_bias)))), A and dt_bias of
    `heads` values: (dt, dt_bias, A, the softplus node, its nodes) or None."""
    reshape_decay = graph.made_by(decay, "Reshape")
    mul_decay = reshape_decay and graph.made_by(reshape_decay.input[0], "Mul")
    pair = mul_decay and graph.pair(mul_decay, heads)
    if not pair:
        return None
    a, softplus_out = pair
    softplus = graph.made_by(softplus_out, "Softplus")
    add_bias = softplus and graph.made_by(softplus.input[0], "Add")
    pair = add_bias and graph.pair(add_bias, heads)
    reshape_dt = pair and graph.made_by(pair[1], "Reshape")
    if not reshape_dt:
        return None
    return reshape_dt.input[0], pair[0], a, softplus, [reshape_decay, mul_decay, softplus, add_bias, reshape_dt]


def key_broadcast(graph: GraphIndex, key: str, groups: int, heads: int):
    """The key heads broadcast to every value head, Reshape(Expand(Unsqueeze(keys [.., groups, dk]))) (or, one key
    head per value head, Reshape(keys)): (the keys' tensor, its nodes) or None."""
    reshape_k = graph.made_by(key, "Reshape")
    expand = reshape_k and graph.made_by(reshape_k.input[0], "Expand")
    if not expand:
        return (reshape_k.input[0], [reshape_k]) if reshape_k and groups == heads else None
    unsqueeze = graph.made_by(expand.input[0], "Unsqueeze")
    # after the groups' axis: head h reads group h // (heads / groups), the kernels' order (not a tiling's h % groups)
    if not unsqueeze or len(unsqueeze.input) != 2 or graph.values(unsqueeze.input[1]) not in ([3], [-2]):
        return None
    return unsqueeze.input[0], [reshape_k, expand, unsqueeze]


def rms_norm(graph: GraphIndex, out: str):
    """`out` = Mul(Div(x, Sqrt(Add(ReduceMean(Pow(x, 2), last axis), eps))), weight), the weight a constant:
    (x, weight, eps, the weight's size, its nodes) or None."""
    mul = graph.made_by(out, "Mul")
    weight = mul and [i for i in mul.input if i in graph.constants]
    core = weight and len(weight) == 1 and rms_core(graph, next(i for i in mul.input if i != weight[0]))
    if not core:
        return None
    x, epsilon, nodes = core
    return x, weight[0], epsilon, graph.constants[weight[0]], [mul, *nodes]


def rms_core(graph: GraphIndex, out: str):
    """`out` = Div(x, Sqrt(Add(ReduceMean(Pow(x, 2), last axis), eps))), the norm without its weight: (x, eps, its
    nodes) or None."""
    div = graph.made_by(out, "Div")
    sqrt = div and graph.made_by(div.input[1], "Sqrt")
    add = sqrt and graph.made_by(sqrt.input[0], "Add")
    pair = add and graph.pair(add, 1)
    mean = pair and graph.made_by(pair[1], "ReduceMean")
    if not mean or len(mean.input) != 2 or graph.values(mean.input[1]) not in ([-1], [3]) or any(
            a.name == "keepdims" and a.i != 1 for a in mean.attribute):
        return None
    power = graph.made_by(mean.input[0], "Pow")
    if not power or power.input[0] != div.input[0] or graph.values(power.input[1]) != [2.0]:
        return None
    return div.input[0], graph.values(pair[0])[0], [div, sqrt, add, mean, power]


def reshape_shape(graph: GraphIndex, node) -> list[int] | None:
    """A Reshape's target shape when the graph stores it as a constant."""
    from onnx import numpy_helper

    shape = graph.shapes.get(node.input[1])
    return None if shape is None else numpy_helper.to_array(shape).tolist()


def replace_in_place(proto, fused: dict[int, object], dropped: set[int]) -> None:
    """Each fused node (or list of nodes) where its anchor (id(node) -> fused) was, the replaced nodes (their ids)
    gone. The caller picks an anchor where every input the fused nodes take exists and before every reader of their
    outputs (a recurrence, the residual Add, the rotary's final Reshape)."""
    nodes = []
    for node in proto.graph.node:
        if id(node) in fused:
            new = fused[id(node)]
            nodes.extend(new if isinstance(new, list) else [new])
        elif id(node) not in dropped:
            nodes.append(node)
    del proto.graph.node[:]
    proto.graph.node.extend(nodes)


CONTRIB = "com.microsoft"  # ONNX Runtime's contrib ops' domain


def recorded_shapes(proto) -> dict[str, list]:
    """Each tensor's shape as the graph records it (value_info, inputs, outputs): dims as names or sizes."""
    infos = [*proto.graph.value_info, *proto.graph.input, *proto.graph.output]
    return {v.name: [d.dim_param or d.dim_value for d in v.type.tensor_type.shape.dim]
            for v in infos if v.type.tensor_type.HasField("shape")}


def attribute_constant(name: str, attribute: str, kind: str = "int"):
    """A function-body Constant node whose value is the caller's attribute `attribute` (`kind`: int or float)."""
    import onnx
    from onnx import helper

    node = helper.make_node("Constant", [], [name])
    types = {"int": onnx.AttributeProto.INT, "float": onnx.AttributeProto.FLOAT}
    node.attribute.append(onnx.AttributeProto(name=f"value_{kind}", ref_attr_name=attribute, type=types[kind]))
    return node


def rms_constants() -> list:
    """The function-body constants `rms_nodes` reads: the exponent 2, the last axis and the caller's `epsilon`."""
    from onnx import helper

    return [helper.make_node("Constant", [], ["two"], value_float=2.0),
            helper.make_node("Constant", [], ["last"], value_ints=[-1]),
            attribute_constant("epsilon", "epsilon", "float")]


def rms_nodes(x: str, weight: str, out: str) -> list:
    """Function-body nodes: out = x / sqrt(mean(x^2) + epsilon) * weight over the last axis, as `rms_norm` matches
    them (and as ONNX Runtime fuses them into one SimplifiedLayerNormalization)."""
    from onnx import helper

    node = helper.make_node
    return [node("Pow", [x, "two"], [f"{out}.sq"]), node("ReduceMean", [f"{out}.sq", "last"], [f"{out}.ms"]),
            node("Add", [f"{out}.ms", "epsilon"], [f"{out}.eps"]), node("Sqrt", [f"{out}.eps"], [f"{out}.rms"]),
            node("Div", [x, f"{out}.rms"], [f"{out}.unit"]), node("Mul", [f"{out}.unit", weight], [out])]


# ---- the fused ops' ONNX functions: the pieces both recurrences' bodies share -----------------------------------
def recurrence_node(inputs: list[str], outputs: list[str], update_rule: str):
    """com.microsoft::LinearAttention with the caller's q_num_heads, kv_num_heads and scale (attribute refs)."""
    import onnx
    from onnx import helper

    node = helper.make_node("LinearAttention", inputs, outputs, domain="com.microsoft", update_rule=update_rule)
    node.attribute.extend(helper.make_attribute_ref(name, kind) for name, kind in (
        ("q_num_heads", onnx.AttributeProto.INT), ("kv_num_heads", onnx.AttributeProto.INT),
        ("scale", onnx.AttributeProto.FLOAT)))
    return node


def head_constants() -> list:
    """Shapes and counts: flat [0, 0, -1], per_head [0, 0, -1, 1], zero, minus1, axis3, ones3, one; group_shape
    [0, 0, q_num_heads, -1] and per_group1 [kv_num_heads / q_num_heads] from the caller's attributes."""
    from onnx import helper

    node = helper.make_node
    const = lambda name, values: node("Constant", [], [name], value_ints=values)  # noqa: E731
    return [const("flat", [0, 0, -1]), const("per_head", [0, 0, -1, 1]), const("zero", [0]), const("minus1", [-1]),
            const("axis3", [3]), const("ones3", [1, 1, 1]), const("one", [1]),
            attribute_constant("groups", "q_num_heads"), attribute_constant("heads", "kv_num_heads"),
            node("Unsqueeze", ["groups", "zero"], ["groups1"]), node("Div", ["heads", "groups"], ["per_group"]),
            node("Unsqueeze", ["per_group", "zero"], ["per_group1"]),
            node("Concat", ["zero", "zero", "groups1", "minus1"], ["group_shape"], axis=0)]


def decay_body() -> list:
    """decay [B, T, H] = A softplus(dt + dt_bias), through dt4 [B, T, H, 1] and sp, as `softplus_decay` matches."""
    from onnx import helper

    node = helper.make_node
    return [node("Reshape", ["dt", "per_head"], ["dt4"]), node("Add", ["dt4", "dt_bias"], ["dt_biased"]),
            node("Softplus", ["dt_biased"], ["sp"]), node("Mul", ["A", "sp"], ["log_decay"]),
            node("Reshape", ["log_decay", "flat"], ["decay"])]


def broadcast_body(keys: str) -> list:
    """k_heads [B, T, H * dk]: `keys` [B, T, G, dk] repeated per_group times each, as `key_broadcast` matches."""
    from onnx import helper

    node = helper.make_node
    return [node("Unsqueeze", [keys, "axis3"], ["k5"]),                         # [B, T, G, 1, dk]
            node("Concat", ["ones3", "per_group1", "one"], ["expand_shape"], axis=0),
            node("Expand", ["k5", "expand_shape"], ["k_expanded"]),
            node("Reshape", ["k_expanded", "flat"], ["k_heads"])]


def add_fused(proto, fused: dict[int, object], dropped: set[int], function) -> int:
    """`replace_in_place`, then the fused op's function `function(opsets)` once; how many nodes were fused."""
    if not fused:
        return 0
    replace_in_place(proto, fused, dropped)
    proto.functions.append(function({o.domain: o.version for o in proto.opset_import}))
    return len(fused)
