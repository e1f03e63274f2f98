"""Shared checks for the kernel wrappers: gate kind from the tensors, shapes, dtypes, strides.

The kernels see what the reference engines see: "is there g (which shape), is there beta, is there an
erase gate (ERASE: Gated DeltaNet-2's delta rule erases along e * k)". A gate
is GATE_NONE (g is None), GATE_SCALAR (g [..., 1], one log-decay per head and token) or
GATE_PER_KEY (g [..., d_k]); DELTA is `beta is not None`. No family name reaches a kernel.
"""

from __future__ import annotations

import os

import torch

from edgelin.errors import EdgelinError

Tensor = torch.Tensor

GATE_NONE, GATE_SCALAR, GATE_PER_KEY = 0, 1, 2
GATE_NAMES = {GATE_NONE: "none", GATE_SCALAR: "scalar", GATE_PER_KEY: "per_key"}
MAX_HEAD_DIM = 256  # the state tile keeps all of d_k in one program; d_v is tiled
IO_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


class KernelError(EdgelinError):
    """A kernel wrapper refused its arguments (shapes, dtypes, devices)."""

    def __init__(self, what: str, why: str, fix: str):
        super().__init__(f"edgelin kernel: {what}", why, fix)


def interpreting() -> bool:
    """True when Triton runs kernels through its CPU interpreter (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def next_pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def gate_kind(g: Tensor | None, d_k: int) -> int:
    if g is None:
        return GATE_NONE
    if g.shape[-1] == 1:
        return GATE_SCALAR
    if g.shape[-1] == d_k:
        return GATE_PER_KEY
    raise KernelError(
        f"log-decay g has last dim {g.shape[-1]}", f"it must be 1 (scalar per head) or d_k={d_k} (per key)",
        "pass g as [..., 1] or [..., d_k]",
    )


def last_dim_contiguous(x: Tensor | None) -> Tensor | None:
    """Kernels take any strides except along the last dim (it is read as a contiguous vector)."""
    if x is None or x.shape[-1] == 1 or x.stride(-1) == 1:
        return x
    return x.contiguous()


def check_device(tensors: dict[str, Tensor | None]) -> torch.device:
    present = {n: t for n, t in tensors.items() if t is not None}
    devices = {t.device for t in present.values()}
    if len(devices) != 1:
        raise KernelError("tensors on several devices", ", ".join(f"{n}: {t.device}" for n, t in present.items()),
                          "move every input to one device")
    device = devices.pop()
    if device.type != "cuda" and not interpreting():
        raise KernelError(f"tensors are on {device}", "the Triton kernels need a CUDA device "
                          "(or TRITON_INTERPRET=1 for the slow CPU interpreter)", "move the tensors to CUDA")
    return device


def check_qkv(q: Tensor, k: Tensor, v: Tensor, lead: tuple[int, ...], what: str) -> tuple[int, int]:
    """q, k [*lead, d_k]; v [*lead, d_v]; one float dtype. Returns (d_k, d_v)."""
    if q.shape != k.shape or q.shape[:-1] != tuple(lead) or v.shape[:-1] != tuple(lead):
        raise KernelError(f"{what}: shapes q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}",
                          f"expected q, k [{', '.join(map(str, lead))}, d_k] and v [{', '.join(map(str, lead))}, d_v]",
                          "reshape the inputs (heads before the head dim)")
    if not (q.dtype == k.dtype == v.dtype) or q.dtype not in IO_DTYPES:
        raise KernelError(f"{what}: dtypes q {q.dtype}, k {k.dtype}, v {v.dtype}",
                          "q, k and v must share one of float32, float16, bfloat16",
                          "cast them to one dtype (the state stays float32)")
    d_k, d_v = q.shape[-1], v.shape[-1]
    if not (1 <= d_k <= MAX_HEAD_DIM and 1 <= d_v <= MAX_HEAD_DIM):
        raise KernelError(f"{what}: head dims d_k={d_k}, d_v={d_v}", f"kernels support 1..{MAX_HEAD_DIM}",
                          "use the torch engines (EDGELIN_KERNELS=torch) for larger heads")
    return d_k, d_v


def check_aux(g: Tensor | None, beta: Tensor | None, lead: tuple[int, ...], d_k: int, what: str) -> int:
    kind = gate_kind(g, d_k)
    if g is not None and (g.shape[:-1] != tuple(lead) or not g.is_floating_point()):
        raise KernelError(f"{what}: g has shape {tuple(g.shape)}, dtype {g.dtype}",
                          f"expected a float tensor [{', '.join(map(str, lead))}, 1 | d_k]", "fix the log-decay")
    if beta is not None and (beta.shape != tuple(lead) or not beta.is_floating_point()):
        raise KernelError(f"{what}: beta has shape {tuple(beta.shape)}, dtype {beta.dtype}",
                          f"expected a float tensor [{', '.join(map(str, lead))}]", "fix the delta-rule strength")
    return kind


def check_erase(erase: Tensor | None, beta: Tensor | None, lead: tuple[int, ...], d_k: int, what: str) -> bool:
    """The erase gate e [*lead, d_k] (Gated DeltaNet-2): the delta rule then erases along e * k. It needs
    beta (there is nothing to erase without the delta rule). Returns whether it is present (ERASE)."""
    if erase is None:
        return False
    if beta is None:
        raise KernelError(f"{what}: an erase gate without beta", "the erase gate splits the delta rule's update",
                          "pass beta (the delta-rule strength) with erase")
    if tuple(erase.shape) != (*lead, d_k) or not erase.is_floating_point():
        raise KernelError(f"{what}: erase has shape {tuple(erase.shape)}, dtype {erase.dtype}",
                          f"expected a float tensor [{', '.join(map(str, (*lead, d_k)))}]", "fix the erase gate")
    return True


def check_state(state: Tensor, shape: tuple[int, ...], what: str, name: str = "state") -> None:
    if tuple(state.shape) != tuple(shape) or state.dtype != torch.float32:
        raise KernelError(f"{what}: {name} is {tuple(state.shape)} {state.dtype}",
                          f"expected float32 {list(shape)} (the state is always float32)",
                          f"allocate {name} as torch.float32 with that shape")
    if state.stride(-1) != 1:
        raise KernelError(f"{what}: {name} has a strided last dim", "the kernels write d_v contiguously",
                          f"pass {name}.contiguous()")


def state_destination(state: Tensor, state_out: Tensor | None, inplace: bool, what: str) -> Tensor | None:
    """Where a step writes its new state: `state` itself (inplace), `state_out` (ping-pong), or
    None for a fresh buffer. Asking for both destinations at once is an error, not a silent choice."""
    if not inplace:
        return state_out
    if state_out is not None and state_out.data_ptr() != state.data_ptr():
        raise KernelError(f"{what}: inplace=True with a different state_out",
                          "the two ask for different destinations", "pass one of them")
    return state


def check_out(out: Tensor | None, shape: tuple[int, ...], dtype: torch.dtype, what: str) -> None:
    if out is not None and (tuple(out.shape) != tuple(shape) or out.dtype != dtype or out.stride(-1) != 1):
        raise KernelError(f"{what}: out is {tuple(out.shape)} {out.dtype}",
                          f"expected {list(shape)} {dtype} with a contiguous last dim", "allocate out to match v")


def strides3(x: Tensor | None) -> tuple[int, int, int]:
    """(batch, time, head) strides of a [B, T, H, ...] tensor; zeros when absent."""
    if x is None:
        return 0, 0, 0
    return x.stride(0), x.stride(1), x.stride(2)
