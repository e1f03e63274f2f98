"""TEST-ONLY SHIM: run flash-linear-attention's (fla's) own models on CPU, for parity tests.

Nothing in this module is part of ``edgelin`` and nothing here fakes a result: it only makes the
*upstream* library (fla 0.6.0 + triton 3.9.0) executable on a machine without a GPU, so that tests
can compare edgelin against fla's real reference implementation. fla's kernels are Triton kernels;
on CPU they run under Triton's interpreter (``TRITON_INTERPRET=1``, numpy-backed, slow). Three
interpreter shortcomings stop fla's models from running there; :func:`enable_fla_cpu` patches them
in-process (monkeypatching, idempotent; no file in site-packages is edited), plus one speed-up:

1. Autotuning: ``triton.autotune`` benchmarks every config, and the interpreter has no
   benchmarker (fails with "0 active drivers"). Patch: in interpreter mode
   ``Autotuner.prune_configs`` returns a single config, so ``Autotuner.run`` skips benchmarking.
   Which one: see :data:`AUTOTUNE_POLICY` (default: the config launching the fewest programs; a
   gated_deltanet decode step is ~2x faster than with the first-listed config). Block sizes only,
   never the maths.
   Needed by every model below.
2. Loop variables: in compiled Triton the induction variable of ``range``/``tl.range`` is an
   int32 tensor; the interpreter yields Python ints, so fla's ``i_t.to(tl.int64)`` fails
   ("'int' object has no attribute 'to'"). Patch: the interpreter's AST rewrite of kernel and
   device-function bodies is extended so ``for ... in range(...)`` iterates int32 scalar tensors
   (int64 if a bound is int64, as compiled Triton would), and ``tl.range`` / ``tl.static_range``
   do the same while a kernel runs. Needed by linear_attn, retnet, gla, gated_deltanet, kda
   (and the hybrid); delta_net's fused-recurrent kernels and mamba2 run without it.
3. bf16 ``tl.dot``: the interpreter stores bf16 as raw uint16 bit patterns and ``np.matmul``
   multiplies those integers (triton-lang/triton#11584). Patch: bf16 operands (and a bf16
   accumulator) of ``tl.dot`` are computed in fp32. No model below issues a bf16 ``tl.dot`` (all run
   in fp32, and elementwise bf16 is still wrong in the interpreter); the patch is checked directly
   by a tiny kernel in the smoke test.
4. Speed only (no semantic change): the interpreter re-patches ``triton.language`` on *every* call
   of a jitted helper (``tl.cdiv``, ``tl.sigmoid``, fla's ``exp`` ...); inside a running kernel
   whose launch already patched those modules the repeat is skipped (~1.7x on decode steps).

Usage -- call :func:`enable_fla_cpu` BEFORE anything imports ``triton`` or ``fla`` (``triton.jit``
decides at decoration time whether a kernel is interpreted, and triton's own ``tl.cdiv`` etc. are
jitted when triton is imported)::

    from upstream_fla import enable_fla_cpu
    enable_fla_cpu()          # raises RuntimeError if triton/fla were imported without the interpreter
    from upstream_fla import tiny_fla_model
    model, config = tiny_fla_model("gla")

``TRITON_INTERPRET=1`` then holds for the whole process (and its subprocesses). Keep torch at one
thread for these tiny models (``torch.set_num_threads(1)``): with 2 OpenMP threads on a busy 2-core
machine each small ``nn.Linear`` between interpreted kernels stalls ~20 ms.

Status with fla 0.6.0 / fla-core 0.6.0, triton 3.9.0, torch 2.13 CPU, fp32, 2 layers, hidden 32,
vocab 100 (tests/convert/test_upstream_fla_smoke.py; "decode err" = max |forward logits (B=2, T=33,
autograd on) - token-by-token cached decoding logits|):

=============== ====================================================================== ==========
model type      kernels exercised on CPU                                               decode err
=============== ====================================================================== ==========
linear_attn     chunk (fwd), fused_recurrent (decode), fla layer_norm/swiglu kernels   ~9e-8
retnet          chunk (fwd), fused_recurrent (decode), rotary                          ~2e-7
gla             fused_recurrent (T <= 64 always), chunk for T > 64 (split test)        ~1.2e-7
delta_net       fused_recurrent only (attn_mode="fused_recurrent"): fla's chunk         ~2e-7
                DeltaNet asserts bf16 ("ChunkDeltaRuleFunction does not support
                float32"), and bf16 elementwise maths is wrong in the interpreter
gated_deltanet  chunk (fwd: kkt/solve, w/u, h, o), fused_recurrent, causal_conv1d      ~1.2e-7
kda             chunk (fwd), fused_recurrent_kda, causal_conv1d                        ~1.2e-7
mamba2          fla's *pure-torch* Mamba2 mixer (its fast path needs mamba_ssm +       ~2e-7
                CUDA); only fla's gated RMSNorm / swish Triton kernels run. Cached
                decoding takes one token per step (no multi-token cached prefill)
hybrid          DOES NOT RUN: gated_deltanet + softmax layer (``attn={"layers": [1],   --
                "num_heads": 2, "num_kv_heads": 1, "window_size": None}``). fla's
                ``fla.layers.attn.Attention`` needs flash-attn (flash_attn_func /
                flash_attn_varlen_func), not installed (CUDA-only); its ``__init__``
                raises ImportError and fla has no torch fallback
=============== ====================================================================== ==========
"""

from __future__ import annotations

import ast
import os
import sys
from typing import Any

__all__ = ["FLA_MODEL_TYPES", "enable_fla_cpu", "fla_cpu_enabled", "tiny_fla_model"]

_PATCH_MARK = "_edgelin_fla_cpu_patch"
_RANGE_NAME = "_edgelin_fla_cpu_tensor_range"
_ENABLED = False

#: How the patched autotuner picks its single config in interpreter mode (no benchmarking either way):
#: "fewest_programs" -- the config whose launch grid is smallest (ties: first listed; falls back to
#: the first config when the grid cannot be evaluated). Bigger blocks mean fewer, numpy-vectorised
#: programs: a gated_deltanet decode step takes ~0.29 s instead of ~0.56 s with "first".
#: "first" -- the first config listed (after the kernel's own early_config_prune).
AUTOTUNE_POLICY = "fewest_programs"


# ----------------------------------------------------------------------------------------------
# enabling
# ----------------------------------------------------------------------------------------------

def fla_cpu_enabled() -> bool:
    """Whether :func:`enable_fla_cpu` has run in this process."""
    return _ENABLED


def enable_fla_cpu() -> None:
    """Make fla's Triton kernels runnable on CPU (Triton interpreter + patches). Idempotent.

    Must be called before ``triton`` or ``fla`` is imported anywhere in the process; raises
    ``RuntimeError`` if triton (or fla) is already loaded without the interpreter.
    """
    global _ENABLED
    if _ENABLED:
        return
    if "triton" in sys.modules and not _triton_is_interpreted():
        loaded = [m for m in ("triton", "fla") if m in sys.modules]
        raise RuntimeError(
            f"enable_fla_cpu() must be called before importing triton/fla: {' and '.join(loaded)} "
            "already imported without TRITON_INTERPRET=1, so @triton.jit functions are compiled-mode "
            "JITFunctions that cannot run on CPU. Call enable_fla_cpu() first (or start the process "
            "with TRITON_INTERPRET=1)."
        )
    os.environ["TRITON_INTERPRET"] = "1"
    _patch_autotuner()
    _patch_loop_variables()
    _patch_bf16_dot()
    _patch_redundant_lang_patching()
    _ENABLED = True


def _triton_is_interpreted() -> bool:
    """True if triton's own jitted library functions were created in interpreter mode."""
    import triton.language.standard as standard
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(standard.cdiv, InterpretedFunction)


# ----------------------------------------------------------------------------------------------
# patch 1: the autotuner picks one config, without benchmarking
# ----------------------------------------------------------------------------------------------

def _grid_size(self, config, kwargs) -> int | None:
    """Number of programs the launch would run with ``config``; None if it cannot be evaluated."""
    grid = kwargs.get("grid")
    try:
        if callable(grid):
            grid = grid({**self.nargs, **kwargs, **config.all_kwargs()})
        n = 1
        for g in grid:
            n *= int(g)
        return n
    except Exception:
        return None


def _patch_autotuner() -> None:
    from triton import knobs
    from triton.runtime.autotuner import Autotuner

    original = Autotuner.prune_configs
    if getattr(original, _PATCH_MARK, False):
        return

    def prune_configs(self, kwargs):
        if not knobs.runtime.interpret:
            return original(self, kwargs)
        configs = list(self.configs)
        if self.early_config_prune:  # the kernel's own validity filter; no benchmarking involved
            configs = list(self.early_config_prune(self.configs, self.nargs, **kwargs)) or configs
        if AUTOTUNE_POLICY == "fewest_programs":
            sizes = [_grid_size(self, c, kwargs) for c in configs]
            if all(n is not None for n in sizes):
                configs = [configs[sizes.index(min(sizes))]]
        # Autotuner.run() skips benchmarking when exactly one config survives pruning.
        return configs[:1]

    setattr(prune_configs, _PATCH_MARK, True)
    prune_configs.__wrapped__ = original
    Autotuner.prune_configs = prune_configs


# ----------------------------------------------------------------------------------------------
# patch 2: loop variables are int32 scalar tensors, as in compiled Triton
# ----------------------------------------------------------------------------------------------

def _scalar_int(value) -> tuple[int, bool]:
    """(python int, is_64_bit) of a loop bound: int, constexpr or scalar interpreter tensor."""
    import triton.language as tl

    if isinstance(value, tl.constexpr):
        value = value.value
    if isinstance(value, tl.tensor):
        data = value.handle.data
        if data.size != 1:
            raise ValueError(f"range() bound must be a scalar, got a tensor of shape {data.shape}")
        return int(data.reshape(())), value.dtype.primitive_bitwidth == 64
    return int(value), False


def _tensor_range(arg1, arg2=None, step=None, **_ignored):
    """``range`` whose items are scalar int32 (int64 if a bound is int64) interpreter tensors.

    Extra keywords of ``tl.range`` (``num_stages``, ``loop_unroll_factor``, ...) only steer code
    generation and are ignored, as the interpreter's own ``tl.range`` does.
    """
    import numpy as np
    import triton.language as tl
    from triton.runtime.interpreter import TensorHandle

    if arg2 is None:
        arg1, arg2 = 0, arg1
    bounds = [_scalar_int(b) for b in (arg1, arg2, 1 if step is None else step)]
    (start, _), (stop, _), (stride, _) = bounds
    wide = any(is64 for _, is64 in bounds)
    ty, np_ty = (tl.int64, np.int64) if wide else (tl.int32, np.int32)
    for i in range(start, stop, stride):
        yield tl.tensor(TensorHandle(np.array([i], dtype=np_ty), ty), ty)


def _patch_loop_variables() -> None:
    import triton.runtime.interpreter as interp

    # (a) builtin ``range`` in kernel / device-function bodies: the interpreter already rewrites
    # each body's AST (FunctionRewriter.ast_transformer); extend that rewrite so that
    # ``for x in range(...)`` calls _tensor_range. Rewritten code runs with the kernel module's
    # globals, into which the interpreter copies any name of its own module that is missing there,
    # so the helper is published under a unique name in the interpreter module.
    setattr(interp, _RANGE_NAME, _tensor_range)
    rewriter = interp.FunctionRewriter
    if not getattr(rewriter.ast_transformer, _PATCH_MARK, False):
        base_cls = type(rewriter.ast_transformer)

        class _RangeTransformer(base_cls):
            def visit_For(self, node):
                node = self.generic_visit(node)
                it = node.iter
                if isinstance(it, ast.Call) and isinstance(it.func, ast.Name) and it.func.id == "range":
                    it.func = ast.copy_location(ast.Name(id=_RANGE_NAME, ctx=ast.Load()), it.func)
                return node

        transformer = _RangeTransformer()
        setattr(transformer, _PATCH_MARK, True)
        rewriter.ast_transformer = transformer
        # functions rewritten before the patch (none, if called before fla's import) are re-done
        interp.InterpretedFunction.rewritten_fn.clear()

    # (b) ``tl.range`` / ``tl.static_range``: the interpreter swaps them for a Python-int range
    # while a kernel runs (_patch_lang_core, undone by the scope afterwards); swap in ours after it.
    original = interp._patch_lang_core
    if getattr(original, _PATCH_MARK, False):
        return

    def _patch_lang_core(lang, scope):
        original(lang, scope)
        scope.set_attr(lang, "range", _tensor_range)
        scope.set_attr(lang, "static_range", _tensor_range)

    setattr(_patch_lang_core, _PATCH_MARK, True)
    _patch_lang_core.__wrapped__ = original
    interp._patch_lang_core = _patch_lang_core


# ----------------------------------------------------------------------------------------------
# patch 3: bf16 operands of tl.dot are widened to fp32
# ----------------------------------------------------------------------------------------------

def _patch_bf16_dot() -> None:
    import numpy as np
    import triton.language as tl
    import triton.runtime.interpreter as interp

    builder_cls = interp.InterpreterBuilder
    original = builder_cls.create_dot
    if getattr(original, _PATCH_MARK, False):
        return

    def bf16_bits_to_f32(data):
        return (np.asarray(data).astype(np.uint32) << 16).view(np.float32)

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        is_bf16 = [h.dtype.scalar == tl.bfloat16 for h in (a, b, d)]
        if not any(is_bf16):
            return original(self, a, b, d, input_precision, max_num_imprecise_acc)
        a_data = bf16_bits_to_f32(a.data) if is_bf16[0] else a.data
        b_data = bf16_bits_to_f32(b.data) if is_bf16[1] else b.data
        if is_bf16[2]:  # bf16 accumulator: compute in fp32, round back to bf16 bits (RTNE)
            acc = np.matmul(a_data, b_data, dtype=np.float32) + bf16_bits_to_f32(d.data)
            bits = interp._convert_float(acc, tl.float32, tl.bfloat16, interp._ir.ROUNDING_MODE.RTNE)
            return interp.TensorHandle(bits.astype(np.uint16), d.dtype.scalar)
        return interp.TensorHandle(np.matmul(a_data, b_data, dtype=d.data.dtype) + d.data, d.dtype.scalar)

    setattr(create_dot, _PATCH_MARK, True)
    create_dot.__wrapped__ = original
    builder_cls.create_dot = create_dot


# ----------------------------------------------------------------------------------------------
# speed-up (no semantic change): do not re-patch triton.language on every device-function call
# ----------------------------------------------------------------------------------------------

class _NoopScope:
    def restore(self) -> None:
        pass


def _patch_redundant_lang_patching() -> None:
    """Skip the interpreter's re-patching of ``triton.language`` on each @jit device-function call.

    A kernel launch (GridExecutor) patches ``tl``'s builtins for its duration; every call of a jitted
    helper (``tl.cdiv``, ``tl.sigmoid``, fla's ``exp`` ...) inside the kernel then patches the same
    modules again (a gated_deltanet decode step: 0.29 s -> 0.17 s without the repeats). While a kernel
    runs, a helper whose language modules are already patched now reuses that patch. Calls outside a
    kernel (e.g. from host code) keep the original behaviour.
    """
    import triton.language as tl
    import triton.runtime.interpreter as interp

    original_patch = interp._patch_lang
    if getattr(original_patch, _PATCH_MARK, False):
        return
    original_call = interp.GridExecutor.__call__
    state = {"depth": 0, "patched": set()}

    def langs_of(fn) -> set[int]:
        return {id(v) for v in fn.__globals__.values() if v is tl or v is tl.core}

    def _patch_lang(fn):
        langs = langs_of(fn)
        if state["depth"] and state["patched"] and langs <= state["patched"]:
            return _NoopScope()
        scope = original_patch(fn)
        if state["depth"]:
            state["patched"] |= langs
        return scope

    def grid_call(self, *args, **kwargs):
        state["depth"] += 1
        try:
            return original_call(self, *args, **kwargs)
        finally:
            state["depth"] -= 1
            if not state["depth"]:
                state["patched"].clear()

    setattr(_patch_lang, _PATCH_MARK, True)
    _patch_lang.__wrapped__ = original_patch
    grid_call.__wrapped__ = original_call
    interp._patch_lang = _patch_lang
    interp.GridExecutor.__call__ = grid_call


# ----------------------------------------------------------------------------------------------
# tiny models
# ----------------------------------------------------------------------------------------------

FLA_MODEL_TYPES = ("linear_attn", "retnet", "gla", "delta_net", "gated_deltanet", "kda", "mamba2", "hybrid")

_VOCAB = 100
_COMMON = dict(vocab_size=_VOCAB, hidden_size=32, num_hidden_layers=2, tie_word_embeddings=False)
_NO_FUSION = dict(fuse_norm=False, fuse_swiglu=False, fuse_cross_entropy=False)

_TINY: dict[str, tuple[str, dict[str, Any]]] = {
    "linear_attn": ("LinearAttentionConfig", dict(num_heads=2, intermediate_size=64, **_NO_FUSION)),
    "retnet": ("RetNetConfig", dict(num_heads=2, intermediate_size=64, **_NO_FUSION)),
    "gla": ("GLAConfig", dict(num_heads=2, intermediate_size=64, **_NO_FUSION)),
    "delta_net": ("DeltaNetConfig", dict(num_heads=2, intermediate_size=64, attn_mode="fused_recurrent", **_NO_FUSION)),
    "gated_deltanet": ("GatedDeltaNetConfig", dict(num_heads=2, head_dim=16, intermediate_size=64, **_NO_FUSION)),
    "kda": ("KDAConfig", dict(num_heads=2, head_dim=16, intermediate_size=64, **_NO_FUSION)),
    "mamba2": ("Mamba2Config", dict(head_dim=16, state_size=16, expand=2, n_groups=1, chunk_size=16,
                                    fuse_norm=False, fuse_cross_entropy=False)),
    "hybrid": ("GatedDeltaNetConfig", dict(num_heads=2, head_dim=16, intermediate_size=64, **_NO_FUSION,
                                           attn={"layers": [1], "num_heads": 2, "num_kv_heads": 1,
                                                 "window_size": None})),
}


def tiny_fla_model(model_type: str, *, seed: int = 0, **overrides):
    """A tiny random fla ``*ForCausalLM`` (fla's own config/model classes), fp32, eval mode.

    ``model_type`` is one of :data:`FLA_MODEL_TYPES`; "hybrid" is gated_deltanet with a softmax
    attention layer at index 1. ``overrides`` are passed to the config class. Returns
    ``(model, config)``. Requires :func:`enable_fla_cpu` to have been called.
    """
    if not _ENABLED:
        raise RuntimeError("call upstream_fla.enable_fla_cpu() before building fla models")
    if model_type not in _TINY:
        raise ValueError(f"unknown fla model type {model_type!r}; expected one of {FLA_MODEL_TYPES}")
    import torch
    import fla.models
    from transformers import AutoModelForCausalLM

    config_name, kwargs = _TINY[model_type]
    config = getattr(fla.models, config_name)(**{**_COMMON, **kwargs, **overrides})
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config).to(torch.float32).eval()
    return model, config
