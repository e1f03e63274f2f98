"""The weight passes over an exported graph (--quantize fp16 / int8 / int4, the float32 panels of --step-ops edgelin)
write each new weight to a data file as they make it (edgelin.export.weights.DataSpill) instead of holding them all
in the protobuf until the graph is saved: at 2 B parameters the held copies were the export's peak (issue 46)."""

from __future__ import annotations

import errno
import tracemalloc

import numpy as np
import onnx
import pytest
from onnx import numpy_helper

from edgelin.export import nbits, panels, quantize, weights
from edgelin.export.weights import MIN_EXTERNAL, save_graph
from helpers import tied_head_model

VOCAB, DIM, HIDDEN = 8197, 256, 1024  # VOCAB: not a whole number of 16-row panels


@pytest.fixture
def graph(tmp_path):
    model, arrays = tied_head_model(np.random.default_rng(7), VOCAB, DIM, HIDDEN)
    path = tmp_path / "g.onnx"
    save_graph(model, path)  # the weights in a data file beside it, as an export leaves them
    return path, arrays


def _initializers(path) -> dict[str, np.ndarray]:
    return {t.name: numpy_helper.to_array(t, base_dir=str(path.parent)) for t in onnx.load(str(path)).graph.initializer}


def _panels(weight: np.ndarray) -> np.ndarray:
    """[ceil(N / 16), K, 16] of a weight [K, N], zeros past N: written out element by element."""
    k, n = weight.shape
    out = np.zeros((-(-n // 16), k, 16), weight.dtype)
    for column in range(n):
        out[column // 16, :, column % 16] = weight[:, column]
    return out


def test_fp16_head_is_packed_from_the_tables_rows(graph, monkeypatch):
    """The tied head's float16 panels, packed a slice of table rows at a time (slices of 1,024 rows here, the last
    one short and not a whole panel), equal the panels of the whole transposed table; the lookup reads the table
    in float16."""
    path, arrays = graph
    monkeypatch.setattr(panels, "ROWS_PER_PIECE", 1024)
    quantize.quantize_graph(path, "fp16", 32)
    values = _initializers(path)
    half = arrays["table"].astype(np.float16)
    np.testing.assert_array_equal(values["table_T_f16p"], _panels(half.T))
    np.testing.assert_array_equal(values["table_f16"], half)
    np.testing.assert_array_equal(values["up_f16p"], _panels(arrays["up"].astype(np.float16)))
    ops = [n.op_type for n in onnx.load(str(path), load_external_data=False).graph.node]
    assert ops.count("MatMulF16") == 3 and "Gemm" not in ops and "table" not in values


@pytest.mark.parametrize("scheme", ["fp16", "int4", "int8", "panels"])
def test_a_pass_holds_no_weights_in_memory(graph, monkeypatch, scheme):
    """When the graph is saved, every large initializer already lies in a data file (none held in the protobuf);
    and the pass's own Python allocations peak well under the graph's weights (one weight or slice at a time)."""
    path, arrays = graph
    monkeypatch.setattr(panels, "ROWS_PER_PIECE", 1024)  # table slices: 1 MiB of float32 rows
    monkeypatch.setattr(nbits, "ROWS_PER_SLICE", 1024)
    held = []

    def check_and_save(proto, where):
        held.extend(t.name for t in proto.graph.initializer if len(t.raw_data) >= MIN_EXTERNAL)
        save_graph(proto, where)

    monkeypatch.setattr(weights, "save_graph", check_and_save)
    tracemalloc.start()
    try:
        if scheme == "panels":
            assert panels.pack_float_products(path) == 2
        else:
            quantize.quantize_graph(path, scheme, 32)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    total = sum(a.nbytes for a in arrays.values())  # 10.0 MiB of float32 weights
    assert held == []  # before DataSpill every new weight was here, in protobuf memory (tracemalloc misses it)
    # Python's own allocations (numpy's included), measured: fp16 3.0 MiB (20.2 with the transposed table the head
    # was packed from), int4 / int8 4.2 / 4.6 (the table's quantised bytes kept for the lookup and the head, and
    # one slice of rows), panels 2.0 (the largest projection, 1 MiB, as read and as packed)
    assert peak < 0.5 * total, f"{scheme}: {peak / 2**20:.1f} MiB at peak for {total / 2**20:.1f} MiB of weights"


def test_a_failed_pass_leaves_only_the_graphs_own_files(graph, monkeypatch):
    """A pass that fails half-way (a full disk while writing) removes the data file it was writing: the folder
    holds the graph and its data as before."""
    from onnxruntime.capi import _pybind_state

    path, _ = graph
    before = sorted(p.name for p in path.parent.iterdir())
    calls = []

    def kernel(*args):
        calls.append(1)
        if len(calls) == 2:  # after the first weight was written
            raise OSError(errno.ENOSPC, "No space left on device")
        return original(*args)

    original = _pybind_state.quantize_matmul_4bits
    monkeypatch.setattr(_pybind_state, "quantize_matmul_4bits", kernel)
    with pytest.raises(OSError):
        quantize.quantize_graph(path, "int4", 32)
    assert sorted(p.name for p in path.parent.iterdir()) == before
