"""The recurrence every family shares, in three forms: one step, a naive token loop, chunked.

The engines never see a family name. A family is expressed by which tensors exist:
    g     log-decay, None (no decay) or [..., 1] (scalar per head) or [..., d_k] (per key)
    beta  None (additive rule) or [...] (delta rule)
Layouts: q, k [B, T, H, d_k]; v [B, T, H, d_v]; g [B, T, H, 1 | d_k]; beta [B, T, H];
state S [B, H, d_k, d_v]. Everything is fp32 reference math.

Backends: on CUDA the same calls run edgelin's own kernels (edgelin.kernels). `use_backend(name)`
/ `set_backend(name)` or the environment variable EDGELIN_KERNELS choose: "auto" (kernels for
CUDA tensors when Triton is importable, torch otherwise), "torch", "triton", "cuda" (the CUDA C++
step kernel for decode, Triton for prefill). Tracing, export, torch.compile and autograd always
take the torch engines; CPU tensors never reach a kernel (except a forced "triton" under
TRITON_INTERPRET=1, which the CPU tests use).
"""

from __future__ import annotations

import contextlib
import contextvars
import math
import os

import torch

from edgelin.errors import EdgelinError

Tensor = torch.Tensor
BACKENDS = ("auto", "torch", "triton", "cuda")
_backend: contextvars.ContextVar[str | None] = contextvars.ContextVar("edgelin_kernels", default=None)


def get_backend() -> str:
    name = _backend.get() or os.environ.get("EDGELIN_KERNELS", "auto") or "auto"
    if name not in BACKENDS:
        raise EdgelinError(f"unknown recurrence backend {name!r}", f"choose one of {', '.join(BACKENDS)}",
                           "fix EDGELIN_KERNELS or the set_backend() argument")
    return name


def set_backend(name: str | None) -> None:
    """Set this context's backend (None: back to EDGELIN_KERNELS / "auto")."""
    if name is not None and name not in BACKENDS:
        raise EdgelinError(f"unknown recurrence backend {name!r}", f"choose one of {', '.join(BACKENDS)}",
                           "pass a known backend")
    _backend.set(name)


@contextlib.contextmanager
def use_backend(name: str):
    token = _backend.set(name)
    try:
        get_backend()
        yield
    finally:
        _backend.reset(token)


def kernel_path(*tensors: Tensor | None) -> str | None:
    """'triton', 'cuda' or None (torch engines) for these inputs under the current backend."""
    name = get_backend()
    if name == "torch" or torch.compiler.is_compiling() or torch.jit.is_tracing() or torch.onnx.is_in_onnx_export():
        return None
    present = [t for t in tensors if t is not None]
    if torch.is_grad_enabled() and any(t.requires_grad for t in present):
        if name == "auto":
            return None
        raise EdgelinError(f"backend {name!r} asked for with autograd on", "the kernels are forward-only",
                           "run under torch.no_grad() / inference_mode(), or use the torch backend")
    if name == "auto" and not present[0].is_cuda:  # CPU: never import the kernels (Triton is heavy)
        return None
    from edgelin import kernels

    if name == "auto":
        fits = present[0].shape[-1] <= 256 and present[2].shape[-1] <= 256  # q, k, v, ...
        return "triton" if present[0].is_cuda and fits and kernels.triton_available() else None
    if not present[0].is_cuda and not (name == "triton" and os.environ.get("TRITON_INTERPRET") == "1"):
        raise EdgelinError(f"backend {name!r} with tensors on {present[0].device}", "kernels run on CUDA devices",
                           "move the model to CUDA or use the torch backend")
    return name


def recurrent_step(
    state: Tensor, q: Tensor, k: Tensor, v: Tensor, g: Tensor | None = None, beta: Tensor | None = None
) -> tuple[Tensor, Tensor]:
    """One token: q, k [B, H, d_k], v [B, H, d_v], g [B, H, 1|d_k], beta [B, H] -> (o, state)."""
    path = kernel_path(q, k, v, state, g, beta)
    if path is not None:
        from edgelin import kernels

        step = kernels.cuda_step if path == "cuda" else kernels.fused_step
        return step(q, k, v, state, g, beta)
    if g is not None:
        state = state * g.exp().unsqueeze(-1)
    if beta is not None:  # (k^T S) as a batched matmul: runtimes run MatMul far faster than Einsum
        v = beta.unsqueeze(-1) * (v - (k.unsqueeze(-2) @ state).squeeze(-2))
    state = state + k.unsqueeze(-1) * v.unsqueeze(-2)
    return (q.unsqueeze(-2) @ state).squeeze(-2), state


def recurrent(
    state: Tensor, q: Tensor, k: Tensor, v: Tensor, g: Tensor | None = None, beta: Tensor | None = None
) -> tuple[Tensor, Tensor]:
    """The naive token loop: the ground truth the chunked form and every kernel are tested against."""
    path = kernel_path(q, k, v, state, g, beta)
    if path == "triton" or (path == "cuda" and q.shape[1] != 1):  # the CUDA kernel is a step kernel
        from edgelin import kernels

        return kernels.fused_recurrent(q, k, v, state, g, beta)
    outputs = []
    for t in range(q.shape[1]):
        o, state = recurrent_step(
            state, q[:, t], k[:, t], v[:, t],
            None if g is None else g[:, t], None if beta is None else beta[:, t],
        )
        outputs.append(o)
    return torch.stack(outputs, dim=1), state


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


def chunked(
    state: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor | None = None,
    beta: Tensor | None = None,
    chunk_size: int = 64,
) -> tuple[Tensor, Tensor]:
    """The chunked parallel form: intra-chunk work is batched matmuls over all chunks at once; the
    inter-chunk recurrence is a scan over chunks carrying S (one ONNX Scan with a dynamic count).

    Per chunk with cumulative log-decay b_i (inclusive) and S0 the state entering the chunk:
        R[i, j]  = exp(b_i - b_j) for j <= i (stable: the exponent is <= 0)
        P[i, j]  = q_i^T R[i, j] k_j                          (j <= i)
        delta:   A[i, j] = beta_i k_i^T R[i, j] k_j (j < i),  T = (I + A)^-1
                 U = T diag(beta) V - T diag(beta) (K * e^b) S0 ;   additive: U = V
        O  = (Q * e^b) S0 + P U
        S1 = e^{b_C} S0 + (K * e^{b_C - b})^T U
    """
    if kernel_path(q, k, v, state, g, beta) is not None:
        from edgelin import kernels

        return kernels.chunk_prefill(q, k, v, g, beta, state)
    batch, length, heads, d_k = q.shape
    num_chunks = (length + chunk_size - 1) // chunk_size
    q, k, v = (_chunk(x, chunk_size, num_chunks) for x in (q, k, v))
    causal = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=q.device).tril()
    strict = causal.tril(-1)

    if g is None:
        decay = causal.to(q.dtype)
        qk, kk = (q @ k.transpose(-1, -2)) * decay, (k @ k.transpose(-1, -2)) * decay
        q_hat, k_hat, k_end, decay_end = q, k, k, None
    else:
        b = _chunk(g, chunk_size, num_chunks).cumsum(-2)  # [N, B, H, C, 1|d_k]
        b_end = b[..., -1:, :]
        if g.shape[-1] == 1:
            diff = b - b.transpose(-1, -2)  # [.., C, C]
            decay = torch.where(causal, diff, float("-inf")).exp()
            qk, kk = (q @ k.transpose(-1, -2)) * decay, (k @ k.transpose(-1, -2)) * decay
        else:  # per key channel: keep the channel axis inside the exponent for stability
            diff = b.unsqueeze(-2) - b.unsqueeze(-3)  # [.., C, C, d_k]
            decay = torch.where(causal.unsqueeze(-1), diff, float("-inf")).exp()
            qk = torch.einsum("...id,...jd,...ijd->...ij", q, k, decay)
            kk = torch.einsum("...id,...jd,...ijd->...ij", k, k, decay)
        q_hat, k_hat = q * b.exp(), k * b.exp()
        k_end = k * (b_end - b).exp()
        decay_end = b_end.squeeze(-2).exp().unsqueeze(-1)  # [N, B, H, 1|d_k, 1]

    if beta is None:
        w_v, w_k = v, None
    else:
        beta_c = _chunk(beta.unsqueeze(-1), chunk_size, num_chunks)  # [N, B, H, C, 1]
        t_inv = invert_unit_lower(beta_c * torch.where(strict, kk, 0.0))
        w_v, w_k = t_inv @ (beta_c * v), t_inv @ (beta_c * k_hat)

    def body(s: Tensor, xs: tuple[Tensor, ...]) -> tuple[Tensor, Tensor]:
        qh, p, wv, ke = xs[:4]
        u = wv if w_k is None else wv - xs[4] @ s
        out = qh @ s + p @ u
        carried = s if decay_end is None else s * xs[-1]
        return carried + ke.transpose(-1, -2) @ u, out

    xs = (q_hat, qk, w_v, k_end) + (() if w_k is None else (w_k,)) + (() if decay_end is None else (decay_end,))
    state, out = _scan(body, state, tuple(x.contiguous() for x in xs))
    out = out.permute(1, 0, 3, 2, 4).reshape(batch, num_chunks * chunk_size, heads, v.shape[-1])
    return out[:, :length], state


def _scan(body, init: Tensor, xs: tuple[Tensor, ...]) -> tuple[Tensor, Tensor]:
    """A Python loop in eager mode; torch's scan operator while exporting (-> ONNX Scan)."""
    if torch.compiler.is_compiling():
        from torch._higher_order_ops.scan import scan

        return scan(body, init, xs)
    outs = []
    for i in range(xs[0].shape[0]):
        init, out = body(init, tuple(x[i] for x in xs))
        outs.append(out)
    return init, torch.stack(outs)
