"""A model trained with its own library (transformers' Qwen3.5, a few hundred CPU steps on Python
source): transformers' greedy generate() and `edgelin generate` on the exported ONNX agree token for
token."""

from __future__ import annotations

import glob
import re
import sysconfig

import pytest
import torch

from edgelin.export.pipeline import export_checkpoint
from edgelin.generate import Sampling, generate
from edgelin.tokenizer import TextTokenizer
from helpers import make_tokenizer
from upstream_hf import tiny_qwen35

STEPS, SEQ, BATCH = 200, 48, 8


def corpus_ids(tokenizer: TextTokenizer) -> torch.Tensor:
    files = sorted(glob.glob(sysconfig.get_paths()["stdlib"] + "/*.py"))[:6]
    text = "\n".join(open(f, encoding="utf-8", errors="replace").read() for f in files)
    # Runs of indentation dominate Python source; folded, a tiny model learns words within its budget.
    return torch.tensor(tokenizer.encode(re.sub(r"\s+", " ", text)[:200_000]))


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    root = tmp_path_factory.mktemp("trained")
    tokenizer = TextTokenizer(make_tokenizer(root / "tokenizer.json", vocab_size=256))
    model = tiny_qwen35(root / "ckpt", vocab=256)
    model.train()
    data = corpus_ids(tokenizer)
    gen = torch.Generator().manual_seed(0)
    opt = torch.optim.AdamW(model.parameters(), lr=5e-3)
    losses = []
    for _ in range(STEPS):
        starts = torch.randint(0, len(data) - SEQ - 1, (BATCH,), generator=gen)
        batch = torch.stack([data[s:s + SEQ + 1] for s in starts])
        loss = model(batch[:, :-1], labels=batch[:, :-1].clone()).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    model.eval()
    model.save_pretrained(root / "ckpt", safe_serialization=True)
    (root / "ckpt" / "tokenizer.json").write_bytes((root / "tokenizer.json").read_bytes())
    return model, tokenizer, root / "ckpt", losses


def test_training_learned_something(trained):
    losses = trained[3]
    assert sum(losses[-20:]) / 20 < sum(losses[:20]) / 20 - 1.5


@pytest.mark.slow
def test_greedy_generations_identical_token_for_token(trained, tmp_path):
    model, tokenizer, ckpt, _ = trained
    folder = export_checkpoint(ckpt, tmp_path / "onnx").folder
    for prompt in ("def main(", "import os\n", "class Path:"):
        ids = torch.tensor([tokenizer.encode(prompt)])
        with torch.no_grad():
            upstream = model.generate(ids, max_new_tokens=48, do_sample=False)[0, ids.shape[1]:].tolist()
        ours = generate(folder, prompt, 48, Sampling(greedy=True), stop_at_eos=False).token_ids
        assert ours == upstream, (prompt, tokenizer.decode(ours), tokenizer.decode(upstream))
        assert len(set(ours)) > 3  # a trained model, not a constant
