"""The EdgelinStep plugin node as the TensorRT lowering emits it: its ONNX domain, name, fields and
dtype codes (edgelin/kernels/cuda/edgelin_step.h), and `plugin_step`, the node while exporting and the
reference step otherwise. Imports no torch at module level (the target and its lowering share it)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from edgelin.errors import EdgelinError

if TYPE_CHECKING:
    import torch

PLUGIN_DOMAIN = "edgelin"
PLUGIN_NAME = "EdgelinStep"
PLUGIN_VERSION = "1"
PLUGIN_NAMESPACE = ""
# The creator's fields, all INT (the parser narrows them to int32), in the plugin's order.
PLUGIN_FIELDS = ("gate", "delta", "heads", "d_k", "d_v", "dtype", "aux_dtype", "inplace", "erase")
GATE_NONE, GATE_SCALAR, GATE_PER_KEY = 0, 1, 2  # EdgelinGate (edgelin_step.h)
DTYPE_F32, DTYPE_F16, DTYPE_BF16 = 0, 1, 2  # EdgelinDtype
_DTYPE_CODES = {"torch.float32": DTYPE_F32, "torch.float16": DTYPE_F16, "torch.bfloat16": DTYPE_BF16}
_ONNX_TYPES = {DTYPE_F32: 1, DTYPE_F16: 10, DTYPE_BF16: 16}  # onnx.TensorProto FLOAT, FLOAT16, BFLOAT16
_SUFFIX = {DTYPE_F32: "", DTYPE_F16: "_f16", DTYPE_BF16: "_bf16"}


def overload_name(gate: int, delta: int, dtype: int = DTYPE_F32, erase: int = 0) -> str:
    """The ONNX function overload for one layer kind and q/k/v dtype (one function body per kind)."""
    return f"gate{gate}_delta{delta}{'_erase' if erase else ''}{_SUFFIX[dtype]}"


def plugin_step(state: "torch.Tensor", q: "torch.Tensor", k: "torch.Tensor", v: "torch.Tensor",
                g: "torch.Tensor | None", beta: "torch.Tensor | None",
                erase: "torch.Tensor | None" = None) -> tuple["torch.Tensor", "torch.Tensor"]:
    """While exporting: one EdgelinStep node (o, state_out); otherwise the reference step.

    q, k, v (and o) may be fp32, fp16 or bf16 (the plugin's `dtype`); g, beta and the erase gate always
    enter the node in fp32 (`aux_dtype` 0: a half-precision engine still decays in fp32) and the state
    is fp32."""
    import torch

    from edgelin.reference.recurrence import recurrent_step

    code = _DTYPE_CODES.get(str(q.dtype))
    if code is None or not (k.dtype == v.dtype == q.dtype):
        raise EdgelinError(f"TensorRT step with q/k/v in {q.dtype}/{k.dtype}/{v.dtype}", "the plugin takes q, k "
                           "and v in one of float32, float16, bfloat16", "export with --precision fp32 or fp16")
    if state.dtype != torch.float32:
        raise EdgelinError(f"TensorRT step with a {state.dtype} state", "the plugin keeps the state in float32",
                           "export with state dtype float32 (a profile with state_dtype = \"float32\")")
    g = None if g is None else g.float()  # one Cast in the graph when the model computed them in half
    beta = None if beta is None else beta.float()
    erase = None if erase is None else erase.float()
    if erase is not None and beta is None:
        raise EdgelinError("TensorRT step with an erase gate and no beta", "the erase gate splits the delta rule's "
                           "update", "report this as an edgelin bug (the family spec pairs them)")
    if not torch.onnx.is_in_onnx_export():  # the reference: computed in fp32, o back in q's dtype
        o, new_state = recurrent_step(state, q.float(), k.float(), v.float(), g, beta, erase)
        return o.to(q.dtype), new_state
    _, heads, d_k = q.shape
    gate = GATE_NONE if g is None else (GATE_SCALAR if g.shape[-1] == 1 else GATE_PER_KEY)
    delta = int(beta is not None)
    fields = dict(gate=gate, delta=delta, heads=int(heads), d_k=int(d_k), d_v=int(v.shape[-1]),
                  dtype=code, aux_dtype=DTYPE_F32, inplace=0,  # inplace: set by add_step_functions
                  erase=int(erase is not None))
    attrs = {**fields, "plugin_version": PLUGIN_VERSION, "plugin_namespace": PLUGIN_NAMESPACE}
    inputs = [q, k, v, *(t for t in (g, beta, erase) if t is not None), state]
    o, new_state = torch.onnx.ops.symbolic_multi_out(
        f"{PLUGIN_DOMAIN}::{PLUGIN_NAME}", inputs, attrs, dtypes=(v.dtype, state.dtype),
        shapes=(v.shape, state.shape), version=1)
    return o, new_state
