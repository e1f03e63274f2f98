"""--step-ops edgelin: a gated MLP's activation, silu(gate) * up, as one `ai.edgelin::SiluGate` node reading the fused
gate/up product (edgelin.export.fuse_matmuls makes the two projections one MatMul and a Split).

The step graph writes it as four nodes: the Split into two halves, SiLU as Sigmoid and Mul, the gate's Mul. ONNX
Runtime fuses the SiLU (QuickGelu) and still runs three per MLP. edgelin's library computes it in one
(edgelin/ortops/ops_mlp.c); its ONNX function is those nodes, so without the library the step is the unfused graph's.
Matched only when the Split cuts the last axis into two equal halves and no inner tensor has another reader.

Export-side module: imports onnx inside its functions.
"""

from __future__ import annotations

from edgelin.export.onnx.patterns import GraphIndex, add_fused
from edgelin.ortops import DOMAIN

NAME = "SiluGate"
INPUTS = ("x",)
OUTPUTS = ("y",)


def silu_gate_function(opsets: dict[str, int]):
    """ai.edgelin::SiluGate as ONNX ops (ops_mlp.c says what it computes), in the unfused graph's order."""
    from onnx import helper

    node = helper.make_node
    body = [node("Split", ["x"], ["gate", "up"], axis=-1, num_outputs=2),
            node("Sigmoid", ["gate"], ["gate_sigmoid"]), node("Mul", ["gate", "gate_sigmoid"], ["silu"]),
            node("Mul", ["silu", "up"], ["y"])]
    imports = [helper.make_opsetid("", opsets.get("", 18))]  # (exports are opset >= 18: Split's num_outputs)
    return helper.make_function(DOMAIN, NAME, list(INPUTS), list(OUTPUTS), body, imports)


def _match(graph: GraphIndex, split):
    """For Split(x) -> gate, up (two equal halves of the last axis) read only by Mul(Mul(gate, Sigmoid(gate)), up):
    (x, the gate Mul's output, the nodes it replaces) or None."""
    axis = next((a.i for a in split.attribute if a.name == "axis"), 0)
    sizes = graph.values(split.input[1]) if len(split.input) == 2 else None
    if axis != -1 or len(split.output) != 2 or not sizes or len(sizes) != 2 or sizes[0] != sizes[1]:
        return None
    gate, up = split.output
    sigmoid = next((r for r in graph.readers[gate] if r.op_type == "Sigmoid" and r.domain in ("", "ai.onnx")), None)
    silu = sigmoid and graph.only_reader(sigmoid.output[0], "Mul")
    if not silu or sorted(silu.input) != sorted([gate, sigmoid.output[0]]):
        return None
    product = graph.only_reader(silu.output[0], "Mul")
    if not product or sorted(product.input) != sorted([silu.output[0], up]):
        return None
    replaced = [split, sigmoid, silu, product]
    return (split.input[0], product.output[0], replaced) if graph.closed(replaced, {product.output[0]}) else None


def fuse_silu_gates(proto, float_tensors: set[str]) -> int:
    """Replace, in the step graph `proto` (in place), every float32 silu(gate) * up of a split product (the module
    docstring's pattern) with one ai.edgelin::SiluGate node, and add its function once. Returns how many it fused."""
    from onnx import helper

    graph = GraphIndex(proto.graph)
    fused: dict[int, object] = {}  # id(the Split) -> the fused node that takes its place
    dropped: set[int] = set()
    for split in proto.graph.node:
        if split.op_type != "Split" or split.domain not in ("", "ai.onnx"):
            continue
        found = _match(graph, split)
        if found is None or found[1] not in float_tensors:  # (the fused product itself has no recorded type)
            continue
        x, output, replaced = found
        fused[id(split)] = helper.make_node(NAME, [x], [output], name=f"{split.name}.silu_gate", domain=DOMAIN)
        dropped |= {id(n) for n in replaced}
    return add_fused(proto, fused, dropped, silu_gate_function)
