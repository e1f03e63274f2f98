"""An ONNX export's decode step at 1 thread, 2 threads, and 2 threads with ONNX Runtime's spinning off,
each in a fresh process (one thread pool per session, as `edgelin bench` runs it), alternating.

    python bench/step_threads.py EXPORT_DIR [--rounds 3] [--prefill 1024] [--steps 400]

Per round, one process per setting in turn: a prefill of --prefill tokens, then --steps greedy steps at
B=1; the figure is the median step (wall time, perf_counter around runner.step, after 50 warm-up steps).
Prints every round and the ratio of each setting's median over rounds to 1 thread's. Not a test.
Why fresh processes: two sessions' thread pools in one process (say a second graph timed beside the
runner's step) contend for the cores while their workers spin, which measures the contention.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

SETTINGS = {"1 thread": (1, True), "2 threads": (2, True), "2 threads, no spinning": (2, False)}
WARMUP = 50


def child(folder: Path, threads: int, spinning: bool, prefill_tokens: int, steps: int) -> float:
    """The median step in ms, in this process."""
    import edgelin.export.onnx.runner as onnx_runtime
    from edgelin.runtime import open_runner, prefill

    options = onnx_runtime._options

    def with_spinning(ort, *args, **kwargs):  # the runner's own options, plus the one setting under test
        session_options = options(ort, *args, **kwargs)
        if not spinning:
            session_options.add_session_config_entry("session.intra_op.allow_spinning", "0")
        return session_options

    onnx_runtime._options = with_spinning
    runner = open_runner(folder, threads=threads)
    state = runner.new_state(1)
    prompt = np.random.default_rng(0).integers(0, runner.manifest.vocab_size, (1, prefill_tokens))
    logits, _ = prefill(runner, prompt, state)
    token, times = int(logits.argmax()), []
    for i in range(WARMUP + steps):
        began = time.perf_counter()
        logits = runner.step(np.array([token]), state, np.array([prefill_tokens + i]))
        times.append(time.perf_counter() - began)
        token = int(logits.argmax())
    return 1e3 * float(np.median(times[WARMUP:]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("folder", type=Path)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--prefill", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--child", nargs=2, metavar=("THREADS", "SPINNING"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(child(args.folder, int(args.child[0]), args.child[1] == "1", args.prefill, args.steps))
        return
    medians: dict[str, list[float]] = {name: [] for name in SETTINGS}
    for round_ in range(args.rounds):
        for name, (threads, spinning) in SETTINGS.items():
            out = subprocess.run([sys.executable, __file__, str(args.folder), "--prefill", str(args.prefill),
                                  "--steps", str(args.steps), "--child", str(threads), str(int(spinning))],
                                 check=True, capture_output=True, text=True).stdout
            medians[name].append(float(out.split()[-1]))
            print(f"round {round_ + 1}: {name}: step p50 {medians[name][-1]:.3f} ms", flush=True)
    base = float(np.median(medians["1 thread"]))
    for name, values in medians.items():
        print(f"{name}: median over rounds {np.median(values):.3f} ms, x{np.median(values) / base:.3f} of 1 thread")


if __name__ == "__main__":
    main()
