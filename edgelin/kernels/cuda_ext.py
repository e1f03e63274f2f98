"""The CUDA C++ step kernel from Python: an nvcc build check (any machine with nvcc) and a small
torch extension (torch.utils.cpp_extension.load) that calls the same C launcher the TensorRT
plugin calls, `edgelin_step_launch` in edgelin/kernels/cuda/step.cu."""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
from pathlib import Path

import torch

from edgelin.kernels.abi import CUDA_DIR, header_abi_version
from edgelin.kernels._common import (
    KernelError, Tensor, check_aux, check_erase, check_out, check_qkv, check_state, last_dim_contiguous,
    state_destination,
)

SOURCES = ("step.cu",)
HEADERS = ("edgelin_step.h", "step.cuh")
# Ampere desktop (sm_86), Jetson Orin (sm_87), Ada (sm_89), Hopper H100/H200 (sm_90)
ARCHS = ("86", "87", "89", "90")


def gencode_flags(archs: tuple[str, ...] | list[str], one_ptx: bool = False) -> list[str]:
    """nvcc's -gencode flags: each arch from its own PTX, or (`one_ptx`) the lowest arch's PTX assembled
    into every arch's SASS (one front-end pass instead of one per arch)."""
    if one_ptx:
        return [f"-gencode=arch=compute_{min(archs, key=int)},code=[{','.join(f'sm_{a}' for a in archs)}]"]
    return [f"-gencode=arch=compute_{a},code=sm_{a}" for a in archs]


def nvcc_build(out_dir: Path, archs: tuple[str, ...] = ARCHS, nvcc: str | None = None, threads: int = 2,
               one_ptx: bool = False) -> Path:
    """Compile step.cu to an object file for `archs` (no torch involved). Returns its path;
    raises KernelError with nvcc's output when the compile fails or nvcc is missing. `one_ptx`: the
    lowest arch's PTX, assembled into every arch's SASS (one front-end pass instead of one per arch:
    42 instead of 81 CPU-seconds for the four ARCHS; step.cu has no arch-specific code)."""
    nvcc = nvcc or shutil.which("nvcc")
    if nvcc is None:
        raise KernelError("nvcc not found", "the CUDA step kernel is compiled with nvcc", "install the CUDA toolkit")
    out_dir.mkdir(parents=True, exist_ok=True)
    obj = out_dir / "edgelin_step.o"
    cmd = [nvcc, "-c", str(CUDA_DIR / "step.cu"), "-o", str(obj), "-O3", "-std=c++17", f"--threads={threads}",
           "-Werror=all-warnings", *gencode_flags(archs, one_ptx)]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise KernelError("nvcc failed on step.cu", (done.stdout + done.stderr)[-2000:], "fix the CUDA source")
    return obj


@functools.lru_cache(maxsize=1)
def load_extension(verbose: bool = False):
    """Build (once per machine; torch caches it) and import the torch binding of the launcher,
    for the current GPU's architecture (EDGELIN_CUDA_ARCHS="86;90" to choose others)."""
    if not torch.cuda.is_available():
        raise KernelError("the CUDA step extension needs a CUDA device", "torch.cuda.is_available() is False",
                          "run on a GPU machine, or use the Triton kernels / torch engines")
    from torch.utils import cpp_extension

    archs = os.environ.get("EDGELIN_CUDA_ARCHS")
    if archs:
        archs_list = archs.replace(",", ";").split(";")
    else:
        major, minor = torch.cuda.get_device_capability()
        archs_list = [f"{major}{minor}"]
    # torch adds its own -gencode flags from TORCH_CUDA_ARCH_LIST; make them the same archs
    os.environ.setdefault("TORCH_CUDA_ARCH_LIST", ";".join(f"{a[:-1]}.{a[-1]}" for a in archs_list))
    ext = cpp_extension.load(
        name="edgelin_cuda_step",
        sources=[str(CUDA_DIR / "torch_ext.cpp"), *(str(CUDA_DIR / s) for s in SOURCES)],
        extra_include_paths=[str(CUDA_DIR)],
        extra_cflags=["-O3"],
        extra_cuda_cflags=["-O3", "-std=c++17", *gencode_flags(archs_list)],
        verbose=verbose,
    )
    # torch caches builds by source hash; a stale one from an older header must not drive the launcher
    want = header_abi_version()
    if ext.abi_version != want or ext.launcher_abi_version() != want:
        raise KernelError("the CUDA step extension has launcher ABI "
                          f"{ext.launcher_abi_version()} (binding {ext.abi_version}), not {want}",
                          "it was built from another edgelin_step.h",
                          "delete TORCH_EXTENSIONS_DIR's edgelin_cuda_step folder and rebuild")
    return ext


def aux_dtype(dtype: torch.dtype, g: Tensor | None, beta: Tensor | None,
              erase: Tensor | None = None) -> torch.dtype:
    """The launcher's dtype for g, beta and erase: float32 (ABI 2's default, so a half-precision step
    still decays in float32), or q's dtype when every one given is already in it (no cast, no copy)."""
    given = [x.dtype for x in (g, beta, erase) if x is not None]
    return dtype if given and all(d == dtype for d in given) else torch.float32


def cuda_step(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    state: Tensor,
    g: Tensor | None = None,
    beta: Tensor | None = None,
    erase: Tensor | None = None,
    *,
    out: Tensor | None = None,
    state_out: Tensor | None = None,
    inplace: bool = False,
) -> tuple[Tensor, Tensor]:
    """The CUDA kernel's decode step, same contract as `edgelin.kernels.fused_step`:
    q, k [B, H, d_k], v [B, H, d_v], g [B, H, 1|d_k], beta [B, H], erase [B, H, d_k] (the erase
    gate, delta rule only), state [B, H, d_k, d_v] fp32."""
    what = "cuda_step"
    if q.dim() != 3:
        raise KernelError(f"{what}: q has {q.dim()} dims", "expected [B, H, d_k]", "drop the time axis")
    batch, heads, _ = q.shape
    d_k, d_v = check_qkv(q, k, v, (batch, heads), what)
    check_aux(g, beta, (batch, heads), d_k, what)
    check_erase(erase, beta, (batch, heads), d_k, what)
    if not q.is_cuda:
        raise KernelError(f"{what}: tensors on {q.device}", "the CUDA kernel runs on a CUDA device", "move them")
    dtype = q.dtype  # one dtype for q, k, v and o
    aux = aux_dtype(dtype, g, beta, erase)  # g, beta, erase: their own (float32 unless all are in q's dtype)
    g = None if g is None else last_dim_contiguous(g.to(aux))
    beta = None if beta is None else beta.to(aux)
    erase = None if erase is None else last_dim_contiguous(erase.to(aux))
    q, k, v = (last_dim_contiguous(x) for x in (q, k, v))
    shape = (batch, heads, d_k, d_v)
    check_state(state, shape, what)
    state_out = state_destination(state, state_out, inplace, what)
    if state_out is None:
        state_out = torch.empty(shape, dtype=torch.float32, device=q.device)
    check_state(state_out, shape, what, "state_out")
    if out is None:
        out = torch.empty(batch, heads, d_v, dtype=dtype, device=q.device)
    check_out(out, (batch, heads, d_v), dtype, what)
    load_extension().step(q, k, v, g, beta, state, state_out, out, erase)
    return out, state_out
