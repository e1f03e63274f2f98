"""Weight-only quantisation of exported ONNX graphs (--quantize int8|int4|fp16, --block-size N), through
ONNX Runtime's own tool: `onnxruntime.quantization.matmul_nbits_quantizer.MatMulNBitsQuantizer`.

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
(x W^T, tied to the table in the shipped models) becomes a MatMul on its own transposed initializer,
which the tool quantises like the others, and the embedding lookup becomes ONNX Runtime's
`com.microsoft.GatherBlockQuantized` (uint8 data with `bits` per weight, blocks along the row). The
tool only emits that op for 4-bit, so the table is quantised by the tool as the head's MatMulNBits
weight and reshaped: the same bytes (the two layouts agree, checked exactly against ORT's kernels),
so a tied table is stored once in weights.bin however many ops read it. A table whose rows are not a
whole number of blocks stays float. `--embeddings-bits 8` with --quantize int4 stores the table and the head at
8 bits, the rest at 4 (what llama.cpp's Q4_0 files do with `token_embd`): the head's MatMulNBits is left out of
the 4-bit pass and quantised by a second one at 8 bits, and marked (HEAD_KEY) so `describe` reports the split.
What stays float always: the norms, the decay parameters, and the
recurrence itself (state, decay, gates: its matmuls multiply activations, never constant weights).
The step and prefill graphs are quantised alike, so identical weights quantise to identical bytes and
still share one weights file (edgelin.export.weights).

Export-side module: imports onnx and onnxruntime's quantisation tools inside its functions.
"""

from __future__ import annotations

import contextlib
import io
import logging
import re
from pathlib import Path
from typing import Any

from edgelin.artifact.quantized import QUANTIZED_OPS, half_tables
from edgelin.errors import EdgelinError, environment_fault, one_line
from edgelin.artifact.quantized import F16_OP
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
METHOD = ("onnxruntime MatMulNBitsQuantizer: block-wise asymmetric round-to-nearest weight-only quantisation "
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


def _run_tool(proto: Any, scheme: str, bits: int, block_size: int, name: str, exclude: tuple[str, ...] = ()) -> Any:
    """`proto` with its constant-weight MatMuls (but the nodes named in `exclude`) quantised by ONNX Runtime's
    MatMulNBitsQuantizer, quietly."""
    root = logging.getLogger()
    handlers, root_level = list(root.handlers), root.level
    from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

    # Its import calls logging.basicConfig(level=INFO) on the root logger, after which every library's
    # INFO records print in the caller's process: undo that.
    for handler in [h for h in root.handlers if h not in handlers]:
        root.removeHandler(handler)
    root.setLevel(root_level)
    quantizer = MatMulNBitsQuantizer(proto, bits=bits, block_size=block_size, is_symmetric=False,
                                     accuracy_level=ACCURACY_LEVEL, nodes_to_exclude=list(exclude))
    logs = [logging.getLogger(name) for name in ("onnxruntime.quantization", "onnxruntime.quantization.matmul_nbits_quantizer",
                                                 "onnx_ir", "onnx_ir.passes.common.initializer_deduplication")]
    levels = [log.level for log in logs]
    for log in logs:
        log.setLevel(logging.WARNING)  # they log every node and initializer they visit at INFO
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            quantizer.process()
    except Exception as exc:  # the tool's own failure: not the user's input
        fault = environment_fault(exc)
        if fault is not None:  # out of memory, or a full disk under its temporary files: the machine's
            raise fault from None
        raise EdgelinError(f"{scheme} quantisation of {name} failed", f"{type(exc).__name__}: {one_line(str(exc))}",
                           "export without --quantize, and report this model config as an edgelin bug") from exc
    finally:
        for log, level in zip(logs, levels):
            log.setLevel(level)
    return quantizer.model.model


def _attrs(node: Any) -> dict[str, Any]:
    import onnx

    return {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}


def _tables(proto: Any, block_size: int) -> dict[str, Any]:
    """The embedding tables this pass quantises: name -> float array [V, D], for every 2-D float
    initializer a Gather reads on axis 0 whose row length is a whole number of blocks (others stay float)."""
    import onnx
    from onnx import numpy_helper

    inits = {t.name: t for t in proto.graph.initializer}
    floats = (onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16)
    found = {}
    for node in proto.graph.node:
        table = inits.get(node.input[0]) if node.op_type == "Gather" and node.input else None
        if table is not None and len(table.dims) == 2 and table.data_type in floats \
                and _attrs(node).get("axis", 0) == 0 and table.dims[1] % block_size == 0:
            found[table.name] = numpy_helper.to_array(table)
    return found


def _untie_heads(proto: Any) -> list[str]:
    """Every Gemm y = x W^T on a constant 2-D weight (the LM head, tied to the embedding table or not)
    becomes MatMul(x, W^T) on its own transposed initializer, which the tool then quantises; the Gemm's
    module scope carries over. The table itself is left to the Gathers (or dropped when unread). Returns the
    MatMuls' names."""
    import numpy as np
    from onnx import helper, numpy_helper

    inits = {t.name: t for t in proto.graph.initializer}
    heads = []
    for index, node in enumerate(list(proto.graph.node)):
        attrs = _attrs(node)
        weight = inits.get(node.input[1]) if node.op_type == "Gemm" and len(node.input) == 2 else None
        if weight is None or len(weight.dims) != 2 or attrs.get("transA", 0) or not attrs.get("transB", 0) \
                or attrs.get("alpha", 1.0) != 1.0:
            continue
        transposed = numpy_helper.from_array(np.ascontiguousarray(numpy_helper.to_array(weight).T), f"{weight.name}_T")
        if transposed.name not in inits:
            proto.graph.initializer.append(transposed)
            inits[transposed.name] = transposed
        matmul = helper.make_node("MatMul", [node.input[0], transposed.name], list(node.output), name=node.name)
        matmul.metadata_props.extend(node.metadata_props)
        proto.graph.node.remove(node)
        proto.graph.node.insert(index, matmul)
        heads.append(matmul.name)
    return heads


def _quantize_table(table: Any, scheme: str, bits: int, block_size: int) -> tuple[Any, Any, Any]:
    """(data [V, D*bits/8] uint8, scales [V, D/block], zero points [V, ...] uint8) of an embedding
    table, made by the tool itself: the table's transpose quantised as a MatMulNBits weight (the packing
    a tied LM head gets), reshaped to GatherBlockQuantized's layout (uint8 data, `bits`, quantize_axis
    1: the same bytes, so the head and the lookup share them in weights.bin)."""
    import numpy as np
    from onnx import helper, numpy_helper

    vocab, dim = table.shape
    dtype = helper.np_dtype_to_tensor_dtype(table.dtype)
    graph = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["y"])], "table",
                              [helper.make_tensor_value_info("x", dtype, [1, dim])],
                              [helper.make_tensor_value_info("y", dtype, [1, vocab])],
                              [numpy_helper.from_array(np.ascontiguousarray(table.T), "w")])
    model = _run_tool(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)]), scheme, bits,
                      block_size, "the embedding table")
    (node,) = [n for n in model.graph.node if n.op_type == "MatMulNBits"]
    inits = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    data, scales, zeros = (inits[node.input[i]] for i in (1, 2, 3))
    if data.dtype != np.uint8 or zeros.dtype != np.uint8 or dim % block_size:
        raise EdgelinError(f"{scheme} quantisation of the embedding table failed", f"the tool packed it as {data.dtype} "
                           f"{data.shape}", "export with --keep-embeddings-float, and report this as an edgelin bug")
    return data.reshape(vocab, -1), scales.reshape(vocab, dim // block_size), zeros.reshape(vocab, -1)


def _quantize_gathers(proto: Any, tables: dict[str, Any], scheme: str, bits: int, block_size: int) -> None:
    """Each Gather on a table of `tables` becomes a com.microsoft GatherBlockQuantized (ONNX Runtime's
    contrib op: uint8 data with `bits` per weight, blocks along the row) keeping the Gather's scope."""
    from onnx import helper, numpy_helper

    for name, table in tables.items():
        arrays = dict(zip(("Q", "scales", "zero_points"), _quantize_table(table, scheme, bits, block_size)))
        proto.graph.initializer.extend(numpy_helper.from_array(a, f"{name}_{k}") for k, a in arrays.items())
        for index, node in enumerate(list(proto.graph.node)):
            if node.op_type != "Gather" or node.input[0] != name:
                continue
            lookup = helper.make_node("GatherBlockQuantized", [f"{name}_Q", node.input[1], f"{name}_scales",
                                                               f"{name}_zero_points"], list(node.output),
                                      name=f"{node.name}_Q{bits}", domain="com.microsoft", gather_axis=0,
                                      quantize_axis=1, block_size=block_size, bits=bits)
            lookup.metadata_props.extend(node.metadata_props)
            proto.graph.node.remove(node)
            proto.graph.node.insert(index, lookup)
    if tables and not any(o.domain == "com.microsoft" for o in proto.opset_import):
        proto.opset_import.append(helper.make_opsetid("com.microsoft", 1))


def _float16_weights(proto: Any, embeddings: bool) -> None:
    """--quantize fp16, in place: each MatMul of ONNX's on a constant 2-D float32 weight becomes ai.edgelin::MatMulF16
    on a float16 copy of it packed in column panels (edgelin.export.panels.pack_products); with `embeddings` also the
    LM head (untied to its own transposed weight first, as for int4) and each Gather on a 2-D float32 table, which
    reads a float16 copy of the table and casts its rows back to float32. Unread float32 weights are dropped."""
    import onnx
    from onnx import helper, numpy_helper

    if embeddings:
        _untie_heads(proto)
    pack_products(proto, half=True)
    inits = {t.name: t for t in proto.graph.initializer}
    halves: dict[str, str] = {}
    nodes = []
    for node in proto.graph.node:
        table = inits.get(node.input[0]) if embeddings and node.op_type == "Gather" and node.input else None
        if table is not None and len(table.dims) == 2 and table.data_type == onnx.TensorProto.FLOAT \
                and _attrs(node).get("axis", 0) == 0:
            if table.name not in halves:  # each table converted once however many lookups read it
                halves[table.name] = f"{table.name}_f16"
                value = to_float16(numpy_helper.to_array(table))
                proto.graph.initializer.append(numpy_helper.from_array(value, halves[table.name]))
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
    from edgelin.export.fuse_matmuls import FUSED_MODULES

    if scheme in BITS and block_size not in BLOCK_SIZES:  # export_settings refuses it first, from the command line
        raise EdgelinError(f"block size {block_size}", f"ONNX Runtime's block quantiser takes blocks of "
                           f"{', '.join(map(str, BLOCK_SIZES))} weights", "pass --block-size 32")
    if scheme == HALF:
        proto = onnx.load(str(path))
        _float16_weights(proto, embeddings)
        onnx.save(proto, str(path))
        return [name for node in proto.graph.node if node.op_type == F16_OP for name in _modules_of(node)]

    bits = BITS[scheme]
    head_bits = embedding_bits or bits
    proto = onnx.load(str(path))
    tables, heads = {}, []
    if embeddings:
        tables = _tables(proto, block_size)
        heads = _untie_heads(proto)
        _quantize_gathers(proto, tables, scheme, head_bits, block_size)
    scopes = {node.name: [p for p in node.metadata_props if p.key in (_SCOPES, FUSED_MODULES)]
              for node in proto.graph.node if node.op_type == "MatMul"}
    if head_bits != bits and heads:  # the body at `bits`, then the heads (the only float MatMuls left) apart
        quantized = _run_tool(proto, scheme, bits, block_size, Path(path).name, exclude=tuple(heads))
        quantized = _run_tool(quantized, scheme, head_bits, block_size, f"{Path(path).name} (LM head)")
    else:
        quantized = _run_tool(proto, scheme, bits, block_size, Path(path).name)
    if embeddings:
        drop_unread(quantized)
    names = []
    for node in quantized.graph.node:
        if node.op_type == "MatMulNBits":
            plain = node.name.removesuffix(f"_Q{bits}").removesuffix(f"_Q{head_bits}")
            node.metadata_props.extend(scopes.get(plain, []))
            if plain in heads:
                node.metadata_props.add(key=HEAD_KEY, value="1")
        if node.op_type in QUANTIZED_OPS:
            names.extend(_modules_of(node))
    onnx.save(quantized, str(path))
    return names


_WEIGHT_OPS = ("MatMul", "Gemm", "Gather", "Conv")  # ops that read a weight matrix


def quantized_weights(entry: dict[str, Any]) -> str:
    """A manifest's extra["quantization"] in words: "4-bit (block 32)", "4-bit (block 32; embedding table and LM
    head 8-bit)", "float16"."""
    if entry.get("bits") == 16:
        return "float16"
    apart = entry.get("embedding_bits")
    return f"{entry['bits']}-bit (block {entry['block_size']}" + (
        f"; embedding table and LM head {apart}-bit)" if apart else ")")


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
        found[kind] = {"bits": sorted({a["bits"] for a in body}),
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
    return described
