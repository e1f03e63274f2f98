"""Weight-only quantisation of exported ONNX graphs (--quantize int8|int4|fp16, --block-size N): int8/int4 in the
layout of ONNX Runtime's own tool (`onnxruntime.quantization.matmul_nbits_quantizer.MatMulNBitsQuantizer`), through
its kernels, one weight at a time (edgelin.export.nbits: the tool holds the whole graph, which a 2 B-parameter model
does not leave room for).

--quantize fp16 (weight-only float16 storage, float32 arithmetic: what llama.cpp's f16 files hold) is edgelin's
own pass: every constant-weight MatMul becomes `ai.edgelin::MatMulF16` on a float16 copy of its weight packed in
column panels (edgelin.export.panels; edgelin's kernel widens the halves as it reads them: edgelin.ortops; its ONNX
function body, Cast, unpacking and MatMul, runs where the library is not loaded), the LM head likewise, and the embedding lookup a Gather on the float16 table and a Cast.
ONNX Runtime's x86 CPU provider has no float16 MatMul, so an fp16 graph (--precision fp16) runs through Casts that
it folds into float32 copies of every weight, per session.

Every MatMul whose second input is a constant 2-D weight becomes a `com.microsoft.MatMulNBits` node:
the weight stored block-wise (`block_size` weights along the input dim share a float scale and a
zero point: asymmetric round-to-nearest), activations and the output stay float. By default the
embedding table and the LM head are quantised too (off: --keep-embeddings-float): the head's Gemm
(x W^T, tied to the table in the shipped models) becomes a MatMulNBits on the table's transpose, and the embedding
lookup becomes ONNX Runtime's `com.microsoft.GatherBlockQuantized` (uint8 data with `bits` per weight, blocks along
the row) on the same bytes reshaped (the two layouts agree, checked exactly against ORT's kernels), so a tied table
is stored once in weights.bin however many ops read it. A table whose rows are not a whole number of blocks stays
float. `--embeddings-bits 8` with --quantize int4 stores the table and the head at 8 bits, the rest at 4 (what
llama.cpp's Q4_0 files do with `token_embd`); the head is marked (HEAD_KEY) so `describe` reports the split.
What stays float always: the norms, the decay parameters, and the
recurrence itself (state, decay, gates: its matmuls multiply activations, never constant weights).
The step and prefill graphs are quantised alike, so identical weights quantise to identical bytes and
still share one weights file (edgelin.export.weights).

Export-side module: imports onnx and onnxruntime's quantisation tools inside its functions.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from edgelin.artifact.quantized import ACTIVATIONS_ROUNDED, QUANTIZED_OPS, half_tables
from edgelin.errors import EdgelinError
from edgelin.artifact.quantized import F16_OP
from edgelin.export.nbits import weight_array
from edgelin.export.panels import drop_unread, pack_products, to_float16

BITS = {"int8": 8, "int4": 4}
HALF = "fp16"  # --quantize fp16: weight-only float16 storage (_float16_weights)
METHOD_F16 = ("edgelin weight-only float16: each constant-weight MatMul as ai.edgelin::MatMulF16 on a float16 "
              "copy of its weight packed in column panels (float32 arithmetic; function body Cast, unpacking, "
              "MatMul), embedding lookups as Gather "
              "on the float16 table + Cast")
# MatMulNBits' accuracy_level 4: the CPU kernel multiplies int8-quantised activation blocks (float
# accumulation). Shipped model (docs/performance.md#precision-and-size): int8 steps 18x faster than with the
# default level (7.1 -> 0.38 ms; the default has no fast 8-bit kernel), int4 ~15% faster, perplexity
# unchanged within 0.1%. Other providers treat the attribute as a minimum precision hint.
ACCURACY_LEVEL = 4
METHOD = ("onnxruntime's block quantisation kernels (MatMulNBitsQuantizer's layout, one weight at a time): block-wise "
          "asymmetric round-to-nearest weight-only quantisation "
          f"(MatMulNBits nodes, accuracy_level {ACCURACY_LEVEL}: int8 activation blocks in the CPU kernel; "
          "embedding lookups as GatherBlockQuantized on the same packed bytes)")
_SCOPES = "pkg.torch.onnx.name_scopes"  # the exporter's module path of a node (kept by strip_trace_metadata)
HEAD_KEY = "edgelin.lm_head"  # metadata_props of an LM head's MatMulNBits (its bits are the embeddings')
_WRAPPERS = re.compile(r"^(?:inner\.)?model\.")  # the graph modules' own attributes before the model's names


def _module_of(node: Any) -> str | None:
    """The torch module a node came from, as the checkpoint names it (e.g. model.layers.0.mixer.q_proj);
    for fused sibling projections (edgelin.export.fuse_matmuls) their modules joined with '+'."""
    import ast
    import json

    from edgelin.export.fuse_matmuls import FUSED_MODULES

    props = {p.key: p.value for p in node.metadata_props}
    if FUSED_MODULES in props:
        return "+".join(_WRAPPERS.sub("", name) for name in json.loads(props[FUSED_MODULES]))
    scopes = props.get(_SCOPES)
    if not scopes:
        return None
    try:
        names = ast.literal_eval(scopes)
    except (ValueError, SyntaxError):
        return None
    return _WRAPPERS.sub("", names[-2]) if len(names) >= 2 else None


def _modules_of(node: Any) -> list[str]:
    """The modules whose weights a node reads (several for fused sibling projections), else its own name."""
    return (_module_of(node) or node.name).split("+")


def _attrs(node: Any) -> dict[str, Any]:
    import onnx

    return {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}


def _head_panels(proto: Any, folder: Path | None, spill: Any) -> None:
    """--quantize fp16 with the embeddings: every Gemm y = x W^T on a constant 2-D float32 weight (the LM head,
    tied to the embedding table or not) becomes ai.edgelin::MatMulF16 on float16 panels packed from W's rows (one
    slice at a time: edgelin.export.panels.table_panels); its module scope carries over. The table itself is left
    to the Gathers (or dropped when unread)."""
    import numpy as np
    import onnx

    from edgelin.export.nbits import FileRows
    from edgelin.export.panels import table_panels, to_panel_op

    inits = {t.name: t for t in proto.graph.initializer}
    packed: set[str] = set()
    for node in proto.graph.node:
        weight = inits.get(node.input[1]) if node.op_type == "Gemm" and _is_head(node) else None
        if weight is None or len(weight.dims) != 2 or weight.data_type != onnx.TensorProto.FLOAT:
            continue
        name = f"{weight.name}_T_f16p"
        if name not in packed:  # a table read by two heads is packed once
            shape, pieces = table_panels(FileRows.of(weight, folder) if folder is not None
                                         else weight_array(weight), half=True)
            spill.add_pieces(proto, name, np.float16, shape, pieces)
            packed.add(name)
        del node.attribute[:]
        to_panel_op(proto, node, F16_OP, name, weight.dims[0])


def _float16_weights(proto: Any, embeddings: bool, folder: Path | None = None, spill: Any = None) -> None:
    """--quantize fp16, in place: each MatMul of ONNX's on a constant 2-D float32 weight becomes ai.edgelin::MatMulF16
    on a float16 copy of it packed in column panels (edgelin.export.panels.pack_products); with `embeddings` also the
    LM head (_head_panels) and each Gather on a 2-D float32 table, which reads a float16 copy of the table and casts
    its rows back to float32. Every new weight is written to `spill` as it is made (None: held in the protobuf, for
    a graph in memory); unread float32 weights are dropped."""
    import numpy as np
    import onnx
    from onnx import helper

    from edgelin.export.nbits import ROWS_PER_SLICE, FileRows

    from edgelin.export.weights import HeldInitializers

    spill = spill if spill is not None else HeldInitializers()  # a graph in memory: its new weights stay there
    if embeddings:
        _head_panels(proto, folder, spill)
    pack_products(proto, half=True, folder=folder, spill=spill)
    inits = {t.name: t for t in proto.graph.initializer}
    halves: dict[str, str] = {}
    nodes = []
    for node in proto.graph.node:
        table = inits.get(node.input[0]) if embeddings and node.op_type == "Gather" and node.input else None
        if table is not None and len(table.dims) == 2 and table.data_type == onnx.TensorProto.FLOAT \
                and _attrs(node).get("axis", 0) == 0:
            if table.name not in halves:  # each table converted once however many lookups read it
                halves[table.name] = f"{table.name}_f16"
                rows = FileRows.of(table, folder) if folder is not None else weight_array(table)
                spill.add_pieces(proto, halves[table.name], np.float16, tuple(table.dims),
                                 (to_float16(rows[start:start + ROWS_PER_SLICE])
                                  for start in range(0, table.dims[0], ROWS_PER_SLICE)))
            node.input[0], out = halves[table.name], node.output[0]
            node.output[0] = f"{out}_f16"
            nodes.append(node)
            node = helper.make_node("Cast", [node.output[0]], [out], name=f"{node.name}_to_float",
                                    to=onnx.TensorProto.FLOAT)
        nodes.append(node)
    del proto.graph.node[:]
    proto.graph.node.extend(nodes)
    drop_unread(proto)


def quantize_graph(path: Path, scheme: str, block_size: int, embeddings: bool = True,
                   embedding_bits: int | None = None) -> list[str]:
    """Quantise the constant-weight MatMuls of the graph at `path` in place; returns the modules whose
    weights were quantised (checkpoint names), in graph order. Each MatMulNBits node keeps its MatMul's
    module scope, so `describe` can name the matrices from the file alone. `embeddings` (the default;
    off: --keep-embeddings-float): the LM head too, as a MatMulNBits on its own transposed copy, and
    the embedding lookup as a GatherBlockQuantized whose bytes equal the head's when they are tied
    (so weights.bin stores them once); both at `embedding_bits` (None: the scheme's bits) when given."""
    import onnx

    if scheme not in (*BITS, HALF):
        raise EdgelinError(f"weight quantisation {scheme!r}", f"edgelin quantises to {', '.join((*BITS, HALF))}",
                           "pass --quantize int8, int4 or fp16")
    from edgelin.devices import BLOCK_SIZES
    from edgelin.export.weights import DataSpill, save_graph

    if scheme in BITS and block_size not in BLOCK_SIZES:  # export_settings refuses it first, from the command line
        raise EdgelinError(f"block size {block_size}", f"ONNX Runtime's block quantiser takes blocks of "
                           f"{', '.join(map(str, BLOCK_SIZES))} weights", "pass --block-size 32")
    if scheme == HALF:
        proto = onnx.load(str(path), load_external_data=False)  # each weight read from its data file in turn
        with DataSpill(path) as spill:
            _float16_weights(proto, embeddings, Path(path).parent, spill)
        save_graph(proto, path)
        return [name for node in proto.graph.node if node.op_type == F16_OP for name in _modules_of(node)]

    from edgelin.export.nbits import NbitsGraph

    bits = BITS[scheme]
    proto = onnx.load(str(path), load_external_data=False)  # each weight is read from its data file in turn
    with DataSpill(path) as spill:
        graph = NbitsGraph(proto, Path(path).parent, block_size, ACCURACY_LEVEL, spill)
        nodes = _nbits_nodes(proto, graph, bits, embedding_bits or bits, embeddings)
    del proto.graph.node[:]
    proto.graph.node.extend(nodes)
    graph.close()
    drop_unread(proto)
    save_graph(proto, path)
    return [name for node in proto.graph.node if node.op_type in QUANTIZED_OPS for name in _modules_of(node)]


def _nbits_nodes(proto: Any, graph: Any, bits: int, head_bits: int, embeddings: bool) -> list[Any]:
    """The graph's nodes with each constant-weight MatMul (and with `embeddings` the LM head and the embedding
    lookups) replaced by its block-quantised form (edgelin.export.nbits.NbitsGraph)."""
    block_size = graph.block_size
    nodes = []
    for node in proto.graph.node:
        weight = graph.float_matrix(node.input[1]) if len(node.input) == 2 and node.domain in ("", "ai.onnx") else None
        if embeddings and node.op_type == "Gather" and graph.float_matrix(node.input[0]) is not None \
                and _attrs(node).get("axis", 0) == 0 and graph.inits[node.input[0]].dims[1] % block_size == 0:
            node = graph.gather(node, head_bits)
        elif embeddings and node.op_type == "Gemm" and weight is not None and _is_head(node):
            node = graph.matmul(node, weight, head_bits, head=True)
            node.metadata_props.add(key=HEAD_KEY, value="1")
        elif node.op_type == "MatMul" and weight is not None:
            node = graph.matmul(node, weight, bits)
        nodes.append(node)
    return nodes


def _is_head(node: Any) -> bool:
    """A Gemm y = x W^T (the LM head's form, tied to the embedding table or not)."""
    attrs = _attrs(node)
    return not attrs.get("transA", 0) and bool(attrs.get("transB", 0)) and attrs.get("alpha", 1.0) == 1.0 \
        and "C" not in attrs and len(node.input) == 2


_WEIGHT_OPS = ("MatMul", "Gemm", "Gather", "Conv")  # ops that read a weight matrix


def describe(folder: Path, graph_files: dict[str, str]) -> dict[str, Any] | None:
    """manifest extra["quantization"], read off the graph files: bits, block size, the quantised
    matrices and the weight matrices kept float (the same in every graph, checked), or None for an
    unquantised export. --quantize fp16: bits 16, no block size, method METHOD_F16."""
    import onnx

    found: dict[str, dict[str, Any]] = {}
    for kind, file in graph_files.items():
        proto = onnx.load(str(Path(folder) / file), load_external_data=False)
        matrices = {t.name for t in proto.graph.initializer if len(t.dims) >= 2}
        tables = half_tables(proto.graph)
        nodes = [n for n in proto.graph.node if n.op_type in (*QUANTIZED_OPS, F16_OP)
                 or (n.op_type == "Gather" and n.input and n.input[0] in tables)]
        taken = {id(n) for n in nodes}
        attrs = [{a.name: onnx.helper.get_attribute_value(a) for a in n.attribute} for n in nodes]
        attrs = [a if n.op_type in QUANTIZED_OPS else {"bits": 16, "block_size": None} for n, a in zip(nodes, attrs)]
        kept = {name for n in proto.graph.node if n.op_type in _WEIGHT_OPS and id(n) not in taken
                and any(i in matrices for i in n.input) for name in _modules_of(n)}
        # the embedding table and LM head (--embeddings-bits): their bits apart from the body's
        apart = [n.op_type == "GatherBlockQuantized" or any(p.key == HEAD_KEY for p in n.metadata_props)
                 for n in nodes]
        body = [a for a, e in zip(attrs, apart) if not e] or attrs
        rounding = sorted({a["block_size"] for n, a in zip(nodes, attrs)
                           if n.op_type == "MatMulNBits" and a.get("accuracy_level") == ACTIVATIONS_ROUNDED})
        found[kind] = {"bits": sorted({a["bits"] for a in body}), "activation_block": rounding[:1],
                       "embedding_bits": sorted({a["bits"] for a, e in zip(attrs, apart) if e}),
                       "block_size": sorted({a["block_size"] for a in attrs}, key=str),
                       "quantized": sorted({name for n in nodes for name in _modules_of(n)}), "kept_float": sorted(kept)}
    first_kind, first = next(iter(found.items()))
    if not first["quantized"]:
        return None
    for kind, entry in found.items():
        if (entry["bits"], entry["block_size"]) != (first["bits"], first["block_size"]) or len(entry["bits"]) != 1 \
                or len(entry["block_size"]) != 1:
            raise EdgelinError(f"the {kind} and {first_kind} graphs are not quantised alike",
                               f"bits {entry['bits']} / {first['bits']}, block sizes {entry['block_size']} / "
                               f"{first['block_size']}", "report this as an edgelin bug")
        if entry["embedding_bits"] != first["embedding_bits"] or len(entry["embedding_bits"]) > 1:
            raise EdgelinError(f"the {kind} and {first_kind} graphs' embeddings are not quantised alike",
                               f"bits {entry['embedding_bits']} / {first['embedding_bits']}",
                               "report this as an edgelin bug")
    matrices = sorted(set().union(*(entry["quantized"] for entry in found.values())))
    kept = sorted(set().union(*(entry["kept_float"] for entry in found.values())))
    described = {"method": METHOD_F16 if first["bits"][0] == 16 else METHOD, "bits": first["bits"][0],
                 "block_size": first["block_size"][0], "matrices": matrices, "kept_float": kept}
    if first["embedding_bits"] and first["embedding_bits"][0] != described["bits"]:
        described["embedding_bits"] = first["embedding_bits"][0]
    if all(entry["activation_block"] for entry in found.values()):  # products that round their activations to int8
        described["activation_block"] = first["activation_block"][0]  # (the parity threshold: quality.threshold_key)
    return described
