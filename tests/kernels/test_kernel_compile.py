"""The chunked-prefill kernels compile for a real GPU (sm_90: the H200 the defaults were tuned on), on
this CPU machine: Triton's front end and ptxas run without a driver. CI runs the kernels only under
Triton's interpreter, which executes the Python body and so accepts what the compiler rejects (a
constexpr assigned to a plain local name, then used as a static `if`, compiled both branches on
the GPU and failed every prefill there while all interpreter tests passed)."""

from __future__ import annotations

import inspect
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

triton = pytest.importorskip("triton")

from edgelin.kernels import chunk, chunk_ho, chunk_intra  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
FP32 = {"g", "beta", "gc", "A", "OX", "ox", "h0", "ht"}
INT = {"cu_seqlens", "chunk_indices", "chunk_offsets"}


def _ptxas() -> str | None:
    import triton.backends.nvidia as nvidia

    path = Path(nvidia.__file__).parent / "bin" / "ptxas"
    return str(path) if path.exists() else shutil.which("ptxas")


def compile_for_sm90(kernel, num_warps: int, **constexprs):
    """Compile `kernel` with the given constexprs for sm_90: bf16 inputs, fp32 decay/state scratch,
    int32 sizes and strides (what a bf16 prefill launches)."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    params = inspect.signature(kernel.fn).parameters
    names = list(params)
    constexprs = {**{n: p.default for n, p in params.items() if p.default is not p.empty}, **constexprs}
    signature = {}
    for name in names:
        if name in constexprs:
            signature[name] = "constexpr"
        elif name.startswith("s_") or name in ("T", "H", "K", "V"):
            signature[name] = "i32"
        else:
            signature[name] = "*fp32" if name in FP32 else "*i32" if name in INT else "*bf16"
    source = ASTSource(kernel, signature, constexprs={(names.index(k),): v for k, v in constexprs.items()})
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps})


PREP = dict(BT=64, BC=16, BK=64, BV=64, DELTA=True, ERASE=False, STORE_P=False, VARLEN=False, PREC="tf32",
            PREC_T="tf32")
INTRA = dict(BT=64, BC=16, DELTA=True, VARLEN=False)
CASES = {  # (kernel, num_warps, constexprs): each launch path of chunk_prefill's defaults, plus varlen
    "prep-kda-phase1": (chunk._chunk_prep_kernel, 1, {**PREP, "GATE": 2, "PHASE": 1}),
    "prep-kda-phase2": (chunk._chunk_prep_kernel, 4, {**PREP, "GATE": 2, "PHASE": 2}),
    "prep-gated-deltanet-varlen": (chunk._chunk_prep_kernel, 2, {**PREP, "GATE": 1, "VARLEN": True}),
    "prep-deltanet2-erase": (chunk._chunk_prep_kernel, 4, {**PREP, "GATE": 1, "ERASE": True, "STORE_P": True,
                                                           "PREC_T": "tf32x3"}),
    "cumsum-per-key": (chunk_intra._chunk_cumsum_kernel, 1,
                       {"BT": 64, "BK": 64, "VARLEN": False, "SCALE_K": True, "SPLIT_K": True}),
    "intra-off-kda": (chunk_intra._chunk_intra_off_kernel, 1, {**INTRA, "BK": 32, "PREC": "tf32"}),
    "cumsum-per-key-b-only": (chunk_intra._chunk_cumsum_kernel, 4,
                              {"BT": 64, "BK": 32, "VARLEN": False, "SCALE_K": False, "SPLIT_K": True}),
    "intra-diag-rows-kda": (chunk_intra._chunk_intra_diag_token_kernel, 2, {**INTRA, "BK": 128, "BH": 4,
                                                                           "STORE_KG": True}),
    "intra-diag-rows-gla-varlen": (chunk_intra._chunk_intra_diag_token_kernel, 2,
                                   {**INTRA, "BK": 128, "BH": 4, "DELTA": False, "VARLEN": True, "STORE_KG": True}),
    "intra-diag-rows-kda-kg-in-cumsum": (chunk_intra._chunk_intra_diag_token_kernel, 2,
                                         {**INTRA, "BK": 128, "BH": 4}),
    "intra-diag-tiles-kda": (chunk_intra._chunk_intra_diag_kernel, 4, {**INTRA, "BK": 64, "STORE_KG": True}),
    "intra-diag-tiles-gla": (chunk_intra._chunk_intra_diag_kernel, 4, {**INTRA, "BK": 64, "DELTA": False,
                                                                        "STORE_KG": True}),
    "state-kda": (chunk_ho._chunk_h_kernel, 4, {"BT": 64, "BK": 128, "BV": 16, "GATE": 2, "DELTA": True,
                                                "ERASE": False, "VARLEN": False, "HAS_H0": True, "PREC": "tf32"}),
    "state-kda-t-in-state": (chunk_ho._chunk_h_kernel, 4, {"BT": 64, "BK": 128, "BV": 16, "GATE": 2, "DELTA": True,
                                                           "ERASE": False, "VARLEN": False, "HAS_H0": True,
                                                           "PREC": "tf32", "T_IN_H": True}),
    "state-gated-deltanet-t-in-state": (chunk_ho._chunk_h_kernel, 4, {"BT": 64, "BK": 128, "BV": 16, "GATE": 1,
                                                                      "DELTA": True, "ERASE": False, "VARLEN": True,
                                                                      "HAS_H0": True, "PREC": "tf32", "T_IN_H": True}),
    "intra-diag-rows-kda-ke": (chunk_intra._chunk_intra_diag_token_kernel, 2, {**INTRA, "BK": 128, "BH": 4,
                                                                              "STORE_KG": True, "STORE_KE": True}),
    "output-kda": (chunk_ho._chunk_o_kernel, 4, {"BT": 64, "BK": 64, "BV": 128, "GATE": 2, "DELTA": True,
                                                 "ERASE": False, "P_IN": False, "VARLEN": False, "PREC": "tf32"}),
}


def compile_all(names: list[str]) -> None:
    """Run in a subprocess without TRITON_INTERPRET (under it `triton.jit` makes interpreted functions,
    which do not compile): one line per case, "ok NAME" or "FAIL NAME: error"."""
    for name in names:
        kernel, num_warps, constexprs = CASES[name]
        try:
            compiled = compile_for_sm90(kernel, num_warps, **constexprs)
            assert ".target sm_90" in compiled.asm["ptx"] and len(compiled.asm["cubin"]) > 1000
            print(f"ok {name}", flush=True)
        except Exception as exc:  # noqa: BLE001  (reported by the test, with the compiler's message)
            print(f"FAIL {name}: {type(exc).__name__}: {exc}".replace("\n", " | "), flush=True)


@pytest.mark.slow
def test_prefill_kernels_compile_for_sm90(tmp_path):
    if _ptxas() is None:
        pytest.skip("Triton's NVIDIA backend has no ptxas here: nothing to compile with")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path)  # a real compile, not a cache hit
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    done = subprocess.run([sys.executable, __file__, *CASES], env=env, capture_output=True, text=True, timeout=600)
    lines = [line for line in done.stdout.splitlines() if line.startswith(("ok ", "FAIL "))]
    failed = [line for line in lines if line.startswith("FAIL")]
    assert not failed, "\n".join(failed)
    assert sorted(line[3:] for line in lines) == sorted(CASES), done.stderr[-2000:]


if __name__ == "__main__":
    compile_all(sys.argv[1:])
