"""The small-batch GEMVs of the fused decode (edgelin.export.torch.fused_decode, B <= DecodeTuning.small_batch).

A B=1 decode step is ~80 dependent kernels, each reading 1-6 MB of weights: at 4 TB/s that is ~1 us of
bytes per kernel, about as long as one DRAM round trip. So each kernel is one wave: a program holds its
whole slice of W (BN rows x the full K, padded to a power of two and masked) and issues every load of it
at once, before it touches anything the previous kernel wrote. On Hopper the kernels are launched with
programmatic dependent launch (PDL): a program may start while the previous kernel still runs, loads
its weights (which no kernel writes), then waits (`gdc_wait`) for the previous kernel's results. The
weight reads of one kernel so overlap the tail of the one before, and launch gaps vanish.

Ordering rules that PDL makes explicit (tests/gpu/test_decode_gpu.py checks the results with it on and
off): before `gdc_wait` a kernel reads only weights and state that no kernel of the current step writes
before it (the first kernel of a step is launched without PDL, so a step starts after the previous one
ended); everything else, and every store, after.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

Tensor = torch.Tensor


@dataclass(frozen=True)
class DecodeTuning:
    """Launch parameters of the fused decode. bn_*: output rows per program; warps_*: warps per program.
    The defaults are the best of a greedy sweep on an H200 (147.6M model, B=1: 213 us/token with them,
    230 us with bn_gu=4 and mixer_bv=32, 293 us without PDL; the GEMVs beat cuBLAS up to B=4 and lose at
    B=8: 478 vs 666 us at B=4, 885 vs 683 us at B=8).
    pdl: programmatic dependent launch (used only on CUDA devices of compute capability >= 9).
    small_batch: up to this batch the projections are these GEMVs, above cuBLAS. mixer_bv: value-tile
    width of the mixer at small batch (more programs for B=1)."""

    pdl: bool = True
    small_batch: int = 4
    bk: int = 256
    bn_in: int = 8
    warps_in: int = 4
    bn_o: int = 4
    warps_o: int = 4
    bn_gu: int = 8
    warps_gu: int = 4
    bn_down: int = 4
    warps_down: int = 4
    bn_head: int = 8
    warps_head: int = 4
    mixer_bv: int = 16
    mixer_warps: int = 4


@triton.jit
def _norm_gemv_kernel(x, s_xb, ids, x_out, s_ob2, nw, w, out, s_ob, N, D, eps,
                      BB: tl.constexpr, BN: tl.constexpr, NKT: tl.constexpr, BK: tl.constexpr,
                      SWIGLU: tl.constexpr, EMBED: tl.constexpr, PDL: tl.constexpr):
    """out[b, n] = sum_k rmsnorm(x[b])[k] W[n, k] for b < BB (W read once for all rows). SWIGLU: W holds
    [gate; up] (2N rows) and out = silu(x W_gate^T) * (x W_up^T). EMBED: x is the embedding table and
    row b is x[ids[b]]; program 0 also writes those rows to x_out (the residual stream)."""
    pid = tl.program_id(0)
    on = pid * BN + tl.arange(0, BN)
    ok = tl.arange(0, NKT)[:, None] * BK + tl.arange(0, BK)[None, :]  # [NKT, BK]: the whole row, padded
    mn, mk = on < N, ok < D
    p_w = w + on.to(tl.int64)[:, None, None] * D + ok[None, :, :]
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
    wv = tl.load(p_w, mask=mn[:, None, None] & mk[None, :, :], other=0.0)
    if SWIGLU:
        wu = tl.load(p_w + N * D, mask=mn[:, None, None] & mk[None, :, :], other=0.0)
    nwv = tl.load(nw + ok, mask=mk, other=0.0).to(tl.float32)
    if PDL:
        tl.extra.cuda.gdc_wait()
    for b in tl.static_range(BB):
        if EMBED:
            row = tl.load(ids + b).to(tl.int64)
            xr = tl.load(x + row * s_xb + ok, mask=mk, other=0.0)
            if pid == 0:
                tl.store(x_out + b * s_ob2 + ok, xr, mask=mk)
        else:
            xr = tl.load(x + b * s_xb + ok, mask=mk, other=0.0)
        xv = xr.to(tl.float32)
        r = tl.rsqrt(tl.sum(tl.sum(xv * xv, 1), 0) / D + eps)
        xn = (xv * nwv)[None, :, :]
        acc = tl.sum(tl.sum(wv.to(tl.float32) * xn, 2), 1) * r
        if SWIGLU:
            up = tl.sum(tl.sum(wu.to(tl.float32) * xn, 2), 1) * r
            acc = acc * tl.sigmoid(acc) * up
        tl.store(out + b * s_ob + on, acc.to(out.dtype.element_ty), mask=mn)


@triton.jit
def _gemv_add_kernel(a, s_ab, w, x, s_xb, N, D, gate, s_gb, onw, eps, conv, s_cb, s_cc, y, s_yb, QK,
                     BB: tl.constexpr, BN: tl.constexpr, NKT: tl.constexpr, BK: tl.constexpr,
                     GATED_NORM: tl.constexpr, SIGMOID_GATE: tl.constexpr, SHIFT_QK: tl.constexpr,
                     CH: tl.constexpr, PDL: tl.constexpr):
    """x[b, n] += sum_k a'[b, k] W[n, k] (the residual add, in place). GATED_NORM: a is the mixer's
    float32 o, BK the head dim, and a' = rmsnorm per head * weight * silu|sigmoid(gate). SHIFT_QK: also
    shift the short-conv state of the q/k channels (the first QK channels of y), CH channels per program:
    the value-tiled mixer reads those taps from several programs, so it cannot shift them itself."""
    pid = tl.program_id(0)
    on = pid * BN + tl.arange(0, BN)
    ok = tl.arange(0, NKT)[:, None] * BK + tl.arange(0, BK)[None, :]
    mn, mk = on < N, ok < D
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
    wv = tl.load(w + on.to(tl.int64)[:, None, None] * D + ok[None, :, :], mask=mn[:, None, None] & mk[None, :, :],
                 other=0.0)
    if GATED_NORM:
        onwv = tl.load(onw + tl.arange(0, BK)).to(tl.float32)
    if PDL:
        tl.extra.cuda.gdc_wait()
    if SHIFT_QK:
        c = pid * CH + tl.arange(0, CH)
        mc = c < QK
        for b in tl.static_range(BB):
            crow = conv + b * s_cb + c * s_cc
            t1 = tl.load(crow + 1, mask=mc)
            t2 = tl.load(crow + 2, mask=mc)
            raw = tl.load(y + b * s_yb + c, mask=mc)
            tl.debug_barrier()  # every copy of a tap read before any is written
            tl.store(crow, t1, mask=mc)
            tl.store(crow + 1, t2, mask=mc)
            tl.store(crow + 2, raw.to(t1.dtype), mask=mc)
    for b in tl.static_range(BB):
        av = tl.load(a + b * s_ab + ok, mask=mk, other=0.0).to(tl.float32)
        if GATED_NORM:
            av = av * tl.rsqrt(tl.sum(av * av, 1) / BK + eps)[:, None] * onwv[None, :]
            gv = tl.load(gate + b * s_gb + ok, mask=mk, other=0.0).to(tl.float32)
            av = av * (tl.sigmoid(gv) if SIGMOID_GATE else gv * tl.sigmoid(gv))
        acc = tl.sum(tl.sum(wv.to(tl.float32) * av[None, :, :], 2), 1)
        p_x = x + b * s_xb + on
        tl.store(p_x, (tl.load(p_x, mask=mn, other=0.0).to(tl.float32) + acc).to(x.dtype.element_ty), mask=mn)


def _tiles(d: int, bk: int) -> tuple[int, int]:
    """(NKT, BK): K as NKT tiles of BK, NKT * BK >= d, both powers of two."""
    bk = min(bk, triton.next_power_of_2(d))
    return triton.next_power_of_2(triton.cdiv(d, bk)), bk


def norm_gemv(x: Tensor, norm_w: Tensor, eps: float, w: Tensor, out: Tensor, bn: int, warps: int, bk: int,
              pdl: bool, swiglu: bool = False, embed_ids: Tensor | None = None, x_out: Tensor | None = None) -> None:
    """out = rmsnorm(x) W^T (swiglu: silu(gate) * up); embed_ids: x is the embedding table, rows ids,
    copied into x_out too."""
    n, d = (w.shape[0] // 2 if swiglu else w.shape[0]), w.shape[1]
    nkt, bk = _tiles(d, bk)
    batch = out.shape[0]
    ids = embed_ids if embed_ids is not None else out
    x_out = x_out if x_out is not None else out
    extra = {"launch_pdl": True} if pdl else {}
    _norm_gemv_kernel[(triton.cdiv(n, bn),)](
        x, x.stride(0), ids, x_out, x_out.stride(0), norm_w, w, out, out.stride(0), n, d, eps, BB=batch, BN=bn,
        NKT=nkt, BK=bk, SWIGLU=swiglu, EMBED=embed_ids is not None, PDL=pdl, num_warps=warps, **extra)


def gemv_add(a: Tensor, w: Tensor, x: Tensor, bn: int, warps: int, bk: int, pdl: bool, gate: Tensor | None = None,
             norm_w: Tensor | None = None, eps: float = 0.0, sigmoid: bool = False,
             shift: tuple[Tensor, Tensor, int] | None = None) -> None:
    """x += a' W^T in place; gate/norm_w: a' = the gated per-head RMSNorm of a (head dim = norm_w's size);
    shift = (conv_state, y, qk_channels): shift the q/k short-conv taps by y's raw q/k."""
    n, d = w.shape
    nkt, bk = _tiles(d, norm_w.shape[0] if gate is not None else bk)
    grid = triton.cdiv(n, bn)
    conv, y, qk = shift if shift is not None else (x, x, 0)
    ch = triton.next_power_of_2(triton.cdiv(qk, grid)) if shift is not None else 1
    extra = {"launch_pdl": True} if pdl else {}
    _gemv_add_kernel[(grid,)](
        a, a.stride(0), w, x, x.stride(0), n, d, a if gate is None else gate, 0 if gate is None else gate.stride(0),
        w if norm_w is None else norm_w, eps, conv, conv.stride(0), conv.stride(1) if shift else 0, y, y.stride(0),
        qk, BB=x.shape[0], BN=bn, NKT=nkt, BK=bk, GATED_NORM=gate is not None, SIGMOID_GATE=sigmoid,
        SHIFT_QK=shift is not None, CH=ch, PDL=pdl, num_warps=warps, **extra)


def pdl_available(device: torch.device) -> bool:
    """Programmatic dependent launch: CUDA, compute capability >= 9 (Hopper), and a Triton that has it."""
    if device.type != "cuda" or torch.cuda.get_device_capability(device)[0] < 9:
        return False
    try:
        from triton.language.extra.cuda import gdc_wait  # noqa: F401
    except ImportError:
        return False
    return True
