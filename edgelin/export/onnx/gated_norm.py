"""--step-ops edgelin: a recurrence's gated output norm, RMSNorm(o) * w * silu(z) per head, as one
`ai.edgelin::GatedRmsNorm` node (the family spec's `output_gate=AFTER_NORM` with SiLU: Gated DeltaNet's and GLA's
output), and Mamba2's, the gate first, RMSNorm(o * silu(z)) * w over groups of the width (the whole width in
transformers' Mamba2 with n_groups 1; a head's values in edgelin's own), as one `ai.edgelin::GateThenRmsNorm` node
where the step had nine (Sigmoid, the two Muls, the norm's six) or eleven (with the groups' two Reshapes).

The step graph writes it as ~12 small nodes: o and the gate z each reshaped to [B, T, H, dv], the norm's six (Pow,
ReduceMean, Add, Sqrt, Div, Mul w), SiLU as Sigmoid and Mul, the gate's Mul and the reshape back; ONNX Runtime
fuses the norm and the SiLU and still runs six per layer. edgelin's library computes it in one
(edgelin/ortops/ops_gdn.c). Its ONNX function is those nodes, so without the library the step is the unfused
graph's. Matched only when the pattern is exact and no inner tensor has another reader.

Export-side module: imports onnx inside its functions.
"""

from __future__ import annotations

from edgelin.export.onnx.patterns import (GraphIndex, add_fused, attribute_constant, reshape_shape, rms_constants,
                                          rms_core, rms_nodes, rms_norm)
from edgelin.ortops import DOMAIN

NAME = "GatedRmsNorm"
GATE_FIRST = "GateThenRmsNorm"
INPUTS = ("x", "z", "weight")
OUTPUTS = ("y",)


def gated_norm_function(opsets: dict[str, int]):
    """ai.edgelin::GatedRmsNorm as ONNX ops (ops_gdn.c says what it computes), in the unfused graph's order."""
    from onnx import helper

    node = helper.make_node
    body = [
        *rms_constants(),
        node("Constant", [], ["zero"], value_ints=[0]), node("Constant", [], ["minus1"], value_ints=[-1]),
        node("Constant", [], ["flat"], value_ints=[0, 0, -1]),
        node("Shape", ["weight"], ["width"]),
        node("Concat", ["zero", "zero", "minus1", "width"], ["head_shape"], axis=0),   # [B, T, H, dv]
        node("Reshape", ["x", "head_shape"], ["x4"]),
        *rms_nodes("x4", "weight", "normed"),
        node("Reshape", ["z", "head_shape"], ["z4"]),
        node("Sigmoid", ["z4"], ["z_sigmoid"]),
        node("Mul", ["z4", "z_sigmoid"], ["silu"]),
        node("Mul", ["normed", "silu"], ["gated"]),
        node("Reshape", ["gated", "flat"], ["y"]),
    ]
    imports = [helper.make_opsetid("", opsets.get("", 18))]
    return helper.make_function(DOMAIN, NAME, list(INPUTS), list(OUTPUTS), body, imports, attributes=["epsilon"])


def gate_then_norm_function(opsets: dict[str, int]):
    """ai.edgelin::GateThenRmsNorm as ONNX ops (ops_gdn.c says what it computes): the gate, the gated values
    reshaped to groups of `group_size`, the norm's core per group, back to the input's shape, the weight."""
    from onnx import helper

    node = helper.make_node
    body = [
        *rms_constants(), node("Constant", [], ["zero"], value_ints=[0]),
        node("Constant", [], ["minus1"], value_ints=[-1]),
        node("Constant", [], ["one"], value_float=1.0),  # the core's weight: the real one comes after the groups
        attribute_constant("group", "group_size"), node("Constant", [], ["axis0"], value_ints=[0]),
        node("Unsqueeze", ["group", "axis0"], ["group1"]),
        node("Concat", ["zero", "zero", "minus1", "group1"], ["group_shape"], axis=0),  # [B, T, groups, group_size]
        node("Sigmoid", ["z"], ["z_sigmoid"]), node("Mul", ["z", "z_sigmoid"], ["silu"]),
        node("Mul", ["x", "silu"], ["gated"]), node("Reshape", ["gated", "group_shape"], ["gated4"]),
        *rms_nodes("gated4", "one", "unit4"), node("Shape", ["gated"], ["x_shape"]),
        node("Reshape", ["unit4", "x_shape"], ["unit"]), node("Mul", ["unit", "weight"], ["y"]),
    ]
    imports = [helper.make_opsetid("", opsets.get("", 18))]
    return helper.make_function(DOMAIN, GATE_FIRST, list(INPUTS), list(OUTPUTS), body, imports,
                                attributes=["epsilon", "group_size"])


def _silu_of(graph: GraphIndex, name: str):
    """For `name` = Mul(z, Sigmoid(z)): (z, the two nodes), else None."""
    mul = graph.made_by(name, "Mul")
    sigmoid = mul and next((s for s in map(lambda i: graph.made_by(i, "Sigmoid"), mul.input) if s), None)
    if not sigmoid or sorted(mul.input) != sorted([sigmoid.input[0], sigmoid.output[0]]):
        return None
    return sigmoid.input[0], [sigmoid, mul]


def _match_gate_first(graph: GraphIndex, out: str):
    """For out = Mul(norm core(Mul(x, silu(z))), w) (one group), or with the core between Reshape(gated -> [.., G,
    group]) and a Reshape back to [.., .., width] (groups): the fused node's inputs, epsilon, group size and the nodes
    it replaces, or None."""
    mul = graph.made_by(out, "Mul")
    weight = mul and [i for i in mul.input if i in graph.constants]
    if not weight or len(weight) != 1:
        return None
    width, inner = graph.constants[weight[0]], next(i for i in mul.input if i != weight[0])
    back = graph.made_by(inner, "Reshape")
    core = rms_core(graph, back.input[0] if back else inner)
    if not core:
        return None
    grouped, epsilon, core_nodes = core
    reshapes, group = [], width
    if back:  # the groups' Reshapes: into [..., groups, group] and back to [..., ..., width]
        split = graph.made_by(grouped, "Reshape")
        into, out_shape = split and reshape_shape(graph, split), reshape_shape(graph, back)
        if not into or not out_shape or len(out_shape) != 3 or out_shape[-1] != width or into[-1] <= 0 \
                or width % into[-1]:
            return None
        grouped, group, reshapes = split.input[0], into[-1], [split, back]
    gate = graph.made_by(grouped, "Mul")
    if not gate or len(gate.input) != 2:
        return None
    for x, silu in (gate.input, gate.input[::-1]):
        found = _silu_of(graph, silu)
        if found:
            break
    else:
        return None
    z, silu_nodes = found
    replaced = [*silu_nodes, gate, *reshapes, *core_nodes, mul]
    if not graph.closed(replaced, {out}):
        return None
    return [x, z, weight[0]], epsilon, group, replaced


def _match(graph: GraphIndex, gate):
    """For the gate's Mul(RMSNorm(Reshape(x)), Mul(z4, Sigmoid(z4))), z4 = Reshape(z), read by one Reshape: the
    fused node's inputs, its epsilon, its output and the nodes it replaces, or None."""
    if len(gate.input) != 2:
        return None
    for normed, silu in (gate.input, gate.input[::-1]):
        norm, mul_silu = rms_norm(graph, normed), graph.made_by(silu, "Mul")
        if norm and mul_silu:
            break
    else:
        return None
    x4, weight, epsilon, width, norm_nodes = norm
    reshape_x = graph.made_by(x4, "Reshape")
    sigmoid = next((s for s in map(lambda i: graph.made_by(i, "Sigmoid"), mul_silu.input) if s), None)
    z4 = sigmoid and sigmoid.input[0]
    reshape_z = z4 and sorted(mul_silu.input) == sorted([z4, sigmoid.output[0]]) and graph.made_by(z4, "Reshape")
    reshape_y = graph.only_reader(gate.output[0], "Reshape")
    if not (reshape_x and reshape_z and reshape_y) or (graph.values(reshape_x.input[1]) or [])[-1:] != [width]:
        return None
    replaced = [reshape_x, *norm_nodes, reshape_z, sigmoid, mul_silu, gate, reshape_y]
    if not graph.closed(replaced, {reshape_y.output[0]}):
        return None
    return [reshape_x.input[0], reshape_z.input[0], weight], epsilon, reshape_y.output[0], replaced


def fuse_gated_norms(proto, float_tensors: set[str]) -> int:
    """Replace, in the step graph `proto` (in place), every float32 gated output norm (the module docstring's
    patterns) with one ai.edgelin::GatedRmsNorm or GateThenRmsNorm node, and add each one's function once. Returns
    how many it fused."""
    return _fuse_norm_then_gate(proto, float_tensors) + _fuse_gate_then_norm(proto, float_tensors)


def _fuse_gate_then_norm(proto, float_tensors: set[str]) -> int:
    from onnx import helper

    graph = GraphIndex(proto.graph)
    fused: dict[int, object] = {}  # id(the norm's last Mul) -> the fused node that takes its place
    dropped: set[int] = set()
    for last in proto.graph.node:
        if last.op_type != "Mul" or last.domain not in ("", "ai.onnx") or last.output[0] not in float_tensors \
                or id(last) in dropped:
            continue
        found = _match_gate_first(graph, last.output[0])
        if found is None:
            continue
        inputs, epsilon, group, replaced = found
        fused[id(last)] = helper.make_node(GATE_FIRST, inputs, [last.output[0]], name=f"{last.name}.gate_then_norm",
                                           domain=DOMAIN, epsilon=float(epsilon), group_size=int(group))
        dropped |= {id(n) for n in replaced}
    return add_fused(proto, fused, dropped, gate_then_norm_function)


def _fuse_norm_then_gate(proto, float_tensors: set[str]) -> int:
    from onnx import helper

    graph = GraphIndex(proto.graph)
    fused: dict[int, object] = {}  # id(the gate's Mul) -> the fused node that takes its place
    dropped: set[int] = set()
    for gate in proto.graph.node:
        if gate.op_type != "Mul" or gate.domain not in ("", "ai.onnx") or gate.output[0] not in float_tensors \
                or id(gate) in dropped:
            continue
        found = _match(graph, gate)
        if found is None:
            continue
        inputs, epsilon, output, replaced = found
        fused[id(gate)] = helper.make_node(NAME, inputs, [output], name=f"{gate.name}.gated_norm", domain=DOMAIN,
                                           epsilon=float(epsilon))
        dropped |= {id(n) for n in replaced}
    return add_fused(proto, fused, dropped, gated_norm_function)
