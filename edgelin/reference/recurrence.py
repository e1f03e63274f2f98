"""The recurrence every family shares, in pure torch: one step, a naive token loop, chunked.

This is the ground truth every kernel and every exported graph is tested against. It knows no
target, no kernel and no tracer: how a target lowers it (ONNX's Scan over chunks, a TensorRT
step node, a static chunk loop for Core ML) is chosen in `edgelin.export.lowering`, and GPU
kernel dispatch lives in `edgelin.kernels.dispatch`; both reach these functions through an
engine (`edgelin.reference.engine`). The chunked form takes its chunk loop as an argument
(`loop`, a plain Python loop by default) so a lowering can swap the loop without copying math.

The engines never see a family name. A family is expressed by which tensors exist:
    g      log-decay, None (no decay) or [..., 1] (scalar per head) or [..., d_k] (per key)
    beta   None (additive rule) or [...] (delta rule)
    erase  None (the delta rule erases along k) or [..., d_k]: a per-key-channel erase gate e, the
           delta rule then erases along e * k (Gated DeltaNet-2; needs beta)
Layouts: q, k [B, T, H, d_k]; v [B, T, H, d_v]; g [B, T, H, 1 | d_k]; beta [B, T, H];
erase [B, T, H, d_k]; state S [B, H, d_k, d_v]; normaliser z [B, H, d_k]. Everything is fp32
reference math.

The erase-gated delta rule (one token, after the decay S' = e^g S):
    S_t = S' - beta_t (e_t * k_t) (k_t^T S') + beta_t k_t v_t^T
The transition I - beta (e * k) k^T is an asymmetric rank-one update (a diagonal-plus-low-rank
transition, fla's generalized_delta_rule); e = 1 is the plain delta rule. A write gate over value
channels needs no engine support: the mixer folds it into v (it writes k (w * v)^T).

The normaliser (linear transformer, Performer) is its own state: z_t = decay_t z_{t-1} + k_t and
the readout divides by q_t^T z_t. It is updated by its own small functions (`normalizer_*`), never
as an extra value column concatenated onto S, so a step updates S and z in place, with no
Concat/Slice of the state.
"""

from __future__ import annotations

import math
from typing import Callable

import torch

Tensor = torch.Tensor
# body(carry, xs_i) -> (carry, out_i); loop(body, init, xs) -> (final carry, outs stacked on dim 0)
ChunkBody = Callable[[Tensor, tuple[Tensor, ...]], tuple[Tensor, Tensor]]
ChunkLoop = Callable[[ChunkBody, Tensor, tuple[Tensor, ...]], tuple[Tensor, Tensor]]


def python_loop(body: ChunkBody, init: Tensor, xs: tuple[Tensor, ...]) -> tuple[Tensor, Tensor]:
    """The chunk loop as a plain Python loop over the leading axis of xs."""
    outs = []
    for i in range(xs[0].shape[0]):
        init, out = body(init, tuple(x[i] for x in xs))
        outs.append(out)
    return init, torch.stack(outs)


def recurrent_step(
    state: Tensor, q: Tensor, k: Tensor, v: Tensor, g: Tensor | None = None, beta: Tensor | None = None,
    erase: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """One token: q, k [B, H, d_k], v [B, H, d_v], g [B, H, 1|d_k], beta [B, H], erase [B, H, d_k]
    -> (o, state)."""
    if g is not None:
        state = state * g.exp().unsqueeze(-1)
    if erase is not None:  # S' - beta (e * k)(k^T S') + beta k v^T: erase and write directions differ
        if beta is None:
            raise ValueError("an erase gate needs the delta rule (beta)")
        read = (k.unsqueeze(-2) @ state).squeeze(-2)  # k^T S' [B, H, d_v]
        b = beta.unsqueeze(-1)
        state = state - (b * erase * k).unsqueeze(-1) * read.unsqueeze(-2) + k.unsqueeze(-1) * (b * v).unsqueeze(-2)
        return (q.unsqueeze(-2) @ state).squeeze(-2), state
    if beta is not None:  # (k^T S) as a batched matmul: runtimes run MatMul far faster than Einsum
        v = beta.unsqueeze(-1) * (v - (k.unsqueeze(-2) @ state).squeeze(-2))
    state = state + k.unsqueeze(-1) * v.unsqueeze(-2)
    return (q.unsqueeze(-2) @ state).squeeze(-2), state


def recurrent(
    state: Tensor, q: Tensor, k: Tensor, v: Tensor, g: Tensor | None = None, beta: Tensor | None = None,
    erase: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """The naive token loop: the ground truth the chunked form and every kernel are tested against."""
    outputs = []
    for t in range(q.shape[1]):
        o, state = recurrent_step(
            state, q[:, t], k[:, t], v[:, t], *(None if x is None else x[:, t] for x in (g, beta, erase)),
        )
        outputs.append(o)
    return torch.stack(outputs, dim=1), state


# ---- the normaliser: z_t = decay_t z_{t-1} + k_t, readout denominator q_t^T z_t ---------------
def normalizer_step(z: Tensor, q: Tensor, k: Tensor, g: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """One token: z [B, H, d_k], q, k [B, H, d_k], g [B, H, 1|d_k] -> (q^T z' [B, H], z').
    Elementwise in z's dtype (float32), whatever q and k are."""
    q, k = q.to(z.dtype), k.to(z.dtype)
    if g is not None:
        z = z * g.to(z.dtype).exp()
    z = z + k
    return (q * z).sum(-1), z


def normalizer_recurrent(z: Tensor, q: Tensor, k: Tensor, g: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """The token loop of the normaliser: q, k [B, T, H, d_k] -> (denominators [B, T, H], final z)."""
    dens = []
    for t in range(q.shape[1]):
        den, z = normalizer_step(z, q[:, t], k[:, t], None if g is None else g[:, t])
        dens.append(den)
    return torch.stack(dens, dim=1), z


def normalizer_chunked(
    z: Tensor, q: Tensor, k: Tensor, g: Tensor | None = None, chunk_size: int = 64, loop: ChunkLoop = python_loop
) -> tuple[Tensor, Tensor]:
    """The normaliser over a whole sequence, without touching S: a cumulative sum when nothing
    decays; otherwise per chunk Z_i = sum_{j<=i} R[i, j] k_j (R as in `chunked`) and a loop over
    chunks carrying only z [B, H, d_k]. Returns (denominators [B, T, H], final z)."""
    q, k = q.to(z.dtype), k.to(z.dtype)
    if g is None:
        zs = z.unsqueeze(1) + k.cumsum(1)  # [B, T, H, d_k]: z after each token
        return (q * zs).sum(-1), zs[:, -1]
    batch, length, heads, _ = q.shape
    num_chunks = (length + chunk_size - 1) // chunk_size
    q, k = (_chunk(x, chunk_size, num_chunks) for x in (q, k))
    b, decay = _decays(_chunk(g.to(z.dtype), chunk_size, num_chunks), chunk_size)
    if g.shape[-1] == 1:
        within = decay @ k  # [N, B, H, C, d_k]: sum_j R[i, j] k_j
    else:
        within = torch.einsum("...ijd,...jd->...id", decay, k)
    q_hat = q * b.exp()  # the part of z entering the chunk seen at row i: e^{b_i} z0

    def body(carry: Tensor, xs: tuple[Tensor, ...]) -> tuple[Tensor, Tensor]:
        qh, intra, added, kept = xs
        den = (qh * carry.unsqueeze(-2)).sum(-1) + intra
        return carry * kept + added, den

    # within[..., -1, :] = sum_j e^{b_C - b_j} k_j (padding rows have k = 0 and g = 0)
    xs = ((q_hat, (q * within).sum(-1), within[..., -1, :], b[..., -1, :].exp()))
    z, den = loop(body, z, tuple(x.contiguous() for x in xs))
    return den.permute(1, 0, 3, 2).reshape(batch, num_chunks * chunk_size, heads)[:, :length], z


def invert_unit_lower(a: Tensor, block: int = 8) -> Tensor:
    """(I + A)^-1 for strictly lower-triangular A [..., C, C], exportable everywhere (ONNX has no
    triangular solve).

    Blocks of at most `block` rows use N = -A nilpotent: (I - N)^-1 = prod_i (I + N^(2^i)), a few
    matrix products. Larger matrices recurse on halves, [[T11, 0], [-T22 A21 T11, T22]]: powers of
    N grow like binomial coefficients with cancelling signs, so applying the product form to a whole
    32- or 64-row chunk loses digits (1e-4..3e-2 relative on trained Gated DeltaNet layers), while
    blocks of 8 stay at fp32 rounding, like forward substitution.
    """
    size = a.shape[-1]
    if size > block:
        half = size // 2
        t11 = invert_unit_lower(a[..., :half, :half], block)
        t22 = invert_unit_lower(a[..., half:, half:], block)
        t21 = -(t22 @ (a[..., half:, :half] @ t11))
        top = torch.cat([t11, torch.zeros_like(a[..., :half, half:])], dim=-1)
        return torch.cat([top, torch.cat([t21, t22], dim=-1)], dim=-2)
    eye = torch.eye(size, dtype=a.dtype, device=a.device)
    power = -a
    result = eye + power
    for _ in range(max(math.ceil(math.log2(size)) - 1, 0)):
        power = power @ power
        result = result + result @ power
    return result


def _chunk(x: Tensor, chunk: int, num_chunks) -> Tensor:
    """[B, T, H, D] -> [N, B, H, C, D], zero-padded. Zero k, g and beta make padding a no-op.

    Built with a gather instead of pad + reshape: the exporter keeps T symbolic this way.
    """
    b, _, h, d = x.shape
    padded = torch.cat([x, x.new_zeros(b, chunk, h, d)], dim=1)
    index = torch.arange(num_chunks, device=x.device).unsqueeze(1) * chunk + torch.arange(chunk, device=x.device)
    return padded[:, index].permute(1, 0, 3, 2, 4)


def _decays(g: Tensor, chunk_size: int) -> tuple[Tensor, Tensor]:
    """Chunked log-decays g [N, B, H, C, 1|d_k] -> (b: inclusive cumulative sums, same shape;
    R[i, j] = exp(b_i - b_j) for j <= i, else 0: [.., C, C] for a scalar decay, [.., C, C, d_k]
    per key, where the channel axis stays inside the exponent for stability)."""
    causal = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=g.device).tril()
    b = g.cumsum(-2)
    if g.shape[-1] == 1:
        return b, torch.where(causal, b - b.transpose(-1, -2), float("-inf")).exp()
    diff = b.unsqueeze(-2) - b.unsqueeze(-3)  # [.., C, C, d_k]
    return b, torch.where(causal.unsqueeze(-1), diff, float("-inf")).exp()


def _pairs(a: Tensor, b: Tensor, decay: Tensor) -> Tensor:
    """[.., C, C]: a_i^T R[i, j] b_j (R from `_decays`, or the causal mask when nothing decays)."""
    if decay.dim() > a.dim():  # per key: the channel axis stays inside R
        return torch.einsum("...id,...jd,...ijd->...ij", a, b, decay)
    return (a @ b.transpose(-1, -2)) * decay


def chunked(
    state: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor | None = None,
    beta: Tensor | None = None,
    chunk_size: int = 64,
    loop: ChunkLoop = python_loop,
    erase: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """The chunked parallel form: intra-chunk work is batched matmuls over all chunks at once; the
    inter-chunk recurrence is `loop` over chunks carrying S (a Python loop here; the ONNX lowering
    passes torch's scan, which exports as one ONNX Scan with a dynamic count).

    Per chunk with cumulative log-decay b_i (inclusive) and S0 the state entering the chunk:
        R[i, j]  = exp(b_i - b_j) for j <= i (stable: the exponent is <= 0)
        P[i, j]  = q_i^T R[i, j] k_j                          (j <= i)
        delta:   A[i, j] = beta_i k_i^T R[i, j] k_j (j < i),  T = (I + A)^-1
                 U = T diag(beta) V - T diag(beta) (K * e^b) S0 ;   additive: U = V
        O  = (Q * e^b) S0 + P U
        S1 = e^{b_C} S0 + (K * e^{b_C - b})^T U

    With an erase gate the erase direction f_j = e_j * k_j differs from the write direction k_j, so
    the WY/UT form keeps two sets of rows. Let r_j = beta_j k_j^T S'_j (S'_j: the decayed state
    just before token j's update: what token j reads, then erases along f_j). Unrolling the chunk,
        S_i = e^{b_i} S0 + sum_{j<=i} R[i, j] (k_j beta_j v_j^T - f_j r_j^T)
    and reading it with k_j gives a unit lower-triangular system for the rows r:
        (I + diag(beta) A_kf) r = diag(beta) ((K * e^b) S0 + A_kk diag(beta) V)
        A_kf[i, j] = k_i^T R[i, j] f_j,  A_kk[i, j] = k_i^T R[i, j] k_j   (j < i)
    so with T = (I + diag(beta) A_kf)^-1: r = r_V + M S0, r_V = T diag(beta) A_kk diag(beta) V and
    M = T diag(beta) (K * e^b), both free of S0 (batched over all chunks). The loop then runs
        r  = r_V + M S0
        O  = (Q * e^b) S0 + P diag(beta) V - P_qf r,     P_qf[i, j] = q_i^T R[i, j] f_j (j <= i)
        S1 = e^{b_C} S0 + (K * e^{b_C - b})^T diag(beta) V - (F * e^{b_C - b})^T r
    With f = k, U = diag(beta) V - r recovers the delta rule's form above.
    """
    blocks = chunk_inputs(q, k, v, g, beta, erase, chunk_size)
    state, out = chunked_blocks(state, *blocks, loop=loop)
    return unchunk(out, q.shape[1]), state


def chunk_inputs(q: Tensor, k: Tensor, v: Tensor, g: Tensor | None, beta: Tensor | None, erase: Tensor | None,
                 chunk_size: int) -> tuple[Tensor | None, ...]:
    """`chunked`'s inputs as zero-padded chunks [N, B, H, C, D] (beta [N, B, H, C, 1]); None stays None."""
    num_chunks = (q.shape[1] + chunk_size - 1) // chunk_size
    beta = None if beta is None else beta.unsqueeze(-1)
    return tuple(None if x is None else _chunk(x, chunk_size, num_chunks) for x in (q, k, v, g, beta, erase))


def unchunk(out: Tensor, length: int) -> Tensor:
    """Chunked outputs [N, B, H, C, d_v] -> [B, length, H, d_v]."""
    num_chunks, batch, heads, chunk_size, d_v = out.shape
    return out.permute(1, 0, 3, 2, 4).reshape(batch, num_chunks * chunk_size, heads, d_v)[:, :length]


def chunked_blocks(state: Tensor, q: Tensor, k: Tensor, v: Tensor, g: Tensor | None, beta_c: Tensor | None,
                   erase: Tensor | None, loop: ChunkLoop = python_loop) -> tuple[Tensor, Tensor]:
    """`chunked` on inputs already in chunks (`chunk_inputs`): -> (final state, outputs [N, B, H, C, d_v]).
    A lowering may call it on one chunk at a time (N = 1) inside its own loop."""
    chunk_size = q.shape[-2]
    causal = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=q.device).tril()
    strict = causal.tril(-1)

    if g is None:
        decay = causal.to(q.dtype)
        q_hat, k_hat, to_end, decay_end = q, k, None, None
    else:
        b, decay = _decays(g, chunk_size)  # b [N, B, H, C, 1|d_k]
        b_end = b[..., -1:, :]
        q_hat, k_hat = q * b.exp(), k * b.exp()
        to_end = (b_end - b).exp()
        decay_end = b_end.squeeze(-2).exp().unsqueeze(-1)  # [N, B, H, 1|d_k, 1]
    qk, kk = _pairs(q, k, decay), _pairs(k, k, decay)
    k_end = k if to_end is None else k * to_end

    if erase is not None:
        if beta_c is None:
            raise ValueError("an erase gate needs the delta rule (beta)")
        f = erase * k  # the erase directions
        t_inv = invert_unit_lower(beta_c * torch.where(strict, _pairs(k, f, decay), 0.0))
        bv = beta_c * v
        r_v = t_inv @ (beta_c * (torch.where(strict, kk, 0.0) @ bv))
        m = t_inv @ (beta_c * k_hat)

        def body(s: Tensor, xs: tuple[Tensor, ...]) -> tuple[Tensor, Tensor]:
            qh, p, bvv, ke, rv, mm, pf, fe = xs[:8]
            r = rv + mm @ s
            out = qh @ s + p @ bvv - pf @ r
            carried = s if decay_end is None else s * xs[-1]
            return carried + ke.transpose(-1, -2) @ bvv - fe.transpose(-1, -2) @ r, out

        xs = (q_hat, qk, bv, k_end, r_v, m, _pairs(q, f, decay), f if to_end is None else f * to_end)
    else:
        if beta_c is None:
            w_v, w_k = v, None
        else:
            t_inv = invert_unit_lower(beta_c * torch.where(strict, kk, 0.0))
            w_v, w_k = t_inv @ (beta_c * v), t_inv @ (beta_c * k_hat)

        def body(s: Tensor, xs: tuple[Tensor, ...]) -> tuple[Tensor, Tensor]:
            qh, p, wv, ke = xs[:4]
            u = wv if w_k is None else wv - xs[4] @ s
            out = qh @ s + p @ u
            carried = s if decay_end is None else s * xs[-1]
            return carried + ke.transpose(-1, -2) @ u, out

        xs = (q_hat, qk, w_v, k_end) + (() if w_k is None else (w_k,))
    xs = xs + (() if decay_end is None else (decay_end,))
    return loop(body, state, tuple(x.contiguous() for x in xs))
