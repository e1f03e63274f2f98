"""Weight-only quantisation of exported ONNX graphs (--quantize int8|int4, --block-size N), through
ONNX Runtime's own tool: `onnxruntime.quantization.matmul_nbits_quantizer.MatMulNBitsQuantizer`.

Every MatMul whose second input is a constant 2-D weight becomes a `com.microsoft.MatMulNBits` node:
the weight stored block-wise (`block_size` weights along the input dim share a float scale and a
zero point: asymmetric round-to-nearest), activations and the output stay float. What is not such a
MatMul stays float: the embedding table and the tied LM head (a Gather and a Gemm on one float
tensor), the norms, the decay parameters, and the recurrence itself (state, decay, gates: its
matmuls multiply activations, never constant weights). The step and prefill graphs are quantised
alike, so identical weights quantise to identical bytes and still share one weights file
(edgelin.export.weights).

Export-side module: imports onnx and onnxruntime's quantisation tools inside its functions.
"""

from __future__ import annotations

import contextlib
import io
import logging
import re
from pathlib import Path
from typing import Any

from edgelin.errors import EdgelinError

BITS = {"int8": 8, "int4": 4}
# MatMulNBits' accuracy_level 4: the CPU kernel multiplies int8-quantised activation blocks (float
# accumulation). Measured on the shipped model (docs/benchmarks.md): int8 steps 18x faster than with the
# default level (7.1 -> 0.38 ms; the default has no fast 8-bit kernel), int4 ~15% faster, perplexity
# unchanged within 0.1%. Other providers treat the attribute as a minimum precision hint.
ACCURACY_LEVEL = 4
METHOD = ("onnxruntime MatMulNBitsQuantizer: block-wise asymmetric round-to-nearest weight-only quantisation "
          f"(MatMulNBits nodes, accuracy_level {ACCURACY_LEVEL}: int8 activation blocks in the CPU kernel)")
_SCOPES = "pkg.torch.onnx.name_scopes"  # the exporter's module path of a node (kept by strip_trace_metadata)
_WRAPPERS = re.compile(r"^(?:inner\.)?model\.")  # the graph modules' own attributes before the model's names


def _module_of(node: Any) -> str | None:
    """The torch module a node came from, as the checkpoint names it (e.g. model.layers.0.mixer.q_proj)."""
    import ast

    scopes = {p.key: p.value for p in node.metadata_props}.get(_SCOPES)
    if not scopes:
        return None
    try:
        names = ast.literal_eval(scopes)
    except (ValueError, SyntaxError):
        return None
    return _WRAPPERS.sub("", names[-2]) if len(names) >= 2 else None


def quantize_graph(path: Path, scheme: str, block_size: int) -> list[str]:
    """Quantise the constant-weight MatMuls of the graph at `path` in place; returns the modules whose
    weights were quantised (checkpoint names), in graph order. Each MatMulNBits node keeps its MatMul's
    module scope, so `describe` can name the matrices from the file alone."""
    import onnx

    root = logging.getLogger()
    handlers, root_level = list(root.handlers), root.level
    from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

    # Its import calls logging.basicConfig(level=INFO) on the root logger, after which every library's
    # INFO records print in the caller's process: undo that.
    for handler in [h for h in root.handlers if h not in handlers]:
        root.removeHandler(handler)
    root.setLevel(root_level)
    if scheme not in BITS:
        raise EdgelinError(f"weight quantisation {scheme!r}", f"edgelin quantises to {', '.join(BITS)}",
                           "pass --quantize int8 or --quantize int4")
    bits = BITS[scheme]
    proto = onnx.load(str(path))
    scopes = {node.name: [p for p in node.metadata_props if p.key == _SCOPES]
              for node in proto.graph.node if node.op_type == "MatMul"}
    quantizer = MatMulNBitsQuantizer(proto, bits=bits, block_size=block_size, is_symmetric=False,
                                     accuracy_level=ACCURACY_LEVEL)
    logs = [logging.getLogger(name) for name in ("onnxruntime.quantization", "onnxruntime.quantization.matmul_nbits_quantizer",
                                                 "onnx_ir", "onnx_ir.passes.common.initializer_deduplication")]
    levels = [log.level for log in logs]
    for log in logs:
        log.setLevel(logging.WARNING)  # they log every node and initializer they visit at INFO
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            quantizer.process()
    except Exception as exc:  # the tool's own failure: not the user's input
        raise EdgelinError(f"{scheme} quantisation of {Path(path).name} failed", f"{type(exc).__name__}: {exc}",
                           "export without --quantize, and report this model config as an edgelin bug") from exc
    finally:
        for log, level in zip(logs, levels):
            log.setLevel(level)
    quantized = quantizer.model.model
    names = []
    for node in quantized.graph.node:
        if node.op_type == "MatMulNBits":
            node.metadata_props.extend(scopes.get(node.name.removesuffix(f"_Q{bits}"), []))
            names.append(_module_of(node) or node.name)
    onnx.save(quantized, str(path))
    return names


_WEIGHT_OPS = ("MatMul", "Gemm", "Gather", "Conv")  # ops that read a weight matrix


def describe(folder: Path, graph_files: dict[str, str]) -> dict[str, Any] | None:
    """manifest extra["quantization"], read off the graph files: bits, block size, the quantised
    matrices and the weight matrices kept float (the same in every graph, checked), or None for an
    unquantised export."""
    import onnx

    found: dict[str, dict[str, Any]] = {}
    for kind, file in graph_files.items():
        proto = onnx.load(str(Path(folder) / file), load_external_data=False)
        matrices = {t.name for t in proto.graph.initializer if len(t.dims) >= 2}
        nodes = [n for n in proto.graph.node if n.op_type == "MatMulNBits"]
        attrs = [{a.name: onnx.helper.get_attribute_value(a) for a in n.attribute} for n in nodes]
        kept = {_module_of(n) or n.name for n in proto.graph.node
                if n.op_type in _WEIGHT_OPS and any(i in matrices for i in n.input)}
        found[kind] = {"bits": sorted({a["bits"] for a in attrs}), "block_size": sorted({a["block_size"] for a in attrs}),
                       "quantized": sorted({_module_of(n) or n.name for n in nodes}), "kept_float": sorted(kept)}
    first_kind, first = next(iter(found.items()))
    if not first["quantized"]:
        return None
    for kind, entry in found.items():
        if (entry["bits"], entry["block_size"]) != (first["bits"], first["block_size"]) or len(entry["bits"]) != 1 \
                or len(entry["block_size"]) != 1:
            raise EdgelinError(f"the {kind} and {first_kind} graphs are not quantised alike",
                               f"bits {entry['bits']} / {first['bits']}, block sizes {entry['block_size']} / "
                               f"{first['block_size']}", "report this as an edgelin bug")
    matrices = sorted(set().union(*(entry["quantized"] for entry in found.values())))
    kept = sorted(set().union(*(entry["kept_float"] for entry in found.values())))
    return {"method": METHOD, "bits": first["bits"][0], "block_size": first["block_size"][0],
            "matrices": matrices, "kept_float": kept}
