"""--step-ops edgelin, Gated DeltaNet (Qwen3.5's linear layers): each layer's step into its recurrence as one
`ai.edgelin::GatedDeltaRecurrence` node.

The step graph feeds the gated delta rule (com.microsoft `LinearAttention`, update rule gated_delta, one decay per
head) through ~26 small nodes: q and k each reshaped to their heads and L2-normalised (written as RMSNorm, six nodes
each: edgelin.export.lowering's `l2_normalize`), the key heads broadcast to the value heads (Unsqueeze, Expand,
Reshape), the decay's softplus path (Reshape, Add dt_bias, Softplus, Mul A, Reshape), beta's Sigmoid and the
reshapes into the recurrence. ONNX Runtime pays a kernel launch for each (after its own fusions, ~17 per layer);
edgelin's library computes the lot in one (edgelin/ortops/ops_gdn.c). The fused node reads the Split pieces, the
constants and the state, and writes the recurrence's own outputs; its ONNX function (the fallback, for a runtime
without the library) computes them with the same ONNX ops and the com.microsoft op, so it gives what the unfused
graph gives.

A recurrence is fused only when its neighbourhood is exactly that pattern (the gated_deltanet family's step as
edgelin exports it) and no intermediate tensor has another reader; anything else (a beta scale, a per-key decay,
a spec variant that adds a node) is left as it was.

Export-side module: imports onnx inside its functions.
"""

from __future__ import annotations

from edgelin.export.onnx.patterns import (GraphIndex, add_fused, broadcast_body, decay_body, head_constants,
                                          key_broadcast, recurrence_node, recurrences, reshape_shape, rms_constants,
                                          rms_nodes, rms_norm, softplus_decay)
from edgelin.ortops import DOMAIN

NAME = "GatedDeltaRecurrence"
INPUTS = ("q", "k", "v", "dt", "b", "past_state", "dt_bias", "A", "q_scale", "k_scale")
OUTPUTS = ("output", "present_state")


def gdn_function(opsets: dict[str, int]):
    """ai.edgelin::GatedDeltaRecurrence as ONNX ops around com.microsoft::LinearAttention (ops_gdn.c says what it
    computes), in the unfused graph's order of operations."""
    from onnx import helper

    node = helper.make_node
    body = [
        *head_constants(), *rms_constants(),
        node("Reshape", ["q", "group_shape"], ["q4"]),                                    # [B, T, G, dk]
        *rms_nodes("q4", "q_scale", "q_unit"),
        node("Reshape", ["q_unit", "flat"], ["q_heads"]),
        node("Reshape", ["k", "group_shape"], ["k4"]),
        *rms_nodes("k4", "k_scale", "k_unit"),
        *broadcast_body("k_unit"),
        node("Reshape", ["v", "flat"], ["v_flat"]),
        *decay_body(),
        node("Sigmoid", ["b"], ["b_gate"]),
        node("Reshape", ["b_gate", "flat"], ["beta"]),
        recurrence_node(["q_heads", "k_heads", "v_flat", "past_state", "decay", "beta"], list(OUTPUTS),
                        "gated_delta"),
    ]
    imports = [helper.make_opsetid("com.microsoft", 1), helper.make_opsetid("", opsets.get("", 18))]
    return helper.make_function(DOMAIN, NAME, list(INPUTS), list(OUTPUTS), body, imports,
                                attributes=["q_num_heads", "kv_num_heads", "scale", "epsilon"])


def _heads(graph: GraphIndex, normed: str, groups: int):
    """The normalised heads' path: (the pre-reshape tensor [B, T, groups * dk], weight, eps, dk, its nodes)."""
    norm = rms_norm(graph, normed)
    reshape = norm and graph.made_by(norm[0], "Reshape")
    if not reshape or (reshape_shape(graph, reshape) or [])[2:3] != [groups]:
        return None
    return reshape.input[0], norm[1], norm[2], norm[3], [*norm[4], reshape]


def _match(graph: GraphIndex, la, groups: int, heads: int):
    """The fused node's inputs, its epsilon and the nodes it replaces, or None."""
    reshape_q = graph.made_by(la.input[0], "Reshape")
    keys = key_broadcast(graph, la.input[1], groups, heads)
    reshape_v = graph.made_by(la.input[2], "Reshape")
    decay = softplus_decay(graph, la.input[4], heads)
    reshape_beta = graph.made_by(la.input[5], "Reshape")
    sigmoid = reshape_beta and graph.made_by(reshape_beta.input[0], "Sigmoid")
    if None in (reshape_q, keys, reshape_v, decay) or not sigmoid:
        return None
    q, k = _heads(graph, reshape_q.input[0], groups), _heads(graph, keys[0], groups)
    if None in (q, k) or q[2] != k[2] or q[3] != k[3]:
        return None  # one epsilon and one head size for both
    dt, dt_bias, a, _, decay_nodes = decay
    replaced = [reshape_q, *q[4], *keys[1], *k[4], reshape_v, *decay_nodes, reshape_beta, sigmoid, la]
    if not graph.closed(replaced, set(la.output)):
        return None  # an intermediate tensor has a reader outside the pattern
    inputs = [q[0], k[0], reshape_v.input[0], dt, sigmoid.input[0], la.input[3], dt_bias, a, q[1], k[1]]
    return inputs, q[2], replaced


def fuse_gated_delta_steps(proto, float_tensors: set[str]) -> int:
    """Replace, in the step graph `proto` (in place), every Gated DeltaNet step into a float32 per-head-decay
    com.microsoft LinearAttention (gated_delta) with one ai.edgelin::GatedDeltaRecurrence node, and add its function
    once. Returns how many it fused."""
    from onnx import helper

    graph = GraphIndex(proto.graph)
    fused: dict[int, object] = {}  # id(the recurrence node) -> the fused node that takes its place
    dropped: set[int] = set()
    for la, attrs in recurrences(proto, "gated_delta", 6, float_tensors):
        found = _match(graph, la, int(attrs.get("q_num_heads", 0)), int(attrs.get("kv_num_heads", 0)))
        if found is None:
            continue
        inputs, epsilon, replaced = found
        fused[id(la)] = helper.make_node(NAME, inputs, list(la.output), name=f"{la.name}.gdn", domain=DOMAIN,
                                         q_num_heads=attrs["q_num_heads"], kv_num_heads=attrs["kv_num_heads"],
                                         scale=float(attrs["scale"]), epsilon=float(epsilon))
        dropped |= {id(n) for n in replaced}
    return add_fused(proto, fused, dropped, gdn_function)
