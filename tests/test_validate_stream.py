"""validate --against (the full check against the checkpoint) streams its rollout: the reference runs
window by window (never over the whole sequence), the progress callback moves from the first window
on, and peak memory does not grow with the step count (issue 7.13: 100000 steps used to grow to 10 GB)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

import edgelin.validate as validate_module
from edgelin.export.pipeline import export_checkpoint
from edgelin.validate import MAX_WINDOW, validate
from helpers import make_checkpoint

VOCAB = 8192  # heavy per-position logits: 2 x 8192 floats = 64 KiB per position at batch 2


@pytest.fixture(scope="module")
def big_vocab(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("stream")
    ckpt = make_checkpoint(root / "ckpt", "hybrid", tokenizer=False, vocab_size=VOCAB)
    return export_checkpoint(ckpt, root / "out").folder


@pytest.mark.slow
def test_reference_runs_in_windows_and_progress_moves(big_vocab, monkeypatch):
    load = validate_module.load_reference
    lengths: list[int] = []

    def spying_load(manifest, against):
        model = load(manifest, against)
        forward = model.forward

        def spy(ids, *args, **kwargs):
            lengths.append(ids.shape[1])
            return forward(ids, *args, **kwargs)

        model.forward = spy
        return model

    monkeypatch.setattr(validate_module, "load_reference", spying_load)
    progress: list[tuple[int, int]] = []
    steps, prompt = 300, 8
    report = validate(big_vocab, steps=steps, prompt_len=prompt, batch=2,
                      on_progress=lambda done, total: progress.append((done, total)))
    assert report.passed, [m.to_dict() for m in report.failures]
    assert {m.check for m in report.metrics} == {"prefill", "rollout", "final", "prefill-vs-steps"}
    # 2 x 8192 x 4 bytes per position: the 8 MiB window budget gives 128 positions per window
    window = 128
    chunked = [n for n in lengths if n > 1]
    assert chunked == [prompt, window, window, steps - 2 * window], lengths
    assert max(lengths) <= MAX_WINDOW and steps + prompt not in lengths
    # the prefill counts as `prompt` at once, then every step moves the bar, up to the total
    assert progress == [(i, 2 * prompt + steps) for i in range(prompt, 2 * prompt + steps + 1)]


CHILD = """
import resource, sys
from edgelin.validate import validate
report = validate(sys.argv[1], steps=int(sys.argv[2]), prompt_len=8, batch=2)
assert report.passed, [m.to_dict() for m in report.failures]
print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
"""


def peak_rss(folder: Path, steps: int) -> int:
    proc = subprocess.run([sys.executable, "-c", CHILD, str(folder), str(steps)], capture_output=True, text=True,
                          timeout=300, cwd=Path(__file__).parent.parent)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return int(proc.stdout.split()[-1])


@pytest.mark.slow
def test_validate_memory_does_not_grow_with_steps(big_vocab):
    """Peak RSS at 2000 steps vs 200: the old code held [2, 8 + steps, 8192] float32 reference logits
    (and computed them in one forward), 1800 more positions = 112 MiB more (measured: +122 MiB);
    streaming holds one window (measured: +1 to +13 MiB, the spread between two processes)."""
    small, large = peak_rss(big_vocab, 200), peak_rss(big_vocab, 2000)
    assert large - small < 32 << 20, f"peak RSS grew by {(large - small) / 2**20:.1f} MiB (200 -> 2000 steps)"
