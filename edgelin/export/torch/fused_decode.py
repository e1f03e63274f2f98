"""Fused whole-model decode for Gated DeltaNet stacks: 5 kernels per layer at B <= the small batch
(DecodeTuning.small_batch), 8 above, instead of ~85 (H200: docs/performance.md#gpu-decode).

B <= small batch (edgelin.kernels.fused_decode_gemv): the norms, gated output norm, SwiGLU and residual
adds live in the prologues and epilogues of edgelin's one-wave GEMVs, launched with programmatic
dependent launch on Hopper; the embedding gather is in the first in-projection. Above, per layer and
token, with the weights concatenated ONCE at load:
  1. RMSNorm (Triton, one program per row)
  2. one GEMV/GEMM over [q | k | v | gate | beta | output gate] projections (cuBLAS)
  3. the whole mixer in one Triton program per (row, head): short conv + SiLU over q/k/v (the conv
     state shifted in place), L2 norm of q and k, q scale, decay g = -exp(A_log) softplus(a + dt_bias),
     beta = sigmoid(b), the gated delta-rule step on the state (in place, float32), the per-head
     RMSNorm of the output times silu/sigmoid of the output gate
  4. o_proj GEMV accumulated into the residual stream (cuBLAS addmm, in place)
  5. RMSNorm  6. one GEMV over [MLP gate | up]  7. silu(gate) * up (Triton)  8. down GEMV + residual
plus the embedding gather, the final norm and the LM head. `FusedDecoder` captures it in one CUDA graph.

The numbers are the model's (edgelin.model.mixer) with every elementwise step in float32 inside the
kernels instead of rounded to the weights' dtype between ops: equal to the unfused model within the
fp16 tolerance (tests/export/torch/test_fused_decode.py runs the kernels under TRITON_INTERPRET=1 against the
model; tests/gpu/test_decode_gpu.py on CUDA). `fused_support(model)` says which models it takes
(otherwise callers use the unfused GraphDecoder).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from edgelin.kernels._common import KernelError
from edgelin.kernels.fused_decode_gemv import DecodeTuning, gemv_add, norm_gemv, pdl_available

Tensor = torch.Tensor


@triton.jit
def _conv_taps(crow, s_cc, convw, convb, ch, HAS_BIAS: tl.constexpr):
    """The stored taps of a causal depthwise conv (width 4) for channels `ch` of one row: (t1, t2, the
    partial sum over the three stored taps, the weight of the new input). Reads only the conv state and
    weights, so a PDL kernel issues it before waiting for the in-projection."""
    t0 = tl.load(crow + ch * s_cc)
    t1 = tl.load(crow + ch * s_cc + 1)
    t2 = tl.load(crow + ch * s_cc + 2)
    part = (t0.to(tl.float32) * tl.load(convw + ch * 4).to(tl.float32)
            + t1.to(tl.float32) * tl.load(convw + ch * 4 + 1).to(tl.float32)
            + t2.to(tl.float32) * tl.load(convw + ch * 4 + 2).to(tl.float32))
    if HAS_BIAS:
        part += tl.load(convb + ch).to(tl.float32)
    return t1, t2, part, tl.load(convw + ch * 4 + 3).to(tl.float32)


@triton.jit
def _conv_silu(yrow, crow, s_cc, ch, t1, t2, part, w3, m, SHIFT: tl.constexpr):
    """Finish the conv with the new input y[ch], SiLU; SHIFT: shift the row's conv state in place where
    `m`. A channel's taps may sit in several threads (Triton replicates small tensors across warps):
    every tap is read before the barrier, and written only after it."""
    raw = tl.load(yrow + ch)
    acc = part + raw.to(tl.float32) * w3
    if SHIFT:
        tl.debug_barrier()
        tl.store(crow + ch * s_cc, t1, mask=m)
        tl.store(crow + ch * s_cc + 1, t2, mask=m)
        tl.store(crow + ch * s_cc + 2, raw.to(crow.dtype.element_ty), mask=m)
    return acc * tl.sigmoid(acc)


@triton.jit
def _gdn_mixer_kernel(y, s_yb, conv, s_cb, s_cc, convw, convb, a_log, dt_bias, s, s_sb, s_sh, s_sk,
                      norm_w, o, s_ob, H, scale, eps,
                      K: tl.constexpr, V: tl.constexpr, BV: tl.constexpr, HAS_BIAS: tl.constexpr,
                      SIGMOID_GATE: tl.constexpr, NORM: tl.constexpr, SHIFT_QK: tl.constexpr,
                      PDL: tl.constexpr):
    """One (row, head, value tile). NORM (needs BV == V): the gated RMSNorm too, o in the weights'
    dtype; else o before the norm, float32 (small batches: the o_proj GEMV's prologue norms it, and
    value tiles BV < V give more programs). SHIFT_QK: shift the q/k conv state here (only with one
    value tile: with several, every tile reads those taps, so the o_proj GEMV shifts them after).
    PDL: the state, conv taps and gate parameters are read before waiting for the in-projection."""
    pid = tl.program_id(0).to(tl.int64)
    i_v = tl.program_id(1)
    b, h = pid // H, pid % H
    ok, ov = tl.arange(0, K), i_v * BV + tl.arange(0, BV)
    kw, vw = H * K, H * V
    yrow, crow = y + b * s_yb, conv + b * s_cb
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
    p_s = s + b * s_sb + h * s_sh + ok[:, None] * s_sk + ov[None, :]
    if not NORM:  # small batch: the state tile (BV <= 32 wide) loads while the rest waits; a whole head
        state = tl.load(p_s)  # (NORM, large batch) would hold 64 KB of registers through the conv: later
    q1, q2, qp, qw = _conv_taps(crow, s_cc, convw, convb, h * K + ok, HAS_BIAS)
    k1, k2, kp, kw3 = _conv_taps(crow, s_cc, convw, convb, kw + h * K + ok, HAS_BIAS)
    v1, v2, vp, vw3 = _conv_taps(crow, s_cc, convw, convb, 2 * kw + h * V + ov, HAS_BIAS)
    a_h, dt_h = tl.load(a_log + h).to(tl.float32), tl.load(dt_bias + h).to(tl.float32)
    if PDL:
        tl.extra.cuda.gdc_wait()
    all_k = ok < K
    q = _conv_silu(yrow, crow, s_cc, h * K + ok, q1, q2, qp, qw, all_k, SHIFT_QK)
    k = _conv_silu(yrow, crow, s_cc, kw + h * K + ok, k1, k2, kp, kw3, all_k, SHIFT_QK)
    v = _conv_silu(yrow, crow, s_cc, 2 * kw + h * V + ov, v1, v2, vp, vw3, ov < V, True)
    q = q * tl.rsqrt(tl.sum(q * q, 0) + 1e-6) * scale  # the mixer's l2 form, then q * d**-0.5
    k = k * tl.rsqrt(tl.sum(k * k, 0) + 1e-6)
    a = tl.load(yrow + 2 * kw + vw + h).to(tl.float32) + dt_h
    dt = tl.where(a > 20.0, a, tl.log(1.0 + tl.exp(a)))  # F.softplus (threshold 20)
    g = -tl.exp(a_h) * dt
    beta = tl.sigmoid(tl.load(yrow + 2 * kw + vw + H + h).to(tl.float32))
    if NORM:
        state = tl.load(p_s)
    state = state * tl.exp(g)
    u = beta * (v - tl.sum(state * k[:, None], 0))
    state += k[:, None] * u[None, :]
    tl.store(p_s, state)
    out = tl.sum(state * q[:, None], 0)
    if NORM:
        out = out * tl.rsqrt(tl.sum(out * out, 0) / V + eps) * tl.load(norm_w + ov).to(tl.float32)
        gate = tl.load(yrow + 2 * kw + vw + 2 * H + h * V + ov).to(tl.float32)
        out = out * (tl.sigmoid(gate) if SIGMOID_GATE else gate * tl.sigmoid(gate))
    tl.store(o + b * s_ob + h * V + ov, out.to(o.dtype.element_ty))


@triton.jit
def _rmsnorm_kernel(x, s_xb, w, out, s_ob, D, eps, BD: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    od = tl.arange(0, BD)
    m = od < D
    v = tl.load(x + b * s_xb + od, mask=m, other=0.0).to(tl.float32)
    v = v * tl.rsqrt(tl.sum(v * v, 0) / D + eps) * tl.load(w + od, mask=m, other=0.0).to(tl.float32)
    tl.store(out + b * s_ob + od, v.to(out.dtype.element_ty), mask=m)


@triton.jit
def _silu_mul_kernel(gu, s_gb, out, s_ob, I, BLOCK: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    oi = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = oi < I
    a = tl.load(gu + b * s_gb + oi, mask=m, other=0.0).to(tl.float32)
    u = tl.load(gu + b * s_gb + I + oi, mask=m, other=0.0).to(tl.float32)
    tl.store(out + b * s_ob + oi, (a * tl.sigmoid(a) * u).to(out.dtype.element_ty), mask=m)


def fused_support(model: torch.nn.Module) -> str | None:
    """None when every layer fits the fused decode; otherwise why not (callers fall back to GraphDecoder)."""
    from edgelin.families import Decay, Gate, OutputGate
    from edgelin.model.mixer import LinearMixer

    for i, block in enumerate(model.model.layers):
        mixer = block.mixer
        if not isinstance(mixer, LinearMixer):
            return f"layer {i} is softmax attention"
        s, d = mixer.spec, mixer.dims
        wanted = (s.decay is Decay.SCALAR and s.gate is Gate.SOFTPLUS and s.delta_rule and s.use_beta
                  and s.beta_scale == 1.0 and s.short_conv and s.qk_norm == "l2" and s.scale_queries
                  and s.feature_map == "identity" and not (s.rotary or s.value_dt or s.skip_d or s.erase_gate
                                                           or s.write_gate or s.normalizer or mixer.clvr)
                  and s.output_norm and s.output_norm_scope == "head" and s.output_gate is OutputGate.AFTER_NORM
                  and s.gate_low_rank == 0 and s.output_gate_low_rank == 0 and s.dt_clamp is None)
        if not wanted:
            return f"layer {i} ({s.name}) is not a Gated DeltaNet layer the fused kernels take"
        if d.conv_size != 4:
            return f"layer {i}: short conv of width {d.conv_size} (the fused kernel takes 4)"
        if d.num_k_heads != d.num_heads or mixer.d_state != d.head_k_dim:
            return f"layer {i}: grouped key heads"
        for dim in (d.head_k_dim, d.head_v_dim):
            if dim & (dim - 1) or dim > 256:
                return f"layer {i}: head dim {dim} is not a power of two <= 256"
        if not hasattr(block, "mlp"):
            return f"layer {i} has no MLP"
    return None


class _Layer:
    """One layer's weights, concatenated once."""

    def __init__(self, block: torch.nn.Module):
        m = block.mixer
        self.norm_in, self.norm_post = block.input_norm.weight.detach(), block.post_norm.weight.detach()
        self.eps_in, self.eps_post = block.input_norm.eps, block.post_norm.eps
        self.w_in = torch.cat([m.q_proj.weight, m.k_proj.weight, m.v_proj.weight, m.gate_proj.weight,
                               m.b_proj.weight, m.g_proj.weight]).detach().contiguous()
        self.conv_w = m.conv1d.detach().contiguous()
        bias = getattr(m, "conv1d_bias", None)
        self.conv_b = None if bias is None else bias.detach().contiguous()
        self.a_log, self.dt_bias = m.A_log.detach().float().contiguous(), m.dt_bias.detach().float().contiguous()
        self.o_norm, self.o_norm_eps = m.o_norm.weight.detach(), m.o_norm.eps
        self.sigmoid_gate = m.spec.output_gate_activation == "sigmoid"
        self.w_o = m.o_proj.weight.detach().contiguous()  # [N, K] as nn.Linear keeps it
        self.w_gu = torch.cat([block.mlp.gate_proj.weight, block.mlp.up_proj.weight]).detach().contiguous()
        self.w_down = block.mlp.down_proj.weight.detach().contiguous()
        self.heads, self.d_k, self.d_v = m.dims.num_heads, m.dims.head_k_dim, m.dims.head_v_dim
        self.scale = m.d_state ** -0.5
        self.intermediate = block.mlp.gate_proj.weight.shape[0]


class FusedDecoder:
    """decoder = FusedDecoder(model, batch=1); decoder.reset(state); logits = decoder.step(ids)
    The same interface as GraphDecoder (state: a list of per-layer dicts, updated in place). With
    graph=False (or on CPU, under TRITON_INTERPRET=1) the fused step runs eagerly, without capture."""

    def __init__(self, model: torch.nn.Module, batch: int = 1, graph: bool = True, warmup: int = 2, pool=None,
                 tuning: DecodeTuning | None = None):
        reason = fused_support(model)
        if reason is not None:
            raise KernelError("the fused decode cannot take this model", reason, "use GraphDecoder (unfused)")
        from edgelin.export.torch.graph_decode import decode_state

        weight = model.lm_head.weight
        device, dtype = weight.device, weight.dtype
        self.model, self.batch = model, batch
        self.tuning = tuning or DecodeTuning()
        self.small = batch <= self.tuning.small_batch
        self.pdl = self.small and self.tuning.pdl and pdl_available(device)  # PDL only between edgelin's kernels
        self.layers = [_Layer(block) for block in model.model.layers]
        self.embed, self.head = model.model.embed_tokens.weight.detach(), weight.detach()
        self.final_norm, self.final_eps = model.model.norm.weight.detach(), model.model.norm.eps
        hidden = self.embed.shape[1]
        self.ids = torch.zeros(batch, dtype=torch.long, device=device)
        self.state = decode_state(model, batch, device)
        buffers: dict[tuple[int, str], Tensor] = {}  # one contiguous buffer per width: cuBLAS writes it whole

        def buffer(width: int, tag: str) -> Tensor:
            return buffers.setdefault((width, tag), torch.zeros(batch, width, dtype=dtype, device=device))

        self.x, self.h = buffer(hidden, "x"), buffer(hidden, "h")
        for layer in self.layers:
            layer.y, layer.o = buffer(layer.w_in.shape[0], "y"), buffer(layer.heads * layer.d_v, "o")
            layer.gu, layer.act = buffer(2 * layer.intermediate, "gu"), buffer(layer.intermediate, "act")
            layer.o_raw = torch.zeros(batch, layer.heads * layer.d_v, dtype=torch.float32, device=device)
        self.logits_buffer = buffer(self.head.shape[0], "logits")
        self.graph = None
        with torch.no_grad():
            if graph and device.type == "cuda":
                side = torch.cuda.Stream(device)
                side.wait_stream(torch.cuda.current_stream(device))
                with torch.cuda.stream(side):  # compile the kernels, pick cuBLAS algorithms outside capture
                    saved = [{n: t.clone() for n, t in layer.items()} for layer in self.state]
                    for _ in range(warmup):
                        self._forward()
                    self.reset(saved)
                torch.cuda.current_stream(device).wait_stream(side)
                self.graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(self.graph, pool=pool):
                    self.logits = self._forward()
            else:
                self.logits = None

    def _norm(self, x: Tensor, weight: Tensor, eps: float, out: Tensor) -> Tensor:
        _rmsnorm_kernel[(x.shape[0],)](x, x.stride(0), weight, out, out.stride(0), x.shape[1], eps,
                                       BD=triton.next_power_of_2(x.shape[1]), num_warps=4)
        return out

    def _forward(self) -> Tensor:
        if self.small:
            return self._forward_small()
        x, h, batch = self.x, self.h, self.batch
        torch.index_select(self.embed, 0, self.ids, out=x)
        for layer, state in zip(self.layers, self.state):
            y, o, gu, act = layer.y, layer.o, layer.gu, layer.act
            torch.mm(self._norm(x, layer.norm_in, layer.eps_in, h), layer.w_in.t(), out=y)
            self._mixer(layer, state, o, layer.d_v, shift_qk=True)
            x.addmm_(o, layer.w_o.t())
            torch.mm(self._norm(x, layer.norm_post, layer.eps_post, h), layer.w_gu.t(), out=gu)
            _silu_mul_kernel[(batch, triton.cdiv(layer.intermediate, 1024))](
                gu, gu.stride(0), act, act.stride(0), layer.intermediate, BLOCK=1024, num_warps=4)
            x.addmm_(act, layer.w_down.t())
        return F.linear(self._norm(x, self.final_norm, self.final_eps, h), self.head)

    def _mixer(self, layer: _Layer, state: dict[str, Tensor], o: Tensor, bv: int, shift_qk: bool,
               pdl: bool = False) -> None:
        y, conv, s = layer.y, state["conv_state"], state["recurrent_state"]
        _gdn_mixer_kernel[(self.batch * layer.heads, layer.d_v // bv)](
            y, y.stride(0), conv, conv.stride(0), conv.stride(1), layer.conv_w,
            layer.conv_w if layer.conv_b is None else layer.conv_b, layer.a_log, layer.dt_bias,
            s, s.stride(0), s.stride(1), s.stride(2), layer.o_norm, o, o.stride(0), layer.heads,
            layer.scale, layer.o_norm_eps, K=layer.d_k, V=layer.d_v, BV=bv,
            HAS_BIAS=layer.conv_b is not None, SIGMOID_GATE=layer.sigmoid_gate, NORM=bv == layer.d_v and not self.small,
            SHIFT_QK=shift_qk, PDL=pdl, num_warps=self.tuning.mixer_warps if self.small else 8,
            **({"launch_pdl": True} if pdl else {}))

    def _forward_small(self) -> Tensor:
        """B <= tuning.small_batch: 5 kernels per layer, the norms, gates and residual adds inside the
        GEMVs; the embedding gather inside the first in-projection."""
        x, t, pdl = self.x, self.tuning, self.pdl
        for i, (layer, state) in enumerate(zip(self.layers, self.state)):
            y = layer.y
            if i == 0:  # the step's first kernel: no PDL, so it starts after the previous step ended
                norm_gemv(self.embed, layer.norm_in, layer.eps_in, layer.w_in, y, t.bn_in, t.warps_in, t.bk, False,
                          embed_ids=self.ids, x_out=x)
            else:
                norm_gemv(x, layer.norm_in, layer.eps_in, layer.w_in, y, t.bn_in, t.warps_in, t.bk, pdl)
            bv = min(layer.d_v, t.mixer_bv)
            tiled = bv < layer.d_v  # several value tiles read the q/k conv taps: o_proj shifts them after
            self._mixer(layer, state, layer.o_raw, bv, shift_qk=not tiled, pdl=pdl)
            gate = y[:, y.shape[1] - layer.heads * layer.d_v:]
            shift = (state["conv_state"], y, 2 * layer.heads * layer.d_k) if tiled else None
            gemv_add(layer.o_raw, layer.w_o, x, t.bn_o, t.warps_o, t.bk, pdl, gate=gate, norm_w=layer.o_norm,
                     eps=layer.o_norm_eps, sigmoid=layer.sigmoid_gate, shift=shift)
            norm_gemv(x, layer.norm_post, layer.eps_post, layer.w_gu, layer.act, t.bn_gu, t.warps_gu, t.bk, pdl,
                      swiglu=True)
            gemv_add(layer.act, layer.w_down, x, t.bn_down, t.warps_down, t.bk, pdl)
        norm_gemv(x, self.final_norm, self.final_eps, self.head, self.logits_buffer, t.bn_head, t.warps_head, t.bk, pdl)
        return self.logits_buffer

    def reset(self, state: list[dict[str, Tensor]] | None = None, start: Tensor | int = 0) -> None:
        """Load a state (None: zeros). `start` is accepted for GraphDecoder's interface (no positions here)."""
        with torch.no_grad():
            for i, layer in enumerate(self.state):
                for name, tensor in layer.items():
                    tensor.zero_() if state is None else tensor.copy_(state[i][name])

    def step(self, token_ids: Tensor) -> Tensor:
        """One token per row -> logits [B, vocab] (with a graph: a static buffer, overwritten next step)."""
        self.ids.copy_(token_ids.reshape(self.batch))
        if self.graph is None:
            with torch.no_grad():
                return self._forward()
        self.graph.replay()
        return self.logits

    def current_state(self) -> list[dict[str, Tensor]]:
        return [{name: t.clone() for name, t in layer.items()} for layer in self.state]
