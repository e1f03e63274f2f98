"""The two state-side kernels of the chunked prefill (edgelin.kernels.chunk runs them after its prep, if any):

1. `_chunk_h_kernel`, sequential over chunks, parallel over sequences x heads x d_v tiles (x d_k tiles
   for the additive rule), the state tile in registers. Per chunk it only stores the state entering
   the chunk (h, in the matmul operand dtype) and, for the delta rule, U = U0 - W S (over U0, in place);
   then S = e^{b_C} S + K^T (e^{b_C - b} U): a scalar decay scales U's rows (BT x BV); a per-key one
   K's columns, once, in the cumsum or diagonal-block kernel (KG, read instead of K); K is read
   transposed ([BK, BT]) straight into the matmul. The cumulative log-decay b
   (`gc`) comes from the prep kernel (the delta rule with a scalar decay) or the cumsum kernel.
   Nothing quadratic in the chunk and no output is on this sequential path.
2. `_chunk_o_kernel`, parallel over every chunk x head x d_v tile: O = (Q * e^b) h + P U
   (+ the erase gate's S-free part). With no per-key decay and no erase gate (P_IN) it forms the
   intra-chunk readout P = (Q K^T) * e^{b_i - b_j} itself, so the additive rule needs no prep kernel.

Gated DeltaNet-2's erase gate (f = e * k, see `edgelin.reference.recurrence.chunked`): with U = beta V - r
the state update is S1 = e^{b_C} S0 + F_end^T U + ((1 - e) * K)_end^T (beta V), and the readout
O = (Q * e^b) S0 + P_qf U + (P_qk - P_qf)(beta V), whose last term the prep kernel stores (`ox`).
"""

from __future__ import annotations

import triton
import triton.language as tl

from edgelin.kernels.chunk_tiles import _ld_lower

__all__ = ["_chunk_h_kernel", "_chunk_o_kernel"]


@triton.jit(do_not_specialize=["T"])
def _chunk_h_kernel(
    k, v, e, beta, gc, KG, U, W, A, h, h0, ht, cu_seqlens, chunk_offsets,
    s_kb, s_kt, s_kh, s_vb, s_vt, s_vh, s_eb, s_et, s_eh, s_bb, s_bt, s_bh,
    s_0n, s_0h, s_0k, s_tn, s_th, s_tk,
    T, H, K, V,
    BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    GATE: tl.constexpr, DELTA: tl.constexpr, ERASE: tl.constexpr, VARLEN: tl.constexpr, HAS_H0: tl.constexpr,
    PREC: tl.constexpr, T_IN_H: tl.constexpr = False, BC: tl.constexpr = 16,
):
    """T_IN_H (the delta rule, no erase gate): the prep stored only the WY inverse T (over A), and this
    kernel forms U = T (diag(beta) V - KE S) with KE = diag(beta) K e^b (stored in W by the per-key
    diagonal kernel, else formed here from K): one more small matmul per chunk on this sequential path, and
    W and U0 never go through memory."""
    i_v = tl.program_id(0)
    i_nh = tl.program_id(1).to(tl.int64)
    i_n, i_h = i_nh // H, i_nh % H
    if VARLEN:
        bos = tl.load(cu_seqlens + i_n).to(tl.int64)
        length = tl.load(cu_seqlens + i_n + 1).to(tl.int64) - bos
        i_b = i_n * 0
        tok = bos
        c0 = tl.load(chunk_offsets + i_n).to(tl.int64)
    else:
        bos = i_n * 0
        length = T
        i_b = i_n
        tok = i_n * T
        c0 = i_n * tl.cdiv(T, BT)
    dt = k.dtype.element_ty
    rows = tl.arange(0, BT)
    o_k = tl.program_id(2) * BK + tl.arange(0, BK)  # one K tile (the additive rule) or all of K
    o_v = i_v * BV + tl.arange(0, BV)
    m_k, m_v = o_k < K, o_v < V
    m_s = m_k[:, None] & m_v[None, :]
    if HAS_H0:
        b_s = tl.load(h0 + i_n * s_0n + i_h * s_0h + o_k[:, None] * s_0k + o_v[None, :], mask=m_s, other=0.0)
    else:
        b_s = tl.zeros([BK, BV], dtype=tl.float32)
    k += i_b * s_kb + bos * s_kt + i_h * s_kh
    v += i_b * s_vb + bos * s_vt + i_h * s_vh
    if ERASE:
        e += i_b * s_eb + bos * s_et + i_h * s_eh
    if ERASE or T_IN_H:
        beta += i_b * s_bb + bos * s_bt + i_h * s_bh

    for i_t in range(0, tl.cdiv(length, BT)):
        t0 = i_t * BT
        m_t = t0 + rows < length
        row0 = (tok + t0) * H + i_h
        m_kt = m_k[:, None] & m_t[None, :]
        m_tv = m_t[:, None] & m_v[None, :]
        tl.store(h + ((c0 + i_t) * H + i_h) * K * V + o_k[:, None] * V + o_v[None, :], b_s.to(h.dtype.element_ty),
                 mask=m_s)
        if GATE == 2:  # K^T [BK, BT] already scaled by e^{b_last - b} (KG: the cumsum or diagonal-block kernel)
            b_kt = tl.load(KG + (row0 + rows[None, :] * H) * K + o_k[:, None], mask=m_kt, other=0.0)
        else:
            b_kt = tl.load(k + (t0 + rows[None, :]) * s_kt + o_k[:, None], mask=m_kt, other=0.0)  # K^T [BK, BT]
        if DELTA and T_IN_H:  # U = T (diag(beta) V - KE S)
            m_tk = m_t[:, None] & m_k[None, :]
            b_bt = tl.load(beta + (t0 + rows) * s_bt, mask=m_t, other=0.0).to(tl.float32)
            if GATE == 2:
                b_ke = tl.load(W + (row0 + rows[:, None] * H) * K + o_k[None, :], mask=m_tk, other=0.0)
            else:
                b_ke = tl.load(k + (t0 + rows[:, None]) * s_kt + o_k[None, :], mask=m_tk, other=0.0).to(tl.float32)
                b_eb = b_bt
                if GATE == 1:
                    b_eb = b_bt * tl.exp(tl.load(gc + row0 + rows * H, mask=m_t, other=0.0))
                b_ke = (b_ke * b_eb[:, None]).to(dt)
            b_x = tl.load(v + (t0 + rows[:, None]) * s_vt + o_v[None, :], mask=m_tv, other=0.0).to(tl.float32)
            b_x = b_x * b_bt[:, None] - tl.dot(b_ke.to(dt), b_s.to(dt), input_precision=PREC)
            b_t = _ld_lower(A, row0, t0, length, H, BT, BC)  # T's blocks on and left of the diagonal
            b_u = tl.dot(b_t.to(dt), b_x.to(dt), input_precision=PREC)
            tl.store(U + (row0 + rows[:, None] * H) * V + o_v[None, :], b_u.to(U.dtype.element_ty), mask=m_tv)
        elif DELTA:  # (the delta rule's kernel holds all of K: BK >= K)
            b_w = tl.load(W + (row0 + rows[:, None] * H) * K + o_k[None, :], mask=m_t[:, None] & m_k[None, :],
                          other=0.0)
            b_u = tl.load(U + (row0 + rows[:, None] * H) * V + o_v[None, :], mask=m_tv, other=0.0).to(tl.float32)
            b_u = b_u - tl.dot(b_w.to(dt), b_s.to(dt), input_precision=PREC)
            tl.store(U + (row0 + rows[:, None] * H) * V + o_v[None, :], b_u.to(U.dtype.element_ty), mask=m_tv)
        else:
            b_u = tl.load(v + (t0 + rows[:, None]) * s_vt + o_v[None, :], mask=m_tv, other=0.0).to(tl.float32)
        if GATE == 1:  # the decay to the chunk's end scales U's rows (BT x BV), not K's
            b_b = tl.load(gc + row0 + rows * H, mask=m_t, other=0.0)
            b_last = tl.load(gc + row0 + (tl.minimum(t0 + BT, length) - 1 - t0) * H)
            b_d = tl.exp(b_last - b_b)
            b_u = b_u * b_d[:, None]
            b_s = b_s * tl.exp(b_last)
        if GATE == 2:
            last = tl.minimum(t0 + BT, length) - 1 - t0
            b_last = tl.load(gc + (row0 + last * H) * K + o_k, mask=m_k, other=0.0)
            b_s = b_s * tl.exp(b_last)[:, None]
        if ERASE:  # S += F_end^T U + ((1 - e) K)_end^T (beta V)
            b_e = tl.load(e + (t0 + rows[None, :]) * s_et + o_k[:, None], mask=m_kt, other=0.0).to(tl.float32)
            b_be = tl.load(beta + (t0 + rows) * s_bt, mask=m_t, other=0.0).to(tl.float32)
            if GATE == 1:
                b_be = b_be * b_d
            b_bv = tl.load(v + (t0 + rows[:, None]) * s_vt + o_v[None, :], mask=m_tv, other=0.0).to(tl.float32)
            b_kf = b_kt.to(tl.float32)
            b_s += tl.dot((b_kf * b_e).to(dt), b_u.to(dt), input_precision=PREC)
            b_s += tl.dot((b_kf - b_kf * b_e).to(dt), (b_bv * b_be[:, None]).to(dt), input_precision=PREC)
        else:
            b_s = tl.dot(b_kt.to(dt), b_u.to(dt), b_s, input_precision=PREC)
    tl.store(ht + i_n * s_tn + i_h * s_th + o_k[:, None] * s_tk + o_v[None, :], b_s, mask=m_s)


@triton.jit(do_not_specialize=["T"])
def _chunk_o_kernel(
    q, k, v, gc, P, U, h, ox, o, cu_seqlens, chunk_indices, chunk_offsets,
    s_qb, s_qt, s_qh, s_kb, s_kt, s_kh, s_vb, s_vt, s_vh, s_ob, s_ot, s_oh,
    T, H, K, V,
    BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    GATE: tl.constexpr, DELTA: tl.constexpr, ERASE: tl.constexpr, P_IN: tl.constexpr, VARLEN: tl.constexpr,
    PREC: tl.constexpr,
):
    i_v = tl.program_id(0)
    i_c = tl.program_id(1).to(tl.int64)
    i_bh = tl.program_id(2).to(tl.int64)
    i_b, i_h = i_bh // H, i_bh % H
    if VARLEN:
        i_n = tl.load(chunk_indices + 2 * i_c).to(tl.int64)
        i_t = tl.load(chunk_indices + 2 * i_c + 1).to(tl.int64)
        bos = tl.load(cu_seqlens + i_n).to(tl.int64)
        length = tl.load(cu_seqlens + i_n + 1).to(tl.int64) - bos
        tok = bos
        i_hc = tl.load(chunk_offsets + i_n).to(tl.int64) + i_t
    else:
        i_t = i_c
        bos = i_c * 0
        length = T
        tok = i_b * T
        i_hc = i_b * tl.cdiv(T, BT) + i_t
    dt = q.dtype.element_ty
    t0 = i_t * BT
    rows = tl.arange(0, BT)
    m_t = t0 + rows < length
    row0 = (tok + t0) * H + i_h
    o_v = i_v * BV + tl.arange(0, BV)
    m_v = o_v < V
    m_tv = m_t[:, None] & m_v[None, :]
    q += i_b * s_qb + (bos + t0) * s_qt + i_h * s_qh
    k += i_b * s_kb + (bos + t0) * s_kt + i_h * s_kh
    h += (i_hc * H + i_h) * K * V
    b_o = tl.zeros([BT, BV], dtype=tl.float32)
    b_p = tl.zeros([BT, BT], dtype=tl.float32)
    for i_k in range(0, tl.cdiv(K, BK)):
        o_k = i_k * BK + tl.arange(0, BK)
        m_k = o_k < K
        m_qk = m_t[:, None] & m_k[None, :]
        b_q = tl.load(q + rows[:, None] * s_qt + o_k[None, :], mask=m_qk, other=0.0)
        if P_IN:  # the intra-chunk readout here, not in a prep kernel: P = Q K^T (decay applied below)
            b_kt = tl.load(k + rows[None, :] * s_kt + o_k[:, None], mask=m_k[:, None] & m_t[None, :], other=0.0)
            b_p = tl.dot(b_q, b_kt, b_p, input_precision=PREC)
        if GATE == 2:
            b_b = tl.load(gc + (row0 + rows[:, None] * H) * K + o_k[None, :], mask=m_qk, other=0.0)
            b_q = (b_q.to(tl.float32) * tl.exp(b_b)).to(dt)
        b_h = tl.load(h + o_k[:, None] * V + o_v[None, :], mask=m_k[:, None] & m_v[None, :], other=0.0)
        b_o = tl.dot(b_q, b_h, b_o, input_precision=PREC)
    causal = rows[:, None] >= rows[None, :]
    if GATE == 1:  # (Q * e^b) h = diag(e^b) (Q h); P_ij picks up e^{b_i - b_j}, j <= i
        b_b = tl.load(gc + row0 + rows * H, mask=m_t, other=0.0)
        b_o = b_o * tl.exp(b_b)[:, None]
        if P_IN:
            b_p = b_p * tl.exp(tl.where(causal & m_t[:, None], b_b[:, None] - b_b[None, :], float("-inf")))
    if P_IN:
        b_p = tl.where(causal, b_p, 0.0)
    else:
        b_p = tl.load(P + (row0 + rows[:, None] * H) * BT + rows[None, :], mask=m_t[:, None] & causal, other=0.0)
    if DELTA:
        b_u = tl.load(U + (row0 + rows[:, None] * H) * V + o_v[None, :], mask=m_tv, other=0.0)
    else:
        b_u = tl.load(v + i_b * s_vb + (bos + t0 + rows[:, None]) * s_vt + i_h * s_vh + o_v[None, :], mask=m_tv,
                      other=0.0)
    b_o += tl.dot(b_p.to(dt), b_u.to(dt), input_precision=PREC)
    if ERASE:
        b_o += tl.load(ox + (row0 + rows[:, None] * H) * V + o_v[None, :], mask=m_tv, other=0.0)
    tl.store(o + i_b * s_ob + (bos + t0 + rows[:, None]) * s_ot + i_h * s_oh + o_v[None, :],
             b_o.to(o.dtype.element_ty), mask=m_tv)
