"""The dequantised parity reference of weight-quantised exports (edgelin/export/dequantized.py): the
numpy unpacking against ONNX Runtime's own MatMulNBits kernel, and the matching of parameters to
quantised rows (fused, offset, not found)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import helper, numpy_helper

from edgelin.export import quantize
from edgelin.export.dequantized import Dequantized, _match, read_quantized


def _one_matmul(path: Path, weight: np.ndarray) -> Path:
    k, n = weight.shape
    graph = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["y"])], "one",
                              [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, ["rows", k])],
                              [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, ["rows", n])],
                              [numpy_helper.from_array(weight, "w")])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)]), str(path))
    return path


@pytest.mark.parametrize("scheme, block, k", [("int4", 32, 64), ("int4", 64, 128), ("int8", 32, 96),
                                              ("int4", 32, 80)], ids=["int4-b32", "int4-b64", "int8-b32",
                                                                      "int4-b32-partial-block"])
def test_unpacking_equals_onnxruntimes_kernel(tmp_path, scheme, block, k):
    """ONNX Runtime's MatMulNBits applied to the identity returns the weights it dequantises: our numpy
    unpacking of the same bytes must give them (a nibble order, zero-point packing or block axis wrong
    is off by whole steps)."""
    import onnxruntime as ort

    rng = np.random.default_rng(7)
    weight = rng.normal(0, 0.05, (k, 48)).astype(np.float32)
    path = _one_matmul(tmp_path / "one.onnx", weight)
    quantize.quantize_graph(path, scheme, block, embeddings=False)
    (tensor,) = read_quantized(tmp_path, ["one.onnx"])
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    # one-hot rows survive accuracy_level 4's int8 activation blocks exactly (1 -> code 127)
    by_kernel = session.run(None, {"x": np.eye(k, dtype=np.float32)})[0]  # [K, N]: the dequantised weight
    assert tensor.rows.shape == (48, k)
    np.testing.assert_allclose(tensor.rows.T, by_kernel, rtol=0, atol=1e-6 * np.abs(by_kernel).max())
    # within half a step of the float weight (round-to-nearest), and not equal to it
    error = np.abs(tensor.rows.T - weight)
    assert (error <= tensor.bound.T).all() and error.max() > 1e-4


def test_parameters_are_found_by_value_at_their_offset_and_not_elsewhere():
    rng = np.random.default_rng(3)
    first, second = rng.normal(size=(5, 32)).astype(np.float32), rng.normal(size=(7, 32)).astype(np.float32)
    step = np.full((12, 32), 0.1, np.float32)
    fused = np.concatenate([first, second]) + rng.uniform(-0.049, 0.049, (12, 32)).astype(np.float32)
    tensor = Dequantized("fused", fused, 0.5 * step)
    assert (_match(first, tensor), _match(second, tensor)) == (0, 5)
    assert _match(second + 0.2, tensor) is None  # off by two steps: not this weight
    assert _match(first[:, :16], tensor) is None  # another input width
