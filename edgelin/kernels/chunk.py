"""Triton chunked prefill (forward only): outputs + final state for every gate kind and rule, Gated
DeltaNet-2's erase gate included, fixed-length batches or varlen (`cu_seqlens`) in one call.

Three kernels, the chunked form of `edgelin.reference.recurrence.chunked` (same notation):
1. `_chunk_prep_kernel`, parallel over every chunk of every head: cumulative log-decay b, the
   intra-chunk readout P[i, j] = q_i^T R[i, j] k_j (j <= i) and, for the delta rule, the chunk's
   WY form: T = (I + A)^-1 (`_unit_lower_inverse`: 16-row diagonal blocks by forward substitution,
   all at once, then the off-diagonal blocks by small matmuls), W = T diag(beta) (K * e^b),
   U0 = T diag(beta) V. With an erase gate (f = e * k): A = diag(beta) A_kf, P = P_qf,
   U0 = beta V - T diag(beta) A_kk diag(beta) V and the S-free readout (P_qk - P_qf) beta V.
2. `chunk_ho._chunk_h_kernel`, sequential over chunks, parallel over heads x d_v tiles (x d_k tiles
   for the additive rule): stores the state entering each chunk; U = U0 - W S; S = e^{b_C} S + K_end^T U.
3. `chunk_ho._chunk_o_kernel`, parallel over every chunk x head x d_v tile: O = (Q * e^b) h + P U.
Only kernel 2 is sequential, with two small matmuls per chunk and no output work (fla's design:
per-chunk states in one kernel, the outputs of all chunks in parallel in another).
Per-key decays never form e^{+b}: off-diagonal 16x16 sub-blocks factor exp(b_i - b_j) through the
row block's first row, diagonal sub-blocks take the exact exponent (as fla's chunk_gla does).
Requires g <= 0 (a decay), which every family's gate guarantees.
"""

from __future__ import annotations

import functools
import itertools

import torch
import triton
import triton.language as tl

from edgelin.kernels._common import (
    KernelError, Tensor, check_aux, check_device, check_out, check_qkv, check_state, interpreting, last_dim_contiguous,
    next_pow2, strides3,
)

SUB = 16  # sub-block of the per-key intra-chunk products (tl.dot's smallest tile)


@triton.jit
def _unit_lower_inverse(A, row0, t0, length, H, BT: tl.constexpr, BC: tl.constexpr, PREC: tl.constexpr):
    """T = (I + A)^-1 for this chunk's strictly lower A (scratch rows row0 + i * H, BT wide), by BC-row
    blocks: the diagonal blocks all at once by forward substitution (BC - 1 steps, not BT - 1), then
    T_ij = -T_ii sum_{j<=m<i} A_im T_mj, written over A block row by block row (ascending j: T_ij
    needs only A_im with m >= j). Returns T [BT, BT] float32 (rows past the sequence end: 0)."""
    NB: tl.constexpr = BT // BC
    o_c = tl.arange(0, BC)
    blk = tl.arange(0, NB)
    l3 = tl.zeros([NB, BC, BC], dtype=tl.float32)
    for i in range(1, BC):
        r = blk * BC + i
        m = (o_c[None, :] < i) & (t0 + r < length)[:, None]
        a = -tl.load(A + (row0 + r[:, None] * H) * BT + (blk[:, None] * BC + o_c[None, :]), mask=m, other=0.0)
        a = a + tl.sum(a[:, :, None] * l3, axis=1)
        l3 = tl.where((o_c == i)[None, :, None], a[:, None, :], l3)
    l3 = l3 + (o_c[:, None] == o_c[None, :]).to(tl.float32)[None, :, :]
    rr = blk[:, None, None] * BC + o_c[None, :, None]
    cc = blk[:, None, None] * BC + o_c[None, None, :]
    tl.debug_barrier()  # every thread has read the diagonal blocks of A
    tl.store(A + (row0 + rr * H) * BT + cc, l3, mask=t0 + rr < length)
    for i in tl.static_range(1, NB):
        r_i = i * BC + o_c
        m_i = (t0 + r_i < length)[:, None]
        tl.debug_barrier()  # T's earlier block rows are stored
        t_ii = tl.load(A + (row0 + r_i[:, None] * H) * BT + (i * BC + o_c)[None, :], mask=m_i, other=0.0)
        for j in tl.static_range(0, i):
            acc = tl.zeros([BC, BC], dtype=tl.float32)
            for mm in tl.static_range(j, i):
                r_m = mm * BC + o_c
                a_im = tl.load(A + (row0 + r_i[:, None] * H) * BT + r_m[None, :], mask=m_i, other=0.0)
                t_mj = tl.load(A + (row0 + r_m[:, None] * H) * BT + (j * BC + o_c)[None, :],
                               mask=(t0 + r_m < length)[:, None], other=0.0)
                acc += tl.dot(a_im, t_mj, input_precision=PREC)
            t_ij = -tl.dot(t_ii, acc, input_precision=PREC)
            tl.debug_barrier()  # A_ij is read by every thread before T_ij replaces it
            tl.store(A + (row0 + r_i[:, None] * H) * BT + (j * BC + o_c)[None, :], t_ij, mask=m_i)
    tl.debug_barrier()
    rows = tl.arange(0, BT)
    return tl.load(A + (row0 + rows[:, None] * H) * BT + rows[None, :], mask=(t0 + rows < length)[:, None], other=0.0)


@triton.jit(do_not_specialize=["T"])  # T == 1 must take the general path (and not recompile)
def _chunk_prep_kernel(
    q, k, v, g, beta, ep, gc, P, A, W, U, OX, cu_seqlens, chunk_indices,
    s_qb, s_qt, s_qh, s_kb, s_kt, s_kh, s_vb, s_vt, s_vh, s_gb, s_gt, s_gh, s_bb, s_bt, s_bh, s_eb, s_et, s_eh,
    T, H, K, V,
    BT: tl.constexpr, BC: tl.constexpr, BK: tl.constexpr, BKD: tl.constexpr, BV: tl.constexpr,
    GATE: tl.constexpr, DELTA: tl.constexpr, ERASE: tl.constexpr, VARLEN: tl.constexpr, PREC: tl.constexpr,
    PREC_T: tl.constexpr,
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
    if ERASE:
        ep += i_b * s_eb + (bos + t0) * s_et + i_h * s_eh
    row0 = (tok + t0) * H + i_h  # scratch row of this chunk's first token (row stride: H)
    causal = rows[:, None] >= rows[None, :]
    if DELTA:
        b_beta = tl.load(beta + i_b * s_bb + (bos + t0 + rows) * s_bt + i_h * s_bh, mask=m_t, other=0.0).to(tl.float32)

    if GATE != 2:  # no decay or one per head: the whole [BT, BT] block at once, stably
        b_qk = tl.zeros([BT, BT], dtype=tl.float32)
        b_kk = tl.zeros([BT, BT], dtype=tl.float32)
        b_qf = tl.zeros([BT, BT], dtype=tl.float32)
        b_kf = tl.zeros([BT, BT], dtype=tl.float32)
        for i_k in range(0, tl.cdiv(K, BK)):
            o_k = i_k * BK + tl.arange(0, BK)
            m = m_t[:, None] & (o_k < K)[None, :]
            b_q = tl.load(q + rows[:, None] * s_qt + o_k[None, :], mask=m, other=0.0)
            b_k = tl.load(k + rows[:, None] * s_kt + o_k[None, :], mask=m, other=0.0)
            b_qk += tl.dot(b_q, tl.trans(b_k), input_precision=PREC)
            if DELTA:
                b_kk += tl.dot(b_k, tl.trans(b_k), input_precision=PREC)
            if ERASE:  # the erase directions f = e * k
                b_f = (tl.load(ep + rows[:, None] * s_et + o_k[None, :], mask=m, other=0.0).to(tl.float32)
                       * b_k.to(tl.float32)).to(dt)
                b_qf += tl.dot(b_q, tl.trans(b_f), input_precision=PREC)
                b_kf += tl.dot(b_k, tl.trans(b_f), input_precision=PREC)
        if GATE == 1:
            b_g = tl.load(g + i_b * s_gb + (bos + t0 + rows) * s_gt + i_h * s_gh, mask=m_t, other=0.0)
            b_b = tl.cumsum(b_g.to(tl.float32), axis=0)
            tl.store(gc + row0 + rows * H, b_b, mask=m_t)
            b_d = tl.exp(tl.where(causal, b_b[:, None] - b_b[None, :], float("-inf")))
            b_qk = b_qk * b_d
            b_kk = b_kk * b_d
            if ERASE:
                b_qf = b_qf * b_d
                b_kf = b_kf * b_d
        if ERASE:  # P = P_qf, A = diag(beta) A_kf; A_kk and P_qk - P_qf stay for U0 and the readout's S-free part
            b_kks = tl.where(rows[:, None] > rows[None, :], b_kk, 0.0)
            b_pd = tl.where(causal, b_qk - b_qf, 0.0)
            b_qk = b_qf
            b_kk = b_kf
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
        b_t = _unit_lower_inverse(A, row0, t0, length, H, BT, BC, PREC_T).to(dt)
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
            b_bv = (b_v * b_beta[:, None]).to(dt)
            if ERASE:  # U0 = beta V - r_V, r_V = T diag(beta) A_kk diag(beta) V; OX = (P_qk - P_qf) beta V
                b_x = tl.dot(b_kks.to(dt), b_bv, input_precision=PREC) * b_beta[:, None]
                b_u = b_v * b_beta[:, None] - tl.dot(b_t, b_x.to(dt), input_precision=PREC)
                b_ox = tl.dot(b_pd.to(dt), b_bv, input_precision=PREC)
                tl.store(OX + (row0 + rows[:, None] * H) * V + o_v[None, :], b_ox, mask=m)
            else:
                b_u = tl.dot(b_t, b_bv, input_precision=PREC)
            tl.store(U + (row0 + rows[:, None] * H) * V + o_v[None, :], b_u.to(U.dtype.element_ty), mask=m)


@functools.lru_cache(maxsize=None)
def _num_sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def chunk_config(num_heads_total: int, d_k: int, d_v: int, dtype: torch.dtype, device: torch.device) -> dict:
    """Tile sizes: BT 64 unless the [BT, d_k] operand tiles get large (fp32, d_k 256); the state kernel's
    BV small enough that heads x tiles fill the GPU (its only parallelism), the output kernel's BV 64."""
    bk = max(16, next_pow2(d_k))
    size = 4 if dtype == torch.float32 else 2
    bt = 64 if bk * size <= 256 else 32
    sms = 1 if device.type != "cuda" else _num_sms(device.index or 0)
    bv = min(64, max(16, next_pow2(d_v)))
    while bv > 32 and num_heads_total * triton.cdiv(d_v, bv) < sms:
        bv //= 2
    warps = 4 if bk * bv <= 128 * 32 else 8
    return {"BT": bt, "BV": bv, "num_warps": warps, "BV_O": min(64, max(16, next_pow2(d_v))), "BK_O": min(bk, 64)}


def chunk_prefill(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor | None = None,
    beta: Tensor | None = None,
    initial_state: Tensor | None = None,
    *,
    erase: Tensor | None = None,
    cu_seqlens: Tensor | None = None,
    out: Tensor | None = None,
    final_state: Tensor | None = None,
    block_v: int | None = None,
    num_warps: int | None = None,
) -> tuple[Tensor, Tensor]:
    """Prefill a whole sequence: q, k [B, T, H, d_k], v [B, T, H, d_v], g [B, T, H, 1|d_k],
    beta [B, T, H], erase [B, T, H, d_k] (Gated DeltaNet-2: needs beta, g none or scalar),
    initial_state [N, H, d_k, d_v] float32 (None: zeros) -> (o [B, T, H, d_v] in v's dtype, final
    state [N, H, d_k, d_v] float32). Varlen: B = 1 and cu_seqlens [N+1]."""
    from edgelin.kernels.chunk_ho import _chunk_h_kernel, _chunk_o_kernel

    what = "chunk_prefill"
    if q.dim() != 4:
        raise KernelError(f"{what}: q has {q.dim()} dims", "expected [B, T, H, d_k]", "add the time axis")
    batch, length, heads, _ = q.shape
    d_k, d_v = check_qkv(q, k, v, (batch, length, heads), what)
    kind = check_aux(g, beta, (batch, length, heads), d_k, what)
    if erase is not None and (beta is None or kind == 2 or tuple(erase.shape) != tuple(q.shape)
                              or not erase.is_floating_point()):
        raise KernelError(f"{what}: erase gate {tuple(erase.shape)} with beta {'absent' if beta is None else 'given'}"
                          f" and a {('no', 'scalar', 'per-key')[kind]} decay",
                          "the erase gate needs the delta rule (beta), a scalar or no decay, and q's shape",
                          "pass erase [B, T, H, d_k] with beta and g [..., 1] (Gated DeltaNet-2)")
    device = check_device({"q": q, "k": k, "v": v, "g": g, "beta": beta, "erase": erase,
                           "initial_state": initial_state, "cu_seqlens": cu_seqlens})
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
    q, k, v, g, erase = (last_dim_contiguous(x) for x in (q, k, v, g, erase))

    cfg = chunk_config(num_seq * heads, d_k, d_v, q.dtype, device)
    bt, bv = cfg["BT"], block_v or cfg["BV"]
    varlen = cu_seqlens is not None
    if varlen:
        counts = [triton.cdiv(b - a, bt) for a, b in zip(offsets, offsets[1:])]
        pairs = [(n, t) for n, c in enumerate(counts) for t in range(c)]
        chunk_indices = torch.tensor(pairs or [(0, 0)], dtype=torch.int32).view(-1).to(device)
        chunk_offsets = torch.tensor([0, *itertools.accumulate(counts)], dtype=torch.int32).to(device)
        num_chunks, grid_c, grid_bh = len(pairs), len(pairs), heads
    else:
        chunk_indices = chunk_offsets = None
        num_chunks, grid_c, grid_bh = batch * triton.cdiv(length, bt), triton.cdiv(length, bt), batch * heads
    delta = beta is not None
    has_erase = erase is not None
    tokens = batch * length
    # fp32 inputs: 3-pass tf32 keeps matmuls at fp32 accuracy (the interpreter is exact anyway)
    prec = "tf32" if q.dtype != torch.float32 else ("ieee" if interpreting() else "tf32x3")
    prec_t = "ieee" if interpreting() else "tf32x3"  # the triangular inverse: fp32 always
    f32 = dict(dtype=torch.float32, device=device)
    gc = torch.empty(tokens, heads, d_k if kind == 2 else 1, **f32) if kind else q
    p = torch.empty(tokens, heads, bt, **f32)
    a = torch.empty(tokens, heads, bt, **f32) if delta else p
    w = torch.empty(tokens, heads, d_k, dtype=k.dtype, device=device) if delta else q
    u = torch.empty(tokens, heads, d_v, dtype=v.dtype, device=device) if delta else v
    ox = torch.empty(tokens, heads, d_v, **f32) if has_erase else p
    h = torch.empty(max(num_chunks, 1), heads, d_k, d_v, dtype=q.dtype, device=device)  # state entering each chunk
    bk = max(16, next_pow2(d_k))
    e_arg = erase if has_erase else q
    if grid_c > 0:
        _chunk_prep_kernel[(grid_c, grid_bh)](
            q, k, v, g if g is not None else q, beta if beta is not None else q, e_arg, gc, p, a, w, u, ox,
            cu_seqlens, chunk_indices, *strides3(q), *strides3(k), *strides3(v), *strides3(g), *strides3(beta),
            *strides3(erase), length, heads, d_k, d_v,
            BT=bt, BC=SUB, BK=min(bk, 64), BKD=16, BV=min(64, max(16, next_pow2(d_v))),
            GATE=kind, DELTA=delta, ERASE=has_erase, VARLEN=varlen, PREC=prec, PREC_T=prec_t, num_warps=4,
        )
    h0 = initial_state if initial_state is not None else final_state
    bk_h = bk if delta else min(bk, 64)  # the additive rule's state columns are independent: K tiles too
    _chunk_h_kernel[(triton.cdiv(d_v, bv), num_seq * heads, triton.cdiv(d_k, bk_h))](
        k, v, e_arg, beta if beta is not None else q, gc, u, w, h, h0, final_state, cu_seqlens, chunk_offsets,
        *strides3(k), *strides3(v), *strides3(erase), *strides3(beta),
        h0.stride(0), h0.stride(1), h0.stride(2), final_state.stride(0), final_state.stride(1), final_state.stride(2),
        length, heads, d_k, d_v,
        BT=bt, BK=bk_h, BV=bv, GATE=kind, DELTA=delta, ERASE=has_erase, VARLEN=varlen,
        HAS_H0=initial_state is not None, PREC=prec, num_warps=num_warps or cfg["num_warps"],
    )
    if grid_c > 0:
        _chunk_o_kernel[(triton.cdiv(d_v, cfg["BV_O"]), grid_c, grid_bh)](
            q, v, gc, p, u, h, ox, out, cu_seqlens, chunk_indices, chunk_offsets,
            *strides3(q), *strides3(v), *strides3(out), length, heads, d_k, d_v,
            BT=bt, BK=cfg["BK_O"], BV=cfg["BV_O"], GATE=kind, DELTA=delta, ERASE=has_erase, VARLEN=varlen,
            PREC=prec, num_warps=4,
        )
    return out, final_state
