"""Block quantisation of an exported graph one weight at a time (--quantize int8|int4): what ONNX Runtime's
MatMulNBitsQuantizer writes, through the same C++ kernels (`quantize_matmul_4bits` / `_8bits`), without holding
the graph's weights in memory.

Why not the tool itself: it wants the whole graph loaded, keeps every float weight until the end and copies each
one it reads, so a 0.75 B-parameter model's int4 export peaked at 12.8 GB in it (4x the float32 weights). Here
the graph is read without its data; each weight is a read-only map of its bytes in the graph's data file,
quantised, and only the (4-8x smaller) results are held. The embedding table is quantised in slices of rows.

The layout is the tool's, byte for byte (tests/export/test_nbits.py compares them): MatMulNBits(A, B_Q{bits},
B_scales, B_zero_points) with K, N, bits, block_size and accuracy_level; blocks of `block_size` weights along K,
asymmetric round-to-nearest, uint8 zero points. An embedding table [V, D] is the transpose of a tied LM head's
weight, so its GatherBlockQuantized data are the head's MatMulNBits bytes reshaped (stored once in weights.bin).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

DOMAIN = "com.microsoft"
ROWS_PER_SLICE = 16384  # embedding rows quantised at a time (a transposed slice: 64 MiB at D = 1024)


def weight_array(tensor: Any, folder: Path | None = None) -> np.ndarray:
    """An initializer's values without loading the graph's data: a read-only map of its bytes in the data file
    (external data, which needs the graph's `folder`), else its own raw bytes."""
    import onnx
    from onnx import numpy_helper

    from edgelin.artifact.quantized import external_array

    if tensor.data_location != onnx.TensorProto.EXTERNAL:
        return numpy_helper.to_array(tensor)
    return external_array(tensor, Path(folder))


class FileRows:
    """A 2-D external initializer read a slice of rows at a time with plain file reads (`rows[start:stop]`): a
    248k-token table quantised through a map would leave its 1 GB resident in the process by the last slice."""

    def __init__(self, path: Path, offset: int, dtype: np.dtype, shape: tuple[int, int]):
        self.path, self.offset, self.dtype, self.shape = Path(path), offset, np.dtype(dtype), shape

    @classmethod
    def of(cls, tensor: Any, folder: Path) -> "FileRows | np.ndarray":
        """The rows of `tensor` (an in-graph tensor: its array)."""
        import onnx
        from onnx import helper

        if tensor.data_location != onnx.TensorProto.EXTERNAL or len(tensor.dims) != 2:
            return weight_array(tensor, folder)
        info = {entry.key: entry.value for entry in tensor.external_data}
        return cls(Path(folder) / info["location"], int(info.get("offset", 0)),
                   helper.tensor_dtype_to_np_dtype(tensor.data_type), tuple(tensor.dims))

    def __getitem__(self, rows: slice) -> np.ndarray:
        start, stop, step = rows.indices(self.shape[0])
        if step != 1:
            raise IndexError("FileRows reads contiguous rows")
        width = self.shape[1]
        with open(self.path, "rb") as fh:
            fh.seek(self.offset + start * width * self.dtype.itemsize)
            return np.fromfile(fh, self.dtype, count=max(stop - start, 0) * width).reshape(-1, width)


def block_quantize(weight: np.ndarray, bits: int, block_size: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(packed [N, blocks, blob] uint8, scales [N, blocks], zero points [N, ceil(blocks * bits / 8)] uint8) of a
    MatMul weight [K, N]: ONNX Runtime's kernel, as its quantiser calls it (QOperator format, asymmetric)."""
    from onnxruntime.capi._pybind_state import quantize_matmul_4bits, quantize_matmul_8bits

    rows, cols = weight.shape
    per_byte = 8 // bits
    blocks = -(-rows // block_size)
    if blocks * block_size != rows:
        weight = np.pad(weight, ((0, blocks * block_size - rows), (0, 0)))
    weight = np.ascontiguousarray(weight)
    packed = np.zeros((cols, blocks, -(-block_size // per_byte)), np.uint8)
    zero_points = np.zeros((cols, -(-blocks // per_byte)), np.uint8)
    scales = np.zeros((cols, blocks), weight.dtype)
    kernel = quantize_matmul_8bits if bits == 8 else quantize_matmul_4bits
    kernel(packed, weight, scales, zero_points, block_size, cols, rows, False)
    return packed, scales, zero_points


def table_quantize(table: "np.ndarray | FileRows", bits: int, block_size: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """block_quantize of a table's transpose ([V, D] -> the weight [D, V] of its tied head), a slice of rows at a
    time: each output column is quantised on its own, so the slices are exact pieces of the whole."""
    pieces = [block_quantize(np.ascontiguousarray(table[start:start + ROWS_PER_SLICE].T), bits, block_size)
              for start in range(0, table.shape[0], ROWS_PER_SLICE)]
    return tuple(np.concatenate([piece[i] for piece in pieces]) for i in range(3))  # type: ignore[return-value]


class NbitsGraph:
    """One graph (loaded without its data) being block-quantised: each weight is quantised once per bit width and
    its initializers added once per layout, whatever nodes read them (written to `spill` as they are made, when
    given, else held in the protobuf)."""

    def __init__(self, proto: Any, folder: Path, block_size: int, accuracy_level: int, spill: Any = None):
        self.proto, self.folder, self.block_size, self.accuracy_level = proto, Path(folder), block_size, accuracy_level
        from edgelin.export.weights import HeldInitializers

        # edgelin.export.weights.DataSpill: the quantised weights written as they are made (None: held in the protobuf)
        self.spill = spill if spill is not None else HeldInitializers()
        self.inits = {t.name: t for t in proto.graph.initializer}
        self.arrays: dict[tuple[str, int], tuple[np.ndarray, np.ndarray, np.ndarray]] = {}
        self.names: dict[tuple[str, int, str], tuple[str, str, str]] = {}

    def float_matrix(self, name: str) -> Any | None:
        """The 2-D float initializer `name`, or None."""
        import onnx

        tensor = self.inits.get(name)
        if tensor is None or len(tensor.dims) != 2 or tensor.data_type not in (onnx.TensorProto.FLOAT,
                                                                                 onnx.TensorProto.FLOAT16):
            return None
        return tensor

    def initializers(self, name: str, bits: int, layout: str) -> tuple[str, str, str]:
        """The names of (packed, scales, zero points) of initializer `name` at `bits`, added on first use. `layout`:
        "matmul" (a MatMul weight [K, N]), "head" (a table [V, D] read as a Gemm's x W^T: the weight is its
        transpose) or "gather" (the same bytes as "head", shaped [V, D * bits / 8] for GatherBlockQuantized)."""

        key = (name, bits, layout)
        if key not in self.names:
            table = layout != "matmul"
            if (name, bits) not in self.arrays or not table:
                self.arrays[(name, bits)] = self._quantize(name, bits, table)
            packed, scales, zeros = self.arrays[(name, bits)]
            if layout == "gather":
                vocab = packed.shape[0]
                arrays = (packed.reshape(vocab, -1), scales, zeros)
                names = (f"{name}_Q", f"{name}_scales", f"{name}_zero_points")
            else:
                suffix = "_T" if table else ""
                arrays = (packed, scales, zeros)
                names = (f"{name}{suffix}_Q{bits}", f"{name}{suffix}_scales", f"{name}{suffix}_zero_points")
            for array, tensor_name in zip(arrays, names):
                self.spill.add(self.proto, array, tensor_name)
            self.names[key] = names
            if not table:
                del self.arrays[(name, bits)]  # a matmul weight is read by one node (fused siblings: one weight)
        return self.names[key]

    def _quantize(self, name: str, bits: int, table: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """ONNX Runtime's kernel on one weight; its own failure is one line, a machine's fault (memory, disk) itself."""
        from edgelin.errors import EdgelinError, environment_fault, one_line

        try:
            if table:
                return table_quantize(FileRows.of(self.inits[name], self.folder), bits, self.block_size)
            return block_quantize(weight_array(self.inits[name], self.folder), bits, self.block_size)
        except Exception as exc:
            fault = environment_fault(exc)
            if fault is not None:
                raise fault from None
            raise EdgelinError(f"int{bits} quantisation of {name} failed", f"{type(exc).__name__}: {one_line(str(exc))}",
                               "export without --quantize, and report this model config as an edgelin bug") from exc

    def matmul(self, node: Any, weight: Any, bits: int, head: bool = False) -> Any:
        """The MatMulNBits that replaces `node`: a MatMul on `weight`, or with `head` a Gemm x W^T."""
        from onnx import helper

        packed, scales, zeros = self.initializers(weight.name, bits, "head" if head else "matmul")
        k, n = (weight.dims[1], weight.dims[0]) if head else tuple(weight.dims)
        quantized = helper.make_node("MatMulNBits", [node.input[0], packed, scales, zeros], list(node.output),
                                     name=f"{node.name}_Q{bits}", domain=DOMAIN, K=k, N=n, bits=bits,
                                     block_size=self.block_size, accuracy_level=self.accuracy_level)
        quantized.metadata_props.extend(node.metadata_props)
        return quantized

    def gather(self, node: Any, bits: int) -> Any:
        """The GatherBlockQuantized that replaces a Gather on a table (rows of whole blocks)."""
        from onnx import helper

        packed, scales, zeros = self.initializers(node.input[0], bits, "gather")
        lookup = helper.make_node("GatherBlockQuantized", [packed, node.input[1], scales, zeros], list(node.output),
                                  name=f"{node.name}_Q{bits}", domain=DOMAIN, gather_axis=0, quantize_axis=1,
                                  block_size=self.block_size, bits=bits)
        lookup.metadata_props.extend(node.metadata_props)
        return lookup

    def close(self) -> None:
        """The opset of ONNX Runtime's contrib ops, once any was written."""
        from onnx import helper

        if self.names and not any(o.domain == DOMAIN for o in self.proto.opset_import):
            self.proto.opset_import.append(helper.make_opsetid(DOMAIN, 1))
