"""edgelin's ONNX Runtime operator library: CPU kernels that stock ONNX Runtime runs slower, loaded into a session
with `SessionOptions.register_custom_ops_library`.

- `ai.edgelin::MatMulNBits` (ops.c, q4_gemv.c, q8_gemv.c): the 4-bit and 8-bit weight products of one-token
  decoding, and of the prefill's pieces (each slice of weight rows for all of a piece's tokens; the weights read
  where they are mapped, so the two graphs share one copy instead of ONNX Runtime prepacking its own per session).
  Same inputs, attributes and packed weights as `com.microsoft::MatMulNBits` (bits 4 or 8, block 32; the
  activations rounded to int8 per 32-block, as accuracy level 4 does); on AVX2 it multiplies two 4-bit blocks (one
  8-bit block) per 256-bit step and four weight rows at once, and on a CPU with AVX-512 VNNI (Zen 4, Ice Lake and
  later) four 4-bit blocks (two 8-bit ones) per 512-bit step with vpdpbusd; a prefill piece in tiles of 16 tokens,
  one per 32-bit lane, each weight row's codes broadcast to all 16 (q8_gemm.c; the 4-bit codes unpacked to bytes
  first, q4_gemm.c); on AVX2 alone, from 6 tokens, 8 weight rows per register, each token's 4 activations
  broadcast to them (nbits_grouped.c; an 8-bit code as its two nibbles) (docs/performance.md#cpu-step-latency).
- `ai.edgelin::MatMul` (ops_matmul.c, f32_gemv.c): the float32 weight products of one-token decoding on ONNX's
  [K, N] layout (exports made before the packed panels below, whose steps still run it): each of ONNX Runtime's
  threads takes slices of the weight's rows instead of MLAS's column split.
- `ai.edgelin::MatMulF32` and `ai.edgelin::MatMulF16` (ops_matmul.c, panels.c): float32 activations by a float32
  or float16 weight (`--quantize fp16`: weight-only float16 storage) packed in column panels of 16 ([ceil(N / 16),
  K, 16], attribute n: N), in the step and the prefill graphs, read from the mapped weights file (the halves
  widened in registers as they stream in: ONNX Runtime's x86 CPU provider has no float16 MatMul, and folds a
  graph's Casts into float32 copies of the weights per session). Each thread takes a slice of the panels; decoding
  streams each panel as one piece of memory, a prefill piece runs 6-token x 16-column register tiles over it.
  edgelin ops: the function body unpacks the panels for ONNX's MatMul. MatMulF16 also takes ONNX's [K, N] layout
  (exports made before the panels; f16_gemm.c).
- `ai.edgelin::SsdRecurrence` (ops_ssd.c): Mamba2's step around its recurrence (the dt path, the key groups
  broadcast to the heads, the value x softplus(dt), the skip D x) in one node, where the graph had ~20 small ones;
  an edgelin op, whose function body is those ONNX ops around `com.microsoft::LinearAttention`
  (edgelin.export.onnx.ssd).
- `ai.edgelin::GatedDeltaRecurrence` (ops_gdn.c): a Gated DeltaNet layer's step into its recurrence (q and k
  L2-normalised per head, the key heads broadcast to the value heads, the softplus decay, beta's sigmoid) in one
  node, where the graph had ~26 small ones; an edgelin op like SsdRecurrence (edgelin.export.onnx.gdn).
- `ai.edgelin::SiluGate` (ops_mlp.c): a gated MLP's silu(gate) * up from the fused gate/up product, one node where
  the step had three (the Split, SiLU, the Mul; edgelin.export.onnx.silu_gate).
- `ai.edgelin::CausalConvWithState` (conv.c): the short conv's step with its carried state, SiLU fused (ndim 1),
  the SiLU over a whole row of channels at once; the state may be updated in place.
- `ai.edgelin::LinearAttention` (linear_attention.c): the recurrence's step for every update rule (linear, gated,
  delta, gated_delta; decay per head or per key; grouped query heads), each state row read and written once.
- `ai.edgelin::GroupQueryAttention` (ops_attention.c, attention.c): the step's attention over the static KV cache
  (`--kv-cache static`; no rotary, window or softcap inside the op): the new keys and values written at their
  rows (in place), then each cached row read once for all the query heads that share it, the softmax online over
  chunks that stay in L2 and over pieces of rows spread across ONNX Runtime's threads. ONNX Runtime's own kernel
  reads the cache once per query head.

Each kernel also has a portable C path, their tested reference. The library registers its ops on x86-64 CPUs with
AVX2 + FMA and on aarch64, where the products take NEON paths, with dotprod or i8mm where the CPU has them (arm/;
docs/arm.md); on an x86 CPU without AVX2 ONNX Runtime's own kernels run (kernel_path() says "none").

An export made with `--step-ops edgelin` (the ONNX default) names these ops in its step graph and carries, for each, an ONNX
function of the same name whose body is ONNX Runtime's own op: a runtime without the library runs the same file
(bit for bit ONNX Runtime's numbers), one with it runs edgelin's kernels. The runner loads the library when the
manifest lists these ops (`EDGELIN_ORT_OPS`: unset = the library an installed wheel carries, built with it
(edgelin.ortops.packaged), else, in a source checkout, build it here once with the C compiler and cache it,
`0` = never, a path = that prebuilt library, e.g. cross-compiled for a board without a compiler: loaded as it is,
the user's choice). A cached build is loaded only once verified against the sha256 edgelin recorded when it built
it, in a private folder of this user's (edgelin.ortops.cache: where the cache lives, what is refused, the build's
timeout and its recorded failures).

The library is built by the project's CMake build (edgelin/ortops/CMakeLists.txt; docs/development.md), against
ONNX Runtime's onnxruntime_c_api.h when it has one (ort_api.h), else against ort_abi.h's declarations of the few C
API slots it calls, which need nothing but a C11 compiler: `cc -O3 -std=gnu11 -shared -fPIC *.c -lm`.
Runtime-side module: no torch, no onnx.
"""

from __future__ import annotations

import hashlib
import os
import platform
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from edgelin.ortops import cache, packaged

DOMAIN = "ai.edgelin"
ENV = "EDGELIN_ORT_OPS"
SOURCES = ("ops.c", "ops_attention.c", "ops_matmul.c", "ops_ssd.c", "ops_gdn.c", "ops_mlp.c", "glue.c", "q4_gemv.c",
           "q4_gemm.c", "q8_gemv.c", "q8_gemm.c", "nbits_grouped.c", "f32_gemv.c", "f16_gemm.c", "panels.c", "conv.c",
           "linear_attention.c", "attention.c", "cpu.c", "arm/panels.c", "arm/qdot_neon.c", "arm/qdot_dotprod.c",
           "arm/fused.c", "arm/tokens_i8mm.c")
HEADERS = ("ort_api.h", "ort_abi.h", "glue.h", "q4_gemv.h", "q4_scratch.h", "q8_gemv.h", "nbits_grouped.h",
           "f32_gemv.h", "f16_gemm.h",
           "conv.h", "linear_attention.h", "attention.h", "simd_exp.h", "cpu.h", "rows_kernel.h", "tiles_kernel.h",
           "panels.h", "arm/neon.h", "arm/qdot.h")
LIBRARY = "libedgelin_ortops.so"
_HERE = Path(__file__).resolve().parent
_CFLAGS = ("-O3", "-std=gnu11", "-fPIC", "-shared", "-fvisibility=hidden")


@dataclass(frozen=True)
class OpsLibrary:
    """Where the library is and why: `path` None when it is not loaded (`reason` says why). `sha256`: the digest
    it was verified against (a cached build), None for one the user named (EDGELIN_ORT_OPS=path)."""

    path: Path | None
    reason: str
    sha256: str | None = None

    @property
    def loaded(self) -> bool:
        return self.path is not None


def _compiler() -> list[str] | None:
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    return shlex.split(cc) if cc else None


def _compiler_identity(compiler: list[str]) -> str:
    """The compiler binary's resolved path, size and mtime: a new or upgraded compiler is another fingerprint (a
    failed build is retried with it)."""
    found = shutil.which(compiler[0])
    if found is None:
        raise RuntimeError(f"no C compiler {compiler[0]!r} (set CC, or install gcc or clang)")
    resolved = os.path.realpath(found)
    info = os.stat(resolved)
    return f"{resolved} {info.st_size} {info.st_mtime_ns}"


def _fingerprint(compiler: list[str]) -> str:
    """The sources, the flags, the machine and the compiler (command and binary); format 2: since the build record."""
    digest = hashlib.sha256(b"edgelin.ortops cache format 2\n")
    for name in (*SOURCES, *HEADERS):
        digest.update((_HERE / name).read_bytes())
    digest.update(" ".join((*compiler, *_CFLAGS, platform.machine())).encode())
    digest.update(_compiler_identity(compiler).encode())
    return digest.hexdigest()[:16]


def _command(compiler: list[str], out: Path) -> list[str]:
    return [*compiler, *_CFLAGS, "-o", str(out), *(str(_HERE / s) for s in SOURCES), "-lm"]


def build(out: Path | None = None) -> Path:
    """Compile the library (into the per-user cache unless `out` is given) and return its path; a cached build of
    the same sources and compiler is reused once verified (edgelin.ortops.cache). Written to a temporary file
    first, then renamed into place, so a concurrent or interrupted build never leaves a partial library. Raises
    OSError/RuntimeError (cache.CacheError: the cache is unusable or its library refused) on failure."""
    compiler = _compiler()
    if compiler is None:
        raise RuntimeError("no C compiler (set CC, or install gcc or clang)")
    if out is None:
        return _cached(compiler)[0]
    out.parent.mkdir(parents=True, exist_ok=True)
    staged = cache.staged(out.parent, LIBRARY)
    try:
        cache.run_compiler(_command(compiler, staged), cache.build_timeout())
        os.chmod(staged, 0o755)
        os.replace(staged, out)
    finally:
        staged.unlink(missing_ok=True)
    return out


def _cached(compiler: list[str]) -> tuple[Path, str]:
    """(the cached library, its verified sha256), built here first if it is not there; see cache's docstring."""
    timeout = cache.build_timeout()
    where = cache.folder(_fingerprint(compiler))
    found = _ready(where, timeout)
    if found is not None:
        return found
    with cache.locked(where, timeout + 30):
        found = _ready(where, timeout)  # another process built it (or failed to) while this one waited
        if found is not None:
            return found
        cache.clean_stale(where)
        print("progress: compiling edgelin's CPU kernels (once) ...", file=sys.stderr, flush=True)
        staged = cache.staged(where, LIBRARY)
        try:
            try:
                cache.run_compiler(_command(compiler, staged), timeout)
                built_for = cache.wrong_architecture(staged)
                if built_for is not None:  # e.g. the host's x86 cc reached from an emulated aarch64 process
                    raise cache.BuildFailed(f"the C compiler {' '.join(compiler)[:80]} builds code for {built_for}, "
                                            f"this is {cache.this_machine()}: set CC to a compiler for "
                                            f"{cache.this_machine()}")
            except cache.BuildFailed as exc:
                cache.record_failure(where, exc, timeout)
                raise RuntimeError(cache.recorded_failure(where, timeout) or str(exc)) from None
            os.chmod(staged, 0o700)
            sha = cache.write_record(where, staged, compiler)  # the record first: a library is never unrecorded
            os.replace(staged, where / LIBRARY)
        finally:
            staged.unlink(missing_ok=True)
    return where / LIBRARY, sha


def _ready(where: Path, timeout: float) -> tuple[Path, str] | None:
    """The verified library in `where`, or None: a build is due. Raises CacheError (refused) or RuntimeError (an
    earlier build of this fingerprint failed: not retried)."""
    found = cache.verified(where, LIBRARY)
    if found is not None:
        return found
    failure = cache.recorded_failure(where, timeout)
    if failure is not None:
        raise RuntimeError(failure)
    return None


def locate() -> OpsLibrary:
    """The library the runner should load, per EDGELIN_ORT_OPS (see the module docstring); never raises. A path
    the user names is loaded as it is (their choice); the one the package carries (an installed wheel), else a
    cached build, only once verified (edgelin.ortops.packaged, edgelin.ortops.cache)."""
    setting = os.environ.get(ENV, "").strip()
    if setting == "0":
        return OpsLibrary(None, f"{ENV}=0")
    if setting:
        path = Path(setting).expanduser()
        return OpsLibrary(path, f"{ENV}") if path.is_file() else OpsLibrary(None, f"{ENV}={setting}: no such file")
    try:  # the library the installed package carries, built with it (edgelin.ortops.packaged), else the cache
        shipped = packaged.find(sources=[_HERE / name for name in (*SOURCES, *HEADERS)])
    except cache.CacheError as exc:
        return OpsLibrary(None, str(exc))
    if shipped is not None:
        return OpsLibrary(shipped[0], "packaged", shipped[1])
    compiler = _compiler()
    if compiler is None:
        return OpsLibrary(None, "could not build it: no C compiler (set CC, or install gcc or clang)")
    try:
        path, sha = _cached(compiler)
    except cache.CacheError as exc:  # one line of ours, with its fix: shown whole
        return OpsLibrary(None, str(exc))
    except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
        return OpsLibrary(None, f"could not build it: {' '.join(str(exc).split())[:400]}")
    return OpsLibrary(path, "built here", sha)


def kernel_path(library: Path) -> str:
    """Which path the library's kernels take on this CPU (cpu.h): "avx2", "neon-i8mm", "neon-dotprod", "neon",
    "portable" (forced by the tests) or "none" (x86 without AVX2: nothing registered). `library`: one locate() or build() returned (verified, or the user's)."""
    import ctypes

    try:
        entry = ctypes.CDLL(str(library)).edgelin_kernel_path
    except (OSError, AttributeError):  # a library built from other sources (EDGELIN_ORT_OPS=path)
        return "unknown kernel path"
    entry.restype = ctypes.c_char_p
    return entry().decode()


def _digest_or_none(path: Path) -> str | None:
    try:
        return cache.digest(path)
    except OSError:
        return None


def register(options: object, found: OpsLibrary | None = None) -> OpsLibrary:
    """Register the library (`found`, else locate()'s) with an onnxruntime.SessionOptions; returns what was loaded
    (or why not). A library ONNX Runtime refuses (wrong architecture, damaged file) is reported, not raised: the
    export's function bodies then run ONNX Runtime's own ops. A cached build is checked against its verified
    sha256 again first (it is loaded by path)."""
    found = locate() if found is None else found
    if found.path is None:
        return found
    if found.sha256 is not None and _digest_or_none(found.path) != found.sha256:
        return OpsLibrary(None, f"the cached library {found.path} changed after edgelin verified it, so it was not "
                                f"loaded: remove its folder (edgelin rebuilds it) or {cache.FIX}")
    try:
        options.register_custom_ops_library(str(found.path))  # type: ignore[attr-defined]
    except Exception as exc:  # onnxruntime's own error types share no base class
        return OpsLibrary(None, f"ONNX Runtime refused {found.path}: {' '.join(str(exc).split())[:200]}")
    return found
