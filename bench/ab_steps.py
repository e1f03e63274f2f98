"""Two exports' decode steps side by side in one process, interleaved: a before/after that host drift cannot bias.

    python bench/ab_steps.py BEFORE_DIR AFTER_DIR [--prefill 1024] [--steps 400] [--threads 1] [--runs 3]

Both folders are opened in this process (each runner with --threads intra-op threads), each prefills the same
random prompt (in pieces of 2,048 tokens), then their greedy steps alternate A, B, B, A, A, B, ... Per run it
prints each one's median step time and the median over step pairs of the ratio AFTER / BEFORE (the first 20
pairs dropped as warm-up). Both sessions share the caches, so absolute times run higher than in a process of their
own; the ratio is the figure.
Not a test.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np

from edgelin.runtime import open_runner

WARMUP = 20


def one_run(folders: list[Path], prefill: int, steps: int, threads: int, seed: int) -> tuple[float, float, float]:
    """(median ms before, median ms after, median of per-pair ratios after / before)."""
    runners = [open_runner(folder, threads=threads) for folder in folders]
    vocab = runners[0].manifest.vocab_size
    prompt = np.random.default_rng(seed).integers(0, vocab, (1, prefill))
    states = [runner.new_state(1) for runner in runners]
    tokens = []
    for runner, state in zip(runners, states):  # in pieces of 2,048 tokens, as bench/peers.py reaches a position
        for start in range(0, prefill, 2048):
            logits = runner.prefill(prompt[:, start:start + 2048], state, np.full(1, start, np.int64))
        tokens.append(int(logits.argmax()))
    times: list[list[float]] = [[], []]
    for t in range(steps):
        for i in (0, 1) if t % 2 == 0 else (1, 0):
            began = time.perf_counter()
            logits = runners[i].step(np.array([tokens[i]]), states[i], np.array([prefill + t]))
            times[i].append(time.perf_counter() - began)
            tokens[i] = int(logits.argmax())
    before, after = (np.array(x[WARMUP:]) for x in times)
    return float(np.median(before)) * 1e3, float(np.median(after)) * 1e3, float(np.median(after / before))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("before", type=Path)
    parser.add_argument("after", type=Path)
    parser.add_argument("--prefill", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    if args.steps <= WARMUP:
        parser.error(f"--steps must be > {WARMUP}")
    for run in range(args.runs):
        before, after, ratio = one_run([args.before, args.after], args.prefill, args.steps, args.threads, run)
        print(f"run {run + 1}: before {before:.3f} ms, after {after:.3f} ms, median(after / before) {ratio:.3f}",
              flush=True)


if __name__ == "__main__":
    main()
