"""An export's quantised weights read back to float, torch-free: every quantised tensor of the ONNX graphs
(MatMulNBits weights, GatherBlockQuantized tables, --quantize fp16's float16 weights and tables, the latter
packed in column panels) unpacked in numpy, each with half the quantisation step it was rounded on.

This is the artifact side of the reference a weight-quantised export is checked against
(edgelin/reference/parity.py puts these values into the PyTorch model). The layout facts both sides share
(the panel layout, the quantised ops' names) are defined here; the export side's writers
(edgelin/export/panels.py, quantize.py) import them. onnx is imported inside the functions.
"""


from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path
from collections.abc import Iterator
from typing import Any, Callable

import numpy as np

from edgelin.errors import EdgelinError
from edgelin.outputs import inside_path

SLACK = 1.0 + 1e-3  # on the half-step bound: the dequantised product's own float rounding
PANEL = 16  # columns per panel (TILE_N in edgelin/ortops/tiles_kernel.h)
F16_OP = "MatMulF16"  # float32 activations by a float16 weight in panels (--quantize fp16)
QUANTIZED_OPS = ("MatMulNBits", "GatherBlockQuantized")  # the ops that carry a quantised weight
# MatMulNBits' accuracy_level whose CPU kernels (ONNX Runtime's, and edgelin's bit for bit) multiply int8 activation
# blocks: each block of block_size inputs rounded to the nearest of 255 steps of its largest magnitude / 127.
ACTIVATIONS_ROUNDED = 4


def unpack_panels(panels: Any, cols: int) -> Any:
    """edgelin.export.panels.pack_panels' inverse: [P, K, 16] -> [K, cols]."""
    return panels.transpose(1, 0, 2).reshape(panels.shape[1], -1)[:, :cols]


def panel_columns(node: Any, panels: Any) -> int:
    """N of a panel op's node whose weight is `panels` ([P, K, 16]): its attribute n (0 or absent: 16 P)."""
    return next((a.i for a in node.attribute if a.name == "n" and a.i), PANEL * panels.shape[0])


def half_tables(graph: Any) -> set[str]:
    """The float16 2-D initializers Gathers read in a --quantize fp16 graph (its embedding tables; none in a graph
    without MatMulF16 nodes: an fp16 graph's tables are float16 too, and not quantised)."""
    import onnx

    if not any(n.op_type == F16_OP for n in graph.node):
        return set()
    halves = {t.name for t in graph.initializer if len(t.dims) == 2 and t.data_type == onnx.TensorProto.FLOAT16}
    return {n.input[0] for n in graph.node if n.op_type == "Gather" and n.input and n.input[0] in halves}


@dataclass(frozen=True)
class Dequantized:
    """One quantised tensor unpacked: `rows` [N, K] float32 (a MatMulNBits weight's output columns, or a
    table's rows) and `bound` [N, K], half the quantisation step each element was rounded on (slack included;
    an array, or BlockSteps for block-quantised weights). `input_block`: the artifact multiplies it by activations
    rounded to int8 per block of that many (MatMulNBits at ACTIVATIONS_ROUNDED; a table tied to such a head too)."""

    name: str
    rows: np.ndarray
    bound: Any
    input_block: int = 0  # the product rounds its float32 activations to int8 in blocks of this many (0: it does not)


def unpack(data: np.ndarray, scales: np.ndarray, zero_points: np.ndarray | None, rows: int, cols: int, bits: int,
           block_size: int) -> tuple[np.ndarray, "BlockSteps"]:
    """(values [rows, cols], steps [rows, cols]) of ONNX Runtime's block-quantised layout: per row, blocks of
    `block_size` along the columns, `bits` per code packed low bits first, one scale and one zero point per
    block (zero points packed the same way; without them, the midpoint 2^(bits-1)). The steps are one per
    block, expanded only where indexed (BlockSteps: a 2 B-parameter model's would be 8 GB)."""
    packed = PackedRows(data, scales, zero_points, rows, cols, bits, block_size)
    return np.asarray(packed), packed.steps


class PackedRows:
    """unpack's [rows, cols] float32 values, unpacked only where indexed (as BlockSteps does its steps): a row, a
    slice or an index array of rows, or [rows, column] one column's codes. np.asarray unpacks the whole. The
    in-place parity reference matches and copies a 248k-token table through it a slice at a time, never holding its
    1 GB unpacked beside the float one (edgelin.reference.parity.with_dequantized)."""

    def __init__(self, data: np.ndarray, scales: np.ndarray, zero_points: np.ndarray | None, rows: int, cols: int,
                 bits: int, block_size: int):
        if bits not in (4, 8):
            raise ValueError(f"{bits}-bit codes")
        blocks = -(-cols // block_size)
        if zero_points is None:
            self.zeros = np.full((rows, blocks), 2 ** (bits - 1), np.float32)
        else:
            self.zeros = _codes(zero_points, rows, bits)[:, :blocks].astype(np.float32)
        self.scale = np.asarray(scales, np.float32).reshape(rows, blocks)
        self.packed = np.asarray(data, np.uint8).reshape(rows, -1)
        self.bits, self.block_size, self.blocks = bits, block_size, blocks
        self.shape, self.ndim, self.dtype = (rows, cols), 2, np.dtype(np.float32)
        self.steps = BlockSteps(np.abs(self.scale), block_size, cols)

    def __getitem__(self, key: Any) -> np.ndarray:
        if isinstance(key, tuple):
            rows, column = key
            if isinstance(column, (int, np.integer)):
                return self._column(rows, int(column))
            return self[rows][..., column]
        if isinstance(key, (int, np.integer)):
            if not -self.shape[0] <= key < self.shape[0]:
                raise IndexError(f"row {key} of {self.shape[0]}")
            row = int(key) % self.shape[0]
            return self._rows(slice(row, row + 1))[0]
        return self._rows(key)

    def _rows(self, key: Any) -> np.ndarray:
        packed, zeros, scale = self.packed[key], self.zeros[key], self.scale[key]
        if not packed.shape[0]:  # (an empty selection: no candidate rows)
            return np.empty((0, self.shape[1]), np.float32)
        width = self.blocks * self.block_size
        codes = _codes(packed, packed.shape[0], self.bits)[:, :width]
        codes = codes.reshape(-1, self.blocks, self.block_size).astype(np.float32)
        return ((codes - zeros[:, :, None]) * scale[:, :, None]).reshape(-1, width)[:, :self.shape[1]]

    def _column(self, rows: Any, column: int) -> np.ndarray:
        if not -self.shape[1] <= column < self.shape[1]:
            raise IndexError(f"column {column} of {self.shape[1]}")
        column %= self.shape[1]
        block = column // self.block_size
        if self.bits == 8:
            codes = self.packed[rows, column]
        else:  # two codes a byte, low nibble first
            byte = self.packed[rows, column // 2]
            codes = byte >> 4 if column % 2 else byte & 0x0F
        return (codes.astype(np.float32) - self.zeros[rows, block]) * self.scale[rows, block]

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        values = np.empty(self.shape, np.float32)
        for start in range(0, self.shape[0], 4096):  # a slice of rows at a time: the codes as float32 are 4-8x the bytes
            values[start:start + 4096] = self._rows(slice(start, start + 4096))
        return values if dtype is None else values.astype(dtype)


class BlockSteps:
    """A [rows, cols] array of per-element steps stored once per block ([rows, blocks]): indexing by rows (an int,
    a slice, an index array) expands just those rows; [rows, column] reads the column's block."""

    def __init__(self, per_block: np.ndarray, block_size: int, cols: int, scale: float = 1.0, offset: float = 0.0):
        self.per_block, self.block_size, self.cols = per_block, block_size, cols
        self.scale, self.offset = scale, offset
        self.shape = (per_block.shape[0], cols)

    def __mul__(self, factor: float) -> "BlockSteps":
        return BlockSteps(self.per_block, self.block_size, self.cols, self.scale * factor, self.offset * factor)

    __rmul__ = __mul__

    def __add__(self, term: float) -> "BlockSteps":
        return BlockSteps(self.per_block, self.block_size, self.cols, self.scale, self.offset + term)

    def __getitem__(self, key: Any) -> np.ndarray:
        if isinstance(key, tuple):
            rows, column = key
            if isinstance(column, (int, np.integer)):
                return self.per_block[rows, column // self.block_size] * self.scale + self.offset
            return self[rows][..., column]
        expanded = np.repeat(self.per_block[key], self.block_size, axis=-1)[..., :self.cols]
        return expanded * self.scale + self.offset


class HalfRows:
    """[N, K] float32 rows of a --quantize fp16 weight, converted only where indexed (as PackedRows unpacks its
    codes): a table [N, K] as stored, or a MatMulF16 weight's panels [P, K, 16] (`rows` = N; row n is column n of
    its [K, N] weight). The in-place parity reference takes a 248k-token head through it a slice at a time, where
    unpacking it whole took three float32 copies of it (3 GB at Qwen3.5-0.8B's shapes)."""

    def __init__(self, half: np.ndarray, rows: int | None = None):
        self.half, self.panelled = half, half.ndim == 3
        self.shape = (rows if self.panelled else half.shape[0], half.shape[1])
        self.ndim, self.dtype = 2, np.dtype(np.float32)

    def __len__(self) -> int:
        return self.shape[0]

    def __getitem__(self, key: Any) -> np.ndarray:
        if isinstance(key, tuple):
            rows, column = key
            if not isinstance(column, (int, np.integer)):
                return self[rows][..., column]
            values = self.half[:, column, :].reshape(-1)[:self.shape[0]] if self.panelled else self.half[:, column]
            return np.asarray(values, np.float32)[rows]
        if isinstance(key, (int, np.integer)):
            return self[np.arange(self.shape[0])[key:key + 1 or None]][0]
        if isinstance(key, slice) and key.step in (None, 1):
            start, stop, _ = key.indices(self.shape[0])
            if not self.panelled:
                return np.asarray(self.half[start:stop], np.float32)
            first = start // PANEL  # the panels holding these rows, their columns laid out as rows
            block = self.half[first:-(-stop // PANEL)].transpose(0, 2, 1).reshape(-1, self.shape[1])
            return np.asarray(block[start - first * PANEL:stop - first * PANEL], np.float32)
        index = np.arange(self.shape[0])[key]
        if not self.panelled:
            return np.asarray(self.half[index], np.float32)
        return np.asarray(self.half[index // PANEL, :, index % PANEL], np.float32).reshape(len(index), self.shape[1])

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        whole = self[:]
        return whole if dtype is None else whole.astype(dtype)


class HalfSteps:
    """The [rows, cols] float16 steps of `values` (np.spacing: each element's step; subnormals included), times
    `scale` plus `offset`, computed only for the rows indexed (as BlockSteps; a whole model's would be 3 GB). The
    largest finite float16's step up is inf: it rounds with the step of its binade, 65472's."""

    def __init__(self, values: np.ndarray, scale: float = 1.0, offset: float = 0.0):
        self.values, self.scale, self.offset, self.shape = values, scale, offset, values.shape

    def __getitem__(self, key: Any) -> np.ndarray:
        top = np.nextafter(np.finfo(np.float16).max, np.float16(0))
        steps = np.spacing(np.minimum(np.abs(self.values[key]).astype(np.float16), top)).astype(np.float32)
        return steps * self.scale + self.offset

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        whole = self[:]
        return whole if dtype is None else whole.astype(dtype)


def _codes(packed: np.ndarray, rows: int, bits: int) -> np.ndarray:
    """[rows, codes]: the bytes of each row as codes, two 4-bit codes per byte low nibble first."""
    packed = np.asarray(packed, np.uint8).reshape(rows, -1)
    return np.stack([packed & 0x0F, packed >> 4], -1).reshape(rows, -1) if bits == 4 else packed


def _graph(folder: Path, file: str) -> tuple[Any, dict[str, Any], Callable[[str], np.ndarray]]:
    """(graph, its initializers by name, name -> array): the graphs share one weights file, so each tensor's bytes
    are read only when asked for."""
    import onnx
    from onnx import numpy_helper

    graph = onnx.load(str(Path(folder) / file), load_external_data=False).graph
    inits = {t.name: t for t in graph.initializer}

    def array(name: str) -> np.ndarray:
        tensor = inits[name]
        if tensor.data_location == onnx.TensorProto.EXTERNAL:  # the graph keeps none of the bytes read
            return external_array(tensor, Path(folder))
        return numpy_helper.to_array(tensor)

    return graph, inits, array


def external_array(tensor: Any, folder: Path) -> np.ndarray:
    """An external initializer's values as a read-only map of its bytes in the folder's data file (nothing copied;
    the export reads its own weights this way too: edgelin.export.nbits.weight_array). Read here, not by onnx's
    loader, which refuses a file with more than one hard link (an export copied with `cp -al`, or deduplicated by
    the file system); a data-file name that leaves the folder, or a file too short for the tensor, is one line."""
    from onnx import helper

    info = {entry.key: entry.value for entry in tensor.external_data}
    location, offset = info.get("location", ""), int(info.get("offset", 0))
    if not inside_path(location):
        raise EdgelinError(f"{folder}: tensor {tensor.name} names data file {location!r}",
                           "an export's graphs read their weights from a file in the export folder",
                           "re-export: the folder was edited")
    dtype, shape = np.dtype(helper.tensor_dtype_to_np_dtype(tensor.data_type)), tuple(tensor.dims)
    count = int(np.prod(shape, dtype=np.int64))
    path = Path(folder) / location
    if not count:
        return np.empty(shape, dtype)
    if offset + count * dtype.itemsize > path.stat().st_size:
        raise EdgelinError(f"{path} is truncated", f"tensor {tensor.name} lies past its end",
                           "re-export, or copy the folder again")
    return np.memmap(path, dtype=dtype, mode="r", offset=offset, shape=shape)


def float_lookups(folder: Path, graph_files: list[str]) -> list[np.ndarray]:
    """The embedding tables the graphs look rows up in unquantised: 2-D float initializers plain Gathers read on
    axis 0 (each once). A table whose rows are not a whole number of blocks stays float (edgelin.export.quantize)
    while the LM head tied to it is quantised: the reference must then look its rows up in the float table too."""
    import onnx

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


def _rounding_block(graph: Any) -> int:
    """The block the graph's MatMulNBits products round their activations in (0: they take them as float32). The
    exporter gives every product of a graph one accuracy level (edgelin.export.quantize.ACCURACY_LEVEL)."""
    import onnx

    for node in graph.node:
        if node.op_type == "MatMulNBits":
            attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
            if attrs.get("accuracy_level", 0) == ACTIVATIONS_ROUNDED:
                return int(attrs["block_size"])
    return 0


def read_quantized(folder: Path, graph_files: list[str]) -> list[Dequantized]:
    """Every quantised tensor the graphs read, unpacked (each distinct initializer once)."""
    return list(iter_quantized(folder, graph_files))


def iter_quantized(folder: Path, graph_files: list[str], lazy: bool = False) -> Iterator[Dequantized]:
    """read_quantized's tensors one at a time, each unpacked only when asked for (a 0.75 B model's are 3 GB
    unpacked: the reference takes them in turn, edgelin.reference.parity.with_dequantized). `lazy`: a
    block-quantised tensor's rows are a PackedRows, a float16 one's a HalfRows, unpacked where indexed."""
    import onnx

    found: set[str] = set()
    contents: set[str] = set()  # a tied table's lookup and head hold the same bytes: unpacked once
    for file in graph_files:
        graph, inits, array = _graph(folder, file)
        tables = half_tables(graph)
        rounding = _rounding_block(graph)
        for node in graph.node:
            half = node.input[1] if node.op_type == F16_OP else node.input[0] if node.op_type == "Gather" \
                and node.input and node.input[0] in tables else None
            if half is not None and half in inits and half not in found:  # --quantize fp16: a float16 weight
                stored = array(half)
                if node.op_type != F16_OP:  # a table [N, K], as the module holds it
                    values: Any = HalfRows(stored)
                elif stored.ndim == 3:  # MatMul's [K, N] packed in panels [P, K, 16] -> the module's [N, K]
                    values = HalfRows(stored, panel_columns(node, stored))
                else:
                    values = HalfRows(np.ascontiguousarray(stored.T))
                values = values if lazy else np.asarray(values)
                found.add(half)
                yield Dequantized(half, values, HalfSteps(values, 0.5 * SLACK, 1e-12))
                continue
            if node.op_type not in QUANTIZED_OPS:
                continue
            attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
            weight = node.input[0] if node.op_type == "GatherBlockQuantized" else node.input[1]
            if weight in found or weight not in inits:
                continue
            data = array(weight)
            content = hashlib.sha256(np.ascontiguousarray(data).data).hexdigest()
            if content in contents:
                continue
            contents.add(content)
            if node.op_type == "MatMulNBits":
                rows, cols = attrs["N"], attrs["K"]
            else:  # the table [V, D] along its rows (quantize_axis 1)
                if attrs.get("quantize_axis", 1) != 1 or attrs.get("gather_axis", 0) != 0:
                    continue
                rows, cols = data.shape[0], data.shape[1] * 8 // attrs.get("bits", 4)
            zeros = array(node.input[3]) if len(node.input) > 3 and node.input[3] in inits else None
            packed = PackedRows(data, array(node.input[2]), zeros, rows, cols, attrs.get("bits", 4),
                                attrs["block_size"])
            found.add(weight)
            # (a table, looked up by GatherBlockQuantized, is multiplied only as the tied head: a MatMulNBits)
            yield Dequantized(weight, packed if lazy else np.asarray(packed), 0.5 * SLACK * packed.steps + 1e-7,
                              rounding)
