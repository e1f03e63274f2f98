"""Smoke tests: flash-linear-attention's (fla's) own models run correctly on CPU.

fla is the upstream reference that edgelin's parity tests compare against; its Triton kernels run
here under Triton's interpreter via the test-only shim ``tests/upstream_fla.py`` (see its docstring
for the patches). These tests check the shim and fla, not edgelin: for each tiny random fla model
the full-sequence forward must be finite and agree with fla's own cached inference.

* ``test_forward_matches_cached_decoding``: forward over T=33 (B=2) vs feeding the tokens one by
  one with ``past_key_values`` (fla's recurrent decode kernels). The forward runs with autograd
  enabled because fla layers then pick their *chunk* kernels (linear_attn, retnet, gated_deltanet,
  kda); with grad disabled and T <= 64 they use the same fused-recurrent kernel as decoding.
* ``test_chunked_prefill_matches_split_prefill``: forward over T=72 (> 64, so gla takes its chunk
  path too) vs a cached prefill in two pieces (40 + 32 tokens: fused-recurrent kernels, state
  handed over through fla's cache).
* ``test_interpreter_patches``: two tiny kernels check the loop-variable and bf16 ``tl.dot`` patches
  directly (no fla model in this setup issues a bf16 ``tl.dot``: they all run in fp32).
* ``test_save_pretrained_roundtrip``: ``save_pretrained(safe_serialization=True)`` writes
  config.json + model.safetensors, and ``from_pretrained`` reproduces the logits.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

if importlib.util.find_spec("fla") is None or importlib.util.find_spec("triton") is None:
    pytest.skip("flash-linear-attention (fla) and triton are needed for the upstream fla tests",
                allow_module_level=True)

from upstream_fla import FLA_MODEL_TYPES, enable_fla_cpu, tiny_fla_model  # noqa: E402

try:  # must run before anything imports triton/fla (TRITON_INTERPRET is read at decoration time)
    enable_fla_cpu()
except RuntimeError as err:
    pytest.skip(str(err), allow_module_level=True)

import triton  # noqa: E402  (only after enable_fla_cpu: kernels below must be interpreted)
import triton.language as tl  # noqa: E402

pytestmark = [
    pytest.mark.filterwarnings("ignore:Triton is not supported on current platform"),
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
    pytest.mark.filterwarnings("ignore::FutureWarning"),
]

ATOL = 1e-4
VOCAB = 100
HYBRID_SKIP = (
    "fla's softmax attention layer (fla.layers.attn.Attention, used for config.attn layers) calls "
    "flash_attn.flash_attn_func / flash_attn_varlen_func; flash-attn is not installed (it is a CUDA-only "
    "extension), so Attention.__init__ raises ImportError and fla has no CPU/torch fallback"
)


@pytest.fixture(scope="module", autouse=True)
def _one_torch_thread():
    # The interpreter runs numpy between tiny torch ops; with 2 OpenMP threads on a busy 2-core
    # machine each 32-wide nn.Linear can wait ~20 ms for its worker (decode steps ~3x slower).
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _model(model_type: str):
    try:
        model, _ = tiny_fla_model(model_type)
    except ImportError as err:
        if model_type == "hybrid" and "flash" in str(err).lower():
            pytest.skip(HYBRID_SKIP)
        raise
    return model


def _ids(batch: int, length: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, length), generator=torch.Generator().manual_seed(1234))


def _full_logits(model, ids) -> torch.Tensor:
    with torch.enable_grad():  # grad enabled -> fla's chunk kernels where the layer has them
        return model(ids).logits.detach()


@pytest.mark.parametrize("model_type", FLA_MODEL_TYPES)
def test_forward_matches_cached_decoding(model_type):
    model = _model(model_type)
    ids = _ids(2, 33)
    full = _full_logits(model, ids)
    assert full.shape == (2, 33, VOCAB)
    assert torch.isfinite(full).all()

    steps, cache = [], None
    with torch.no_grad():
        for t in range(ids.shape[1]):
            out = model(ids[:, t:t + 1], past_key_values=cache, use_cache=True)
            cache = out.past_key_values
            steps.append(out.logits)
    step = torch.cat(steps, dim=1)
    err = (full - step).abs().max().item()
    print(f"{model_type}: max |forward - cached decoding| = {err:.3g}")
    assert err < ATOL


@pytest.mark.parametrize("model_type", ["linear_attn", "retnet", "gla"])
def test_chunked_prefill_matches_split_prefill(model_type):
    model = _model(model_type)
    ids = _ids(2, 72)
    full = _full_logits(model, ids)
    assert torch.isfinite(full).all()
    with torch.no_grad():
        first = model(ids[:, :40], use_cache=True)
        second = model(ids[:, 40:], past_key_values=first.past_key_values, use_cache=True)
    split = torch.cat([first.logits, second.logits], dim=1)
    err = (full - split).abs().max().item()
    print(f"{model_type}: max |chunked forward - split cached prefill| = {err:.3g}")
    assert err < ATOL


@pytest.mark.parametrize("model_type", FLA_MODEL_TYPES)
def test_save_pretrained_roundtrip(model_type, tmp_path):
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    model = _model(model_type)
    model.save_pretrained(tmp_path, safe_serialization=True)
    assert (tmp_path / "config.json").is_file()
    assert (tmp_path / "model.safetensors").is_file()
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["model_type"] == model.config.model_type
    with safe_open(tmp_path / "model.safetensors", framework="pt") as f:
        names = set(f.keys())
    assert names == set(model.state_dict())

    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path).to(torch.float32).eval()
    ids = _ids(1, 5)
    with torch.no_grad():
        torch.testing.assert_close(reloaded(ids).logits, model(ids).logits, rtol=0, atol=0)


@triton.jit
def _loop_var_kernel(out, n):
    acc = tl.zeros((1,), dtype=tl.int64)
    for i in range(n):  # loop variable must be a tensor: .to() fails on a Python int
        acc += i.to(tl.int64)
    for j in tl.range(0, 3):
        acc += j.to(tl.int64) * 100
    for k in tl.static_range(2):
        acc += k.to(tl.int64) * 1000
    tl.store(out + tl.arange(0, 1), acc)


@triton.jit
def _bf16_dot_kernel(a, b, c, M: tl.constexpr, N: tl.constexpr, K: tl.constexpr):
    o_m, o_n, o_k = tl.arange(0, M), tl.arange(0, N), tl.arange(0, K)
    b_a = tl.load(a + o_m[:, None] * K + o_k[None, :])
    b_b = tl.load(b + o_k[:, None] * N + o_n[None, :])
    tl.store(c + o_m[:, None] * N + o_n[None, :], tl.dot(b_a, b_b))


def test_interpreter_patches():
    out = torch.zeros(1, dtype=torch.int64)
    _loop_var_kernel[(1,)](out, 5)
    assert out.item() == (0 + 1 + 2 + 3 + 4) + 100 * (0 + 1 + 2) + 1000 * (0 + 1)

    g = torch.Generator().manual_seed(0)
    a = torch.randn(16, 16, generator=g).to(torch.bfloat16)
    b = torch.randn(16, 16, generator=g).to(torch.bfloat16)
    c = torch.empty(16, 16, dtype=torch.float32)
    _bf16_dot_kernel[(1,)](a, b, c, 16, 16, 16)
    torch.testing.assert_close(c, a.float() @ b.float(), rtol=1e-5, atol=1e-5)


def test_enable_fla_cpu_refuses_after_plain_triton_import():
    code = (
        "import sys; sys.path.insert(0, sys.argv[1]); import triton, upstream_fla\n"
        "try:\n    upstream_fla.enable_fla_cpu()\nexcept RuntimeError as e:\n    print('REFUSED', e)\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-c", code, str(Path(__file__).resolve().parents[1])], env=env,
                         capture_output=True, text=True, timeout=120)
    assert "REFUSED enable_fla_cpu() must be called before importing triton/fla" in out.stdout, out.stderr
