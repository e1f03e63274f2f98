"""Test helpers: tiny transformers models built with transformers itself, on its pure-torch path.

With fla importable, transformers' Qwen3.5 would pick fla's Triton kernels (CPU cannot run them), so
the modeling modules are imported while `fla` is hidden; the decision is made at import time.
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import torch


def torch_only_modeling():
    hidden = sys.modules.get("fla", "absent")
    sys.modules["fla"] = None  # import fla -> ImportError while transformers decides
    try:
        qwen = importlib.import_module("transformers.models.qwen3_5.modeling_qwen3_5")
        mamba2 = importlib.import_module("transformers.models.mamba2.modeling_mamba2")
    finally:
        if hidden == "absent":
            del sys.modules["fla"]
        else:
            sys.modules["fla"] = hidden
    return qwen, mamba2


def jitter(model: torch.nn.Module, scale: float = 0.05, seed: int = 0) -> torch.nn.Module:
    """Random init leaves norms at 0/1 and biases at 0; perturb everything so every weight matters."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * scale)
    return model


def tiny_qwen35(folder: Path, vocab: int = 100, seed: int = 0, **changes):
    from transformers.models.qwen3_5 import Qwen3_5TextConfig

    qwen, _ = torch_only_modeling()
    torch.manual_seed(seed)
    # Two linear-attention layers around a full-attention one: every kind and both orders of neighbours,
    # one layer fewer than Qwen3.5's 3:1 pattern (the ONNX exports' tracing grows with the layers).
    base = dict(vocab_size=vocab, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, linear_conv_kernel_dim=4, linear_key_head_dim=8,
                linear_value_head_dim=8, linear_num_key_heads=2, linear_num_value_heads=4,
                layer_types=["linear_attention", "full_attention", "linear_attention"])
    base.update(changes)
    model = jitter(qwen.Qwen3_5ForCausalLM(Qwen3_5TextConfig(**base)).eval(), seed=seed)
    model.save_pretrained(folder, safe_serialization=True)
    return model


def tiny_mamba2(folder: Path, vocab: int = 100, seed: int = 0, **changes):
    from transformers.models.mamba2 import Mamba2Config

    _, mamba2 = torch_only_modeling()
    torch.manual_seed(seed)
    base = dict(vocab_size=vocab, hidden_size=64, num_hidden_layers=2, state_size=16, expand=2, head_dim=16,
                num_heads=8, n_groups=2, conv_kernel=4, chunk_size=16)
    base.update(changes)
    model = jitter(mamba2.Mamba2ForCausalLM(Mamba2Config(**base)).eval(), seed=seed)
    model.save_pretrained(folder, safe_serialization=True)
    return model
