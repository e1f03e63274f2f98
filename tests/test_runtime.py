"""Sampling, checkpoint loading details, and constant memory while decoding."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from edgelin.checkpoint import load_model
from edgelin.errors import EdgelinError
from edgelin.export.pipeline import export_checkpoint
from edgelin.generate import Sampling, sample
from helpers import make_checkpoint


def test_greedy_is_argmax():
    logits = np.array([0.1, 3.0, -1.0, 2.9])
    assert sample(logits, Sampling(greedy=True), np.random.default_rng(0)) == 1


def test_top_k_and_top_p_restrict_the_support():
    rng = np.random.default_rng(0)
    logits = np.log(np.array([0.5, 0.3, 0.15, 0.05]))
    draws = {sample(logits, Sampling(temperature=1.0, top_k=2, top_p=1.0), rng) for _ in range(300)}
    assert draws == {0, 1}
    draws = {sample(logits, Sampling(temperature=1.0, top_k=0, top_p=0.6), rng) for _ in range(300)}
    assert draws == {0, 1}  # 0.5 < 0.6 <= 0.8
    draws = {sample(logits, Sampling(temperature=1.0, top_k=0, top_p=1.0), rng) for _ in range(2000)}
    assert draws == {0, 1, 2, 3}


def test_bad_sampling_arguments():
    with pytest.raises(EdgelinError, match="temperature"):
        Sampling(temperature=0)
    with pytest.raises(EdgelinError, match="top-p"):
        Sampling(top_p=1.5)


def test_sharded_checkpoint_loads_like_the_single_file(tmp_path):
    ckpt = make_checkpoint(tmp_path / "ckpt", "gated_deltanet", tokenizer=False)
    model, _ = load_model(ckpt)
    tensors = load_file(str(ckpt / "model.safetensors"))
    names = sorted(tensors)
    half = len(names) // 2
    shards = {"model-00001-of-00002.safetensors": names[:half], "model-00002-of-00002.safetensors": names[half:]}
    for file, keys in shards.items():
        save_file({k: tensors[k] for k in keys}, str(ckpt / file))
    (ckpt / "model.safetensors").unlink()
    index = {"weight_map": {k: f for f, keys in shards.items() for k in keys}}
    (ckpt / "model.safetensors.index.json").write_text(json.dumps(index))
    sharded, _ = load_model(ckpt)
    ids = torch.randint(0, 97, (1, 9))
    with torch.no_grad():
        assert torch.equal(model(ids)[0], sharded(ids)[0])
    (ckpt / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(EdgelinError, match="missing shards model-00002-of-00002"):
        load_model(ckpt)


def test_index_naming_a_file_outside_the_checkpoint(tmp_path):
    ckpt = make_checkpoint(tmp_path / "ckpt", "gla", tokenizer=False)
    (ckpt / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"a": "../../etc/passwd"}}))
    with pytest.raises(EdgelinError, match="escapes the checkpoint folder"):
        load_model(ckpt)


def test_decoding_memory_is_flat(tmp_path):
    """3000 sampled tokens through ONNX Runtime, as a user runs them (`edgelin generate --ignore-eos` in its
    own process: a test worker's earlier tests leave its allocator in states no user process has): RSS after
    the first steps does not grow."""
    ckpt = make_checkpoint(tmp_path / "ckpt", "hybrid")
    out = export_checkpoint(ckpt, tmp_path / "out").folder
    proc = subprocess.run([sys.executable, "-m", "edgelin.cli", "generate", str(out), "--prompt", "import os",
                           "-n", "3000", "--seed", "1", "--ignore-eos", "--json"],
                          capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout)
    assert result["new_tokens"] == 3000 and len(result["token_ids"]) == 3000
    assert result["rss_growth_bytes"] < 1 << 20, f"RSS grew by {result['rss_growth_bytes']} bytes"


def test_generate_reports_rss_growth_only_once_the_runtime_settled():
    """Before SETTLE_STEPS tokens the start figure predates the step session's buffers: `-n 10` showed
    growth that was only their allocation. Then the growth is None, not a number that reads as a leak."""
    from edgelin.generate import SETTLE_STEPS, GenerateResult

    short = GenerateResult(3, SETTLE_STEPS, 0.1, 0.1, 100 << 20, 102 << 20, None, None)
    long = GenerateResult(3, SETTLE_STEPS + 1, 0.1, 0.1, 100 << 20, 100 << 20, None, None)
    assert short.to_dict()["rss_growth_bytes"] is None and not short.rss_settled
    assert long.to_dict()["rss_growth_bytes"] == 0 and long.rss_settled
