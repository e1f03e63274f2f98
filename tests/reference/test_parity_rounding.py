"""The parity reference's int8 activation blocks (edgelin.reference.parity.round_activation_blocks) against the
kernels that define them: ONNX Runtime's MatMulNBits at accuracy_level 4 and edgelin's own op on the same node,
for 8- and 4-bit weights, a partial last block, and inputs on a quantised table's lattice, whose blocks hold exact
ties (x * 127 / amax = k + 0.5) where an ulp in the scale decides the rounding."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from edgelin.artifact.quantized import ACTIVATIONS_ROUNDED, unpack
from edgelin.export.nbits import block_quantize
from edgelin.reference.parity import round_activation_blocks

K, N, BLOCK = 80, 24, 32  # 80 = two blocks and a partial one


def product(domain: str, weight: np.ndarray, bits: int, x: np.ndarray) -> np.ndarray:
    """x @ weight by one MatMulNBits node in `domain`, as an export writes it."""
    import onnxruntime as ort
    from onnx import TensorProto, helper, numpy_helper

    from edgelin.ortops import register

    packed, scales, zeros = block_quantize(weight, bits, BLOCK)
    node = helper.make_node("MatMulNBits", ["A", "B", "scales", "zeros"], ["Y"], domain=domain, K=K, N=N, bits=bits,
                            block_size=BLOCK, accuracy_level=ACTIVATIONS_ROUNDED)
    graph = helper.make_graph(
        [node], "product", [helper.make_tensor_value_info("A", TensorProto.FLOAT, [None, K])],
        [helper.make_tensor_value_info("Y", TensorProto.FLOAT, [None, N])],
        [numpy_helper.from_array(packed, "B"), numpy_helper.from_array(scales.reshape(-1), "scales"),
         numpy_helper.from_array(zeros.reshape(-1), "zeros")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid(domain, 1)])
    options = ort.SessionOptions()
    if domain != "com.microsoft":
        register(options)
    session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    return session.run(None, {"A": x})[0]


TIE_AMAX = np.float32(2.109173059463501)  # (x / amax) * 127 of amax / 2: exactly 63.5 with 127 / amax divided


def lattice_rows(rng: np.random.Generator, rows: int) -> np.ndarray:
    """Rows like a normed, quantised embedding row: integers times one scale, and in each block an exact tie."""
    x = rng.integers(-120, 121, (rows, K)).astype(np.float32) * (TIE_AMAX / np.float32(127))
    x[:, ::BLOCK] = TIE_AMAX  # each block's largest magnitude ...
    x[:, 1::BLOCK] = TIE_AMAX / 2  # ... and half of it: 63.5 steps, rounded to 64 (half to even)
    return x


@pytest.mark.parametrize("domain", ["com.microsoft", "ai.edgelin"])
@pytest.mark.parametrize("bits", [8, 4])
def test_rounded_activations_times_the_dequantised_weight_is_the_kernels_product(domain, bits):
    rng = np.random.default_rng(bits)
    weight = rng.standard_normal((K, N)).astype(np.float32)
    x = np.concatenate([rng.standard_normal((4, K)).astype(np.float32), lattice_rows(rng, 4)])
    got = product(domain, weight, bits, x)
    packed, scales, zeros = block_quantize(weight, bits, BLOCK)
    dequantized, _ = unpack(packed, scales, zeros, N, K, bits, BLOCK)  # [N, K]
    rounded = round_activation_blocks(torch.from_numpy(x), BLOCK).numpy().astype(np.float64) @ dequantized.T
    plain = x.astype(np.float64) @ dequantized.T
    scale = np.abs(plain).max()
    assert np.abs(got - rounded).max() / scale < 2e-6
    assert np.abs(got - plain).max() / scale > 1e-3  # (the kernel does round: float activations are far off)


def test_a_tie_rounds_as_the_kernel_does_not_an_ulp_away():
    """torch's `127.0 / amax` multiplies by amax's reciprocal: 63.5 would come out 63.4999 and round down."""
    x = torch.zeros(1, BLOCK)
    x[0, 0] = float(TIE_AMAX)
    x[0, 1] = x[0, 0] / 2  # 63.5 steps with 127 / amax divided; 63.49999 by the reciprocal
    steps = round_activation_blocks(x, BLOCK)[0, :2] / (x[0, 0] / 127)
    assert torch.allclose(steps, torch.tensor([127.0, 64.0]), atol=1e-4)  # half to even, as lrintf / cvtps


def test_zero_and_partial_blocks():
    x = torch.zeros(2, 40)
    x[1, 35] = -1.5  # the partial block [32, 40): its amax from its own 8 values
    got = round_activation_blocks(x, BLOCK)
    assert got.shape == x.shape and torch.equal(got[0], x[0]) and got[1, 35] == -1.5 and got[1].count_nonzero() == 1


def test_float_noise_tips_the_ties_of_rounding_products_only():
    """The noise floor's run (with_float_noise): one ulp of noise before a rounding product moves its output by whole
    steps where its input sits on ties (a quantised table's normed rows), by about an ulp elsewhere; products that
    do not round are left alone; removing the hooks gives the reference back bit for bit."""
    import functools

    from edgelin.reference.parity import _round_input, rounded_products, with_float_noise

    torch.manual_seed(0)
    rounding, plain = torch.nn.Linear(K, N, bias=False), torch.nn.Linear(K, N, bias=False)
    rounding.register_forward_pre_hook(functools.partial(_round_input, block=BLOCK))
    model = torch.nn.Sequential(rounding, plain)  # (only the modules are looked at)
    ties = torch.from_numpy(lattice_rows(np.random.default_rng(0), 64))
    smooth = torch.randn(64, K)
    with torch.no_grad():
        clean = [rounding(ties), rounding(smooth), plain(smooth)]
        handles = with_float_noise(model, seed=1)
        assert rounded_products(model) == [rounding] and len(handles) == 1
        noisy = [rounding(ties), rounding(smooth), plain(smooth)]
        for handle in handles:
            handle.remove()
        assert torch.equal(rounding(ties), clean[0])
    step = float(TIE_AMAX / 127 * rounding.weight.detach().abs().max())

    def tipped(a: torch.Tensor, b: torch.Tensor) -> int:  # rows moved by a tenth of a step or more
        return int(((a - b).abs().amax(-1) > 0.1 * step).sum())

    # Ties tip in most rows; random inputs rarely hold a value within an ulp of one (each 64 rows of 80 values)
    assert tipped(noisy[0], clean[0]) > 32 and tipped(noisy[1], clean[1]) <= 4
    assert torch.equal(noisy[2], clean[2])
