"""edgelin.export.nbits writes what ONNX Runtime's own MatMulNBitsQuantizer writes, byte for byte, while reading
each weight from the graph's data file (never the whole graph's data in memory)."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from edgelin.export.quantize import quantize_graph
from edgelin.export.weights import save_graph
from helpers import tied_head_model

VOCAB, DIM, HIDDEN = 96, 64, 80  # HIDDEN: not a whole number of 32-blocks along K of the second MatMul


def _graph(rng: np.random.Generator):
    model, arrays = tied_head_model(rng, VOCAB, DIM, HIDDEN)
    return model, arrays["table"], arrays["up"], arrays["down"]


def _tool(weight: np.ndarray, bits: int, block: int) -> dict[str, np.ndarray]:
    """ONNX Runtime's quantiser on a one-MatMul graph: its initializers by suffix."""
    from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

    k, n = weight.shape
    graph = helper.make_graph([helper.make_node("MatMul", ["a", "w"], ["b"], name="m")], "t",
                              [helper.make_tensor_value_info("a", TensorProto.FLOAT, [1, k])],
                              [helper.make_tensor_value_info("b", TensorProto.FLOAT, [1, n])],
                              [numpy_helper.from_array(np.ascontiguousarray(weight), "w")])
    quantizer = MatMulNBitsQuantizer(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)]),
                                     bits=bits, block_size=block, is_symmetric=False, accuracy_level=4)
    quantizer.process()
    return {t.name.removeprefix("w"): numpy_helper.to_array(t) for t in quantizer.model.model.graph.initializer}


@pytest.mark.parametrize("bits", [4, 8])
def test_block_quantised_bytes_equal_onnxruntimes_tool(tmp_path, bits):
    model, table, up, down = _graph(np.random.default_rng(bits))
    path = tmp_path / "g.onnx"
    save_graph(model, path)  # the weights in a data file beside it, as an export leaves them
    assert len(list(tmp_path.glob("g.onnx*.data"))) == 1
    quantize_graph(path, f"int{bits}", 32)
    proto = onnx.load(str(path))
    inits = {t.name: numpy_helper.to_array(t) for t in proto.graph.initializer}
    ops = {n.name: n for n in proto.graph.node}
    assert sorted(n.op_type for n in proto.graph.node) == ["GatherBlockQuantized", "MatMulNBits", "MatMulNBits",
                                                            "MatMulNBits"]
    assert not {"table", "up", "down"} & set(inits)  # the float weights are gone
    for name, weight in (("up", up), ("down", down), ("table_T", table.T)):
        expected = _tool(weight, bits, 32)
        for suffix in (f"_Q{bits}", "_scales", "_zero_points"):
            np.testing.assert_array_equal(inits[name + suffix], expected[suffix], err_msg=name + suffix)
    # the lookup reads the head's bytes, shaped for GatherBlockQuantized
    np.testing.assert_array_equal(inits["table_Q"].reshape(-1), inits[f"table_T_Q{bits}"].reshape(-1))
    assert {a.name: helper.get_attribute_value(a) for a in ops[f"down_proj_Q{bits}"].attribute} == \
        {"K": HIDDEN, "N": DIM, "bits": bits, "block_size": 32, "accuracy_level": 4}
    import onnxruntime as ort

    ids = np.array([0, 5, VOCAB - 1])
    got = ort.InferenceSession(str(path)).run(None, {"ids": ids})[0]
    exact = table[ids] @ up @ down @ table.T
    assert np.abs(got - exact).max() / np.abs(exact).max() < (0.2 if bits == 4 else 0.02)


def test_the_tables_slices_are_exact_pieces(monkeypatch):
    """Quantising the table a slice of rows at a time gives the whole-table bytes."""
    from edgelin.export import nbits

    table = np.random.default_rng(0).standard_normal((100, 64)).astype(np.float32)
    whole = nbits.block_quantize(np.ascontiguousarray(table.T), 4, 32)
    monkeypatch.setattr(nbits, "ROWS_PER_SLICE", 7)
    for got, want in zip(nbits.table_quantize(table, 4, 32), whole):
        np.testing.assert_array_equal(got, want)


def test_file_rows_read_the_slices_a_map_would(tmp_path):
    """The table's rows read from its data file a slice at a time equal the mapped rows (partial last slice too)."""
    from edgelin.export.nbits import FileRows, table_quantize, weight_array

    table = np.random.default_rng(5).normal(size=(1000, 64)).astype(np.float32)
    proto = numpy_helper.from_array(table, "table")
    onnx.external_data_helper.set_external_data(proto, "t.data", offset=4096, length=table.nbytes)
    (tmp_path / "t.data").write_bytes(b"\0" * 4096 + table.tobytes())
    rows = FileRows.of(proto, tmp_path)
    assert isinstance(rows, FileRows) and rows.shape == (1000, 64)
    assert np.array_equal(rows[990:2000], table[990:]) and np.array_equal(rows[3:7], weight_array(proto, tmp_path)[3:7])
    assert all(np.array_equal(a, b) for a, b in zip(table_quantize(rows, 4, 32), table_quantize(table, 4, 32)))
