"""The two transformers checkpoints of the CPU peers benchmark (issue 13): a small Qwen3.5 and a Mamba2.

    python bench/peer_checkpoints.py data  --out runs/peers/data            # here: corpus + tokenizer
    python bench/peer_checkpoints.py train --arch qwen3_5 --data runs/peers/data --out DIR [--device cuda]
    python bench/peer_checkpoints.py train --arch mamba2  --data runs/peers/data --out DIR [--device cuda]
    python bench/peer_checkpoints.py tokenizer --data runs/peers/data --out DIR   # tokenizer files into DIR

`data` tokenises the shipped recipe's text (recipes/tiny-gdn-hybrid/recipe.toml: the Python standard
library, byte-level BPE with 2,048 tokens, the held-out files kept apart) with edgelin's own pipeline and
writes tokens.npz + tokenizer.json. `train` needs only torch, numpy and transformers (no edgelin), so it
runs on a GPU machine that has neither the corpus nor edgelin: it trains the architecture's transformers
model with AdamW (seed, steps, batch, sequence length below; bf16 autocast on CUDA, fp32 master weights)
and saves `save_pretrained` with the weights rounded to float16 (small enough to travel; every runtime
then loads the same values in fp32) plus training_log.json (seed, steps, parameters, time, losses).
Sizes: see ARCHS; `python bench/peer_checkpoints.py sizes` prints the parameter counts.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "recipes" / "tiny-gdn-hybrid" / "recipe.toml"
VOCAB = 2048
EOS = 0  # the recipe tokenizer's <|endoftext|>, also its file separator

# Hidden 384 keeps every row a multiple of 32 (llama.cpp's Q4_0/Q8_0 blocks) and of 128 (edgelin int4).
ARCHS: dict[str, dict[str, Any]] = {
    "qwen3_5": {"model_type": "qwen3_5_text", "vocab_size": VOCAB, "hidden_size": 384, "intermediate_size": 1024,
                "num_hidden_layers": 8, "layer_types": ["linear_attention"] * 3 + ["full_attention"]
                + ["linear_attention"] * 3 + ["full_attention"],
                "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64,
                "linear_num_key_heads": 4, "linear_num_value_heads": 8, "linear_key_head_dim": 64,
                "linear_value_head_dim": 64, "linear_conv_kernel_dim": 4, "max_position_embeddings": 65536,
                "tie_word_embeddings": True, "rms_norm_eps": 1e-6,
                "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25}},
    # n_groups=1: transformers 5.17's gated RMSNorm bug (group-wide vs per-group) cannot show.
    "mamba2": {"model_type": "mamba2", "vocab_size": VOCAB, "hidden_size": 384, "num_hidden_layers": 12,
               "state_size": 64, "expand": 2, "head_dim": 64, "num_heads": 12, "n_groups": 1, "conv_kernel": 4,
               "chunk_size": 64, "tie_word_embeddings": True, "residual_in_fp32": True},
}
TRAIN = {"seed": 0, "steps": 400, "batch_size": 32, "seq_len": 256, "lr": 3e-3, "warmup": 30,
         "weight_decay": 0.1, "grad_clip": 1.0}


def make_config(arch: str):
    from transformers import AutoConfig

    spec = dict(ARCHS[arch])
    config = AutoConfig.for_model(spec.pop("model_type"), **spec, bos_token_id=EOS, eos_token_id=EOS,
                                  pad_token_id=EOS)
    config.architectures = ["Qwen3_5ForCausalLM" if arch == "qwen3_5" else "Mamba2ForCausalLM"]
    return config


def cmd_data(out: Path) -> None:
    """Corpus of the shipped recipe through edgelin's pipeline (cached in runs/peers/.cache)."""
    from edgelin.train import Recipe, build_corpus

    corpus = build_corpus(Recipe.load(RECIPE), out.parent / ".cache")
    out.mkdir(parents=True, exist_ok=True)
    assert max(corpus.train.max(), corpus.val.max()) < VOCAB
    np.savez(out / "tokens.npz", train=corpus.train.astype(np.uint16), val=corpus.val.astype(np.uint16))
    (out / "tokenizer.json").write_bytes(corpus.tokenizer_path.read_bytes())
    print(f"{out}: {len(corpus.train):,} train / {len(corpus.val):,} val tokens")


def write_tokenizer(data: Path, out: Path) -> None:
    """tokenizer.json + tokenizer_config.json (PreTrainedTokenizerFast), as transformers and llama.cpp read."""
    from transformers import PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast(tokenizer_file=str(data / "tokenizer.json"), bos_token="<|endoftext|>",
                                  eos_token="<|endoftext|>", pad_token="<|endoftext|>")
    tok.save_pretrained(str(out))


def lr_at(step: int) -> float:
    """Linear warmup, then cosine to 10% (edgelin.train.lr_at's schedule)."""
    if step < TRAIN["warmup"]:
        return TRAIN["lr"] * (step + 1) / TRAIN["warmup"]
    progress = (step - TRAIN["warmup"]) / max(1, TRAIN["steps"] - TRAIN["warmup"])
    return TRAIN["lr"] * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))


def cmd_train(arch: str, data: Path, out: Path, device: str, steps: int | None, batch: int | None,
              max_seconds: float) -> None:
    import torch
    import transformers
    from transformers import AutoModelForCausalLM

    TRAIN.update({k: v for k, v in (("steps", steps), ("batch_size", batch)) if v})  # smoke runs
    torch.manual_seed(TRAIN["seed"])
    rng = np.random.default_rng(TRAIN["seed"])
    arrays = np.load(data / "tokens.npz")
    stream, val = arrays["train"].astype(np.int64), arrays["val"].astype(np.int64)
    model = AutoModelForCausalLM.from_config(make_config(arch)).to(device)
    params = sum(p.numel() for p in model.parameters())
    decay = [p for p in model.parameters() if p.ndim >= 2]
    rest = [p for p in model.parameters() if p.ndim < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": TRAIN["weight_decay"]},
                             {"params": rest, "weight_decay": 0.0}], lr=TRAIN["lr"], betas=(0.9, 0.95))
    L, B = TRAIN["seq_len"], TRAIN["batch_size"]
    autocast = torch.autocast("cuda", torch.bfloat16) if device.startswith("cuda") else torch.autocast(
        "cpu", enabled=False)

    def loss_of(ids: np.ndarray) -> torch.Tensor:
        batch = torch.from_numpy(ids).to(device)
        with autocast:
            return model(input_ids=batch, labels=batch, use_cache=False).loss

    losses, t0 = [], time.perf_counter()
    model.train()
    for step in range(TRAIN["steps"]):
        for group in opt.param_groups:
            group["lr"] = lr_at(step)
        starts = rng.integers(0, len(stream) - L - 1, B)
        loss = loss_of(np.stack([stream[s:s + L] for s in starts]))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), TRAIN["grad_clip"])
        opt.step()
        losses.append(round(loss.item(), 4))
        if step % 50 == 0 or step == TRAIN["steps"] - 1:
            print(f"{arch} step {step} loss {losses[-1]:.3f} {time.perf_counter() - t0:.1f}s", flush=True)
        if time.perf_counter() - t0 > max_seconds:  # a time-boxed run: save what it reached, say so in the log
            print(f"{arch}: stopped at step {step + 1} by --max-seconds {max_seconds:g}", flush=True)
            break
    train_s = time.perf_counter() - t0
    model.eval()
    with torch.no_grad():
        starts = np.arange(0, len(val) - L - 1, L)[:2 * B]
        val_loss = float(np.mean([loss_of(np.stack([val[s:s + L] for s in starts[i:i + B]])).item()
                                  for i in range(0, len(starts), B)]))
    model.to(torch.float16)  # rounded to fp16 to travel; every runtime here loads these values in fp32
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out), max_shard_size="15MB")
    log = {"arch": arch, "parameters": params, "train": TRAIN, "steps_done": len(losses), "config": ARCHS[arch],
           "device": device,
           "gpu": torch.cuda.get_device_name() if device.startswith("cuda") else None,
           "torch": torch.__version__, "transformers": transformers.__version__, "train_seconds": round(train_s, 1),
           "final_train_loss": float(np.mean(losses[-20:])), "val_loss": round(val_loss, 4), "val_windows": len(starts),
           "losses": losses}
    (out / "training_log.json").write_text(json.dumps(log, indent=1))
    print(f"{arch}: {params / 1e6:.2f}M parameters, {len(losses)} steps in {train_s:.1f}s, "
          f"val loss {val_loss:.3f}", flush=True)


class _NoFla:
    """Import hook: `fla` is unimportable, so transformers takes its pure-torch Qwen3.5/Mamba2 paths (with fla
    importable it picks fla's Triton kernels, which fail on CPU); every runtime here runs the same math."""

    @staticmethod
    def find_spec(name: str, path: Any = None, target: Any = None) -> None:
        if name == "fla" or name.startswith("fla."):
            raise ModuleNotFoundError(f"No module named {name!r} (blocked by the peers benchmark)")


def block_fla() -> None:
    import sys

    if not any(isinstance(f, _NoFla) for f in sys.meta_path):
        sys.meta_path.insert(0, _NoFla())


def main() -> None:
    block_fla()
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("command", choices=["data", "train", "tokenizer", "sizes"])
    parser.add_argument("--arch", choices=sorted(ARCHS))
    parser.add_argument("--data", type=Path, default=ROOT / "runs" / "peers" / "data")
    parser.add_argument("--out", type=Path)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--steps", type=int)
    parser.add_argument("--batch-size", type=int)
    parser.add_argument("--max-seconds", type=float, default=math.inf)
    args = parser.parse_args()
    if args.command == "data":
        cmd_data(args.out or args.data)
    elif args.command == "tokenizer":
        write_tokenizer(args.data, args.out)
    elif args.command == "sizes":
        import torch
        from transformers import AutoModelForCausalLM

        for arch in ARCHS:
            with torch.device("meta"):
                model = AutoModelForCausalLM.from_config(make_config(arch))
            print(arch, f"{sum(p.numel() for p in model.parameters()) / 1e6:.2f}M")
    else:
        cmd_train(args.arch, args.data, args.out, args.device, args.steps, args.batch_size, args.max_seconds)


if __name__ == "__main__":
    main()
