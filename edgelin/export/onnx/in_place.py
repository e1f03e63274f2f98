"""Which recurrent states an ONNX step graph may update in place (one buffer bound as both the past input
and the present output), found on the graph as written (edgelin.export.onnx.target records them in the
step graph's metadata for the runner: IN_PLACE_KEY).

Why: ping-pong buffers (the past in one set, the present written to another) double the state's cache
footprint, and each step writes to lines it has not read. Bound in place, a state's update writes over
what it just read: the Mamba2 peer's int4 step 1.20 -> 1.10 ms, int8 1.44 -> 1.36, fp32 2.91 -> 2.82 on one
thread (medians of five runs, issue 13's ninth session; docs/performance.md#cpu-step-latency).

When it is safe: ONNX Runtime runs nodes in an order that respects data dependencies and never writes a
graph input, so one buffer can serve both roles when every read of the past is finished before the
first write of the present, or reads the same element just before writing it. That holds when
  - every node that reads the past's data (or a view of it: Reshape, Squeeze, Unsqueeze, Flatten and
    Identity may hand out their input's buffer), directly or from inside a subgraph, other than the node
    that writes the present, is an ancestor of that node (it has finished before that node starts), and
  - the node that writes the present does not read the past, or is an elementwise Add/Sub/Mul/Div or
    Where (a sliding window's ring buffer): the past has the present's shape, so such a kernel reads
    each of its elements before it writes that element (ONNX Runtime reuses the input buffers of the
    first four for their outputs itself, MayInplace; its CPU Where selects from both inputs into
    temporaries before it writes the output).
A kernel such as a Concat, a MatMul or a Scan may write its output while it still reads its inputs: a
present they write from the past (a growing cache) keeps its ping-pong buffers, as does a present copied
from its past (Identity) or a past also read by a node that may run after the present is written.
ONNX Runtime's com.microsoft LinearAttention and CausalConvWithState (the step's recurrence and short conv,
edgelin.export.lowering) are checked to give bit-equal outputs with their past and present bound to one
buffer (tests/export/onnx/test_onnx_in_place.py: every update rule, batch 3).
"""

from __future__ import annotations

from typing import TYPE_CHECKING


if TYPE_CHECKING:
    import onnx

ELEMENTWISE = {"Add", "Sub", "Mul", "Div", "Where"}  # writers that may read the past (same element, before)
# contrib writers checked to read their past before writing it (tests/export/onnx/test_onnx_in_place.py)
# edgelin.ortops' own: each conv channel's window and each state row (the delta rules: the whole state) read first
IN_PLACE_CONTRIB = {("com.microsoft", "LinearAttention"), ("com.microsoft", "CausalConvWithState"),
                    ("ai.edgelin", "LinearAttention"), ("ai.edgelin", "CausalConvWithState")}
SHAPE_ONLY = {"Shape", "Size"}  # readers of a tensor's shape, never of its data
# ops whose output ONNX Runtime may place in their input's buffer (a view of the past is the past)
VIEWS = {"Reshape", "Squeeze", "Unsqueeze", "Flatten", "Identity"}


def _subgraph_reads(node: "onnx.NodeProto") -> set[str]:
    """Every value name a node's subgraphs (If, Loop, Scan bodies, nested) read: an over-approximation of
    the outer-scope values they capture (names the body defines itself are included too; harmless: the
    body's own names are not graph inputs)."""
    import onnx

    names: set[str] = set()
    for attribute in node.attribute:
        graphs = [attribute.g] if attribute.type == onnx.AttributeProto.GRAPH else list(attribute.graphs)
        for graph in graphs:
            for inner in graph.node:
                names.update(inner.input)
                names |= _subgraph_reads(inner)
    return names


def in_place_states(graph: "onnx.GraphProto", feeds: dict[str, str]) -> list[str]:
    """The past inputs (of `feeds`: present output name -> past input name) whose present output can share
    their buffer (the module docstring's test), in the order of `feeds`."""
    reads = [set(node.input) | _subgraph_reads(node) for node in graph.node]
    producer = {name: index for index, node in enumerate(graph.node) for name in node.output}

    def ancestors(index: int) -> set[int]:
        seen: set[int] = set()
        todo = [index]
        while todo:
            for name in reads[todo.pop()]:
                parent = producer.get(name)
                if parent is not None and parent not in seen:
                    seen.add(parent)
                    todo.append(parent)
        return seen

    standard = [node.domain in ("", "ai.onnx") for node in graph.node]
    data_readers = [set() if plain and node.op_type in SHAPE_ONLY | VIEWS else names  # a view's readers read it
                    for node, names, plain in zip(graph.node, reads, standard)]

    def views(past: str) -> set[str]:
        """The past and every view of it (ONNX nodes are in topological order: one pass)."""
        names = {past}
        for node, plain in zip(graph.node, standard):
            if plain and node.op_type in VIEWS and node.input and node.input[0] in names:
                names.add(node.output[0])
        return names

    safe = []
    for present, past in feeds.items():
        writer = producer.get(present)
        if writer is None:
            continue
        past_or_view = views(past)
        node = graph.node[writer]
        if reads[writer] & past_or_view and not (node.op_type in ELEMENTWISE and standard[writer]) \
                and (node.domain, node.op_type) not in IN_PLACE_CONTRIB:
            continue
        readers = {index for index, names in enumerate(data_readers) if names & past_or_view} - {writer}
        if readers <= ancestors(writer):
            safe.append(past)
    return safe
