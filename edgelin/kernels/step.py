"""Triton fused step / fused recurrence: one program owns a [d_k, BV] tile of one head's state,
keeps it in registers for every token it processes, and writes it back once.

Per token (the reference `recurrent_step`):  S *= exp(g);  [delta: v = beta (v - S^T k)];
S += k v^T;  o = S^T q.  With the erase gate e (ERASE, Gated DeltaNet-2; delta rule only):
p = S^T k;  S -= beta (e * k) p^T;  S += beta k v^T  (v already carries the write gate).
Tiling is over d_v only: each value column's update needs a reduction
over all of d_k (delta rule, readout) but never another column, so tiles are independent and
the state can be updated in place (every program reads its whole tile before it writes it).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from edgelin.kernels._common import (
    KernelError, Tensor, check_aux, check_device, check_erase, check_out, check_qkv, check_state, last_dim_contiguous,
    next_pow2, state_destination, strides3,
)


@triton.jit
def _recurrent_kernel(
    q, k, v, g, beta, erase, o, s_in, s_out, cu_seqlens,
    s_qb, s_qt, s_qh, s_kb, s_kt, s_kh, s_vb, s_vt, s_vh,
    s_gb, s_gt, s_gh, s_bb, s_bt, s_bh, s_eb, s_et, s_eh, s_ob, s_ot, s_oh,
    s_ib, s_ih, s_ik, s_tb, s_th, s_tk,
    T, H, K, V,
    BK: tl.constexpr, BV: tl.constexpr, GATE: tl.constexpr, DELTA: tl.constexpr,
    VARLEN: tl.constexpr, HAS_S_IN: tl.constexpr, ERASE: tl.constexpr,
):
    i_v = tl.program_id(0)
    i_nh = tl.program_id(1).to(tl.int64)  # 64-bit offsets: B*T*H*d can pass 2^31
    i_n, i_h = i_nh // H, i_nh % H
    if VARLEN:  # inputs are [1, total, H, d]; sequence i_n owns tokens [bos, eos)
        bos = tl.load(cu_seqlens + i_n).to(tl.int64)
        length = tl.load(cu_seqlens + i_n + 1).to(tl.int64) - bos
        i_b = i_n * 0
    else:
        bos = i_n * 0
        length = T
        i_b = i_n

    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_k, m_v = o_k < K, o_v < V
    m_s = m_k[:, None] & m_v[None, :]
    if HAS_S_IN:
        p_s = s_in + i_n * s_ib + i_h * s_ih + o_k[:, None] * s_ik + o_v[None, :]
        b_s = tl.load(p_s, mask=m_s, other=0.0).to(tl.float32)
    else:
        b_s = tl.zeros([BK, BV], dtype=tl.float32)

    p_q = q + i_b * s_qb + bos * s_qt + i_h * s_qh + o_k
    p_k = k + i_b * s_kb + bos * s_kt + i_h * s_kh + o_k
    p_v = v + i_b * s_vb + bos * s_vt + i_h * s_vh + o_v
    p_o = o + i_b * s_ob + bos * s_ot + i_h * s_oh + o_v
    p_g = g + i_b * s_gb + bos * s_gt + i_h * s_gh
    p_b = beta + i_b * s_bb + bos * s_bt + i_h * s_bh
    p_e = erase + i_b * s_eb + bos * s_et + i_h * s_eh + o_k
    for _ in range(0, length):  # pointers advance instead of indexing with the loop variable
        b_q = tl.load(p_q, mask=m_k, other=0.0).to(tl.float32)
        b_k = tl.load(p_k, mask=m_k, other=0.0).to(tl.float32)
        b_v = tl.load(p_v, mask=m_v, other=0.0).to(tl.float32)
        if GATE == 1:
            b_s = b_s * tl.exp(tl.load(p_g).to(tl.float32))
        if GATE == 2:
            b_g = tl.load(p_g + o_k, mask=m_k, other=0.0).to(tl.float32)
            b_s = b_s * tl.exp(b_g)[:, None]
        if ERASE:  # read with the whole key, erase along e * k, write along k
            b_beta = tl.load(p_b).to(tl.float32)
            b_e = tl.load(p_e, mask=m_k, other=0.0).to(tl.float32)
            b_p = tl.sum(b_s * b_k[:, None], axis=0)
            b_s = b_s - (b_beta * b_e * b_k)[:, None] * b_p[None, :]
            b_v = b_beta * b_v
        elif DELTA:
            b_beta = tl.load(p_b).to(tl.float32)
            b_v = b_beta * (b_v - tl.sum(b_s * b_k[:, None], axis=0))
        b_s = b_s + b_k[:, None] * b_v[None, :]
        b_o = tl.sum(b_s * b_q[:, None], axis=0)
        tl.store(p_o, b_o.to(p_o.dtype.element_ty), mask=m_v)
        p_q += s_qt
        p_k += s_kt
        p_v += s_vt
        p_o += s_ot
        p_g += s_gt
        p_b += s_bt
        p_e += s_et
    p_t = s_out + i_n * s_tb + i_h * s_th + o_k[:, None] * s_tk + o_v[None, :]
    tl.store(p_t, b_s, mask=m_s)


LARGE_GRID = 1024  # programs; beyond this the GPU is full several times over


def step_config(d_k: int, d_v: int, num_heads_total: int = 1) -> tuple[int, int]:
    """(BV, num_warps) for B*H = num_heads_total. H200, K=V=128, bf16 (bench/kernels.py): with
    B*H=4096 a 32 KB fp32 state tile per program (BV=64, 4 warps) streamed 91-94% of copy bandwidth
    for every gate/rule, the 16 KB tile (BV=32) 83-93%; with B*H=16 (decode at B=1) the 16 KB tile
    gives more programs and 2.4-2.9 us per layer."""
    bk = next_pow2(d_k)
    bv = max(16, 8192 // bk)
    if num_heads_total * triton.cdiv(d_v, bv) < LARGE_GRID:
        bv = max(16, 4096 // bk)
    bv = min(next_pow2(d_v), bv)
    return bv, 4 if bk * bv <= 8192 else 8


def fused_recurrent(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    state: Tensor | None = None,
    g: Tensor | None = None,
    beta: Tensor | None = None,
    erase: Tensor | None = None,
    *,
    cu_seqlens: Tensor | None = None,
    out: Tensor | None = None,
    state_out: Tensor | None = None,
    block_v: int | None = None,
    num_warps: int | None = None,
) -> tuple[Tensor, Tensor]:
    """The token loop in one kernel: q, k [B, T, H, d_k], v [B, T, H, d_v], g [B, T, H, 1|d_k],
    beta [B, T, H], erase [B, T, H, d_k] (the erase gate; needs beta), state [N, H, d_k, d_v]
    float32 (None: zeros) -> (o [B, T, H, d_v] in v's
    dtype, final state float32). N = B, or with `cu_seqlens` [N+1] (varlen) B must be 1 and
    sequence n owns tokens cu_seqlens[n]:cu_seqlens[n+1]. `state_out` may be `state` (in place)
    or another buffer (ping-pong); `out` may be preallocated."""
    what = "fused_recurrent"
    if q.dim() != 4:
        raise KernelError(f"{what}: q has {q.dim()} dims", "expected [B, T, H, d_k]", "add the time axis")
    batch, length, heads, _ = q.shape
    d_k, d_v = check_qkv(q, k, v, (batch, length, heads), what)
    kind = check_aux(g, beta, (batch, length, heads), d_k, what)
    has_erase = check_erase(erase, beta, (batch, length, heads), d_k, what)
    device = check_device({"q": q, "k": k, "v": v, "g": g, "beta": beta, "erase": erase, "state": state,
                           "state_out": state_out, "cu_seqlens": cu_seqlens})
    if cu_seqlens is not None:
        if batch != 1 or cu_seqlens.dim() != 1 or cu_seqlens.dtype not in (torch.int32, torch.int64):
            raise KernelError(f"{what}: varlen with batch {batch}, cu_seqlens {tuple(cu_seqlens.shape)} "
                              f"{cu_seqlens.dtype}", "varlen packs sequences along T of a batch of 1; cu_seqlens "
                              "is an int32/int64 vector of N+1 offsets", "pass q [1, total, H, d_k]")
        num_seq = cu_seqlens.shape[0] - 1
    else:
        num_seq = batch
    state_shape = (num_seq, heads, d_k, d_v)
    if state is not None:
        check_state(state, state_shape, what)
    if state_out is None:
        state_out = torch.empty(state_shape, dtype=torch.float32, device=device)
    check_state(state_out, state_shape, what, "state_out")
    if out is None:
        out = torch.empty(batch, length, heads, d_v, dtype=v.dtype, device=device)
    check_out(out, (batch, length, heads, d_v), v.dtype, what)
    q, k, v, g, erase = (last_dim_contiguous(x) for x in (q, k, v, g, erase))

    bv, warps = step_config(d_k, d_v, num_seq * heads)
    bv = block_v or bv
    grid = (triton.cdiv(d_v, bv), num_seq * heads)
    s_in = state if state is not None else state_out
    _recurrent_kernel[grid](
        q, k, v, g if g is not None else q, beta if beta is not None else q, erase if erase is not None else q, out,
        s_in, state_out, cu_seqlens,
        *strides3(q), *strides3(k), *strides3(v), *strides3(g), *strides3(beta), *strides3(erase), *strides3(out),
        s_in.stride(0), s_in.stride(1), s_in.stride(2), state_out.stride(0), state_out.stride(1), state_out.stride(2),
        length, heads, d_k, d_v,
        BK=next_pow2(d_k), BV=bv, GATE=kind, DELTA=beta is not None, VARLEN=cu_seqlens is not None,
        HAS_S_IN=state is not None, ERASE=has_erase, num_warps=num_warps or warps,
    )
    return out, state_out


def fused_step(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    state: Tensor,
    g: Tensor | None = None,
    beta: Tensor | None = None,
    erase: Tensor | None = None,
    *,
    out: Tensor | None = None,
    state_out: Tensor | None = None,
    inplace: bool = False,
    block_v: int | None = None,
    num_warps: int | None = None,
) -> tuple[Tensor, Tensor]:
    """One decode step for a whole layer: q, k [B, H, d_k], v [B, H, d_v], g [B, H, 1|d_k],
    beta [B, H], erase [B, H, d_k] (optional), state [B, H, d_k, d_v] float32 -> (o [B, H, d_v], new
    state). inplace=True
    updates `state` itself; `state_out` names a second buffer (ping-pong); else a new tensor."""
    if q.dim() != 3:
        raise KernelError(f"fused_step: q has {q.dim()} dims", "expected [B, H, d_k]", "drop the time axis")
    state_out = state_destination(state, state_out, inplace, "fused_step")
    o, s = fused_recurrent(
        q.unsqueeze(1), k.unsqueeze(1), v.unsqueeze(1), state,
        None if g is None else g.unsqueeze(1), None if beta is None else beta.unsqueeze(1),
        None if erase is None else erase.unsqueeze(1),
        out=None if out is None else out.unsqueeze(1), state_out=state_out, block_v=block_v, num_warps=num_warps,
    )
    return o.squeeze(1), s
