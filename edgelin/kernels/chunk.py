"""Triton chunked prefill (forward only): outputs + final state for every gate kind and rule,
fixed-length batches or varlen (`cu_seqlens`) in one call.

Two kernels, the chunked form of `edgelin.reference.recurrence.chunked` (same notation):
1. `_chunk_prep_kernel`, parallel over every chunk of every head: cumulative log-decay b, the
   intra-chunk readout P[i, j] = q_i^T R[i, j] k_j (j <= i) and, for the delta rule, the chunk's
   WY form: T = (I + A)^-1 (forward substitution), W = T diag(beta) (K * e^b), U0 = T diag(beta) V.
2. `_chunk_fwd_kernel`, parallel over heads and d_v tiles, sequential over chunks with the state
   tile in registers:  U = U0 - W S (delta) or V;  O = (Q * e^b) S + P U;
   S = e^{b_C} S + (K * e^{b_C - b})^T U.  Only this loop is sequential, and it does three small
   matmuls per chunk; everything quadratic in the chunk size was done in parallel by kernel 1.
Per-key decays never form e^{+b}: off-diagonal 16x16 sub-blocks factor exp(b_i - b_j) through the
row block's first row, diagonal sub-blocks take the exact exponent (as fla's chunk_gla does).
Requires g <= 0 (a decay), which every family's gate guarantees.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from edgelin.kernels._common import (
    KernelError, Tensor, check_aux, check_device, check_out, check_qkv, check_state, interpreting, last_dim_contiguous,
    next_pow2, strides3,
)

SUB = 16  # sub-block of the per-key intra-chunk products (tl.dot's smallest tile)


@triton.jit(do_not_specialize=["T"])  # T == 1 must take the general path (and not recompile)
def _chunk_prep_kernel(
    q, k, v, g, beta, gc, P, A, W, U, cu_seqlens, chunk_indices,
    s_qb, s_qt, s_qh, s_kb, s_kt, s_kh, s_vb, s_vt, s_vh, s_gb, s_gt, s_gh, s_bb, s_bt, s_bh,
    T, H, K, V,
    BT: tl.constexpr, BC: tl.constexpr, BK: tl.constexpr, BKD: tl.constexpr, BV: tl.constexpr,
    GATE: tl.constexpr, DELTA: tl.constexpr, VARLEN: tl.constexpr, PREC: tl.constexpr,
):
    i_c = tl.program_id(0).to(tl.int64)
    i_bh = tl.program_id(1).to(tl.int64)
    i_b, i_h = i_bh // H, i_bh % H
    if VARLEN:
        i_n = tl.load(chunk_indices + 2 * i_c).to(tl.int64)
        i_t = tl.load(chunk_indices + 2 * i_c + 1).to(tl.int64)
        bos = tl.load(cu_seqlens + i_n).to(tl.int64)
        length = tl.load(cu_seqlens + i_n + 1).to(tl.int64) - bos
        tok = bos  # scratch tensors are [tokens, H, ...]; this sequence starts at row `tok`
    else:
        i_t = i_c
        bos = i_c * 0
        length = T
        tok = i_b * T
    dt = q.dtype.element_ty  # matmul operand dtype: the input's (fp32 inputs stay fp32 + PREC)
    t0 = i_t * BT
    rows = tl.arange(0, BT)
    m_t = t0 + rows < length
    q += i_b * s_qb + (bos + t0) * s_qt + i_h * s_qh
    k += i_b * s_kb + (bos + t0) * s_kt + i_h * s_kh
    v += i_b * s_vb + (bos + t0) * s_vt + i_h * s_vh
    row0 = (tok + t0) * H + i_h  # scratch row of this chunk's first token (row stride: H)
    causal = rows[:, None] >= rows[None, :]
    if DELTA:
        b_beta = tl.load(beta + i_b * s_bb + (bos + t0 + rows) * s_bt + i_h * s_bh, mask=m_t, other=0.0).to(tl.float32)

    if GATE != 2:  # no decay or one per head: the whole [BT, BT] block at once, stably
        b_qk = tl.zeros([BT, BT], dtype=tl.float32)
        b_kk = tl.zeros([BT, BT], dtype=tl.float32)
        for i_k in range(0, tl.cdiv(K, BK)):
            o_k = i_k * BK + tl.arange(0, BK)
            m = m_t[:, None] & (o_k < K)[None, :]
            b_q = tl.load(q + rows[:, None] * s_qt + o_k[None, :], mask=m, other=0.0)
            b_k = tl.load(k + rows[:, None] * s_kt + o_k[None, :], mask=m, other=0.0)
            b_qk += tl.dot(b_q, tl.trans(b_k), input_precision=PREC)
            if DELTA:
                b_kk += tl.dot(b_k, tl.trans(b_k), input_precision=PREC)
        if GATE == 1:
            b_g = tl.load(g + i_b * s_gb + (bos + t0 + rows) * s_gt + i_h * s_gh, mask=m_t, other=0.0)
            b_b = tl.cumsum(b_g.to(tl.float32), axis=0)
            tl.store(gc + row0 + rows * H, b_b, mask=m_t)
            b_d = tl.exp(tl.where(causal, b_b[:, None] - b_b[None, :], float("-inf")))
            b_qk = b_qk * b_d
            b_kk = b_kk * b_d
        tl.store(P + (row0 + rows[:, None] * H) * BT + rows[None, :], tl.where(causal, b_qk, 0.0), mask=m_t[:, None])
        if DELTA:
            b_a = tl.where(rows[:, None] > rows[None, :], b_kk, 0.0) * b_beta[:, None]
            tl.store(A + (row0 + rows[:, None] * H) * BT + rows[None, :], b_a, mask=m_t[:, None])
    else:  # per-key decay: cumulative b to scratch, then 16x16 sub-blocks
        for i_k in range(0, tl.cdiv(K, BK)):
            o_k = i_k * BK + tl.arange(0, BK)
            m = m_t[:, None] & (o_k < K)[None, :]
            b_g = tl.load(g + i_b * s_gb + (bos + t0 + rows[:, None]) * s_gt + i_h * s_gh + o_k[None, :], mask=m,
                          other=0.0)
            tl.store(gc + (row0 + rows[:, None] * H) * K + o_k[None, :], tl.cumsum(b_g.to(tl.float32), axis=0), mask=m)
        tl.debug_barrier()  # the sub-blocks below read b rows stored by other threads
        o_c = tl.arange(0, BC)
        for i_i in tl.static_range(0, BT // BC):
            r_i = i_i * BC + o_c
            m_i = t0 + r_i < length
            ref = tl.minimum(t0 + i_i * BC, length - 1) - t0  # block's first row, clamped into the sequence
            if DELTA:
                b_bti = tl.load(beta + i_b * s_bb + (bos + t0 + r_i) * s_bt + i_h * s_bh, mask=m_i, other=0.0)
                b_bti = b_bti.to(tl.float32)
            for j in tl.static_range(0, i_i):  # below the diagonal: exp(b_i - b_ref) exp(b_ref - b_j), both <= 0
                r_j = j * BC + o_c
                m_j = t0 + r_j < length
                b_p = tl.zeros([BC, BC], dtype=tl.float32)
                b_a = tl.zeros([BC, BC], dtype=tl.float32)
                for i_k in range(0, tl.cdiv(K, BK)):
                    o_k = i_k * BK + tl.arange(0, BK)
                    m_k = o_k < K
                    b_r = tl.load(gc + (row0 + ref * H) * K + o_k, mask=m_k, other=0.0)
                    m2i = m_i[:, None] & m_k[None, :]
                    m2j = m_j[:, None] & m_k[None, :]
                    b_bi = tl.load(gc + (row0 + r_i[:, None] * H) * K + o_k[None, :], mask=m2i, other=0.0)
                    b_bj = tl.load(gc + (row0 + r_j[:, None] * H) * K + o_k[None, :], mask=m2j, other=0.0)
                    e_i = tl.exp(tl.where(m2i, b_bi - b_r[None, :], float("-inf")))
                    e_j = tl.exp(tl.where(m2j, b_r[None, :] - b_bj, float("-inf")))
                    b_qi = tl.load(q + r_i[:, None] * s_qt + o_k[None, :], mask=m2i, other=0.0).to(tl.float32)
                    b_kj = tl.load(k + r_j[:, None] * s_kt + o_k[None, :], mask=m2j, other=0.0).to(tl.float32)
                    b_kj = tl.trans((b_kj * e_j).to(dt))
                    b_p += tl.dot((b_qi * e_i).to(dt), b_kj, input_precision=PREC)
                    if DELTA:
                        b_ki = tl.load(k + r_i[:, None] * s_kt + o_k[None, :], mask=m2i, other=0.0).to(tl.float32)
                        b_a += tl.dot((b_ki * e_i).to(dt), b_kj, input_precision=PREC)
                tl.store(P + (row0 + r_i[:, None] * H) * BT + r_j[None, :], b_p, mask=m_i[:, None])
                if DELTA:
                    tl.store(A + (row0 + r_i[:, None] * H) * BT + r_j[None, :], b_a * b_bti[:, None], mask=m_i[:, None])
            # the diagonal block: the exact exponent per (i, j, channel)
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
                b_a = tl.where(o_c[:, None] > o_c[None, :], b_a, 0.0) * b_bti[:, None]
                tl.store(A + (row0 + r_i[:, None] * H) * BT + r_i[None, :], b_a, mask=m_i[:, None])
            for j in tl.static_range(i_i + 1, BT // BC):  # above the diagonal: zeros
                b_z = tl.zeros([BC, BC], dtype=tl.float32)
                tl.store(P + (row0 + r_i[:, None] * H) * BT + (j * BC + o_c)[None, :], b_z, mask=m_i[:, None])
                if DELTA:
                    tl.store(A + (row0 + r_i[:, None] * H) * BT + (j * BC + o_c)[None, :], b_z, mask=m_i[:, None])

    if DELTA:
        tl.debug_barrier()  # A rows are re-read below by other threads
        # T = (I + A)^-1 with A strictly lower: row i of L = T - I is -A_i - sum_j A_ij L_j
        b_l = tl.zeros([BT, BT], dtype=tl.float32)
        for i in range(1, BT):
            n_i = tl.where(t0 + i < length, i, 0)  # row i's valid columns (none past the sequence end)
            b_row = -tl.load(A + (row0 + i * H) * BT + rows, mask=rows < n_i, other=0.0)
            b_row = b_row + tl.sum(b_row[:, None] * b_l, axis=0)
            b_l = tl.where((rows == i)[:, None], b_row[None, :], b_l)
        b_t = (b_l + (rows[:, None] == rows[None, :]).to(tl.float32)).to(dt)
        for i_k in range(0, tl.cdiv(K, BK)):
            o_k = i_k * BK + tl.arange(0, BK)
            m = m_t[:, None] & (o_k < K)[None, :]
            b_k = tl.load(k + rows[:, None] * s_kt + o_k[None, :], mask=m, other=0.0).to(tl.float32)
            if GATE == 1:
                b_k = b_k * tl.exp(b_b)[:, None]
            if GATE == 2:
                b_k = b_k * tl.exp(tl.load(gc + (row0 + rows[:, None] * H) * K + o_k[None, :], mask=m, other=0.0))
            b_w = tl.dot(b_t, (b_k * b_beta[:, None]).to(dt), input_precision=PREC)
            tl.store(W + (row0 + rows[:, None] * H) * K + o_k[None, :], b_w.to(W.dtype.element_ty), mask=m)
        for i_v in range(0, tl.cdiv(V, BV)):
            o_v = i_v * BV + tl.arange(0, BV)
            m = m_t[:, None] & (o_v < V)[None, :]
            b_v = tl.load(v + rows[:, None] * s_vt + o_v[None, :], mask=m, other=0.0).to(tl.float32)
            b_u = tl.dot(b_t, (b_v * b_beta[:, None]).to(dt), input_precision=PREC)
            tl.store(U + (row0 + rows[:, None] * H) * V + o_v[None, :], b_u.to(U.dtype.element_ty), mask=m)


@triton.jit(do_not_specialize=["T"])
def _chunk_fwd_kernel(
    q, k, v, gc, P, W, U, o, h0, ht, cu_seqlens,
    s_qb, s_qt, s_qh, s_kb, s_kt, s_kh, s_vb, s_vt, s_vh, s_ob, s_ot, s_oh,
    s_0n, s_0h, s_0k, s_tn, s_th, s_tk,
    T, H, K, V,
    BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    GATE: tl.constexpr, DELTA: tl.constexpr, VARLEN: tl.constexpr, HAS_H0: tl.constexpr, PREC: tl.constexpr,
):
    i_v = tl.program_id(0)
    i_nh = tl.program_id(1).to(tl.int64)
    i_n, i_h = i_nh // H, i_nh % H
    if VARLEN:
        bos = tl.load(cu_seqlens + i_n).to(tl.int64)
        length = tl.load(cu_seqlens + i_n + 1).to(tl.int64) - bos
        i_b = i_n * 0
        tok = bos
    else:
        bos = i_n * 0
        length = T
        i_b = i_n
        tok = i_n * T
    dt = q.dtype.element_ty
    rows = tl.arange(0, BT)
    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_k, m_v = o_k < K, o_v < V
    m_s = m_k[:, None] & m_v[None, :]
    if HAS_H0:
        b_s = tl.load(h0 + i_n * s_0n + i_h * s_0h + o_k[:, None] * s_0k + o_v[None, :], mask=m_s, other=0.0)
    else:
        b_s = tl.zeros([BK, BV], dtype=tl.float32)
    q += i_b * s_qb + bos * s_qt + i_h * s_qh
    k += i_b * s_kb + bos * s_kt + i_h * s_kh
    v += i_b * s_vb + bos * s_vt + i_h * s_vh
    o += i_b * s_ob + bos * s_ot + i_h * s_oh

    for i_t in range(0, tl.cdiv(length, BT)):
        t0 = i_t * BT
        m_t = t0 + rows < length
        row0 = (tok + t0) * H + i_h
        last = tl.minimum(t0 + BT, length) - 1 - t0  # last valid row of this chunk
        m_qk = m_t[:, None] & m_k[None, :]
        m_tv = m_t[:, None] & m_v[None, :]
        b_q = tl.load(q + (t0 + rows[:, None]) * s_qt + o_k[None, :], mask=m_qk, other=0.0).to(tl.float32)
        b_k = tl.load(k + (t0 + rows[:, None]) * s_kt + o_k[None, :], mask=m_qk, other=0.0).to(tl.float32)
        if GATE == 1:
            b_b = tl.load(gc + row0 + rows * H, mask=m_t, other=0.0)
            b_last = tl.load(gc + row0 + last * H)
            b_q = b_q * tl.exp(b_b)[:, None]
            b_k = b_k * tl.exp(b_last - b_b)[:, None]
        if GATE == 2:
            b_b = tl.load(gc + (row0 + rows[:, None] * H) * K + o_k[None, :], mask=m_qk, other=0.0)
            b_last = tl.load(gc + (row0 + last * H) * K + o_k, mask=m_k, other=0.0)
            b_q = b_q * tl.exp(b_b)
            b_k = b_k * tl.exp(b_last[None, :] - b_b)
        b_p = tl.load(P + (row0 + rows[:, None] * H) * BT + rows[None, :], mask=m_t[:, None], other=0.0)
        b_sd = b_s.to(dt)
        if DELTA:
            b_w = tl.load(W + (row0 + rows[:, None] * H) * K + o_k[None, :], mask=m_qk, other=0.0)
            b_u = tl.load(U + (row0 + rows[:, None] * H) * V + o_v[None, :], mask=m_tv, other=0.0).to(tl.float32)
            b_u = b_u - tl.dot(b_w.to(dt), b_sd, input_precision=PREC)
        else:
            b_u = tl.load(v + (t0 + rows[:, None]) * s_vt + o_v[None, :], mask=m_tv, other=0.0).to(tl.float32)
        b_ud = b_u.to(dt)
        b_o = tl.dot(b_q.to(dt), b_sd, input_precision=PREC)
        b_o += tl.dot(tl.where(rows[:, None] >= rows[None, :], b_p, 0.0).to(dt), b_ud, input_precision=PREC)
        tl.store(o + (t0 + rows[:, None]) * s_ot + o_v[None, :], b_o.to(o.dtype.element_ty), mask=m_tv)
        if GATE == 1:
            b_s = b_s * tl.exp(b_last)
        if GATE == 2:
            b_s = b_s * tl.exp(b_last)[:, None]
        b_s += tl.dot(tl.trans(b_k.to(dt)), b_ud, input_precision=PREC)
    tl.store(ht + i_n * s_tn + i_h * s_th + o_k[:, None] * s_tk + o_v[None, :], b_s, mask=m_s)


@functools.lru_cache(maxsize=None)
def _num_sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def chunk_config(num_heads_total: int, d_k: int, d_v: int, dtype: torch.dtype, device: torch.device) -> dict:
    """Tile sizes: BT 64 unless the [BT, d_k] operand tiles get large (fp32, d_k 256), BV small
    enough that heads x tiles fill the GPU (the sequential kernel's only parallelism)."""
    bk = max(16, next_pow2(d_k))
    size = 4 if dtype == torch.float32 else 2
    bt = 64 if bk * size <= 256 else 32
    sms = 1 if device.type != "cuda" else _num_sms(device.index or 0)
    bv = min(64, max(16, next_pow2(d_v)))
    while bv > 16 and num_heads_total * triton.cdiv(d_v, bv) < sms:
        bv //= 2
    warps = 4 if bk * bt <= 64 * 64 else 8
    return {"BT": bt, "BV": bv, "num_warps": warps}


def chunk_prefill(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor | None = None,
    beta: Tensor | None = None,
    initial_state: Tensor | None = None,
    *,
    cu_seqlens: Tensor | None = None,
    out: Tensor | None = None,
    final_state: Tensor | None = None,
    block_v: int | None = None,
    num_warps: int | None = None,
) -> tuple[Tensor, Tensor]:
    """Prefill a whole sequence: q, k [B, T, H, d_k], v [B, T, H, d_v], g [B, T, H, 1|d_k],
    beta [B, T, H], initial_state [N, H, d_k, d_v] float32 (None: zeros) -> (o [B, T, H, d_v]
    in v's dtype, final state [N, H, d_k, d_v] float32). Varlen: B = 1 and cu_seqlens [N+1]."""
    what = "chunk_prefill"
    if q.dim() != 4:
        raise KernelError(f"{what}: q has {q.dim()} dims", "expected [B, T, H, d_k]", "add the time axis")
    batch, length, heads, _ = q.shape
    d_k, d_v = check_qkv(q, k, v, (batch, length, heads), what)
    kind = check_aux(g, beta, (batch, length, heads), d_k, what)
    device = check_device({"q": q, "k": k, "v": v, "g": g, "beta": beta, "initial_state": initial_state,
                           "cu_seqlens": cu_seqlens})
    if cu_seqlens is not None:
        if batch != 1 or cu_seqlens.dim() != 1 or cu_seqlens.dtype not in (torch.int32, torch.int64):
            raise KernelError(f"{what}: varlen with batch {batch}, cu_seqlens {tuple(cu_seqlens.shape)}",
                              "varlen packs sequences along T of a batch of 1; cu_seqlens holds N+1 int offsets",
                              "pass q [1, total, H, d_k] and an int32 cu_seqlens")
        offsets = cu_seqlens.tolist()  # one host sync per prefill: the grid needs the chunk count
        if offsets[0] != 0 or offsets[-1] != length or any(b < a for a, b in zip(offsets, offsets[1:])):
            raise KernelError(f"{what}: cu_seqlens {offsets[:8]}...", f"offsets must rise from 0 to T={length}",
                              "build cu_seqlens as [0, cumsum(lengths)]")
        num_seq = len(offsets) - 1
    else:
        num_seq = batch
    state_shape = (num_seq, heads, d_k, d_v)
    if initial_state is not None:
        check_state(initial_state, state_shape, what, "initial_state")
    if final_state is None:
        final_state = torch.empty(state_shape, dtype=torch.float32, device=device)
    check_state(final_state, state_shape, what, "final_state")
    if out is None:
        out = torch.empty(batch, length, heads, d_v, dtype=v.dtype, device=device)
    check_out(out, (batch, length, heads, d_v), v.dtype, what)
    q, k, v, g = (last_dim_contiguous(x) for x in (q, k, v, g))

    cfg = chunk_config(num_seq * heads, d_k, d_v, q.dtype, device)
    bt, bv = cfg["BT"], block_v or cfg["BV"]
    if cu_seqlens is not None:
        pairs = [(n, t) for n, (a, b) in enumerate(zip(offsets, offsets[1:])) for t in range(triton.cdiv(b - a, bt))]
        chunk_indices = torch.tensor(pairs or [(0, 0)], dtype=torch.int32).view(-1).to(device)
        grid1 = (len(pairs), heads)
    else:
        chunk_indices = None
        grid1 = (triton.cdiv(length, bt), batch * heads)
    delta = beta is not None
    tokens = batch * length
    # fp32 inputs: 3-pass tf32 keeps matmuls at fp32 accuracy (the interpreter is exact anyway)
    prec = "tf32" if q.dtype != torch.float32 else ("ieee" if interpreting() else "tf32x3")
    f32 = dict(dtype=torch.float32, device=device)
    gc = torch.empty(tokens, heads, d_k if kind == 2 else 1, **f32) if kind else q
    p = torch.empty(tokens, heads, bt, **f32)
    a = torch.empty(tokens, heads, bt, **f32) if delta else p
    w = torch.empty(tokens, heads, d_k, dtype=k.dtype, device=device) if delta else q
    u = torch.empty(tokens, heads, d_v, dtype=v.dtype, device=device) if delta else v
    bk = max(16, next_pow2(d_k))
    if grid1[0] > 0:
        _chunk_prep_kernel[grid1](
            q, k, v, g if g is not None else q, beta if beta is not None else q, gc, p, a, w, u, cu_seqlens,
            chunk_indices, *strides3(q), *strides3(k), *strides3(v), *strides3(g), *strides3(beta),
            length, heads, d_k, d_v,
            BT=bt, BC=SUB, BK=min(bk, 64), BKD=16, BV=min(64, max(16, next_pow2(d_v))),
            GATE=kind, DELTA=delta, VARLEN=cu_seqlens is not None, PREC=prec, num_warps=4,
        )
    h0 = initial_state if initial_state is not None else final_state
    _chunk_fwd_kernel[(triton.cdiv(d_v, bv), num_seq * heads)](
        q, k, v, gc, p, w, u, out, h0, final_state, cu_seqlens,
        *strides3(q), *strides3(k), *strides3(v), *strides3(out),
        h0.stride(0), h0.stride(1), h0.stride(2), final_state.stride(0), final_state.stride(1), final_state.stride(2),
        length, heads, d_k, d_v,
        BT=bt, BK=bk, BV=bv, GATE=kind, DELTA=delta, VARLEN=cu_seqlens is not None,
        HAS_H0=initial_state is not None, PREC=prec, num_warps=num_warps or cfg["num_warps"],
    )
    return out, final_state
