"""The step's rotary embedding as `com.microsoft::RotaryEmbedding` nodes, for a static KV cache (--kv-cache static
--context N: positions below N).

The step graph writes rotate-half rotary on q and k per attention layer as eight nodes each (the rotated and passed
slices, the halves, Neg, Concat, the cos and sin Muls, their Add, the Concat with the passed part) before the reshape
to [B, T, heads x head_dim], plus ~10 shared nodes that compute cos and sin from the positions. ONNX Runtime's
RotaryEmbedding contrib op does one head tensor's (partial) rotary in one node, reading cos and sin from tables of
N rows: each q and k becomes a Reshape and one RotaryEmbedding, and the cos/sin nodes go. The tables are what the
graph computed, cos / sin(float32(p) x inv_freq) in float32, for p < N (a static cache never holds more). 36 of the
Qwen3.5 peer's ~180 step nodes (issue 13; docs/performance.md#cpu-step-latency).

Matched only where the pattern is exact: the slices of the last axis (rot, then the rest; the two halves of the
rot part; over the whole head, the halves of the head), the frequencies a constant of rot / 2 values times the cast
positions, the result reshaped to 3-D (GroupQueryAttention's layout; a float16 KV cache's Cast before it is kept,
after the float32 rotary), float32 heads, and no inner tensor read outside.
Export-side module: imports onnx and numpy inside its functions.
"""

from __future__ import annotations

from edgelin.export.onnx.patterns import CONTRIB, GraphIndex, recorded_shapes, replace_in_place
from edgelin.export.panels import use_domain

OP = "RotaryEmbedding"
FLAT = "rotary.flat_shape"  # the [0, 0, -1] a Reshape to [B, T, heads x head_dim] reads


def _slice(graph: GraphIndex, name: str, rank: int):
    """(input, start, end) of a Slice of the last axis with step 1 that makes `name`, or None."""
    node = graph.made_by(name, "Slice")
    if not node or len(node.input) < 4:
        return None
    starts, ends, axes = (graph.values(i) for i in node.input[1:4])
    steps = graph.values(node.input[4]) if len(node.input) > 4 and node.input[4] else [1]
    if None in (starts, ends, axes, steps) or len(starts) != 1 or axes[0] not in (-1, rank - 1) or steps != [1]:
        return None
    return node, node.input[0], int(starts[0]), int(ends[0])


def _angles(graph: GraphIndex, table: str, kind: str, half: int):
    """`table` = Unsqueeze(Concat(f(angles), f(angles))), f = Cos or Sin, angles = Mul(Unsqueeze(Cast(positions)),
    inv_freq of `half` values): (positions, inv_freq, the nodes) or None."""
    unsqueeze = graph.made_by(table, "Unsqueeze")
    concat = unsqueeze and graph.made_by(unsqueeze.input[0], "Concat")
    if not concat or len(concat.input) != 2 or concat.input[0] != concat.input[1]:
        return None
    trig = graph.made_by(concat.input[0], kind)
    mul = trig and graph.made_by(trig.input[0], "Mul")
    pair = mul and graph.pair(mul, half)
    inner = pair and graph.made_by(pair[1], "Unsqueeze")
    cast = inner and graph.made_by(inner.input[0], "Cast")
    if not cast:
        return None
    return cast.input[0], pair[0], [unsqueeze, concat, trig, mul, inner, cast]


def _match(graph: GraphIndex, shapes: dict, floats: set[str], neg):
    """Around a Neg of rotate-half: (x, positions, inv_freq, rot, heads, the 3-D output, nodes replaced) or None.
    Partial rotary slices x [B, T, H, D] into its first rot channels and the rest and concatenates them back; over
    the whole head (rot = D) the halves are sliced from x itself."""
    cat = graph.only_reader(neg.output[0], "Concat")
    if not cat or len(cat.input) != 2 or cat.input[0] != neg.output[0]:
        return None
    shape = shapes.get(cat.input[1])
    rank = len(shape) if shape else 0
    second, first = _slice(graph, neg.input[0], rank), _slice(graph, cat.input[1], rank)
    if rank != 4 or not second or not first or second[1] != first[1]:
        return None
    half, r = first[3] - first[2], first[1]
    if first[2] != 0 or second[2] != half or second[3] < 2 * half:
        return None
    rotated = _slice(graph, r, rank)
    partial = rotated is not None and rotated[2] == 0 and rotated[3] == 2 * half
    x, rot = rotated[1] if partial else r, 2 * half
    x_shape = shapes.get(x)
    if not x_shape or len(x_shape) != 4 or not all(isinstance(d, int) for d in x_shape[2:]) or x not in floats:
        return None
    passed = next((_slice(graph, o.output[0], rank) for o in graph.readers[x] if o is not rotated[0]), None) \
        if partial else None
    if partial and (not passed or passed[2] != rot or passed[3] < x_shape[3]) or not partial and rot != x_shape[3]:
        return None
    mul_sin = graph.only_reader(cat.output[0], "Mul")
    add = mul_sin and graph.only_reader(mul_sin.output[0], "Add")
    mul_cos = add and next((graph.made_by(i, "Mul") for i in add.input if i != mul_sin.output[0]), None)
    if not mul_cos or r not in mul_cos.input:
        return None
    sin_table = next(i for i in mul_sin.input if i != cat.output[0])
    cos_table = next(i for i in mul_cos.input if i != r)
    out = graph.only_reader(add.output[0], "Concat") if partial else add
    joined = out and (not partial or list(out.input) == [add.output[0], passed[0].output[0]])
    cast = joined and graph.only_reader(out.output[0], "Cast")  # (to a float16 KV cache's dtype)
    reshape = joined and graph.only_reader((cast or out).output[0], "Reshape")
    sin, cos = _angles(graph, sin_table, "Sin", half), _angles(graph, cos_table, "Cos", half)
    if not reshape or not sin or not cos or sin[:2] != cos[:2] or len(shapes.get(reshape.output[0]) or []) != 3:
        return None
    replaced = [second[0], first[0], neg, cat, mul_sin, mul_cos, add, reshape]
    replaced += ([rotated[0], passed[0], out] if partial else []) + ([cast] if cast else [])
    if not graph.closed(replaced, {reshape.output[0]}):
        return None
    return x, sin[0], sin[1], rot, x_shape[2], reshape.output[0], replaced, cast


def fuse_rotary(proto, positions: int, floats: set[str]) -> int:
    """Replace, in the step graph `proto` (in place), each rotate-half rotary (the module docstring's pattern) with
    a Reshape to [B, T, heads x head_dim] and one RotaryEmbedding over cos / sin tables of `positions` rows, and drop
    the cos / sin nodes no longer read. Only float32 heads (`floats`: the graph's float32 tensors; the tables are
    float32). Returns how many it fused."""
    import numpy as np
    from onnx import helper, numpy_helper

    graph, shapes = GraphIndex(proto.graph), recorded_shapes(proto)
    at: dict[int, list] = {}  # id(the final Reshape) -> the nodes that take its place (every input exists there)
    dropped: set[int] = set()
    tables: dict[str, tuple[str, str]] = {}  # inv_freq -> (cos table, sin table)
    for neg in [n for n in proto.graph.node if n.op_type == "Neg" and n.domain in ("", "ai.onnx")]:
        found = _match(graph, shapes, floats, neg)
        if found is None or any(id(n) in dropped for n in found[6]):
            continue
        x, position_ids, inv_freq, rot, heads, output, replaced, cast = found
        if inv_freq not in tables:
            angles = np.arange(positions, dtype=np.float32)[:, None] * np.asarray(
                graph.values(inv_freq), np.float32)[None, :]  # float32, as the graph multiplies them
            names = (f"{inv_freq}.cos_cache", f"{inv_freq}.sin_cache")
            proto.graph.initializer.extend([numpy_helper.from_array(np.cos(angles).astype(np.float32), names[0]),
                                            numpy_helper.from_array(np.sin(angles).astype(np.float32), names[1])])
            tables[inv_freq] = names
        flat = f"{output}.heads_flat"
        rotated = f"{output}.rotated" if cast else output
        at[id(replaced[7])] = [  # (the final Reshape)
            helper.make_node("Reshape", [x, FLAT], [flat], name=f"{output}.rotary_flat"),
            helper.make_node(OP, [flat, position_ids, *tables[inv_freq]], [rotated], name=f"{output}.rotary",
                             domain=CONTRIB, interleaved=0, num_heads=heads, rotary_embedding_dim=rot)]
        if cast:  # the float32 result cast as the graph cast it
            at[id(replaced[7])].append(helper.make_node("Cast", [rotated], [output], name=f"{output}.rotary_cast",
                                                        to=next(a.i for a in cast.attribute if a.name == "to")))
        dropped |= {id(n) for n in replaced}
    if not at:
        return 0
    proto.graph.initializer.append(numpy_helper.from_array(np.array([0, 0, -1], np.int64), FLAT))
    replace_in_place(proto, at, dropped)
    _drop_unread(proto)
    use_domain(proto, CONTRIB)
    return len(at)


def _drop_unread(proto) -> None:
    """Drop nodes none of whose outputs is read or a graph output (the cos / sin path), until none is left."""
    outputs = {o.name for o in proto.graph.output}
    while True:
        read = {name for n in proto.graph.node for name in n.input} | outputs
        kept = [n for n in proto.graph.node if any(o in read for o in n.output if o)]
        if len(kept) == len(proto.graph.node):
            return
        del proto.graph.node[:]
        proto.graph.node.extend(kept)

