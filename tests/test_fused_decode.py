"""The fused decode's Triton kernels (edgelin.kernels.fused_decode) on CPU under TRITON_INTERPRET=1,
against the unfused model's recurrent step: logits and every state tensor, both kernel paths (small
batch: edgelin's GEMVs with the norms fused in and value-tiled mixer; large batch: cuBLAS-style mm +
the mixer with its gated norm). The CUDA-graph path is tests/gpu/test_decode_gpu.py."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from edgelin.kernels import triton_available

SCRIPT = r"""
import torch
from edgelin.kernels.fused_decode import FusedDecoder, SMALL_BATCH
from edgelin.model.config import ModelConfig
from edgelin.model.lm import CausalLM
config = ModelConfig(vocab_size=64, hidden_size=32, layer_types=("gated_deltanet",), num_heads=2, head_k_dim=16,
                     head_v_dim=16, intermediate_size=64)
torch.manual_seed(0)
model = CausalLM(config).eval()
with torch.no_grad():
    for p in model.parameters():
        if p.dim() == 1:  # norms, A_log, dt_bias away from their init: a wrong index shows
            p.add_(0.3 * torch.randn_like(p))
worst = 0.0
for batch in (2, SMALL_BATCH + 1):
    decoder = FusedDecoder(model, batch=batch, graph=False)
    state = model.initial_state(batch)
    ids = torch.arange(batch) * 7 % 64
    with torch.no_grad():
        for _ in range(2):
            ref, state = model(ids.view(batch, 1), state, None, mode="recurrent", last_only=True)
            got = decoder.step(ids)
            worst = max(worst, float((got - ref).abs().max() / ref.abs().max()))
            ids = ref.argmax(-1)
    for mine, theirs in zip(decoder.state, state):
        for name in theirs:
            worst = max(worst, float((mine[name] - theirs[name]).abs().max() / theirs[name].abs().max()))
print("WORST", worst)
"""


@pytest.mark.skipif(not triton_available(), reason="triton is not installed")
def test_fused_kernels_match_the_model_under_the_interpreter():
    # A subprocess: TRITON_INTERPRET must be set before Triton first loads, and only for this test.
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    done = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    worst = float(done.stdout.split("WORST")[-1])
    assert worst < 1e-5, worst  # fp32 model: the kernels compute in fp32 too
