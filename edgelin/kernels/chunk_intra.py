"""The per-key-decay intra-chunk products of the chunked prefill (GLA, KDA): one program per 16-row
block of a chunk (4x the programs of one per chunk), run before `chunk._chunk_prep_kernel` (the delta
rule's WY form) and the state and output kernels of `chunk_ho`.

For the row block I (rows r = I*BC .. I*BC + BC-1 of the chunk, b the cumulative log-decay per key):
  P[r, j] = sum_c q_rc k_jc e^{b_rc - b_jc},  A[r, j] = beta_r sum_c k_rc k_jc e^{b_rc - b_jc}  (j <= r; A: j < r)
- columns of earlier blocks (j < I*BC) in one matmul per d_k tile: e^{b_r - b_j} factors through the
  block's first row R, e^{b_r - b_R} <= 1 and e^{b_R - b_j} <= 1 (g <= 0), so nothing overflows;
- the diagonal block takes the exact exponent per (r, j, channel) (a 3-D product over 16 channels).
b comes from `_chunk_cumsum_kernel` (one program per chunk; `gc`, which the state, output and WY
kernels read too), so no program scans g again.
"""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["_chunk_cumsum_kernel", "_chunk_intra_kernel"]


@triton.jit(do_not_specialize=["T"])
def _chunk_cumsum_kernel(g, gc, cu_seqlens, chunk_indices, s_gb, s_gt, s_gh, T, H, K,
                         BT: tl.constexpr, BK: tl.constexpr, VARLEN: tl.constexpr):
    """gc[token, head, :] = the per-key cumulative log-decay b within each chunk (float32)."""
    i_c = tl.program_id(0).to(tl.int64)
    i_bh = tl.program_id(1).to(tl.int64)
    i_b, i_h = i_bh // H, i_bh % H
    if VARLEN:
        i_n = tl.load(chunk_indices + 2 * i_c).to(tl.int64)
        i_t = tl.load(chunk_indices + 2 * i_c + 1).to(tl.int64)
        bos = tl.load(cu_seqlens + i_n).to(tl.int64)
        length = tl.load(cu_seqlens + i_n + 1).to(tl.int64) - bos
        tok = bos
    else:
        i_t = i_c
        bos = i_c * 0
        length = T
        tok = i_b * T
    t0 = i_t * BT
    rows = tl.arange(0, BT)
    m_t = t0 + rows < length
    row0 = (tok + t0) * H + i_h
    for i_k in range(0, tl.cdiv(K, BK)):
        o_k = i_k * BK + tl.arange(0, BK)
        m = m_t[:, None] & (o_k < K)[None, :]
        b_g = tl.load(g + i_b * s_gb + (bos + t0 + rows[:, None]) * s_gt + i_h * s_gh + o_k[None, :], mask=m, other=0.0)
        tl.store(gc + (row0 + rows[:, None] * H) * K + o_k[None, :], tl.cumsum(b_g.to(tl.float32), axis=0), mask=m)


@triton.jit(do_not_specialize=["T"])
def _chunk_intra_kernel(
    q, k, beta, gc, P, A, cu_seqlens, chunk_indices,
    s_qb, s_qt, s_qh, s_kb, s_kt, s_kh, s_bb, s_bt, s_bh,
    T, H, K,
    BT: tl.constexpr, BC: tl.constexpr, BK: tl.constexpr, BKD: tl.constexpr,
    DELTA: tl.constexpr, VARLEN: tl.constexpr, PREC: tl.constexpr,
):
    NB: tl.constexpr = BT // BC
    i_ci = tl.program_id(0).to(tl.int64)
    i_c, i_blk = i_ci // NB, i_ci % NB
    i_bh = tl.program_id(1).to(tl.int64)
    i_b, i_h = i_bh // H, i_bh % H
    if VARLEN:
        i_n = tl.load(chunk_indices + 2 * i_c).to(tl.int64)
        i_t = tl.load(chunk_indices + 2 * i_c + 1).to(tl.int64)
        bos = tl.load(cu_seqlens + i_n).to(tl.int64)
        length = tl.load(cu_seqlens + i_n + 1).to(tl.int64) - bos
        tok = bos
    else:
        i_t = i_c
        bos = i_c * 0
        length = T
        tok = i_b * T
    dt = q.dtype.element_ty
    t0 = i_t * BT
    r0 = i_blk * BC  # this block's first row in the chunk
    if t0 + r0 < length:
        rows = tl.arange(0, BT)
        o_c = tl.arange(0, BC)
        r_i = r0 + o_c
        m_t = t0 + rows < length
        m_i = t0 + r_i < length
        q += i_b * s_qb + (bos + t0) * s_qt + i_h * s_qh
        k += i_b * s_kb + (bos + t0) * s_kt + i_h * s_kh
        row0 = (tok + t0) * H + i_h  # scratch row of the chunk's first token (row stride: H)
        earlier = (rows < r0) & m_t  # the columns of earlier blocks
        b_p = tl.zeros([BC, BT], dtype=tl.float32)
        b_a = tl.zeros([BC, BT], dtype=tl.float32)
        if i_blk > 0:  # the columns of earlier blocks
            for i_k in range(0, tl.cdiv(K, BK)):
                o_k = i_k * BK + tl.arange(0, BK)
                m_k = o_k < K
                m2 = m_t[:, None] & m_k[None, :]
                m2i = m_i[:, None] & m_k[None, :]
                b_bi = tl.load(gc + (row0 + r_i[:, None] * H) * K + o_k[None, :], mask=m2i, other=0.0)
                b_r = tl.load(gc + (row0 + r0 * H) * K + o_k, mask=m_k, other=0.0)  # b at the block's first row
                b_b = tl.load(gc + (row0 + rows[:, None] * H) * K + o_k[None, :], mask=earlier[:, None] & m_k[None, :],
                              other=0.0)
                e_j = tl.exp(tl.where(earlier[:, None] & m_k[None, :], b_r[None, :] - b_b, float("-inf")))
                b_kj = (tl.load(k + rows[:, None] * s_kt + o_k[None, :], mask=m2, other=0.0).to(tl.float32)
                        * e_j).to(dt)
                e_i = tl.exp(tl.where(m2i, b_bi - b_r[None, :], float("-inf")))
                b_qi = tl.load(q + r_i[:, None] * s_qt + o_k[None, :], mask=m2i, other=0.0).to(tl.float32)
                b_p = tl.dot((b_qi * e_i).to(dt), tl.trans(b_kj), b_p, input_precision=PREC)
                if DELTA:
                    b_ki = tl.load(k + r_i[:, None] * s_kt + o_k[None, :], mask=m2i, other=0.0).to(tl.float32)
                    b_a = tl.dot((b_ki * e_i).to(dt), tl.trans(b_kj), b_a, input_precision=PREC)
        # the block row outside the diagonal block (earlier columns, and zeros after it)
        m_off = m_i[:, None] & ((rows < r0) | (rows >= r0 + BC))[None, :]
        tl.store(P + (row0 + r_i[:, None] * H) * BT + rows[None, :], b_p, mask=m_off)
        if DELTA:
            b_beta = tl.load(beta + i_b * s_bb + (bos + t0 + r_i) * s_bt + i_h * s_bh, mask=m_i, other=0.0)
            b_beta = b_beta.to(tl.float32)
            tl.store(A + (row0 + r_i[:, None] * H) * BT + rows[None, :], b_a * b_beta[:, None], mask=m_off)
        b_p = tl.zeros([BC, BC], dtype=tl.float32)
        b_a = tl.zeros([BC, BC], dtype=tl.float32)
        m3 = ((o_c[:, None] >= o_c[None, :]) & m_i[:, None] & m_i[None, :])[:, :, None]
        for i_k in range(0, tl.cdiv(K, BKD)):
            o_k = i_k * BKD + tl.arange(0, BKD)
            m2 = m_i[:, None] & (o_k < K)[None, :]
            b_bi = tl.load(gc + (row0 + r_i[:, None] * H) * K + o_k[None, :], mask=m2, other=0.0)
            e = tl.exp(tl.where(m3, b_bi[:, None, :] - b_bi[None, :, :], float("-inf")))
            b_qi = tl.load(q + r_i[:, None] * s_qt + o_k[None, :], mask=m2, other=0.0).to(tl.float32)
            b_ki = tl.load(k + r_i[:, None] * s_kt + o_k[None, :], mask=m2, other=0.0).to(tl.float32)
            b_ke = b_ki[None, :, :] * e
            b_p += tl.sum(b_qi[:, None, :] * b_ke, axis=2)
            if DELTA:
                b_a += tl.sum(b_ki[:, None, :] * b_ke, axis=2)
        tl.store(P + (row0 + r_i[:, None] * H) * BT + r_i[None, :], b_p, mask=m_i[:, None])
        if DELTA:
            b_a = tl.where(o_c[:, None] > o_c[None, :], b_a, 0.0) * b_beta[:, None]
            tl.store(A + (row0 + r_i[:, None] * H) * BT + r_i[None, :], b_a, mask=m_i[:, None])
