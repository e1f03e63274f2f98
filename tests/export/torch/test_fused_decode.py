"""The fused decode's Triton kernels (edgelin.export.torch.fused_decode, fused_decode_gemv) on CPU under
TRITON_INTERPRET=1, against the unfused model's recurrent step: logits and every state tensor, both
kernel paths (small batch: edgelin's GEMVs with the norms, embedding gather and conv shift fused in and
the value-tiled mixer; large batch: cuBLAS-style mm + the mixer with its gated norm). The interpreter
runs a grid's programs one after another, so a program that writes what a later program of the same
kernel still reads (the q/k conv taps every value tile reads) shows as a wrong state here. The
CUDA-graph path (and PDL) is tests/gpu/test_decode_gpu.py."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from edgelin.kernels import triton_available

SCRIPT = r"""
import torch
from edgelin.export.torch.fused_decode import DecodeTuning, FusedDecoder
from edgelin.model.config import ModelConfig
from edgelin.model.lm import CausalLM
config = ModelConfig(vocab_size=64, hidden_size=32, layer_types=("gated_deltanet",), num_heads=3, head_k_dim=16,
                     head_v_dim=64, intermediate_size=48)
torch.manual_seed(0)
model = CausalLM(config).eval()
with torch.no_grad():
    for p in model.parameters():
        if p.dim() == 1:  # norms, A_log, dt_bias away from their init: a wrong index shows
            p.add_(0.3 * torch.randn_like(p))
        if p.dim() == 2 and p.shape[-1] == 4:  # conv taps: the stored state must matter
            p.mul_(4.0)
small = DecodeTuning(bk=16, bn_in=4, bn_gu=2, bn_head=8)  # K in several tiles; rows not a multiple of BN
cases = {"B=1 two value tiles": (1, small), "B=2 one value tile": (2, DecodeTuning(mixer_bv=64)),
         "B=3 GEMVs": (3, DecodeTuning(small_batch=4)), "B=3 cuBLAS path": (3, DecodeTuning(small_batch=2))}
for label, (batch, tuning) in cases.items():
    decoder = FusedDecoder(model, batch=batch, graph=False, tuning=tuning)
    state = model.initial_state(batch)
    ids = torch.arange(batch) * 7 % 64
    worst = 0.0
    with torch.no_grad():
        for _ in range(2):
            ref, state = model(ids.view(batch, 1), state, None, mode="recurrent", last_only=True)
            got = decoder.step(ids)
            worst = max(worst, float((got - ref).abs().max() / ref.abs().max()))
            ids = ref.argmax(-1)
    for mine, theirs in zip(decoder.state, state):
        for name in theirs:
            worst = max(worst, float((mine[name] - theirs[name]).abs().max() / theirs[name].abs().max()))
    print("CASE", label, "WORST", worst, flush=True)
"""


@pytest.mark.skipif(not triton_available(), reason="triton is not installed")
def test_fused_kernels_match_the_model_under_the_interpreter():
    # A subprocess: TRITON_INTERPRET must be set before Triton first loads, and only for this test.
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    done = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    cases = [line.split("WORST") for line in done.stdout.splitlines() if line.startswith("CASE")]
    assert len(cases) == 4, done.stdout
    for label, worst in cases:
        assert float(worst) < 1e-5, (label, worst)  # fp32 model: the kernels compute in fp32 too
