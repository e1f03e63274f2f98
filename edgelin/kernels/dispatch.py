"""GPU kernel dispatch: which engine runs the model's recurrences for given tensors.

`use_backend(name)` / `set_backend(name)` or the environment variable EDGELIN_KERNELS choose:
"auto" (the Triton kernels for CUDA tensors when Triton is importable and the head dims fit,
the torch reference otherwise), "torch", "triton", "cuda" (the CUDA C++ step kernel for decode
steps, Triton for token loops and prefill). Tracing, export, torch.compile and autograd always
take the torch reference; CPU tensors never reach a kernel (except a forced "triton" under
TRITON_INTERPRET=1, which the CPU tests use).

This module imports no kernel: Triton and the CUDA extension load only when a kernel engine
actually runs, so the model can consult it on CPU for free.

Gated DeltaNet-2 (an erase gate on the delta rule) takes the kernels' erase flag everywhere: the
Triton step / fused recurrence, the CUDA step kernel's ERASE (launcher ABI 3) and the chunked prefill.
"""

from __future__ import annotations

import contextlib
import contextvars
import os
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from edgelin.errors import EdgelinError
from edgelin.reference.engine import TORCH, Engine, TorchEngine

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
def use_backend(name: str) -> Iterator[None]:
    token = _backend.set(name)
    try:
        get_backend()
        yield
    finally:
        _backend.reset(token)


def kernel_path(*tensors: Tensor | None) -> str | None:
    """'triton', 'cuda' or None (torch reference) for these inputs (q, k, v, ...) under the backend."""
    name = get_backend()
    # A tracer records torch ops only: a kernel call would be opaque to it (or break it).
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


@dataclass(frozen=True)
class KernelEngine(TorchEngine):
    """edgelin's kernels for S; the normaliser (elementwise or a cumulative sum) stays in torch.
    `path` is "triton" or "cuda" (the CUDA step kernel for T = 1, Triton for everything else).
    The engines are functional, so the kernels run out of place here (a new state tensor)."""

    name: str = "kernels"
    path: str = "triton"

    def step(self, state: Tensor, q: Tensor, k: Tensor, v: Tensor, g: Tensor | None = None,
             beta: Tensor | None = None, erase: Tensor | None = None) -> tuple[Tensor, Tensor]:
        from edgelin import kernels

        return (kernels.cuda_step if self.path == "cuda" else kernels.fused_step)(q, k, v, state, g, beta, erase)

    def recurrent(self, state: Tensor, q: Tensor, k: Tensor, v: Tensor, g: Tensor | None = None,
                  beta: Tensor | None = None, erase: Tensor | None = None) -> tuple[Tensor, Tensor]:
        from edgelin import kernels

        return kernels.fused_recurrent(q, k, v, state, g, beta, erase)

    def chunked(self, state: Tensor, q: Tensor, k: Tensor, v: Tensor, g: Tensor | None = None,
                beta: Tensor | None = None, chunk_size: int = 64,
                erase: Tensor | None = None) -> tuple[Tensor, Tensor]:
        from edgelin import kernels  # the kernels pick their own chunk size (a numerics detail)

        return kernels.chunk_prefill(q, k, v, g, beta, state, erase=erase)


KERNEL_ENGINES = {path: KernelEngine(name=f"kernels-{path}", path=path) for path in ("triton", "cuda")}


def engine_for(state: Tensor, q: Tensor, k: Tensor, v: Tensor, g: Tensor | None = None,
               beta: Tensor | None = None, erase: Tensor | None = None) -> Engine:
    """The engine the backend picks for these inputs: a kernel engine or the torch reference."""
    path = kernel_path(q, k, v, state, g, beta, erase)
    return TORCH if path is None else KERNEL_ENGINES[path]
