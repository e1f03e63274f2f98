"""Weights packed in column panels for edgelin's weight products (ai.edgelin::MatMulF32 and MatMulF16;
edgelin/ortops/panels.c).

ONNX's MatMul stores a weight [K, N] row-major. Decoding reads every weight once per token, so a step's products
run at the rate the weights stream in, and in that layout a slice of rows is many short streams N values apart.
Packed as [ceil(N / 16), K, 16] (panel p: columns 16p .. 16p + 15, zeros past N) each panel is one contiguous piece
of memory and the panels follow one another: the hardware prefetchers' best case (on the Mamba2 peer's float16
step: 2.2 -> 1.1 ms; docs/performance.md#cpu-step-latency). Both graphs read the packed weight (one copy in weights.bin);
each node carries `n` (N) and an ONNX function body that unpacks the panels for ONNX's MatMul, which runs where
edgelin's library is not loaded.

Export-side module: imports onnx and numpy inside its functions.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import numpy as np

    from edgelin.export.weights import DataSpill

# The layout's read side (what a reader of the artifact needs) is edgelin.artifact.quantized's.
from edgelin.artifact.quantized import F16_OP, PANEL

F32_OP = "MatMulF32"  # float32 activations by a float32 weight in panels
ROWS_PER_PIECE = 16384  # table rows packed at a time (a multiple of PANEL; 64 MiB of float32 at D = 1024)


def pack_panels(weight: Any) -> Any:
    """A MatMul weight [K, N] as the panel ops read it: [ceil(N / 16), K, 16], zeros past N."""
    import numpy as np

    rows, cols = weight.shape
    padded = np.zeros((rows, -(-cols // PANEL) * PANEL), weight.dtype)
    padded[:, :cols] = weight
    return np.ascontiguousarray(padded.reshape(rows, -1, PANEL).transpose(1, 0, 2))


def table_panels(table: Any, half: bool = False) -> tuple[tuple[int, int, int], Any]:
    """The panels of a tied LM head x W^T read from its table W [V, D] a slice of rows at a time (a table row is a
    column of W^T, so 16 rows make one panel): (the panels' shape [ceil(V / 16), D, 16], their pieces in order),
    as pack_panels(W.T) without the transposed copy of the table (2 GB at Qwen3.5-2B's 248k x 2048). `table`: an
    array or edgelin.export.nbits.FileRows; `half`: float16 panels."""
    import numpy as np

    vocab, width = table.shape

    def pieces() -> Any:
        for start in range(0, vocab, ROWS_PER_PIECE):
            rows = np.asarray(table[start:start + ROWS_PER_PIECE])
            rows = to_float16(rows) if half else rows
            if len(rows) % PANEL:
                rows = np.concatenate([rows, np.zeros((-len(rows) % PANEL, width), rows.dtype)])
            yield rows.reshape(-1, PANEL, width).transpose(0, 2, 1)

    return (-(-vocab // PANEL), width, PANEL), pieces()


def panel_function(name: str, opsets: dict[str, int]) -> Any:
    """ai.edgelin::<name> (F32_OP or F16_OP) as ONNX ops: B's panels [P, K, 16] (cast to float32), laid out as
    [K, 16 P], ONNX's MatMul, then the first n columns."""
    import onnx
    from onnx import helper

    from edgelin.ortops import DOMAIN

    n_value = helper.make_node("Constant", [], ["n"])  # the calling node's attribute n, as a scalar
    n_value.attribute.append(helper.make_attribute_ref("value_int", onnx.AttributeProto.INT, ref_attr_name="n"))
    cast = [helper.make_node("Cast", ["B"], ["B_float"], to=onnx.TensorProto.FLOAT)] if name == F16_OP else []
    body = [*cast,
            helper.make_node("Transpose", ["B_float" if cast else "B"], ["B_rows"], perm=[1, 0, 2]),
            helper.make_node("Constant", [], ["flat"], value_ints=[0, -1]),
            helper.make_node("Reshape", ["B_rows", "flat"], ["B_matrix"]),
            helper.make_node("MatMul", ["A", "B_matrix"], ["Y_padded"]),
            n_value,
            helper.make_node("Constant", [], ["zero"], value_ints=[0]),
            helper.make_node("Constant", [], ["last"], value_ints=[-1]),
            helper.make_node("Unsqueeze", ["n", "zero"], ["end"]),
            helper.make_node("Slice", ["Y_padded", "zero", "end", "last"], ["Y"])]
    return helper.make_function(DOMAIN, name, ["A", "B"], ["Y"], body,
                                [helper.make_opsetid("", opsets.get("", opsets.get("ai.onnx", 18)))],
                                attributes=["n"])


def to_panel_op(proto: Any, node: Any, name: str, packed_weight: str, columns: int) -> None:
    """Turn ONNX MatMul `node` into ai.edgelin::<name> reading `packed_weight` (N = `columns`), in place, adding
    the op's function and domain to `proto` once."""
    from onnx import helper

    from edgelin.ortops import DOMAIN

    node.op_type, node.domain = name, DOMAIN
    node.attribute.append(helper.make_attribute("n", columns))
    node.input[1] = packed_weight
    use_domain(proto, DOMAIN)
    if not any(f.domain == DOMAIN and f.name == name for f in proto.functions):
        proto.functions.append(panel_function(name, {o.domain: o.version for o in proto.opset_import}))


def pack_float_products(path: Any) -> int:
    """--step-ops edgelin: pack_products on the graph at `path` (the float products --quantize left, or all of a
    float export's), the panels written as they are packed (edgelin.export.weights.DataSpill) and the graph saved
    only when something changed; returns how many nodes."""
    import onnx

    from edgelin.export.weights import DataSpill, save_graph

    proto = onnx.load(str(path), load_external_data=False)  # each weight read from its data file in turn
    with DataSpill(path) as spill:
        count = pack_products(proto, folder=Path(path).parent, spill=spill)
    if count:
        save_graph(proto, path)
    return count


def to_float16(values: "np.ndarray") -> "np.ndarray":
    """A float16 copy, saturated at float16's largest finite value (±65504) rather than overflowing to inf
    (the export pipeline warns about such weights: edgelin.model.lm.beyond_range)."""
    import numpy as np

    limit = np.finfo(np.float16).max
    return np.clip(values, -limit, limit).astype(np.float16)


def pack_products(proto: Any, half: bool = False, folder: Path | None = None, spill: "DataSpill | None" = None) -> int:
    """In place: each ONNX MatMul on a constant 2-D float32 weight becomes ai.edgelin::MatMulF32 on the weight
    packed in panels (`half`: ai.edgelin::MatMulF16 on a float16 copy, --quantize fp16), each weight packed once
    however many nodes read it; the unpacked weights nothing else reads are dropped. Returns how many nodes.
    `folder`: where the data files of a graph loaded without its data are (each weight is read when packed);
    `spill`: where the packed weights are written as they are made (else they are held in the protobuf)."""
    import onnx

    from edgelin.export.nbits import weight_array

    from edgelin.export.weights import HeldInitializers

    spill = spill if spill is not None else HeldInitializers()
    inits = {t.name: t for t in proto.graph.initializer}
    packed: dict[str, str] = {}
    count = 0
    for node in proto.graph.node:
        weight = node.input[1] if node.domain == "" and node.op_type == "MatMul" and len(node.input) == 2 else None
        tensor = inits.get(weight) if weight else None
        if tensor is None or len(tensor.dims) != 2 or tensor.data_type != onnx.TensorProto.FLOAT:
            continue
        if weight not in packed:
            packed[weight] = f"{weight}_f16p" if half else f"{weight}_p{PANEL}"
            value = weight_array(tensor, folder)
            value = pack_panels(to_float16(value) if half else value)
            spill.add(proto, value, packed[weight])
            del value
        to_panel_op(proto, node, F16_OP if half else F32_OP, packed[weight], tensor.dims[1])
        count += 1
    if count:
        drop_unread(proto)
    return count


def use_domain(proto, domain: str) -> None:
    """Import `domain` (version 1) in the model, if it does not yet."""
    from onnx import helper

    if domain not in {o.domain for o in proto.opset_import}:
        proto.opset_import.append(helper.make_opsetid(domain, 1))


def drop_unread(proto) -> None:
    """Initializers no node reads any more (a tied table once both its users are quantised), subgraphs included."""
    import onnx

    read: set[str] = set()

    def visit(graph) -> None:
        for node in graph.node:
            read.update(node.input)
            for attribute in node.attribute:
                if attribute.type == onnx.AttributeProto.GRAPH:
                    visit(attribute.g)
                for sub in attribute.graphs:
                    visit(sub)

    visit(proto.graph)
    read.update(o.name for o in proto.graph.output)
    for tensor in [t for t in proto.graph.initializer if t.name not in read]:
        proto.graph.initializer.remove(tensor)
