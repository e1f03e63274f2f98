"""GPU kernels for the recurrences every family shares (see edgelin.reference.recurrence):

- `fused_step` / `fused_recurrent` (Triton): one decode step, or a token loop, state in registers.
- `chunk_prefill` (Triton): chunked prefill, outputs + final state, fixed-length or varlen.
- `cuda_step` (CUDA C++ via a torch extension): the step the TensorRT plugin will call, through
  the plain C launcher `edgelin_step_launch` (edgelin/kernels/cuda/edgelin_step.h).
- `use_backend` / `set_backend` / `get_backend` (`edgelin.kernels.dispatch`): which engine the
  model runs its recurrences through (EDGELIN_KERNELS=auto|torch|triton|cuda).

Kernels take the engines' flags only (gate kind from g's shape, delta rule from beta), never a
family name. Whole-model decoders live with the torch target (edgelin.export.torch). Imports are lazy so that `import edgelin` never pulls in Triton.
"""

from __future__ import annotations

import importlib
import importlib.util

_EXPORTS = {
    "fused_step": "edgelin.kernels.step",
    "fused_recurrent": "edgelin.kernels.step",
    "chunk_prefill": "edgelin.kernels.chunk",
    "cuda_step": "edgelin.kernels.cuda_ext",
    "load_extension": "edgelin.kernels.cuda_ext",
    "KernelError": "edgelin.kernels._common",
    "use_backend": "edgelin.kernels.dispatch",
    "set_backend": "edgelin.kernels.dispatch",
    "get_backend": "edgelin.kernels.dispatch",
}
__all__ = [*_EXPORTS, "triton_available"]


def triton_available() -> bool:
    """Triton is importable (kernels can run on CUDA, or on CPU under TRITON_INTERPRET=1)."""
    return importlib.util.find_spec("triton") is not None


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'edgelin.kernels' has no attribute {name!r}")
