"""The per-key-decay intra-chunk products of the chunked prefill (GLA, KDA), run before
`chunk._chunk_prep_kernel` (the delta rule's WY form) and the state and output kernels of `chunk_ho`.

With b the cumulative log-decay per key within a chunk (`_chunk_cumsum_kernel`, one program per
chunk: `gc`, which the state, output and WY kernels read too, and K e^{b_last - b}, the state kernel's
operand, unless the diagonal-block kernels store that one: `chunk_config`'s `kg_in_diag`), for rows r
and columns j <= r of a chunk (16-row blocks, A: j < r):
  P[r, j] = sum_c q_rc k_jc e^{b_rc - b_jc},  A[r, j] = beta_r sum_c k_rc k_jc e^{b_rc - b_jc}
- `_chunk_intra_off_kernel`: one program per pair (row block I, column block J < I), matmuls over d_k
  tiles; e^{b_r - b_j} factors through I's first row R, e^{b_r - b_R} <= 1 and e^{b_R - b_j} <= 1
  (g <= 0), so nothing overflows;
- the diagonal 16 x 16 blocks, per column j a d_k-vector product with the exact exponent:
  `_chunk_intra_diag_token_kernel` (d_k <= 128, the default: one program per row and a few heads) or
  `_chunk_intra_diag_kernel` (d_k tiles, one row block at a time; wider keys). With STORE_KG they
  also store their rows of K e^{b_last - b} (KG; they load those rows' K and b anyway), and the cumsum
  kernel only b.
(Stream G, 2026-12-01: the split replaced one program per row block doing both, whose diagonal block
was a 3-D product: 233 -> 33 + 101 us for GLA at B=1, T=4096, H=16, d_k=128 on an H200; the row
groups then 101 -> 56 us; 2026-12-02 the program per row, 62 -> 56 us with the accuracy fix in both, and
it replaced the row groups, which it beat at every measured shape (docs/performance.md#gpu-prefill). An exponent
stored as (b - b_r0) log2 e per row, to save a multiply per product, rounded large |b| (strong decay,
b ~ -1e3 within a chunk) to 1e-5 RMS-relative error on the H200, 70x the raw difference's.)
"""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = [
    "_chunk_cumsum_kernel", "_chunk_intra_diag_kernel", "_chunk_intra_diag_token_kernel", "_chunk_intra_off_kernel",
]


@triton.jit(do_not_specialize=["T"])
def _chunk_cumsum_kernel(g, gc, k, KG, cu_seqlens, chunk_indices, s_gb, s_gt, s_gh, s_kb, s_kt, s_kh, T, H, K,
                         BT: tl.constexpr, BK: tl.constexpr, VARLEN: tl.constexpr, SCALE_K: tl.constexpr,
                         SPLIT_K: tl.constexpr = False):
    """gc[token, head, :] = the per-key cumulative log-decay b within each chunk (float32); with SCALE_K
    also KG = k e^{b_last - b} (b_last: the chunk's last valid row; exponent <= 0) in k's dtype, the
    state kernel's operand (it would otherwise load b and exponentiate once per d_v tile); without it
    the diagonal-block kernel stores KG (`kg_in_diag`).
    SPLIT_K: one program per d_k tile (grid axis 2) instead of a loop over the tiles."""
    i_c = tl.program_id(0).to(tl.int64)
    i_bh = tl.program_id(1).to(tl.int64)
    i_b, i_h = i_bh // H, i_bh % H
    i_t, bos, length, tok = _chunk_pos(i_c, i_b, T, cu_seqlens, chunk_indices, VARLEN)
    t0 = i_t * BT
    rows = tl.arange(0, BT)
    m_t = t0 + rows < length
    row0 = (tok + t0) * H + i_h
    last = tl.minimum(length - t0, BT) - 1  # the chunk's last valid row
    k_lo = 0
    k_hi = tl.cdiv(K, BK)
    if SPLIT_K:
        k_lo = tl.program_id(2)
        k_hi = k_lo + 1
    for i_k in range(k_lo, k_hi):
        o_k = i_k * BK + tl.arange(0, BK)
        m = m_t[:, None] & (o_k < K)[None, :]
        b_g = tl.load(g + i_b * s_gb + (bos + t0 + rows[:, None]) * s_gt + i_h * s_gh + o_k[None, :], mask=m, other=0.0)
        b_b = tl.cumsum(b_g.to(tl.float32), axis=0)
        tl.store(gc + (row0 + rows[:, None] * H) * K + o_k[None, :], b_b, mask=m)
        if SCALE_K:
            b_last = tl.sum(tl.where(rows[:, None] == last, b_b, 0.0), axis=0)
            b_k = tl.load(k + i_b * s_kb + (bos + t0 + rows[:, None]) * s_kt + i_h * s_kh + o_k[None, :], mask=m,
                          other=0.0)
            tl.store(KG + (row0 + rows[:, None] * H) * K + o_k[None, :],
                     (b_k.to(tl.float32) * tl.exp(b_last[None, :] - b_b)).to(KG.dtype.element_ty), mask=m)


@triton.jit
def _chunk_pos(i_c, i_b, T, cu_seqlens, chunk_indices, VARLEN: tl.constexpr):
    """(chunk index in its sequence, sequence start in the input, sequence length, its first scratch row)."""
    if VARLEN:
        i_n = tl.load(chunk_indices + 2 * i_c).to(tl.int64)
        i_t = tl.load(chunk_indices + 2 * i_c + 1).to(tl.int64)
        bos = tl.load(cu_seqlens + i_n).to(tl.int64)
        length = tl.load(cu_seqlens + i_n + 1).to(tl.int64) - bos
        tok = bos
    else:
        i_t = i_c
        bos = i_c * 0
        length = T + bos
        tok = i_b * T
    return i_t, bos, length, tok


@triton.jit(do_not_specialize=["T"])
def _chunk_intra_off_kernel(
    q, k, beta, gc, P, A, cu_seqlens, chunk_indices,
    s_qb, s_qt, s_qh, s_kb, s_kt, s_kh, s_bb, s_bt, s_bh,
    T, H, K,
    BT: tl.constexpr, BC: tl.constexpr, BK: tl.constexpr, DELTA: tl.constexpr, VARLEN: tl.constexpr,
    PREC: tl.constexpr,
):
    """One program per (row block I, earlier column block J < I) of a chunk: the [BC, BC] block of P
    (and A) by matmuls over d_k tiles, e^{b_r - b_j} factored through row R = I's first row:
    (q_r e^{b_r - b_R}) (k_j e^{b_R - b_j}), both factors <= 1 (g <= 0, j < R <= r)."""
    NP: tl.constexpr = (BT // BC) * (BT // BC - 1) // 2
    i_cp = tl.program_id(0).to(tl.int64)
    i_c, i_p = i_cp // NP, i_cp % NP
    i_bh = tl.program_id(1).to(tl.int64)
    i_b, i_h = i_bh // H, i_bh % H
    # pair p -> (I, J): p = I (I - 1) / 2 + J (at most 4 row blocks: BT <= 64, BC = 16)
    i_i = 1 + (i_p >= 1).to(tl.int64) + (i_p >= 3).to(tl.int64)
    i_j = i_p - i_i * (i_i - 1) // 2
    i_t, bos, length, tok = _chunk_pos(i_c, i_b, T, cu_seqlens, chunk_indices, VARLEN)
    dt = q.dtype.element_ty
    t0 = i_t * BT
    r0 = i_i * BC
    if t0 + r0 < length:
        o_c = tl.arange(0, BC)
        r_i = r0 + o_c
        r_j = i_j * BC + o_c  # all before r0 < length: valid rows
        m_i = t0 + r_i < length
        q += i_b * s_qb + (bos + t0) * s_qt + i_h * s_qh
        k += i_b * s_kb + (bos + t0) * s_kt + i_h * s_kh
        row0 = (tok + t0) * H + i_h
        b_p = tl.zeros([BC, BC], dtype=tl.float32)
        b_a = tl.zeros([BC, BC], dtype=tl.float32)
        for i_k in range(0, tl.cdiv(K, BK)):
            o_k = i_k * BK + tl.arange(0, BK)
            m_k = o_k < K
            m2i = m_i[:, None] & m_k[None, :]
            b_r = tl.load(gc + (row0 + r0 * H) * K + o_k, mask=m_k, other=0.0)
            b_bi = tl.load(gc + (row0 + r_i[:, None] * H) * K + o_k[None, :], mask=m2i, other=0.0)
            e_i = tl.exp(b_bi - b_r[None, :])
            b_bj = tl.load(gc + (row0 + r_j[None, :] * H) * K + o_k[:, None], mask=m_k[:, None], other=0.0)
            b_kj = tl.load(k + r_j[None, :] * s_kt + o_k[:, None], mask=m_k[:, None], other=0.0).to(tl.float32)
            b_kj = (b_kj * tl.exp(b_r[:, None] - b_bj)).to(dt)  # [BK, BC]
            b_qi = tl.load(q + r_i[:, None] * s_qt + o_k[None, :], mask=m2i, other=0.0).to(tl.float32)
            b_p = tl.dot((b_qi * e_i).to(dt), b_kj, b_p, input_precision=PREC)
            if DELTA:
                b_ki = tl.load(k + r_i[:, None] * s_kt + o_k[None, :], mask=m2i, other=0.0).to(tl.float32)
                b_a = tl.dot((b_ki * e_i).to(dt), b_kj, b_a, input_precision=PREC)
        tl.store(P + (row0 + r_i[:, None] * H) * BT + r_j[None, :], b_p, mask=m_i[:, None])
        if DELTA:
            b_beta = tl.load(beta + i_b * s_bb + (bos + t0 + r_i) * s_bt + i_h * s_bh, mask=m_i, other=0.0)
            tl.store(A + (row0 + r_i[:, None] * H) * BT + r_j[None, :], b_a * b_beta.to(tl.float32)[:, None],
                     mask=m_i[:, None])


@triton.jit(do_not_specialize=["T"])
def _chunk_intra_diag_kernel(
    q, k, beta, gc, P, A, KG, KE, cu_seqlens, chunk_indices,
    s_qb, s_qt, s_qh, s_kb, s_kt, s_kh, s_bb, s_bt, s_bh,
    T, H, K,
    BT: tl.constexpr, BC: tl.constexpr, BK: tl.constexpr, DELTA: tl.constexpr, VARLEN: tl.constexpr,
    STORE_KG: tl.constexpr = False, STORE_KE: tl.constexpr = False,
):
    """One program per diagonal [BC, BC] block of a chunk, token-parallel: for each column j the rows'
    d_k-vector products q_r . (k_j e^{b_r - b_j}) with the exact exponent (<= 0 for r >= j; rows r < j
    are clamped to 0 and then zeroed, so nothing overflows). Nothing right of the diagonal block: the
    output kernel masks P there, the inverse reads A's blocks on and left of the diagonal only.
    STORE_KG: also KG = K e^{b_last - b} for the block's rows (`_chunk_cumsum_kernel`'s formula, on the
    b it stored; b_last: the chunk's last valid row). STORE_KE: also KE = diag(beta) K e^b for them (see
    `_chunk_intra_diag_token_kernel`)."""
    NB: tl.constexpr = BT // BC
    i_ci = tl.program_id(0).to(tl.int64)
    i_c, i_blk = i_ci // NB, i_ci % NB
    i_bh = tl.program_id(1).to(tl.int64)
    i_b, i_h = i_bh // H, i_bh % H
    i_t, bos, length, tok = _chunk_pos(i_c, i_b, T, cu_seqlens, chunk_indices, VARLEN)
    t0 = i_t * BT
    r0 = i_blk * BC
    if t0 + r0 < length:
        o_c = tl.arange(0, BC)
        r_i = r0 + o_c
        m_i = t0 + r_i < length
        n_j = tl.minimum(length - t0 - r0, BC)  # valid columns of this block
        q += i_b * s_qb + (bos + t0) * s_qt + i_h * s_qh
        k += i_b * s_kb + (bos + t0) * s_kt + i_h * s_kh
        row0 = (tok + t0) * H + i_h
        last = tl.minimum(length - t0, BT) - 1  # the chunk's last valid row
        b_p = tl.zeros([BC, BC], dtype=tl.float32)
        b_a = tl.zeros([BC, BC], dtype=tl.float32)
        if DELTA:
            b_beta = tl.load(beta + i_b * s_bb + (bos + t0 + r_i) * s_bt + i_h * s_bh, mask=m_i, other=0.0)
        for i_k in range(0, tl.cdiv(K, BK)):
            o_k = i_k * BK + tl.arange(0, BK)
            m_k = o_k < K
            m2 = m_i[:, None] & m_k[None, :]
            b_bi = tl.load(gc + (row0 + r_i[:, None] * H) * K + o_k[None, :], mask=m2, other=0.0)
            b_qi = tl.load(q + r_i[:, None] * s_qt + o_k[None, :], mask=m2, other=0.0).to(tl.float32)
            if DELTA or STORE_KG:
                b_ki = tl.load(k + r_i[:, None] * s_kt + o_k[None, :], mask=m2, other=0.0).to(tl.float32)
            if STORE_KG:
                b_last = tl.load(gc + (row0 + last * H) * K + o_k, mask=m_k, other=0.0)
                tl.store(KG + (row0 + r_i[:, None] * H) * K + o_k[None, :],
                         (b_ki * tl.exp(b_last[None, :] - b_bi)).to(KG.dtype.element_ty), mask=m2)
            if STORE_KE:
                tl.store(KE + (row0 + r_i[:, None] * H) * K + o_k[None, :],
                         (b_ki * tl.exp(b_bi) * b_beta.to(tl.float32)[:, None]).to(KE.dtype.element_ty), mask=m2)
            for j in range(0, n_j):
                b_bj = tl.load(gc + (row0 + (r0 + j) * H) * K + o_k, mask=m_k, other=0.0)
                b_kj = tl.load(k + (r0 + j) * s_kt + o_k, mask=m_k, other=0.0).to(tl.float32)
                b_ke = b_kj[None, :] * tl.exp(tl.minimum(b_bi - b_bj[None, :], 0.0))
                b_p = tl.where(o_c[None, :] == j, b_p + tl.sum(b_qi * b_ke, axis=1)[:, None], b_p)
                if DELTA:
                    b_a = tl.where(o_c[None, :] == j, b_a + tl.sum(b_ki * b_ke, axis=1)[:, None], b_a)
        causal = (o_c[:, None] >= o_c[None, :]) & m_i[:, None]
        tl.store(P + (row0 + r_i[:, None] * H) * BT + r_i[None, :], tl.where(causal, b_p, 0.0), mask=m_i[:, None])
        if DELTA:
            b_a = tl.where(o_c[:, None] > o_c[None, :], b_a * b_beta.to(tl.float32)[:, None], 0.0)
            tl.store(A + (row0 + r_i[:, None] * H) * BT + r_i[None, :], b_a, mask=m_i[:, None])


@triton.jit(do_not_specialize=["T"])
def _chunk_intra_diag_token_kernel(
    q, k, beta, gc, P, A, KG, KE, cu_seqlens, chunk_indices,
    s_qb, s_qt, s_qh, s_kb, s_kt, s_kh, s_bb, s_bt, s_bh,
    T, H, K,
    BT: tl.constexpr, BC: tl.constexpr, BK: tl.constexpr, BH: tl.constexpr, DELTA: tl.constexpr,
    VARLEN: tl.constexpr, STORE_KG: tl.constexpr = False, STORE_KE: tl.constexpr = False,
):
    """The diagonal [BC, BC] blocks (what `_chunk_intra_diag_kernel` stores) token-parallel: one program
    per row r of a chunk and BH adjacent heads, visiting the columns j <= r of r's block (exponent
    b_r - b_j <= 0: no clamp); nothing right of them (see `_chunk_intra_diag_kernel`). Every row's program is
    independent, so the GPU hides the per-column loads' latency with other rows (a program per block, in row groups, waited
    on them: gla 1x4096 227 vs 223 us). STORE_KG: also row r of KG = K e^{b_last - b}
    (`_chunk_cumsum_kernel`'s formula, on the b it stored; b_last: the chunk's last valid row, one more
    row load the chunk's programs share through L2). STORE_KE (the delta rule, `t_in_state`): also row r of
    diag(beta) K e^b (e^b <= 1), the state kernel's operand in place of W."""
    i_cr = tl.program_id(0).to(tl.int64)
    i_c, r = i_cr // BT, i_cr % BT
    i_bg = tl.program_id(1).to(tl.int64)
    n_hg = tl.cdiv(H, BH)
    i_b, i_hg = i_bg // n_hg, i_bg % n_hg
    i_t, bos, length, tok = _chunk_pos(i_c, i_b, T, cu_seqlens, chunk_indices, VARLEN)
    t0 = i_t * BT
    if t0 + r < length:
        r0 = (r // BC) * BC
        o_h = i_hg * BH + tl.arange(0, BH)
        o_k = tl.arange(0, BK)
        m_h = o_h < H
        m2 = m_h[:, None] & (o_k < K)[None, :]
        q += i_b * s_qb + (bos + t0) * s_qt
        k += i_b * s_kb + (bos + t0) * s_kt
        g_row = gc + ((tok + t0) * H + o_h[:, None]) * K + o_k[None, :]  # [BH, BK] at row 0 of the chunk
        b_bi = tl.load(g_row + r * H * K, mask=m2, other=0.0)
        b_qi = tl.load(q + r * s_qt + o_h[:, None] * s_qh + o_k[None, :], mask=m2, other=0.0).to(tl.float32)
        p_row = P + ((tok + t0 + r) * H + o_h) * BT  # [BH] row starts
        if DELTA or STORE_KG:
            b_ki = tl.load(k + r * s_kt + o_h[:, None] * s_kh + o_k[None, :], mask=m2, other=0.0).to(tl.float32)
        if STORE_KG:
            last = tl.minimum(length - t0, BT) - 1  # the chunk's last valid row
            b_last = tl.load(g_row + last * H * K, mask=m2, other=0.0)
            tl.store(KG + ((tok + t0 + r) * H + o_h[:, None]) * K + o_k[None, :],
                     (b_ki * tl.exp(b_last - b_bi)).to(KG.dtype.element_ty), mask=m2)
        if DELTA:
            b_beta = tl.load(beta + i_b * s_bb + (bos + t0 + r) * s_bt + o_h * s_bh, mask=m_h, other=0.0)
            a_row = A + ((tok + t0 + r) * H + o_h) * BT
        if STORE_KE:
            tl.store(KE + ((tok + t0 + r) * H + o_h[:, None]) * K + o_k[None, :],
                     (b_ki * tl.exp(b_bi) * b_beta.to(tl.float32)[:, None]).to(KE.dtype.element_ty), mask=m2)
        for j in range(r0, r + 1):
            b_bj = tl.load(g_row + j * H * K, mask=m2, other=0.0)
            b_kj = tl.load(k + j * s_kt + o_h[:, None] * s_kh + o_k[None, :], mask=m2, other=0.0).to(tl.float32)
            b_ke = b_kj * tl.exp(b_bi - b_bj)
            tl.store(p_row + j, tl.sum(b_qi * b_ke, axis=1), mask=m_h)
            if DELTA:
                a_rj = tl.sum(b_ki * b_ke, axis=1) * b_beta.to(tl.float32)
                tl.store(a_row + j, tl.where(j < r, a_rj, 0.0), mask=m_h)

