"""--step-ops edgelin: the step graph's 4-bit and 8-bit weight products, short convs, recurrences and KV-cache
attention routed to edgelin's ONNX Runtime operator library (edgelin.ortops), with ONNX Runtime's own op as the
fallback inside the same file.

Each step-graph node the library's kernels take moves from the `com.microsoft` domain to `ai.edgelin`, inputs,
attributes and weights unchanged: `MatMulNBits` with 4 or 8 bits, 32-weight blocks and float32 activations
(--quantize int4 / int8 with the default block size), `CausalConvWithState` (the short conv; float32 graphs, SiLU),
`LinearAttention` (the recurrence; float32 graphs, every update rule) and `GroupQueryAttention` (full-context
attention over the float32 static KV cache of --kv-cache static); before that, each Mamba2 layer's step around
its recurrence becomes one `ai.edgelin::SsdRecurrence` node (edgelin.export.onnx.ssd), each Gated DeltaNet
layer's step into its recurrence one `ai.edgelin::GatedDeltaRecurrence` node (edgelin.export.onnx.gdn), its
gated output norm one `ai.edgelin::GatedRmsNorm` (edgelin.export.onnx.gated_norm; Mamba2's, the gate first, one
`ai.edgelin::GateThenRmsNorm`, per group of the width) and a gated MLP's silu(gate) * up
one `ai.edgelin::SiluGate` (edgelin.export.onnx.silu_gate). The graph gains, per routed op
type, one ONNX function `ai.edgelin::<op>` whose body is the original node with the caller's attributes (attribute
references). ONNX Runtime picks a registered kernel for a node before it inlines the node's function, so a session
with the library runs edgelin's kernels and a session without it runs the bodies: ONNX Runtime's own kernels, bit
for bit what a `--step-ops contrib` export computes (tests/ortops/test_ortops.py, test_ortops_matmul.py).
The prefill graph keeps ONNX Runtime's kernels but for its 4-bit and 8-bit products (MatMulNBits), which take
edgelin's kernel too (for all of a piece's tokens at once): ONNX Runtime prepacks its own MatMulNBits weights into a
private copy per session, so each session held a copy of every quantised weight beside the mapped file.

Export-side module: imports onnx inside its functions.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from edgelin.export.onnx.gated_norm import fuse_gated_norms
from edgelin.export.onnx.gdn import fuse_gated_delta_steps
from edgelin.export.panels import use_domain
from edgelin.export.onnx.silu_gate import fuse_silu_gates
from edgelin.export.onnx.ssd import fuse_ssd_steps
from edgelin.ortops import DOMAIN

_FLOAT, _FLOAT16 = 1, 10  # onnx.TensorProto.FLOAT, FLOAT16
_ATTR_FLOAT, _INT, _STRING = 1, 2, 3  # onnx.AttributeProto.FLOAT, INT, STRING


@dataclass(frozen=True)
class RoutedOp:
    """An op edgelin's library also implements: its inputs, outputs and attributes (name, type), and the domain of
    the op it stands in for (its function body)."""

    name: str
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    attributes: tuple[tuple[str, int], ...]
    domain: str = "com.microsoft"


MATMUL = RoutedOp("MatMulNBits", ("A", "B", "scales", "zero_points"), ("Y",),
                  (("K", _INT), ("N", _INT), ("bits", _INT), ("block_size", _INT), ("accuracy_level", _INT)))
CONV = RoutedOp("CausalConvWithState", ("input", "weight", "bias", "past_state"), ("output", "present_state"),
                (("activation", _STRING), ("ndim", _INT)))
RECURRENCE = RoutedOp("LinearAttention", ("query", "key", "value", "past_state", "decay", "beta"),
                      ("output", "present_state"), (("update_rule", _STRING), ("q_num_heads", _INT),
                                                    ("kv_num_heads", _INT), ("scale", _ATTR_FLOAT)))
ATTENTION = RoutedOp("GroupQueryAttention", ("query", "key", "value", "past_key", "past_value", "seqlens_k",
                                             "total_sequence_length"), ("output", "present_key", "present_value"),
                     (("num_heads", _INT), ("kv_num_heads", _INT), ("scale", _ATTR_FLOAT), ("do_rotary", _INT),
                      ("local_window_size", _INT), ("softcap", _ATTR_FLOAT), ("smooth_softmax", _INT)))


def _takes(node, attrs: dict, float_inputs: set[str], half_inputs: frozenset[str] = frozenset()) -> RoutedOp | None:
    """The op edgelin's kernels compute this node as, else None (float32 weight products are not routed: they are
    packed first, edgelin.export.panels). MatMulNBits: 4 or 8 bits, blocks of 32, float32
    activations, no group index or bias (inputs past the zero points). CausalConvWithState: float32, SiLU,
    one spatial dimension, a past state. LinearAttention: float32, a past state, an explicit non-zero scale and
    none of the prefill attributes (chunk_size, state_window). GroupQueryAttention: float32, or float16 (an fp16
    KV cache: the library's float16 kernel of the op), separate query, key and value, a past KV cache, no rotary,
    local window, softcap or smooth softmax (edgelin's static-cache export)."""
    typed = node.input and (node.input[0] in float_inputs
                            or (node.op_type == ATTENTION.name and node.input[0] in half_inputs))
    if node.domain != "com.microsoft" or not typed:
        return None
    if node.op_type == MATMUL.name and attrs.get("bits") in (4, 8) and attrs.get("block_size") == 32 \
            and len(node.input) <= len(MATMUL.inputs):
        return MATMUL
    if node.op_type == CONV.name and attrs.get("activation") in ("silu", b"silu") and attrs.get("ndim", 1) == 1 \
            and len(node.input) == len(CONV.inputs) and node.input[3]:
        return CONV
    if node.op_type == RECURRENCE.name and attrs.get("scale") and not {"chunk_size", "state_window"} & set(attrs) \
            and len(node.input) > 3 and node.input[3]:
        return RECURRENCE
    if node.op_type == ATTENTION.name and len(node.input) == len(ATTENTION.inputs) and all(node.input) \
            and not attrs.get("do_rotary") and attrs.get("local_window_size", -1) == -1 and not attrs.get("softcap") \
            and not attrs.get("smooth_softmax"):
        return ATTENTION
    return None


def float_tensor_names(proto, elem_type: int = _FLOAT) -> set[str]:
    """Names of the float32 (or `elem_type`) tensors the graph's shape inference knows (inputs, outputs,
    value_info)."""
    import onnx

    inferred = onnx.shape_inference.infer_shapes(proto, data_prop=False)
    infos = [*inferred.graph.input, *inferred.graph.output, *inferred.graph.value_info]
    return {v.name for v in infos if v.type.tensor_type.elem_type == elem_type}


def fallback_function(op: RoutedOp, opsets: dict[str, int]):
    """ai.edgelin::<op> as a function of <op>'s own (com.microsoft's or ONNX's; same inputs, outputs and
    attributes)."""
    from onnx import helper

    body = helper.make_node(op.name, list(op.inputs), list(op.outputs), domain=op.domain)
    body.attribute.extend(helper.make_attribute_ref(name, kind) for name, kind in op.attributes)
    imports = [helper.make_opsetid("", opsets.get("", 18))]
    if op.domain:
        imports.insert(0, helper.make_opsetid(op.domain, 1))
    return helper.make_function(DOMAIN, op.name, list(op.inputs), list(op.outputs), [body], imports,
                                attributes=[name for name, _ in op.attributes])


def route_to_edgelin_kernels(path: Path, products_only: bool = False) -> int:
    """Rewrite the graph at `path` (its weights stay where they are) as the module docstring says; returns how
    many nodes now run edgelin's kernels (0: the file is left as it was). `products_only` (the prefill graph):
    its 4-bit and 8-bit weight products and nothing else, so that both graphs read one mapping of the weights
    instead of ONNX Runtime prepacking a private copy per session (peak RSS, docs/performance.md#cpu-step-latency)."""
    import onnx

    proto = onnx.load(str(path), load_external_data=False)
    count = route_graph(proto, products_only)
    if count:
        onnx.save(proto, str(path))
    return count


def route_graph(proto, products_only: bool = False) -> int:
    """route_to_edgelin_kernels on a loaded ModelProto, in place; returns how many nodes it routed."""
    from onnx import helper

    floats = float_tensor_names(proto)
    # float16 inputs only matter to the attention node, which a products-only pass does not route
    halves = frozenset() if products_only else frozenset(float_tensor_names(proto, _FLOAT16))
    routed: dict[str, RoutedOp] = {}
    count = 0
    if not products_only:  # each Mamba2 and Gated DeltaNet step around its recurrence first, the gated output norms
        # and the gated MLPs' activations (edgelin.export.onnx.ssd, onnx_gdn, onnx_gated_norm, onnx_silu_gate)
        count = fuse_ssd_steps(proto, floats) + fuse_gated_delta_steps(proto, floats)
        count += fuse_gated_norms(proto, floats) + fuse_silu_gates(proto, floats)
    for node in proto.graph.node:
        op = _takes(node, {a.name: helper.get_attribute_value(a) for a in node.attribute}, floats, halves)
        if op is not None and (op is MATMUL or not products_only):
            node.domain = DOMAIN
            routed[op.name] = op
            count += 1
    if count:
        use_domain(proto, DOMAIN)
        opsets = {o.domain: o.version for o in proto.opset_import}
        proto.functions.extend(fallback_function(op, opsets) for op in routed.values())
    return count


def fuse_contrib_steps(path: Path, rotary_positions: int | None = None) -> int:
    """--step-ops contrib and edgelin: the step graph at `path` (its weights stay where they are) with each residual
    Add + RMSNorm as one SkipSimplifiedLayerNormalization (edgelin.export.onnx.skip_norm) and, given
    `rotary_positions` (a static KV cache's capacity), each rotary as one RotaryEmbedding (edgelin.export.onnx.rotary):
    ONNX Runtime's contrib ops, no edgelin library needed. Saved only when something fused; returns how many."""
    import onnx

    from edgelin.export.onnx.rotary import fuse_rotary
    from edgelin.export.onnx.skip_norm import fuse_skip_norms

    proto = onnx.load(str(path), load_external_data=False)
    floats = float_tensor_names(proto)
    count = fuse_skip_norms(proto, floats) + (fuse_rotary(proto, rotary_positions, floats) if rotary_positions else 0)
    if count:
        onnx.save(proto, str(path))
    return count
