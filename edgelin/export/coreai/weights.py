"""The Core AI export's weights (--quantize int8|int4|fp16, --block-size N): compressed in the converted program,
read back, and checked on Apple's runtime before the folder is published.

int8/int4: coreai-opt's weight quantisation pass (`coreai_opt.coreai_utils.quantize_weights`) on the converted
program: every float constant a matmul, transpose or gather reads (the linear weights, the embedding table and
the LM head) becomes Core AI's `blockwise_shift_scale` on signed codes, `block_size` weights along the input
dimension sharing a float32 scale and a zero point (asymmetric round-to-nearest, as the ONNX target's
MatMulNBits). A weight whose input dimension is not a whole number of blocks is left float32 by the pass (listed
as kept_float). fp16: each such constant stored float16 and widened where it is read by the same op with one
scale of 1 (coreai-opt has no weight-only float16 pass; a float16 parameter's cast, from torch or as Core AI's
`cast`, is folded back into a float32 constant).
Compute, state and logits stay float32.

Read back: the compressed constants are dequantised in numpy (int4 codes two per byte, low nibble first) and
matched to the model's parameters (edgelin.reference.parity); the parity reference carries these values.
Apple's notes warn that int4 constants built from numpy come out silently wrong, so the export runs its program
once on the runtime against torch with the same dequantised weights (`verify`) and refuses a disagreement.

coreai, coreai-opt and torch are imported inside the functions.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from edgelin.artifact.quantized import SLACK, Dequantized
from edgelin.errors import EdgelinError

if TYPE_CHECKING:
    from edgelin.artifact.manifest import Manifest
    from edgelin.model.lm import CausalLM

BITS = {"int8": 8, "int4": 4, "fp16": 16}
METHOD = ("coreai-opt quantize_weights: block-wise asymmetric round-to-nearest weight-only quantisation "
          "(Core AI blockwise_shift_scale on signed codes, float32 scales and zero points; float32 compute)")
METHOD_F16 = "edgelin weight-only float16: each weight constant stored float16, cast to float32 where read"
SHIFT_SCALE = "coreai.blockwise_shift_scale"
VERIFY_TOLERANCE = 1e-4  # of the logits' scale (the fp32 replay's): same weights, float32 both sides (~1e-7)


def _walk(program: Any, visit: Any) -> None:
    """Every operation of the program, as coreai-opt's own passes walk it."""
    from coreai_opt.coreai_utils._coreai_imports import WalkResult

    def step(op: Any) -> Any:
        visit(op.operation)
        return WalkResult.ADVANCE

    program._module._mlir_module.operation.walk(step)


def compress(program: Any, mode: str, block_size: int) -> Any:
    """The program with its weights stored as `mode` (int8, int4: coreai-opt; fp16: a float16 copy and a cast)."""
    from edgelin.export.coreai.convert import quiet

    with quiet():  # coreai-opt's import warnings and its line per weight it leaves float
        from coreai_opt.coreai_utils import CompressionGranularity, DType, QScheme, quantize_weights

        if mode == "fp16":
            return _float16_weights(program)
        dtype = {"int8": DType.INT8, "int4": DType.INT4}[mode]
        return quantize_weights(program, dtype, QScheme.ASYMMETRIC, CompressionGranularity.PER_BLOCK, block_size,
                                weight_num_threshold=0)


def _float16_weights(program: Any) -> Any:
    """Each float32 weight matrix (2-D constants coreai-opt's passes would compress: the linear weights, tables) as a float16 constant read
    through `blockwise_shift_scale` with one scale of 1 (a plain cast of a constant is folded back to float32
    when the asset is saved), so the readers see the same float32 values."""
    import copy

    from coreai._compiler.ir import F16Type
    from coreai_opt.coreai_utils._coreai_imports import (InsertionPoint, _get_constant_value_as_np_array,
                                                         blockwise_shift_scale)
    from coreai_opt.coreai_utils._utils.graph_utils import _create_constant_value_from_np_array, _should_compress_op
    from coreai_opt.coreai_utils.passes import _OPS_WEIGHT_NEED_COMPRESSION

    program = copy.deepcopy(program)
    found: list[Any] = []
    _walk(program, lambda op: found.append(op) if _should_compress_op(op, 0, _OPS_WEIGHT_NEED_COMPRESSION)
          and str(op.result.type.element_type) == "f32" and len(op.result.type.shape) == 2 else None)
    for op in found:
        weight = _get_constant_value_as_np_array(op)
        with op.context, op.location, InsertionPoint(op):
            wide_type, half_type = op.result.type.element_type, F16Type.get()
            ones = np.ones([1] * weight.ndim, np.float32)
            half = blockwise_shift_scale(
                data=_create_constant_value_from_np_array(np.ascontiguousarray(weight.astype(np.float16)), half_type),
                scale=_create_constant_value_from_np_array(ones, wide_type),
                offset1=_create_constant_value_from_np_array(np.zeros_like(ones, np.float16), half_type),
                offset2=_create_constant_value_from_np_array(np.zeros_like(ones), wide_type))._to_mlir()
        op.result.replace_all_uses_with(half)
    return program


def _array(op: Any) -> np.ndarray:
    """A constant's value: floats as float32, integer codes as int16 (4-bit codes unpacked, sign-extended)."""
    from coreai._compiler._mlir_libs._coreaiIR import _bindings

    kind = op.result.type.element_type
    shape, width = list(op.result.type.shape), kind.width
    value = np.array(op.attributes["value"])
    if value.dtype != np.object_:  # a dense attribute numpy reads (a splat: one value)
        return np.broadcast_to(value, shape).astype(np.float32 if "f" in str(kind) else np.int16)
    raw = np.zeros(int(np.ceil(np.prod(shape) * width / 8)), np.uint8)
    _bindings.compiler.copy_constant_value_to_array(constant_op=op, destination=raw)
    text = str(kind)
    if text in ("f32", "f16"):
        return np.frombuffer(raw.tobytes(), np.float32 if text == "f32" else np.float16).reshape(shape).astype(
            np.float32)
    if width == 8:
        return raw.view(np.int8 if text.startswith("si") else np.uint8).reshape(shape).astype(np.int16)
    if width == 4:
        codes = np.stack([raw & 0x0F, raw >> 4], -1).reshape(-1)[:int(np.prod(shape))].astype(np.int16)
        return (np.where(codes > 7, codes - 16, codes) if text.startswith("si") else codes).reshape(shape)
    raise EdgelinError(f"a Core AI weight constant of type {text}", "edgelin reads float, 8- and 4-bit constants",
                       "report this as an edgelin bug")


def _source(value: Any) -> Any:
    """The constant operation a value comes from."""
    owner = value.owner
    return owner.operation if hasattr(owner, "operation") else owner


def read_compressed(program: Any) -> list[Dequantized]:
    """Every compressed weight of the program dequantised ([rows, cols] as the constant is laid out: a linear
    weight's [out, in], a table's [vocab, hidden]), each with half the step it was rounded on."""
    found: list[Dequantized] = []

    def visit(op: Any) -> None:
        if op.name == SHIFT_SCALE:
            data, scale, zero, shift = (_array(_source(v)) for v in op.operands)
            repeats = [d // s for d, s in zip(data.shape, scale.shape)]
            wide = [np.kron(a.astype(np.float32), np.ones(repeats, np.float32)) for a in (scale, zero, shift)]
            values = (data.astype(np.float32) - wide[1]) * wide[0] + wide[2]
            if str(op.operands[0].type.element_type) == "f16":  # --quantize fp16: half a float16 step
                top = np.nextafter(np.finfo(np.float16).max, np.float16(0))
                step = np.spacing(np.minimum(np.abs(data).astype(np.float16), top)).astype(np.float32)
            else:
                step = np.abs(wide[0])
            found.append(Dequantized(f"weight{len(found)}", values, 0.5 * SLACK * step + 1e-12))

    _walk(program, visit)
    return [tensor for tensor in found if tensor.rows.ndim == 2]


def read_asset(folder: Path, asset: str) -> list[Dequantized]:
    """read_compressed on an export's saved asset."""
    from coreai.authoring import AIModelAsset

    return read_compressed(AIModelAsset.load(Path(folder) / asset).program)


def describe(model: "CausalLM", tensors: list[Dequantized], mode: str, block_size: int) -> dict[str, Any]:
    """manifest extra["quantization"] (the ONNX target's keys): the matrices stored compressed and those kept
    float32, by parameter name, found by matching the read-back values to the model's weights."""
    from edgelin.reference.parity import with_dequantized

    _, account = with_dequantized(model, tensors, [])
    names = [name for name, p in model.named_parameters() if p.ndim == 2 and p.is_floating_point()]
    matrices = sorted(n.removesuffix(".weight") for n in account.replaced)
    return {"method": METHOD_F16 if mode == "fp16" else METHOD, "bits": BITS[mode],
            "block_size": None if mode == "fp16" else block_size, "matrices": matrices,
            "kept_float": sorted(n.removesuffix(".weight") for n in names if n not in account.replaced)}


def verify(model: "CausalLM", folder: Path, manifest: "Manifest", tensors: list[Dequantized], prompt: int) -> None:
    """Run the export once on Apple's runtime (a prefill of `prompt` tokens and two steps) against torch with the
    weights read back from the program; refuse a disagreement (a compressed program the runtime reads otherwise
    than its constants say: the int4 packing pitfall), or weights that match no parameter."""
    import torch

    from edgelin.export.coreai.runner import CoreaiRunner
    from edgelin.export.graphs import GRAPHS
    from edgelin.reference.parity import with_dequantized

    twin, account = with_dequantized(model, tensors, [])
    fix = "export without --quantize (or another mode), and report this as an edgelin bug"
    if not account.complete:
        raise EdgelinError("the compressed Core AI weights cannot be verified", f"{account.unmatched_rows} of "
                           f"{account.total_rows} compressed rows match no weight of the model", fix)
    rng = np.random.default_rng(0)
    ids = rng.integers(0, model.config.vocab_size, (1, prompt + 2))
    runner = CoreaiRunner(folder, manifest)
    state = runner.new_state(1)
    got = [runner.prefill(ids[:, :prompt], state, np.zeros(1, np.int64))]
    got += [runner.step(ids[:, t], state, np.full(1, t, np.int64)) for t in (prompt, prompt + 1)]
    with torch.no_grad():
        position = [torch.zeros(1, dtype=torch.long)] if twin.needs_position else []
        states = [torch.zeros([1 if d == "batch" else 0 if d == "past_sequence" else d for d in t.dims])
                  for layer in twin.state_tensors() for t in layer]
        out = GRAPHS["prefill"](twin)(torch.from_numpy(ids[:, :prompt]), *position, *states)
        want = [out[0].numpy()]
        for t in (prompt, prompt + 1):
            position = [torch.full((1,), t, dtype=torch.long)] if twin.needs_position else []
            out = GRAPHS["step"](twin)(torch.from_numpy(ids[:, t]), *position, *out[1:])
            want.append(out[0].numpy())
    got_a, want_a = np.concatenate([np.reshape(g, -1) for g in got]), np.concatenate([np.reshape(w, -1) for w in want])
    error = float(np.abs(got_a - want_a).max() / max(np.abs(want_a).max(), 1e-6))
    if not error <= VERIFY_TOLERANCE:
        raise EdgelinError("the compressed Core AI program disagrees with its own weights", f"Apple's runtime's "
                           f"logits differ from torch's with the same dequantised weights by {error:.2g} of their "
                           f"scale (bound {VERIFY_TOLERANCE:g}): the packing cannot be verified", fix)
