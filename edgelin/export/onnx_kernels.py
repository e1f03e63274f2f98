"""--step-ops edgelin: the step graph's 4-bit weight products routed to edgelin's ONNX Runtime operator library
(edgelin.ortops), with ONNX Runtime's own op as the fallback inside the same file.

Each `com.microsoft::MatMulNBits` of the step graph that the library's kernel takes (4 bits, 32-weight blocks,
float32 activations; --quantize int4 with the default block size) moves to the `ai.edgelin` domain, inputs, attributes and packed weights unchanged, and the
graph gains one ONNX function `ai.edgelin::MatMulNBits` whose body is the `com.microsoft` node with the caller's
attributes (attribute references). ONNX Runtime picks a registered kernel for a node before it inlines the
node's function, so a session with the library runs edgelin's kernel and a session without it runs the body:
ONNX Runtime's own kernel, bit for bit what a `--step-ops contrib` export computes (tests/test_ortops.py). The
prefill graph keeps ONNX Runtime's kernels (many rows at once: its GEMM path).

Export-side module: imports onnx inside its functions.
"""

from __future__ import annotations

from pathlib import Path

from edgelin.ortops import DOMAIN

OP = "MatMulNBits"
_ATTRIBUTES = ("K", "N", "bits", "block_size", "accuracy_level")
_INPUTS = ("A", "B", "scales", "zero_points")
_FLOAT = 1  # onnx.TensorProto.FLOAT


def _takes(node, attrs: dict, float_inputs: set[str]) -> bool:
    """Whether edgelin's kernel computes this MatMulNBits: 4 bits, blocks of 32, float32 activations, no group
    index or bias (inputs past the zero points)."""
    return (node.domain == "com.microsoft" and node.op_type == OP and attrs.get("bits") == 4
            and attrs.get("block_size") == 32 and node.input[0] in float_inputs and len(node.input) <= len(_INPUTS))


def _float_tensors(proto) -> set[str]:
    """Names of the float32 tensors the graph's shape inference knows (inputs, outputs, value_info)."""
    import onnx

    inferred = onnx.shape_inference.infer_shapes(proto, data_prop=False)
    infos = [*inferred.graph.input, *inferred.graph.output, *inferred.graph.value_info]
    return {v.name for v in infos if v.type.tensor_type.elem_type == _FLOAT}


def fallback_function(opsets: dict[str, int]):
    """ai.edgelin::MatMulNBits as a function of com.microsoft::MatMulNBits (same inputs and attributes)."""
    from onnx import AttributeProto, helper

    body = helper.make_node(OP, list(_INPUTS), ["Y"], domain="com.microsoft")
    body.attribute.extend(helper.make_attribute_ref(name, AttributeProto.INT) for name in _ATTRIBUTES)
    imports = [helper.make_opsetid("com.microsoft", 1), helper.make_opsetid("", opsets.get("", 18))]
    return helper.make_function(DOMAIN, OP, list(_INPUTS), ["Y"], [body], imports, attributes=list(_ATTRIBUTES))


def route_to_edgelin_kernels(path: Path) -> int:
    """Rewrite the graph at `path` (its weights stay where they are) as the module docstring says; returns how
    many nodes now run edgelin's kernel (0: the file is left as it was)."""
    import onnx
    from onnx import helper

    proto = onnx.load(str(path), load_external_data=False)
    floats = _float_tensors(proto)
    routed = 0
    for node in proto.graph.node:
        attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        if _takes(node, attrs, floats):
            node.domain = DOMAIN
            routed += 1
    if routed:
        opsets = {o.domain: o.version for o in proto.opset_import}
        if DOMAIN not in opsets:
            proto.opset_import.append(helper.make_opsetid(DOMAIN, 1))
        proto.functions.append(fallback_function(opsets))
        onnx.save(proto, str(path))
    return routed
