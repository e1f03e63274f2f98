"""The reference a weight-quantised export is checked against: the PyTorch reference carrying the
export's own dequantised weights.

An int4 model is not the fp32 model. Its recurrent state drifts from the fp32 model's by the
quantisation alone (a trained 12-layer Mamba2 at int4: states 0.26-0.85 of their scale away, logits
0.06-0.14, top-1 92%), so a parity check against the fp32 reference mixes two questions: what the
quantisation costs, and whether the runtime computes this artifact right. edgelin keeps them apart:

  fp32 reference --(quality figures: top-1, perplexity change, against the precision's bounds)-->
  reference with the export's dequantised weights --(parity: logits and every state, the precision's
  threshold)--> the artifact

The second reference is built here: every quantised tensor of the graphs (MatMulNBits weights,
GatherBlockQuantized tables, --quantize fp16's float16 weights and tables) is unpacked to float in numpy, and
each 2-D parameter or buffer of the model takes the rows that match it within half a quantisation step (round-to-nearest's bound),
found by value, so fused matmuls (several modules' weights side by side), transposed heads and tied
tables need no name bookkeeping. One tie is split: a table whose rows are not a whole number of blocks stays
float in the graphs while the LM head tied to it is quantised, so the reference's head takes the dequantised rows
and its embedding keeps the float ones (_untie_products). What stays between this reference and the artifact is
the runtime's own arithmetic (MatMulNBits at accuracy_level 4 also rounds activations to int8 blocks: measured on
that Mamba2, 0.013 of the logits' scale and 0.045 of the states').

Export-side module (torch and onnx are imported inside its functions); the replay on a device reads
only what the recorded reference vectors hold.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

import numpy as np

if TYPE_CHECKING:
    from edgelin.artifact.manifest import Manifest
    from edgelin.model.lm import CausalLM

SLACK = 1.0 + 1e-3  # on the half-step bound: the dequantised product's own float rounding


@dataclass(frozen=True)
class Dequantized:
    """One quantised tensor unpacked: `rows` [N, K] float32 (a MatMulNBits weight's output columns, or a
    table's rows) and `bound` [N, K], half the quantisation step each element was rounded on (slack included)."""

    name: str
    rows: np.ndarray
    bound: np.ndarray


def unpack(data: np.ndarray, scales: np.ndarray, zero_points: np.ndarray | None, rows: int, cols: int, bits: int,
           block_size: int) -> tuple[np.ndarray, np.ndarray]:
    """(values [rows, cols], steps [rows, cols]) of ONNX Runtime's block-quantised layout: per row, blocks of
    `block_size` along the columns, `bits` per code packed low bits first, one scale and one zero point per
    block (zero points packed the same way; without them, the midpoint 2^(bits-1))."""
    if bits not in (4, 8):
        raise ValueError(f"{bits}-bit codes")
    blocks = -(-cols // block_size)
    codes = _codes(data, rows, bits)[:, :blocks * block_size].reshape(rows, blocks, block_size).astype(np.float32)
    if zero_points is None:
        zeros = np.full((rows, blocks), 2 ** (bits - 1), np.float32)
    else:
        zeros = _codes(zero_points, rows, bits)[:, :blocks].astype(np.float32)
    scale = np.asarray(scales, np.float32).reshape(rows, blocks)
    values = (codes - zeros[..., None]) * scale[..., None]
    steps = np.broadcast_to(np.abs(scale)[..., None], values.shape)
    return (values.reshape(rows, -1)[:, :cols], steps.reshape(rows, -1)[:, :cols])


def _codes(packed: np.ndarray, rows: int, bits: int) -> np.ndarray:
    """[rows, codes]: the bytes of each row as codes, two 4-bit codes per byte low nibble first."""
    packed = np.asarray(packed, np.uint8).reshape(rows, -1)
    return np.stack([packed & 0x0F, packed >> 4], -1).reshape(rows, -1) if bits == 4 else packed


def _graph(folder: Path, file: str) -> tuple[Any, dict[str, Any], Callable[[str], np.ndarray]]:
    """(graph, its initializers by name, name -> array): the graphs share one weights file, so each tensor's bytes
    are read only when asked for."""
    import onnx
    from onnx import numpy_helper
    from onnx.external_data_helper import load_external_data_for_tensor, uses_external_data

    graph = onnx.load(str(Path(folder) / file), load_external_data=False).graph
    inits = {t.name: t for t in graph.initializer}

    def array(name: str) -> np.ndarray:
        tensor = inits[name]
        if uses_external_data(tensor):
            load_external_data_for_tensor(tensor, str(folder))
        return numpy_helper.to_array(tensor)

    return graph, inits, array


def float_lookups(folder: Path, graph_files: list[str]) -> list[np.ndarray]:
    """The embedding tables the graphs look rows up in unquantised: 2-D float initializers plain Gathers read on
    axis 0 (each once). A table whose rows are not a whole number of blocks stays float (edgelin.export.quantize)
    while the LM head tied to it is quantised: the reference must then look its rows up in the float table too."""
    import onnx

    from edgelin.export.quantize import half_tables

    found: dict[str, np.ndarray] = {}
    for file in graph_files:
        graph, inits, array = _graph(folder, file)
        halves = half_tables(graph)  # --quantize fp16's tables: quantised ones (read_quantized)
        for node in graph.node:
            name = node.input[0] if node.domain == "" and node.op_type == "Gather" and node.input else None
            tensor = inits.get(name) if name and name not in halves and name not in found else None
            axis = next((a.i for a in node.attribute if a.name == "axis"), 0)
            if tensor is not None and len(tensor.dims) == 2 and axis == 0 \
                    and tensor.data_type in (onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16):
                found[name] = array(name)
    return list(found.values())


def read_quantized(folder: Path, graph_files: list[str]) -> list[Dequantized]:
    """Every quantised tensor the graphs read, unpacked (each distinct initializer once)."""
    import onnx

    from edgelin.export.panels import F16_OP, panel_columns, unpack_panels
    from edgelin.export.quantize import QUANTIZED_OPS, half_tables

    found: dict[str, Dequantized] = {}
    for file in graph_files:
        graph, inits, array = _graph(folder, file)
        tables = half_tables(graph)
        for node in graph.node:
            half = node.input[1] if node.op_type == F16_OP else node.input[0] if node.op_type == "Gather" \
                and node.input and node.input[0] in tables else None
            if half is not None and half in inits and half not in found:  # --quantize fp16: a float16 weight
                values = array(half).astype(np.float32)
                if node.op_type == F16_OP:  # MatMul's [K, N] (packed in panels: [P, K, 16]) -> the module's [N, K]
                    values = (unpack_panels(values, panel_columns(node, values)) if values.ndim == 3 else values).T
                # half a float16 step of each element (np.spacing: that element's step; subnormals included). The
                # largest finite value's step up is inf: it rounds with the step of its binade, 65472's
                top = np.nextafter(np.finfo(np.float16).max, np.float16(0))
                steps = np.spacing(np.minimum(np.abs(values).astype(np.float16), top)).astype(np.float32)
                found[half] = Dequantized(half, np.ascontiguousarray(values), 0.5 * SLACK * steps + 1e-12)
                continue
            if node.op_type not in QUANTIZED_OPS:
                continue
            attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
            weight = node.input[0] if node.op_type == "GatherBlockQuantized" else node.input[1]
            if weight in found or weight not in inits:
                continue
            data = array(weight)
            if node.op_type == "MatMulNBits":
                rows, cols = attrs["N"], attrs["K"]
            else:  # the table [V, D] along its rows (quantize_axis 1)
                if attrs.get("quantize_axis", 1) != 1 or attrs.get("gather_axis", 0) != 0:
                    continue
                rows, cols = data.shape[0], data.shape[1] * 8 // attrs.get("bits", 4)
            zeros = array(node.input[3]) if len(node.input) > 3 and node.input[3] in inits else None
            values, steps = unpack(data, array(node.input[2]), zeros, rows, cols, attrs.get("bits", 4),
                                   attrs["block_size"])
            found[weight] = Dequantized(weight, values, 0.5 * SLACK * steps + 1e-7)
    return list(found.values())


def _match(param: np.ndarray, tensor: Dequantized) -> int | None:
    """The first row offset at which `param` [A, K] lies within half a step of `tensor`'s rows, or None."""
    rows, cols = param.shape
    if cols != tensor.rows.shape[1] or rows > tensor.rows.shape[0]:
        return None
    bound = tensor.bound
    # Candidates by the first element (cheap), then the whole block.
    first = np.flatnonzero(np.abs(tensor.rows[:, 0] - param[0, 0]) <= bound[:, 0])
    first = first[first + rows <= tensor.rows.shape[0]]
    first = first[(np.abs(tensor.rows[first] - param[0]) <= bound[first]).all(1)]
    for offset in first:
        window = slice(offset, offset + rows)
        if (np.abs(tensor.rows[window] - param) <= bound[window]).all():
            return int(offset)
    return None


@dataclass(frozen=True)
class Account:
    """What the dequantised reference took: parameters replaced, and quantised rows no parameter matched
    (0 when the reference carries every quantised weight of the artifact)."""

    replaced: tuple[str, ...]
    unmatched_rows: int
    total_rows: int

    @property
    def complete(self) -> bool:
        return self.unmatched_rows == 0 and bool(self.replaced)

    def to_dict(self) -> dict[str, Any]:
        return {"weights": "the export's own dequantised weights", "replaced": list(self.replaced),
                "unmatched_rows": self.unmatched_rows, "total_rows": self.total_rows}


def _same_table(param: np.ndarray, table: np.ndarray) -> bool:
    """`table` is `param` stored float (in the graph's dtype: float16 graphs hold float16 tables)."""
    return table.shape == param.shape and np.array_equal(param.astype(table.dtype), table)


def _untie_products(model: "CausalLM", weight: Any, dequantized: Any) -> list[str]:
    """The artifact looks `weight`'s rows up in a float copy but multiplies by its quantised copy (a table tied to
    the LM head whose rows are not a whole number of blocks: edgelin.export.quantize): every module but the
    embeddings that holds `weight` gets its own parameter with the `dequantized` values; the embeddings keep the
    float one. Returns the parameters given the dequantised values."""
    import torch

    untied = []
    for module_name, module in list(model.named_modules()):
        if isinstance(module, torch.nn.Embedding):
            continue
        for attr, held in list(module.named_parameters(recurse=False)):
            if held is weight:
                setattr(module, attr, torch.nn.Parameter(dequantized.clone(), requires_grad=held.requires_grad))
                untied.append(f"{module_name}.{attr}" if module_name else attr)
    return untied


def with_export_weights(model: "CausalLM", folder: Path, graph_files: list[str]) -> tuple["CausalLM", Account]:
    """A copy of `model` whose weights are the export's dequantised ones (the model is left as it is)."""
    import torch

    tensors, lookups = read_quantized(folder, graph_files), float_lookups(folder, graph_files)
    twin = copy.deepcopy(model)
    covered = [np.zeros(t.rows.shape[0], bool) for t in tensors]
    replaced = []
    named = list(twin.named_parameters()) + list(twin.named_buffers())
    with torch.no_grad():
        for name, value in named:
            if value.ndim != 2 or not value.is_floating_point():
                continue
            param, found = value.detach().float().numpy(), None
            for index, tensor in enumerate(tensors):  # every match: a graph may hold the weight twice
                offset = _match(param, tensor)
                if offset is not None:
                    rows = slice(offset, offset + param.shape[0])
                    covered[index][rows] = True
                    found = tensor.rows[rows] if found is None else found
            if found is None:
                continue
            dequantized = torch.from_numpy(np.ascontiguousarray(found)).to(value.dtype)
            if any(_same_table(param, table) for table in lookups):  # looked up float, multiplied quantised
                replaced.extend(_untie_products(twin, value, dequantized))
            else:
                value.copy_(dequantized)
                replaced.append(name)
    total = sum(len(c) for c in covered)
    return twin.eval(), Account(tuple(replaced), total - int(sum(c.sum() for c in covered)), total)


def parity_reference(model: "CausalLM", folder: Path, manifest: "Manifest") -> tuple["CausalLM", Account | None]:
    """(what the artifact's parity is checked against, the account): for a weight-quantised export the
    model with the export's dequantised weights, else `model` itself (and None)."""
    from edgelin.quality import quantization_of

    if quantization_of(manifest.extra) is None:
        return model, None
    return with_export_weights(model, folder, [graph.file for graph in manifest.graphs.values()])
