"""The fused whole-model decode (edgelin.export.torch.fused_decode) on CUDA, captured in a CUDA graph,
against the unfused model: logits and state after every step, fp32 and fp16, batch 1, 2, 3 and 9; the
small-batch GEMVs with programmatic dependent launch (Hopper) and without, and at B=9 as GEMVs too."""

from __future__ import annotations

import pytest
import torch

from edgelin.model.config import ModelConfig
from edgelin.model.lm import CausalLM

pytestmark = pytest.mark.gpu


def _model(dtype: torch.dtype) -> CausalLM:
    config = ModelConfig(vocab_size=512, hidden_size=256, layer_types=("gated_deltanet",) * 3, num_heads=2,
                         head_k_dim=128, head_v_dim=128, intermediate_size=512)
    torch.manual_seed(0)
    model = CausalLM(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:  # norms, A_log, dt_bias: away from their init so a wrong index shows
                p.add_(0.2 * torch.randn_like(p))
    return model.cuda().to(dtype)


TUNINGS = {"default": {}, "no-pdl": {"pdl": False}, "gemv-b16": {"small_batch": 16, "mixer_bv": 16, "bn_in": 16},
           "bk128": {"bk": 128, "bn_gu": 8, "bn_down": 2, "bn_o": 8, "warps_in": 8}}


@pytest.mark.parametrize("batch,tuning", [(1, "default"), (3, "default"), (9, "default"), (1, "no-pdl"),
                                          (2, "no-pdl"), (9, "gemv-b16"), (1, "bk128")])
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-4), (torch.float16, 2e-2)])
def test_fused_graph_decode_matches_the_model(dtype, tol, batch, tuning):
    # 1, 2, 3: edgelin's GEMVs (PDL on Hopper), value-tiled mixer; 9: the cuBLAS path, or GEMVs with gemv-b16
    from edgelin.export.torch.fused_decode import DecodeTuning, FusedDecoder

    model = _model(dtype)
    decoder = FusedDecoder(model, batch=batch, tuning=DecodeTuning(**TUNINGS[tuning]))
    assert decoder.small == (batch <= decoder.tuning.small_batch)
    state = model.initial_state(batch, device="cuda", dtype=dtype)
    ids = torch.arange(batch, device="cuda") * 53 + 5
    with torch.no_grad():
        for _ in range(12):
            ref, state = model(ids.view(batch, 1), state, None, mode="recurrent", last_only=True)
            got = decoder.step(ids)
            assert float((got.float() - ref.float()).abs().max() / ref.float().abs().max()) < tol
            ids = ref.argmax(-1)
    for mine, theirs in zip(decoder.state, state):
        for name in theirs:
            err = (mine[name].float() - theirs[name].float()).abs().max() / theirs[name].float().abs().max()
            assert float(err) < tol, name
