"""A static chunk loop of rank <= 5 tensors: the chunked form for targets that trace each prompt length
(Apple's: Core ML and Core AI, one prefill function per enumerated length).

Why not the ONNX forms: coremltools 9.0 cannot convert torch's scan (the ONNX chunk loop), and
Core ML takes tensors of rank <= 5 only, while the reference's chunked form batches all chunks at
once ([chunks, batch, heads, C, C, d_k] for a per-key decay: rank 6). Core ML's prefill functions
are traced at fixed prompt lengths (one function per enumerated length), so the chunk count is known
at trace time: this engine unrolls the loop over chunks in Python and runs each chunk's math on
[batch, heads, C, d] tensors (per-key decays [batch, heads, C, C, d_k]: rank 5). The last chunk may
be shorter than C: the math holds for any chunk length, so nothing is padded.

The per-chunk math is `edgelin.reference.recurrence.chunked`'s (same `_decays`, same blocked
`invert_unit_lower`), applied to one chunk at a time, Gated DeltaNet-2's erase gate included (the
two-row WY form derived in `chunked`'s docstring: erase directions f = e * k, rows r = r_V + M S0);
the step and token-loop forms are the reference's own. Tests compare this engine with the reference
(tests/export/coreml/test_coreml.py). Core AI has no rank limit and a converter that takes torch.export
programs, but its converter crashes on torch's scan too, so it traces the same loop.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from edgelin.reference.engine import TorchEngine
from edgelin.reference.recurrence import _decays, invert_unit_lower

Tensor = torch.Tensor


def _heads_first(x: Tensor | None) -> Tensor | None:
    """[B, T, H, ...] -> [B, H, T, ...] (beta [B, T, H] -> [B, H, T, 1])."""
    if x is None:
        return None
    return x.unsqueeze(-1).transpose(1, 2) if x.dim() == 3 else x.transpose(1, 2)


def _pairs(a: Tensor, b: Tensor, decay: Tensor) -> Tensor:
    """[B, H, C, C]: a_i^T R[i, j] b_j. R is [C, C] (the causal mask), [B, H, C, C] (a scalar decay)
    or [B, H, C, C, d_k] (per key: the channel axis stays inside the sum; rank 5, no einsum: Core ML's
    einsum is limited)."""
    if decay.dim() > a.dim():
        return (a.unsqueeze(-2) * b.unsqueeze(-3) * decay).sum(-1)
    return (a @ b.transpose(-1, -2)) * decay


def chunk_step(s: Tensor, q: Tensor, k: Tensor, v: Tensor, g: Tensor | None, beta: Tensor | None,
               erase: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """One chunk: q, k [B, H, C, d_k], v [B, H, C, d_v], g [B, H, C, 1|d_k], beta [B, H, C, 1],
    erase [B, H, C, d_k], s [B, H, d_k, d_v] -> (o [B, H, C, d_v], s after the chunk). The formulas
    of `chunked` (its docstring derives the erase-gated form)."""
    size = q.shape[-2]
    causal = torch.ones(size, size, dtype=torch.bool, device=q.device).tril()
    strict = causal.tril(-1)
    if g is None:
        decay = causal.to(q.dtype)
        q_hat, k_hat, to_end, s_decay = q, k, None, None
    else:
        b, decay = _decays(g, size)  # b [B, H, C, 1|d_k]; decay [B, H, C, C] or [B, H, C, C, d_k]
        b_end = b[..., -1:, :]
        q_hat, k_hat = q * b.exp(), k * b.exp()
        to_end = (b_end - b).exp()
        s_decay = b_end.squeeze(-2).exp().unsqueeze(-1)  # [B, H, 1|d_k, 1]
    qk, kk = _pairs(q, k, decay), _pairs(k, k, decay)
    k_end = k if to_end is None else k * to_end
    carried = s if s_decay is None else s * s_decay
    if erase is not None:  # erase along f = e * k, write along k: two sets of rows (`chunked`)
        if beta is None:
            raise ValueError("an erase gate needs the delta rule (beta)")
        f = erase * k
        t_inv = invert_unit_lower(beta * torch.where(strict, _pairs(k, f, decay), 0.0))
        bv = beta * v
        r = t_inv @ (beta * (torch.where(strict, kk, 0.0) @ bv)) + (t_inv @ (beta * k_hat)) @ s
        out = q_hat @ s + qk @ bv - _pairs(q, f, decay) @ r
        f_end = f if to_end is None else f * to_end
        return out, carried + k_end.transpose(-1, -2) @ bv - f_end.transpose(-1, -2) @ r
    if beta is None:
        u = v
    else:
        t_inv = invert_unit_lower(beta * torch.where(strict, kk, 0.0))
        u = t_inv @ (beta * v) - (t_inv @ (beta * k_hat)) @ s
    out = q_hat @ s + qk @ u
    return out, carried + k_end.transpose(-1, -2) @ u


def normalizer_chunk(z: Tensor, q: Tensor, k: Tensor, g: Tensor | None) -> tuple[Tensor, Tensor]:
    """One chunk of the normaliser: z [B, H, d_k], q, k [B, H, C, d_k] -> (q^T z per row [B, H, C], z)."""
    if g is None:
        zs = z.unsqueeze(-2) + k.cumsum(-2)
        return (q * zs).sum(-1), zs[..., -1, :]
    b, decay = _decays(g.to(z.dtype), q.shape[-2])
    within = decay @ k if g.shape[-1] == 1 else (decay * k.unsqueeze(-3)).sum(-2)  # sum_j R[i, j] k_j
    den = (q * b.exp() * z.unsqueeze(-2)).sum(-1) + (q * within).sum(-1)
    return den, z * b[..., -1, :].exp() + within[..., -1, :]


@dataclass(frozen=True)
class StaticChunkEngine(TorchEngine):
    """The reference forms, except that the chunked forms loop over chunks in Python (unrolled at
    trace time) with rank <= 5 tensors per chunk (module docstring)."""

    name: str = "static-chunks"

    def chunked(self, state: Tensor, q: Tensor, k: Tensor, v: Tensor, g: Tensor | None = None,
                beta: Tensor | None = None, chunk_size: int = 64,
                erase: Tensor | None = None) -> tuple[Tensor, Tensor]:
        q, k, v, g, beta, erase = (_heads_first(t) for t in (q, k, v, g, beta, erase))
        outs = []
        for lo in range(0, q.shape[2], chunk_size):
            part = slice(lo, lo + chunk_size)
            out, state = chunk_step(state, q[:, :, part], k[:, :, part], v[:, :, part],
                                    *(None if t is None else t[:, :, part] for t in (g, beta, erase)))
            outs.append(out)
        return torch.cat(outs, 2).transpose(1, 2), state

    def normalizer_chunked(self, z: Tensor, q: Tensor, k: Tensor, g: Tensor | None = None,
                           chunk_size: int = 64) -> tuple[Tensor, Tensor]:
        q, k, g = (_heads_first(t) for t in (q.to(z.dtype), k.to(z.dtype), g))
        dens = []
        for lo in range(0, q.shape[2], chunk_size):
            part = slice(lo, lo + chunk_size)
            den, z = normalizer_chunk(z, q[:, :, part], k[:, :, part], None if g is None else g[:, :, part])
            dens.append(den)
        return torch.cat(dens, 2).transpose(1, 2), z
