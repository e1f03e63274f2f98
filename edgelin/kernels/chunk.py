"""Triton chunked prefill (forward only): outputs + final state for every gate kind and rule, Gated
DeltaNet-2's erase gate included, fixed-length batches or varlen (`cu_seqlens`) in one call.

The chunked form of `edgelin.reference.recurrence.chunked` (same notation), in two to five kernels
(tile sizes: `chunk_config`):
0. `chunk_intra._chunk_cumsum_kernel`: the cumulative log-decay b within each chunk (`gc`), for a
   per-key decay (and K e^{b_last - b}, the state kernel's operand, unless kernel 0b's diagonal-block
   kernel stores it: `kg_in_diag`) and the additive rule's scalar decay (the delta rule's prep stores
   a scalar b itself);
1. `_chunk_prep_kernel` (the delta rule only), parallel over every chunk of every head: with no or a
   scalar decay A = diag(beta) (K K^T * R) (and P with an erase gate: else the output kernel forms P
   itself), then the chunk's WY form: T = (I + A)^-1 (`_unit_lower_inverse`: 16-row diagonal blocks by
   forward substitution, all at once, then the off-diagonal blocks by small matmuls in registers),
   W = T diag(beta) (K * e^b),
   U0 = T diag(beta) V. With an erase gate (f = e * k): A = diag(beta) A_kf, P = P_qf,
   U0 = beta V - T diag(beta) A_kk diag(beta) V and the S-free readout (P_qk - P_qf) beta V.
   With `t_in_state` (KDA, and the delta rule from 64 sequence-heads on) it stores T only.
2. `chunk_ho._chunk_h_kernel`, sequential over chunks, parallel over heads x d_v tiles (x d_k tiles
   for the additive rule): stores the state entering each chunk; U = U0 - W S, or with `t_in_state`
   U = T (diag(beta) V - KE S), KE = diag(beta) K e^b; S = e^{b_C} S + K_end^T U.
3. `chunk_ho._chunk_o_kernel`, parallel over every chunk x head x d_v tile: O = (Q * e^b) h + P U.
The additive rule (linear attention, RetNet, simple GLA) runs kernels 2 and 3 (and 0 for a decay),
the delta rule 1, 2, 3 (Gated DeltaNet, DeltaNet, Gated DeltaNet-2), GLA 0, 0b, 2, 3 and KDA all.
Only kernel 2 is sequential, with two small matmuls per chunk (three with `t_in_state`) and no output
work (fla's design: per-chunk states in one kernel, the outputs of all chunks in parallel in another).
0b. Per-key decays: `chunk_intra._chunk_intra_off_kernel` (one program per pair of 16-row blocks left
of the diagonal: matmuls, exp(b_i - b_j) factored through the row block's first row) and
`_chunk_intra_diag_token_kernel` (the diagonal 16x16 blocks, one program per row and 4 heads, the exact
exponent, as fla's KDA does; with `kg_in_diag` also K e^{b_last - b}, with `t_in_state` KE) store P and
A (the delta rule) before kernel 1. Neither forms
e^{+b}. Without `t_in_state` KDA's kernel 1 runs in two launches (`prep_split`: T, then W and U one tile
per program).
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
from edgelin.kernels.chunk_tiles import _ld_lower

SUB = 16  # sub-block of the per-key intra-chunk products (tl.dot's smallest tile)


@triton.jit
def _ld_blk(A, row0, t0, length, H, i: tl.constexpr, j: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr):
    """Block (i, j) (BC x BC) of this chunk's [BT, BT] scratch matrix (rows past the sequence end: 0)."""
    o_c = tl.arange(0, BC)
    r = i * BC + o_c
    return tl.load(A + (row0 + r[:, None] * H) * BT + (j * BC + o_c)[None, :], mask=(t0 + r < length)[:, None],
                   other=0.0)


@triton.jit
def _st_blk(A, row0, t0, length, H, x, i: tl.constexpr, j: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr):
    o_c = tl.arange(0, BC)
    r = i * BC + o_c
    tl.store(A + (row0 + r[:, None] * H) * BT + (j * BC + o_c)[None, :], x, mask=(t0 + r < length)[:, None])


@triton.jit
def _unit_lower_inverse(A, row0, t0, length, H, BT: tl.constexpr, BC: tl.constexpr, PREC: tl.constexpr):
    """T = (I + A)^-1 for this chunk's strictly lower A (scratch rows row0 + i * H, BT wide; BT = 2 or 4
    BC-row blocks): the diagonal blocks all at once by forward substitution (BC - 1 steps, not BT - 1),
    then the off-diagonal blocks in registers, T_ij = -T_ii sum_{j<=m<i} A_im T_mj (block rows in
    order; no round trip through memory between them), written over A. Returns T [BT, BT] float32."""
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
    tl.debug_barrier()  # the diagonal inverses are stored
    t11 = _ld_blk(A, row0, t0, length, H, 0, 0, BT, BC)
    t22 = _ld_blk(A, row0, t0, length, H, 1, 1, BT, BC)
    a21 = _ld_blk(A, row0, t0, length, H, 1, 0, BT, BC)
    t21 = -tl.dot(t22, tl.dot(a21, t11, input_precision=PREC), input_precision=PREC)
    if NB == 4:
        t33 = _ld_blk(A, row0, t0, length, H, 2, 2, BT, BC)
        t44 = _ld_blk(A, row0, t0, length, H, 3, 3, BT, BC)
        a31 = _ld_blk(A, row0, t0, length, H, 2, 0, BT, BC)
        a32 = _ld_blk(A, row0, t0, length, H, 2, 1, BT, BC)
        a41 = _ld_blk(A, row0, t0, length, H, 3, 0, BT, BC)
        a42 = _ld_blk(A, row0, t0, length, H, 3, 1, BT, BC)
        a43 = _ld_blk(A, row0, t0, length, H, 3, 2, BT, BC)
        t32 = -tl.dot(t33, tl.dot(a32, t22, input_precision=PREC), input_precision=PREC)
        t43 = -tl.dot(t44, tl.dot(a43, t33, input_precision=PREC), input_precision=PREC)
        x31 = tl.dot(a31, t11, input_precision=PREC) + tl.dot(a32, t21, input_precision=PREC)
        t31 = -tl.dot(t33, x31, input_precision=PREC)
        x42 = tl.dot(a42, t22, input_precision=PREC) + tl.dot(a43, t32, input_precision=PREC)
        t42 = -tl.dot(t44, x42, input_precision=PREC)
        x41 = (tl.dot(a41, t11, input_precision=PREC) + tl.dot(a42, t21, input_precision=PREC)
               + tl.dot(a43, t31, input_precision=PREC))
        t41 = -tl.dot(t44, x41, input_precision=PREC)
    tl.debug_barrier()  # every block of A is read before T replaces it
    _st_blk(A, row0, t0, length, H, t21, 1, 0, BT, BC)
    if NB == 4:
        _st_blk(A, row0, t0, length, H, t31, 2, 0, BT, BC)
        _st_blk(A, row0, t0, length, H, t32, 2, 1, BT, BC)
        _st_blk(A, row0, t0, length, H, t41, 3, 0, BT, BC)
        _st_blk(A, row0, t0, length, H, t42, 3, 1, BT, BC)
        _st_blk(A, row0, t0, length, H, t43, 3, 2, BT, BC)
    tl.debug_barrier()
    return _ld_lower(A, row0, t0, length, H, BT, BC)


@triton.jit(do_not_specialize=["T"])  # T == 1 must take the general path (and not recompile)
def _chunk_prep_kernel(
    q, k, v, g, beta, ep, gc, P, A, W, U, OX, cu_seqlens, chunk_indices,
    s_qb, s_qt, s_qh, s_kb, s_kt, s_kh, s_vb, s_vt, s_vh, s_gb, s_gt, s_gh, s_bb, s_bt, s_bh, s_eb, s_et, s_eh,
    T, H, K, V,
    BT: tl.constexpr, BC: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    GATE: tl.constexpr, DELTA: tl.constexpr, ERASE: tl.constexpr, STORE_P: tl.constexpr, VARLEN: tl.constexpr,
    PREC: tl.constexpr, PREC_T: tl.constexpr, PHASE: tl.constexpr = 0,
):
    """PHASE 0: all of it; 1: up to T (left in A); 2: W and U from the stored T, one d_k or d_v tile per
    program (grid axis 2: the d_k tiles, then the d_v tiles). No erase gate in phases 1 and 2."""
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

    if GATE != 2 and PHASE != 2:  # no decay or one per head: the whole [BT, BT] block at once, stably
        b_qk = tl.zeros([BT, BT], dtype=tl.float32)
        b_kk = tl.zeros([BT, BT], dtype=tl.float32)
        b_qf = tl.zeros([BT, BT], dtype=tl.float32)
        b_kf = tl.zeros([BT, BT], dtype=tl.float32)
        for i_k in range(0, tl.cdiv(K, BK)):
            o_k = i_k * BK + tl.arange(0, BK)
            m = m_t[:, None] & (o_k < K)[None, :]
            b_k = tl.load(k + rows[:, None] * s_kt + o_k[None, :], mask=m, other=0.0)
            if STORE_P:
                b_q = tl.load(q + rows[:, None] * s_qt + o_k[None, :], mask=m, other=0.0)
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
            tl.store(gc + row0 + rows * H, b_b, mask=m_t)  # for the state and output kernels
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
        if STORE_P:  # else the output kernel forms P itself
            tl.store(P + (row0 + rows[:, None] * H) * BT + rows[None, :], tl.where(causal, b_qk, 0.0),
                     mask=m_t[:, None])
        if DELTA:
            b_a = tl.where(rows[:, None] > rows[None, :], b_kk, 0.0) * b_beta[:, None]
            tl.store(A + (row0 + rows[:, None] * H) * BT + rows[None, :], b_a, mask=m_t[:, None])
    # (per-key decay: the cumsum and intra kernels of `chunk_intra` have stored b, P and A)

    if DELTA and PHASE != 2:
        tl.debug_barrier()  # A rows are re-read below by other threads
        b_t = _unit_lower_inverse(A, row0, t0, length, H, BT, BC, PREC_T).to(dt)
    if DELTA and PHASE == 2:  # T from phase 1 (over A); b from the cumsum phase 1 stored
        b_t = _ld_lower(A, row0, t0, length, H, BT, BC).to(dt)
        if GATE == 1:
            b_b = tl.load(gc + row0 + rows * H, mask=m_t, other=0.0)
    if DELTA and PHASE != 1:
        k_lo = 0
        k_hi = tl.cdiv(K, BK)
        v_lo = 0
        v_hi = tl.cdiv(V, BV)
        if PHASE == 2:
            i_x = tl.program_id(2)
            k_lo = tl.minimum(i_x, k_hi)
            k_hi = tl.minimum(i_x + 1, k_hi)
            v_lo = tl.maximum(i_x - tl.cdiv(K, BK), 0)
            v_hi = tl.maximum(i_x - tl.cdiv(K, BK) + 1, 0)
        for i_k in range(k_lo, k_hi):
            o_k = i_k * BK + tl.arange(0, BK)
            m = m_t[:, None] & (o_k < K)[None, :]
            b_k = tl.load(k + rows[:, None] * s_kt + o_k[None, :], mask=m, other=0.0).to(tl.float32)
            if GATE == 1:
                b_k = b_k * tl.exp(b_b)[:, None]
            if GATE == 2:
                b_k = b_k * tl.exp(tl.load(gc + (row0 + rows[:, None] * H) * K + o_k[None, :], mask=m, other=0.0))
            b_w = tl.dot(b_t, (b_k * b_beta[:, None]).to(dt), input_precision=PREC)
            tl.store(W + (row0 + rows[:, None] * H) * K + o_k[None, :], b_w.to(W.dtype.element_ty), mask=m)
        for i_v in range(v_lo, v_hi):
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


def chunk_config(num_heads_total: int, d_k: int, d_v: int, dtype: torch.dtype, device: torch.device,
                 delta: bool = False, erase: bool = False, gate: int = 0) -> dict:
    """Tile sizes, warps and paths, from sweeps on an H200 (B=1 and 8, T=4096, H=16, d_k=d_v=128, bf16;
    streams F and G, then a greedy staged sweep on 2026-12-01: bench/prefill_sweep.py; docs/performance.md#gpu-prefill).
    `gate`: 0 none, 1 one decay per head, 2 one per key. BT 64 unless the [BT, d_k] operand tiles get
    large (fp32, d_k > 64). The state kernel (h) is the only sequential one, and its programs
    (sequences x heads x d_v tiles, x d_k tiles for the additive rule) are all its parallelism: the
    largest tile that still gives about one program per multiprocessor (B=1, 16 heads: d_v tiles of 16
    for the delta rule, 64 x 32 for the additive rule, 32 x 32 (two per multiprocessor) with per-key
    decays; B=8: 64-wide, and all of d_k for the additive rule). `stages*` are Triton's num_stages
    (software pipelining of the chunk loop's loads; never 1 in
    the state kernel: it gave NaN), `warps*` num_warps of the state (h), output (o), delta-rule prep,
    cumsum (cs) and per-key intra kernels (`*_off`: blocks left of the diagonal, `*_diag`: the diagonal
    blocks). Per-key decays: the diagonal blocks one program per row and BH_DIAG heads (`diag="token"`:
    gla 1x4096 227 -> 223 us, kda 8x4096 2110 -> 2025 us, over row groups that had taken it 277 -> 233
    us), the cumsum one program per 32-key tile (64 keys in one warp from 64 sequence-heads on:
    gla 8x4096 1294 -> 1267 us), and the state kernel's operand K e^{b_last - b} stored by the diagonal-block
    kernel, which loads K and b for its rows anyway, the cumsum then storing b only (`kg_in_diag`, 2026-12-02:
    gla 1x4096 217.5 -> 204.6 us, 8x4096 1267 -> 1158, 1x32768 1625 -> 1486; kda 339.9 -> 332.9, 1964 -> 1903,
    2533 -> 2436; storing it from KDA's prep instead lost 1-3%). 16-bit inputs:
    the delta rule's triangular inverse in one tf32 pass (`prec_t`; T is rounded to the input dtype
    next anyway: error vs the fp32 reference unchanged, gated_delta_rule 172.7 -> 158.6 us); KDA's
    prep in two launches (T with one warp, then W and U one tile per program: `prep_split`).
    The erase gate (Gated DeltaNet-2) keeps more tiles live in its prep and state kernels: 2 prep warps
    spill there (297 vs 64 us at B=1 T=4096), so it keeps 4, the state kernel's warps the rule before
    the sweep (8 above 128 x 32 tiles), and the fp32 inverse (not swept).
    `t_in_state` (2026-12-04, `bench/prefill_ab.py`): the prep stores only T and the state kernel forms
    U = T (diag(beta) V - KE S) itself, so W and U0 never go through memory (KDA: KE from the diagonal
    kernel, and no second prep launch): kda 1x4096 333 -> 302 us, 8x4096 1913 -> 1568, 1x32768 2436 -> 2174;
    with a scalar or no decay it puts a matmul on the sequential path that only pays from 64 sequence-heads
    on (gated_delta_rule 4x4096 465 -> 435, 8x4096 833 -> 717; 2x4096 265 vs 266; 1x4096 159 -> 200)."""
    bk = max(16, next_pow2(d_k))
    size = 4 if dtype == torch.float32 else 2
    bt = 64 if bk * size <= 256 else 32
    sms = 1 if device.type != "cuda" else _num_sms(device.index or 0)
    want = 0.9 * sms
    bv = min(64, max(16, next_pow2(d_v)))
    bk_h = bk if delta else min(bk, 128)
    if delta:  # all of d_k in one program (W S needs it): only d_v tiles
        while bv > 16 and num_heads_total * triton.cdiv(d_v, bv) < want:
            bv //= 2
    else:  # halve d_v, then d_k, down to 32 x 64 (per-key decays: to 32 x 32, about two programs per multiprocessor:
        # gla at B=1 T=4096 221.6 -> 219.0 us, T=32768 1659 -> 1616 us)
        k_floor, target = (32, 2 * want) if gate == 2 else (64, want)
        while num_heads_total * triton.cdiv(d_v, bv) * triton.cdiv(d_k, bk_h) < target and (bv > 32 or bk_h > k_floor):
            if bv > 32:
                bv //= 2
            else:
                bk_h //= 2
    if not delta:  # 8 warps at every tile of the additive rule (64 x 32 at B=1: simple_gla 78.4 -> 74.8 us)
        warps, stages = 8, 4 if bk_h * bv <= 64 * 32 else 3
    else:  # 2 stages once the d_v tiles are 64 wide (B=8: kda 2099 -> 2034 us; 3 at B=1, where 2 loses 8%)
        warps = 8 if bk_h * bv > (128 * 32 if erase else 128 * 64) else 4
        stages = 2 if bv >= 64 and not erase else 3
    per_key, fast_inverse = gate == 2, delta and not erase and size == 2
    wide = num_heads_total >= 64  # B=8 x 16 heads: the cumsum's 64-key tiles in one warp (gla 1294 -> 1267 us)
    return {"BT": bt, "BV": bv, "num_warps": warps, "stages": stages, "BK_H": bk_h,
            "BV_O": min(128, max(16, next_pow2(d_v))), "BK_O": min(bk, 64), "warps_o": 4, "stages_o": 3,
            "warps_prep": 4 if erase else 1 if per_key else 2, "prep_split": per_key and delta and not erase,
            "warps_prep2": 4, "BK_P": min(bk, 64), "BV_P": min(64, max(16, next_pow2(d_v))),
            "prec_t": "tf32" if fast_inverse else "tf32x3",
            "warps_cs": 1 if wide and per_key else 4, "BK_CS": min(bk, 64 if wide else 32), "cumsum_split": per_key,
            "warps_off": 1, "BK_OFF": min(bk, 32), "stages_off": 3,
            "diag": "token" if bk <= 128 else "loop", "warps_diag": 2 if bk <= 128 else 4,
            "BK_DIAG": min(bk, 64), "BH_DIAG": 4, "kg_in_diag": per_key,
            "t_in_state": delta and not erase and (per_key or num_heads_total >= 64)}


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
    from edgelin.kernels.chunk_intra import (
        _chunk_cumsum_kernel, _chunk_intra_diag_kernel, _chunk_intra_diag_token_kernel, _chunk_intra_off_kernel,
    )

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

    delta = beta is not None
    cfg = chunk_config(num_seq * heads, d_k, d_v, q.dtype, device, delta, erase is not None, kind)
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
    has_erase = erase is not None
    p_in = kind != 2 and not has_erase  # the output kernel forms P itself
    tokens = batch * length
    # fp32 inputs: 3-pass tf32 keeps matmuls at fp32 accuracy (the interpreter is exact anyway)
    prec = "tf32" if q.dtype != torch.float32 else ("ieee" if interpreting() else "tf32x3")
    prec_t = "ieee" if interpreting() else cfg["prec_t"]  # the triangular inverse
    f32 = dict(dtype=torch.float32, device=device)
    gc = torch.empty(tokens, heads, d_k if kind == 2 else 1, **f32) if kind else q  # b, cumulative per chunk
    # P in q's dtype: the output kernel rounds it to that for its matmul anyway (fp32 inputs: fp32)
    p = q if p_in else torch.empty(tokens, heads, bt, dtype=q.dtype, device=device)
    a = torch.empty(tokens, heads, bt, **f32) if delta else p
    u = torch.empty(tokens, heads, d_v, dtype=v.dtype, device=device) if delta else v
    ox = torch.empty(tokens, heads, d_v, **f32) if has_erase else p
    h = torch.empty(max(num_chunks, 1), heads, d_k, d_v, dtype=q.dtype, device=device)  # state entering each chunk
    bk = max(16, next_pow2(d_k))
    e_arg = erase if has_erase else q
    kg = torch.empty(tokens, heads, d_k, dtype=k.dtype, device=device) if kind == 2 else k  # K e^{b_last - b}
    kg_in_diag = kind == 2 and bool(cfg["kg_in_diag"])  # else the cumsum kernel stores KG
    t_in_state = delta and not has_erase and bool(cfg["t_in_state"])  # the prep stores T only
    # W (or, with t_in_state, KE = diag(beta) K e^b from the per-key diagonal kernel; else none)
    wy = delta and (kind == 2 or not t_in_state)
    w = torch.empty(tokens, heads, d_k, dtype=k.dtype, device=device) if wy else q
    if grid_c > 0 and (kind == 2 or (kind == 1 and not delta)):  # (the delta rule's prep stores a scalar b)
        bk_cs = cfg["BK_CS"] if kind == 2 else 16
        split = kind == 2 and cfg["cumsum_split"]
        _chunk_cumsum_kernel[(grid_c, grid_bh, triton.cdiv(d_k, bk_cs) if split else 1)](
            g, gc, k, kg, cu_seqlens, chunk_indices, *strides3(g), *strides3(k), length, heads, gc.shape[-1],
            BT=bt, BK=bk_cs, VARLEN=varlen, SCALE_K=kind == 2 and not kg_in_diag, SPLIT_K=split,
            num_warps=cfg["warps_cs"])
    if grid_c > 0 and kind == 2:
        outs = (q, k, beta if beta is not None else q, gc, p, a)  # inputs, then what the kernels store
        rest = (cu_seqlens, chunk_indices, *strides3(q), *strides3(k), *strides3(beta), length, heads, d_k)
        # the diagonal kernels may store KG too, and (t_in_state) KE = diag(beta) K e^b in w
        intra_args, diag_args = (*outs, *rest), (*outs, kg, w, *rest)
        if bt > SUB:  # the blocks left of the diagonal ones: matmuls through a reference row
            _chunk_intra_off_kernel[(grid_c * (bt // SUB) * (bt // SUB - 1) // 2, grid_bh)](
                *intra_args, BT=bt, BC=SUB, BK=cfg["BK_OFF"], DELTA=delta, VARLEN=varlen, PREC=prec,
                num_warps=cfg["warps_off"], num_stages=cfg["stages_off"],
            )
        if cfg["diag"] == "token":  # the diagonal blocks: exact exponents, one program per row and BH heads
            _chunk_intra_diag_token_kernel[(grid_c * bt, grid_bh // heads * triton.cdiv(heads, cfg["BH_DIAG"]))](
                *diag_args, BT=bt, BC=SUB, BK=bk, BH=cfg["BH_DIAG"], DELTA=delta,
                VARLEN=varlen, STORE_KG=kg_in_diag, STORE_KE=t_in_state, num_warps=cfg["warps_diag"],
            )
        else:  # d_k > 128: d_k tiles, one row at a time
            _chunk_intra_diag_kernel[(grid_c * (bt // SUB), grid_bh)](
                *diag_args, BT=bt, BC=SUB, BK=cfg["BK_DIAG"], DELTA=delta,
                VARLEN=varlen, STORE_KG=kg_in_diag, STORE_KE=t_in_state, num_warps=cfg["warps_diag"],
            )
    if grid_c > 0 and delta:
        prep_args = (q, k, v, g if g is not None else q, beta if beta is not None else q, e_arg, gc, p, a, w, u, ox,
                     cu_seqlens, chunk_indices, *strides3(q), *strides3(k), *strides3(v), *strides3(g),
                     *strides3(beta), *strides3(erase), length, heads, d_k, d_v)
        bk_p, bv_p = cfg["BK_P"], cfg["BV_P"]
        prep_kw = dict(BT=bt, BC=SUB, BK=bk_p, BV=bv_p, GATE=kind, DELTA=delta, ERASE=has_erase, STORE_P=not p_in,
                       VARLEN=varlen, PREC=prec, PREC_T=prec_t)
        if t_in_state:  # T only: the state kernel forms U from it
            _chunk_prep_kernel[(grid_c, grid_bh)](*prep_args, **prep_kw, PHASE=1, num_warps=cfg["warps_prep"])
        elif cfg["prep_split"] and not has_erase:  # T first, then W and U tile-parallel
            _chunk_prep_kernel[(grid_c, grid_bh)](*prep_args, **prep_kw, PHASE=1, num_warps=cfg["warps_prep"])
            _chunk_prep_kernel[(grid_c, grid_bh, triton.cdiv(d_k, bk_p) + triton.cdiv(d_v, bv_p))](
                *prep_args, **prep_kw, PHASE=2, num_warps=cfg["warps_prep2"])
        else:
            _chunk_prep_kernel[(grid_c, grid_bh)](*prep_args, **prep_kw, num_warps=cfg["warps_prep"])
    h0 = initial_state if initial_state is not None else final_state
    bk_h = cfg["BK_H"]  # the additive rule's state columns are independent: K tiles too (the delta rule: all of K)
    _chunk_h_kernel[(triton.cdiv(d_v, bv), num_seq * heads, triton.cdiv(d_k, bk_h))](
        k, v, e_arg, beta if beta is not None else q, gc, kg, u, w, a, h, h0, final_state, cu_seqlens, chunk_offsets,
        *strides3(k), *strides3(v), *strides3(erase), *strides3(beta),
        h0.stride(0), h0.stride(1), h0.stride(2), final_state.stride(0), final_state.stride(1), final_state.stride(2),
        length, heads, d_k, d_v,
        BT=bt, BK=bk_h, BV=bv, GATE=kind, DELTA=delta, ERASE=has_erase, VARLEN=varlen,
        HAS_H0=initial_state is not None, PREC=prec, T_IN_H=t_in_state, BC=SUB, num_warps=num_warps or cfg["num_warps"],
        num_stages=cfg["stages"],
    )
    if grid_c > 0:
        _chunk_o_kernel[(triton.cdiv(d_v, cfg["BV_O"]), grid_c, grid_bh)](
            q, k, v, gc, p, u, h, ox, out, cu_seqlens, chunk_indices, chunk_offsets,
            *strides3(q), *strides3(k), *strides3(v), *strides3(out), length, heads, d_k, d_v,
            BT=bt, BK=cfg["BK_O"], BV=cfg["BV_O"], GATE=kind, DELTA=delta, ERASE=has_erase, P_IN=p_in,
            VARLEN=varlen, PREC=prec, num_warps=cfg["warps_o"], num_stages=cfg["stages_o"],
        )
    return out, final_state
