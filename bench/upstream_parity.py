"""Parity of edgelin against the upstream libraries' own forward, per architecture, at any size.

    python bench/upstream_parity.py                         # CPU: tiny models, fla under the Triton interpreter
    python bench/upstream_parity.py --device cuda --hidden 512 --layers 4 --seq 1024   # the H200 sweep

Random upstream models (fla / transformers classes, weights jittered so every parameter matters) are
saved with save_pretrained, loaded by edgelin, and compared: max |edgelin - upstream| / max |upstream|
over all logits of a batch, edgelin's reference in fp32 on CPU, upstream on --device. With --onnx the
exported ONNX rollout (prefill half, step the rest) is compared too.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

FLA = ("linear_attn", "retnet", "gla", "delta_net", "gated_deltanet", "kda", "mamba2-fla")
HF = ("qwen3_5_text", "mamba2")


def fla_model(kind: str, hidden: int, layers: int, vocab: int, heads: int):
    import fla.models as fm
    from transformers import AutoModelForCausalLM

    common = dict(vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers, tie_word_embeddings=False,
                  fuse_norm=False, fuse_cross_entropy=False)
    head_dim = hidden // heads
    configs = {
        "linear_attn": lambda: fm.LinearAttentionConfig(num_heads=heads, fuse_swiglu=False, **common),
        "retnet": lambda: fm.RetNetConfig(num_heads=heads, fuse_swiglu=False, **common),
        "gla": lambda: fm.GLAConfig(num_heads=heads, fuse_swiglu=False, **common),
        "delta_net": lambda: fm.DeltaNetConfig(num_heads=heads, fuse_swiglu=False, attn_mode="fused_recurrent", **common),
        "gated_deltanet": lambda: fm.GatedDeltaNetConfig(num_heads=heads, head_dim=head_dim, fuse_swiglu=False, **common),
        "kda": lambda: fm.KDAConfig(num_heads=heads, head_dim=head_dim, fuse_swiglu=False, **common),
        "mamba2-fla": lambda: fm.Mamba2Config(head_dim=head_dim, state_size=head_dim, expand=2, n_groups=1,
                                              chunk_size=64, **common),
    }
    return AutoModelForCausalLM.from_config(configs[kind]())


def hf_model(kind: str, hidden: int, layers: int, vocab: int, heads: int):
    hidden_fla = sys.modules.get("fla", "absent")
    sys.modules["fla"] = None  # transformers' pure-torch path (its fla path needs CUDA)
    try:
        from transformers.models.mamba2 import Mamba2Config, Mamba2ForCausalLM
        from transformers.models.qwen3_5 import Qwen3_5ForCausalLM, Qwen3_5TextConfig
    finally:
        if hidden_fla == "absent":
            del sys.modules["fla"]
        else:
            sys.modules["fla"] = hidden_fla
    head_dim = hidden // heads
    if kind == "mamba2":
        return Mamba2ForCausalLM(Mamba2Config(vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers,
                                              state_size=head_dim, expand=2, head_dim=head_dim,
                                              num_heads=2 * hidden // head_dim, n_groups=2, chunk_size=64))
    types = ["linear_attention", "linear_attention", "linear_attention", "full_attention"]
    return Qwen3_5ForCausalLM(Qwen3_5TextConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=3 * hidden, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=max(heads // 2, 1), head_dim=head_dim,
        linear_key_head_dim=head_dim, linear_value_head_dim=head_dim, linear_num_key_heads=max(heads // 2, 1),
        linear_num_value_heads=heads,
        layer_types=[types[i % 4] if i < layers - 1 else "full_attention" for i in range(layers)]))


def rel(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.abs(a - b).max() / np.abs(b).max())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--types", default=",".join(FLA + HF))
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--vocab", type=int, default=128)
    parser.add_argument("--seq", type=int, default=48)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--onnx", action="store_true")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    if args.device == "cpu" and any(t in FLA for t in args.types.split(",")):
        sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
        from upstream_fla import enable_fla_cpu  # test shim: fla's Triton kernels under the interpreter

        enable_fla_cpu()
        torch.set_num_threads(1)
    from edgelin.checkpoint import load_model

    rows = []
    for kind in args.types.split(","):
        torch.manual_seed(0)
        build = fla_model if kind in FLA else hf_model
        model = build(kind, args.hidden, args.layers, args.vocab, args.heads).float().eval()
        gen = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn(p.shape, generator=gen) * 0.02)
        ids = torch.from_numpy(np.random.default_rng(0).integers(0, args.vocab, (args.batch, args.seq)))
        with tempfile.TemporaryDirectory() as tmp:
            model.save_pretrained(tmp, safe_serialization=True)
            t0 = time.perf_counter()
            with torch.no_grad():
                want = model.to(args.device)(ids.to(args.device)).logits.float().cpu().numpy()
            upstream_s = time.perf_counter() - t0
            ours, info = load_model(Path(tmp))
            with torch.no_grad():
                got = ours(ids)[0].numpy()
            row = {"arch": kind, "source": info.format, "params": ours.num_parameters(), "seq": args.seq,
                   "device": args.device, "max_abs": float(np.abs(got - want).max()), "max_rel": rel(got, want),
                   "upstream_s": round(upstream_s, 2)}
            if args.onnx:
                from edgelin.export.pipeline import export_checkpoint
                from edgelin.runtime import open_runner, prefill

                runner = open_runner(export_checkpoint(Path(tmp), Path(tmp) / "onnx").folder)
                half = args.seq // 2
                logits, state = prefill(runner, ids[:, :half].numpy())
                steps = [logits]
                for t in range(half, args.seq - 1):
                    logits = runner.step(ids[:, t].numpy(), state, np.full(args.batch, t, np.int64))
                    steps.append(logits)
                row["onnx_max_rel"] = rel(np.stack(steps, 1), want[:, half - 1:args.seq - 1])
        rows.append(row)
        print(json.dumps(row), flush=True)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
