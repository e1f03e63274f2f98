"""Test helpers: tiny checkpoints in the real on-disk format, and a small BPE tokenizer."""

from __future__ import annotations

import glob
import sysconfig
from pathlib import Path

import torch

from conftest import family_layers, tiny_config
from edgelin.checkpoint import save_checkpoint
from edgelin.export.pipeline import export_checkpoint
from edgelin.model.lm import CausalLM


def make_tokenizer(path: Path, vocab_size: int = 97) -> Path:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    files = sorted(glob.glob(sysconfig.get_paths()["stdlib"] + "/*.py"))[:3]
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train(files, trainer)
    tok.save(str(path))
    return path


def make_checkpoint(folder: Path, family: str = "hybrid", tokenizer: bool = True, seed: int = 0, **changes) -> Path:
    torch.manual_seed(seed)
    vocab = changes.pop("vocab_size", 97)
    model = CausalLM(tiny_config(family_layers(family), vocab_size=max(vocab, 256 if tokenizer else vocab), **changes))
    tok = make_tokenizer(folder.parent / f"{folder.name}-tokenizer.json", model.config.vocab_size) if tokenizer else None
    return save_checkpoint(model, folder, tok)


def export_family(root: Path, family: str, **changes) -> Path:
    ckpt = make_checkpoint(root / f"{family}-ckpt", family, tokenizer=False, **changes)
    return export_checkpoint(ckpt, root / f"{family}-onnx").folder
