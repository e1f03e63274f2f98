"""edgelin.artifact.quantized.PackedRows: a block-quantised tensor's values unpacked where indexed equal the whole
unpacked array at the same places, bit for bit (4 and 8 bits, with and without zero points, a last partial block),
and the whole equals an independent float64 unpacking written from ONNX Runtime's layout."""

from __future__ import annotations

import numpy as np
import pytest

from edgelin.artifact.quantized import PackedRows, unpack


def _layout(rows: int, cols: int, bits: int, block: int, zero_points: bool, seed: int):
    """Random codes in ONNX Runtime's MatMulNBits layout and the float64 values they stand for."""
    rng = np.random.default_rng(seed)
    blocks = -(-cols // block)
    codes = rng.integers(0, 2 ** bits, (rows, blocks * block))
    zeros = rng.integers(0, 2 ** bits, (rows, blocks)) if zero_points else np.full((rows, blocks), 2 ** (bits - 1))
    scales = rng.uniform(0.001, 0.1, (rows, blocks)).astype(np.float32)
    pack = (lambda c: (c[:, 0::2] | (c[:, 1::2] << 4)).astype(np.uint8)) if bits == 4 else \
        (lambda c: c.astype(np.uint8))
    zero_bytes = None
    if zero_points:
        padded = np.pad(zeros, ((0, 0), (0, blocks % 2))) if bits == 4 else zeros
        zero_bytes = pack(padded).reshape(-1)
    want = ((codes.reshape(rows, blocks, block) - zeros[:, :, None]) * scales.astype(np.float64)[:, :, None])
    return pack(codes), scales.reshape(-1), zero_bytes, want.reshape(rows, -1)[:, :cols]


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("zero_points", [True, False])
@pytest.mark.parametrize("cols, block", [(96, 32), (80, 32), (48, 16)])
def test_rows_unpacked_where_indexed_equal_the_whole(bits, zero_points, cols, block):
    data, scales, zeros, want = _layout(37, cols, bits, block, zero_points, seed=bits + cols)
    packed = PackedRows(data, scales, zeros, 37, cols, bits, block)
    whole, steps = unpack(data, scales, zeros, 37, cols, bits, block)
    assert packed.shape == whole.shape == (37, cols) and whole.dtype == np.float32
    np.testing.assert_allclose(whole, want, rtol=1e-6, atol=0)  # float32 of the float64 formula
    picks = np.array([0, 5, 36, 5])
    for key in (slice(None), slice(3, 11), slice(30, 90), slice(40, 50), picks, picks[:0], 7, -1):
        assert np.array_equal(packed[key], whole[key]), key
    for column in (0, 1, 31, 32, cols - 1, -1):
        assert np.array_equal(packed[:, column], whole[:, column]), column
        assert np.array_equal(packed[picks, column], whole[picks, column]), column
        assert packed[picks[:0], column].shape == (0,)
    assert np.array_equal(packed[2:9, 3:40], whole[2:9, 3:40])
    assert np.array_equal(np.asarray(packed), whole)
    assert np.array_equal(packed.steps[:], steps[:])
    with pytest.raises(IndexError):
        packed[:, cols]


@pytest.mark.parametrize("panelled", [True, False])
def test_half_rows_converted_where_indexed_equal_the_whole(panelled):
    """HalfRows (--quantize fp16's weights, converted only where indexed): every kind of index the parity reference
    uses gives the float32 of the float16 values at those places; a panelled weight's row n is column n of its
    [K, N] weight, written out here element by element, N not a whole number of 16-column panels."""
    from edgelin.artifact.quantized import HalfRows

    rng = np.random.default_rng(5)
    weight = rng.standard_normal((24, 37)).astype(np.float16)  # [K, N]
    want = weight.T.astype(np.float32)  # the module's rows [N, K]
    if panelled:
        stored = np.zeros((3, 24, 16), np.float16)  # [P, K, 16], zeros past N
        for column in range(37):
            stored[column // 16, :, column % 16] = weight[:, column]
        rows = HalfRows(stored, 37)
    else:
        rows = HalfRows(np.ascontiguousarray(weight.T))
    assert rows.shape == (37, 24) and len(rows) == 37
    np.testing.assert_array_equal(np.asarray(rows), want)
    picks = np.array([0, 15, 16, 36, 15])
    for key in (slice(None), slice(3, 11), slice(14, 33), slice(30, 90), slice(40, 50), picks, picks[:0]):
        got = rows[key]
        assert got.dtype == np.float32
        np.testing.assert_array_equal(got, want[key])
    for row in (0, 17, 36, -1):
        np.testing.assert_array_equal(rows[row], want[row])
    for column in (0, 5, 23):
        np.testing.assert_array_equal(rows[:, column], want[:, column])
        np.testing.assert_array_equal(rows[picks, column], want[picks, column])
    np.testing.assert_array_equal(rows[2:9, 3:7], want[2:9, 3:7])
