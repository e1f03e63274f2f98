"""The ONNX target's lowering: the torch forms, with the chunked form's loop over chunks as torch's
scan operator, which the exporter turns into one ONNX `Scan` with a dynamic trip count (a Python loop
would be unrolled for the example's chunk count and pin the sequence length), and the one-token step
as ONNX Runtime's contrib ops (edgelin.export.lowering says how a target's lowering is installed)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from edgelin.export.lowering import Lowering, scan_loop
from edgelin.model.layers import short_conv
from edgelin.reference import recurrence
from edgelin.reference.engine import TorchEngine

Tensor = torch.Tensor

def softplus(x: Tensor) -> Tensor:
    """softplus as the one ONNX Softplus node while exporting (torch's form adds its threshold as
    Greater + Where; ONNX Runtime's Softplus is log1p(exp(-|x|)) + max(x, 0), exact for large x too)."""
    if torch.onnx.is_in_onnx_export():
        return torch.onnx.ops.symbolic("Softplus", (x,), dtype=x.dtype, shape=x.shape, version=1)
    return torch.nn.functional.softplus(x)


# LinearAttention's update rule by which of the decay (g) and the delta rule's beta a layer has.
UPDATE_RULES = {(False, False): "linear", (True, False): "gated", (False, True): "delta", (True, True): "gated_delta"}


def linear_attention_step(state: Tensor, q: Tensor, k: Tensor, v: Tensor, g: Tensor | None,
                          beta: Tensor | None) -> tuple[Tensor, Tensor]:
    """OnnxEngine.step_t1 as one com.microsoft LinearAttention node (ONNX Runtime >= 1.32, CPU and CUDA):
    S_t = exp(g) S (g per head or per key), the delta rule's beta (v - S^T k) when beta is given, then
    S_t += k v^T and o = S_t^T q, with S [B, H, d_k, d_v] as edgelin keeps it. Its packed [B, T, heads *
    dim] inputs take q with its own head count (a query head serves H / Hq value heads, as here), but k
    with one head per value head: grouped key heads are repeated (H * d_k values per token)."""
    heads, d_k, d_v = state.shape[1:]
    key_heads = k.shape[2]
    if key_heads != heads:
        k = k.unsqueeze(3).expand(-1, -1, -1, heads // key_heads, -1)
    inputs = [q.reshape(-1, 1, key_heads * d_k), k.reshape(-1, 1, heads * d_k), v.reshape(-1, 1, heads * d_v), state,
              None if g is None else g.reshape(-1, 1, heads * g.shape[-1]),
              None if beta is None else beta.reshape(-1, 1, heads)]
    while inputs[-1] is None:
        inputs.pop()
    batch = state.shape[0]
    o, state = torch.onnx.ops.symbolic_multi_out(
        "com.microsoft::LinearAttention", inputs,
        {"update_rule": UPDATE_RULES[g is not None, beta is not None], "q_num_heads": key_heads,
         "kv_num_heads": heads, "scale": 1.0},
        dtypes=(v.dtype, state.dtype), shapes=((batch, 1, heads * d_v), state.shape), version=1)
    return o.reshape(-1, 1, heads, d_v), state


@dataclass(frozen=True)
class OnnxEngine(TorchEngine):
    """The torch forms with the chunk loop as a scan, plus what the step graph needs to stay small
    (ONNX Runtime pays a few microseconds per node, about as much as the step's arithmetic): a one-token
    step that keeps the time axis (`step_t1`: reshapes instead of Gather / Unsqueeze / Squeeze) and
    broadcasts grouped key heads instead of repeating them, and `softplus` as one node. The mixer
    (edgelin.model.mixer) uses `step_t1` for a T = 1 step of layers without a normaliser or erase gate."""

    # The step's recurrence and short conv as ONNX Runtime's com.microsoft LinearAttention (decay, delta
    # rule, outer product and readout) and CausalConvWithState (window, taps, bias, SiLU, shift): one node
    # each per layer instead of ~10 and ~8 standard ops. Off (--step-ops standard): standard ops only, for
    # runtimes without these contrib ops (ONNX Runtime < 1.32, other ONNX runtimes).
    contrib_ops: bool = True

    def step_t1(self, state: Tensor, q: Tensor, k: Tensor, v: Tensor, g: Tensor | None = None,
                beta: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """recurrence.recurrent_step for one token, time axis kept: q, k [B, 1, Hk, d_k] (Hk key heads,
        dividing H), v [B, 1, H, d_v], g [B, 1, H, 1 | d_k], beta [B, 1, H], state [B, H, d_k, d_v]
        -> (o [B, 1, H, d_v], state)."""
        if self.contrib_ops and torch.onnx.is_in_onnx_export():
            return linear_attention_step(state, q, k, v, g, beta)
        heads, d_k, d_v = state.shape[1:]
        key_heads = q.shape[2]
        grouped = key_heads not in (1, heads)  # then S is viewed [B, Hk, H/Hk, d_k, d_v]
        lead = (-1, key_heads, 1) if grouped else (-1, key_heads)  # a key head, broadcast over its value heads
        each = (-1, key_heads, heads // key_heads) if grouped else (-1, heads)
        s = state.reshape(-1, key_heads, heads // key_heads, d_k, d_v) if grouped else state
        if g is not None:
            s = s * g.exp().reshape(*each, g.shape[-1], 1)
        v = v.reshape(*each, 1, d_v)
        if beta is not None:  # v <- beta (v - k^T S)
            v = beta.reshape(*each, 1, 1) * (v - k.reshape(*lead, 1, d_k) @ s)
        s = s + k.reshape(*lead, d_k, 1) @ v  # the outer product as a K = 1 MatMul: exact, a little faster
        o = q.reshape(*lead, 1, d_k) @ s  # [.., 1, d_v]
        return o.reshape(-1, 1, heads, d_v), (s.reshape(-1, heads, d_k, d_v) if grouped else s)

    # The chunked form's per-chunk preparation (decays, P, the WY inverse) inside the Scan body, one chunk per
    # iteration, instead of batched over every chunk of the piece before the Scan: ONNX Runtime then holds one
    # chunk's intermediates at a time, not the piece's (per-key decays' [C, C, d_k] ones above all: KDA prefill
    # peak RSS 269 -> 183 MiB, GLA 382 -> 210, both faster; issue 13; docs/performance.md#cpu-step-latency).
    prep_in_loop: bool = True
    # q and k of one key head shared by every value head (Mamba2's single group) stay one head in the chunked
    # form: its products broadcast over the heads (edgelin.model.mixer), one q k^T per chunk instead of H.
    broadcasts_one_key_head: ClassVar[bool] = True

    def chunked(self, state: Tensor, q: Tensor, k: Tensor, v: Tensor, g: Tensor | None = None,
                beta: Tensor | None = None, chunk_size: int = 64,
                erase: Tensor | None = None) -> tuple[Tensor, Tensor]:
        if not self.prep_in_loop:
            return super().chunked(state, q, k, v, g, beta, chunk_size, erase)
        blocks = recurrence.chunk_inputs(q, k, v, g, beta, erase, chunk_size)
        given = [x is not None for x in blocks]

        def body(s: Tensor, xs: tuple[Tensor, ...]) -> tuple[Tensor, Tensor]:
            one = iter(xs)
            s, out = recurrence.chunked_blocks(s, *(next(one).unsqueeze(0) if x else None for x in given))
            return s, out.squeeze(0)

        state, out = self.loop(body, state, tuple(x.contiguous() for x in blocks if x is not None))
        return recurrence.unchunk(out, q.shape[1]), state

    def short_conv_t1(self, x: Tensor, weight: Tensor, conv_state: Tensor,
                      bias: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """edgelin.model.layers.short_conv for one token (x [B, 1, C], weight [C, W], conv_state [B, C, W-1]),
        as one com.microsoft CausalConvWithState node (channels first, the state's layout; SiLU fused) for a
        float32 graph: ONNX Runtime's CPU kernel takes float only."""
        if not (self.contrib_ops and torch.onnx.is_in_onnx_export() and x.dtype == torch.float32):
            return short_conv(x, weight, conv_state, bias, window_sum=True)
        batch, _, channels = x.shape
        y, state = torch.onnx.ops.symbolic_multi_out(
            "com.microsoft::CausalConvWithState", [x.reshape(batch, channels, 1), weight.unsqueeze(1), bias, conv_state],
            {"activation": "silu", "ndim": 1}, dtypes=(x.dtype, conv_state.dtype),
            shapes=((batch, channels, 1), conv_state.shape), version=1)
        return y.reshape(batch, 1, channels), state

    @staticmethod
    def softplus(x: Tensor) -> Tensor:
        return softplus(x)

    @staticmethod
    def l2_normalize(x: Tensor, eps: float, scale: float = 1.0) -> Tensor:
        """scale * x / sqrt(|x|^2 + eps) written as RMSNorm (x / sqrt(mean(x^2) + eps / d) * w with
        w = scale / sqrt(d): the same value), which ONNX Runtime fuses into one SimplifiedLayerNormalization
        node; the sum-and-rsqrt form stays six. Statistics in float32 (fp16 graphs), as RMSNorm."""
        d = x.shape[-1]
        wide = x.float()
        weight = torch.full((d,), scale * d**-0.5, dtype=torch.float32)
        return (wide / torch.sqrt(wide.pow(2).mean(-1, keepdim=True) + eps / d) * weight).to(x.dtype)


LOWERING = Lowering("onnx", OnnxEngine(name="onnx-scan", loop=scan_loop),
                    "torch forms; the chunk loop is torch's scan (one ONNX Scan, dynamic count); "
                    "the one-token step's recurrence and conv as ONNX Runtime's LinearAttention and "
                    "CausalConvWithState")
