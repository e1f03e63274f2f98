"""The step graph's residual Add and the RMSNorm that reads it as one `com.microsoft::SkipSimplifiedLayerNormalization`
node (its fourth output is the sum, for the residual stream's next Add).

Every pre-norm block writes h = x + f(x) and then RMSNorm(h). ONNX Runtime fuses the norm's six nodes into one
SimplifiedLayerNormalization, but its own Add + norm fusion (SkipLayerNormFusion) takes LayerNormalization only, and
only an Add whose sum has no other reader, which a residual stream's sum always has. So the step kept 21 Adds and 21
norms for Qwen3.5's eight layers, each a node of a few microseconds of dispatch around a few hundred floats of work
(docs/performance.md#cpu-step-latency). A contrib op: no edgelin library needed, so it applies with --step-ops contrib too.

Matched only where the Add's two inputs are tensors of one shape (not a broadcast bias) and the norm is exactly the
six nodes `rms_norm` matches, over float32. Export-side module: imports onnx inside its functions.
"""

from __future__ import annotations

from edgelin.export.onnx.patterns import CONTRIB, GraphIndex, recorded_shapes, replace_in_place, rms_norm
from edgelin.export.panels import use_domain

OP = "SkipSimplifiedLayerNormalization"


def fuse_skip_norms(proto, float_tensors: set[str]) -> int:
    """Replace, in the graph `proto` (in place), every float32 Add(a, b) -> RMSNorm pair (the module docstring's
    pattern) with one SkipSimplifiedLayerNormalization(a, b, weight). Returns how many it fused."""
    from onnx import helper

    graph, shapes = GraphIndex(proto.graph), recorded_shapes(proto)
    at_add: dict[int, object] = {}  # id(the residual Add) -> the fused node that takes its place
    dropped: set[int] = set()
    for mul in proto.graph.node:
        if mul.op_type != "Mul" or mul.domain not in ("", "ai.onnx") or mul.output[0] not in float_tensors:
            continue
        norm = rms_norm(graph, mul.output[0])
        add = norm and graph.made_by(norm[0], "Add")
        if not add or id(add) in at_add:
            continue
        x, weight, epsilon, width, norm_nodes = norm
        a, b = add.input
        shape = shapes.get(a)
        if a in graph.constants or b in graph.constants or not shape or shape != shapes.get(b) \
                or shape[-1] != width or not {a, b, x} <= float_tensors:
            continue
        if not graph.closed(norm_nodes, {mul.output[0]}):  # the norm's inner tensors are read only inside it
            continue
        # the sum stays available (the 4th output) when anything besides the norm reads it
        norm_ids = {id(n) for n in norm_nodes}
        sum_read = x in graph.outputs or any(id(r) not in norm_ids for r in graph.readers[x])
        outputs = [mul.output[0], "", "", x] if sum_read else [mul.output[0]]
        at_add[id(add)] = helper.make_node(OP, [a, b, weight], outputs, name=f"{add.name}.skip_norm",
                                           domain=CONTRIB, epsilon=float(epsilon))
        dropped |= norm_ids
    if not at_add:
        return 0
    # each fused node where its Add was: its inputs exist there, and every reader of the sum or the norm comes after
    replace_in_place(proto, at_add, dropped)
    use_domain(proto, CONTRIB)
    return len(at_add)

