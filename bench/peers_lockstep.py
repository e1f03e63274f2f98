"""Two runtimes' decode steps timed in lockstep: a benchmark (not a test) for a host whose speed drifts.

bench/peers.py runs each runtime in its own process, one after the other; on a host whose speed moves 2-3x within
minutes, a pair of cells can straddle a change. Here both runtimes live in resident worker processes (each under
its own Python: edgelin's venv, llama-cpp-python's), prefilled to the same position, and the driver alternates
them block by block (A B, then B A, ...): each block of --steps decode steps gives one median per runtime, and
each round's ratio compares two blocks timed seconds apart. Printed: each runtime's median over blocks and the
median and range of the rounds' ratios (first / second).

    python bench/peers_lockstep.py /work/peers/ckpt/qwen3_5 --threads 1 --position 1024 --rounds 20 \\
        edgelin-int4=.venv/bin/python:/work/peers/work/qwen3_5/edgelin-int4-kv34944 \\
        llama-q4_0=/work/peers/venv-llama/bin/python:/work/peers/work/qwen3_5/llama-q4_0.gguf
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve()


def serve(kind: str, artifact: str, threads: int, position: int, n_ctx: int, vocab: int) -> None:
    """Worker: prefill `position` seeded tokens (ids below `vocab`, the same in every worker), then answer each stdin
    line `N` with N greedy steps' times (ms)."""
    sys.path.insert(0, str(HERE.parent))
    from peers import EdgelinSession, LlamaSession

    session = EdgelinSession(artifact, threads) if kind == "edgelin" else LlamaSession(artifact, threads, n_ctx)
    logits = session.prefill(np.random.default_rng(0).integers(0, vocab, position).astype(np.int64))
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        times = []
        for _ in range(int(line)):
            began = time.perf_counter()
            logits = session.step(int(np.argmax(logits)))
            times.append((time.perf_counter() - began) * 1e3)
        print(json.dumps(times), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("checkpoint", type=Path, help="the checkpoint both artifacts were made from (its "
                        "config.json's vocab_size bounds the prompt ids, as in bench/peers.py)")
    parser.add_argument("runtimes", nargs=2, help="NAME=PYTHON:ARTIFACT (NAME starting with 'edgelin' or 'llama')")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--position", type=int, default=1024)
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--steps", type=int, default=32, help="decode steps per block")
    args = parser.parse_args()
    vocab = json.loads((args.checkpoint / "config.json").read_text())["vocab_size"]
    workers = {}
    for spec in args.runtimes:
        name, rest = spec.split("=", 1)
        python, artifact = rest.split(":", 1)
        kind = "edgelin" if name.startswith("edgelin") else "llama"
        n_ctx = args.position + args.rounds * args.steps + 16
        workers[name] = subprocess.Popen(
            [python, str(HERE), "--serve", kind, artifact,
             *(str(n) for n in (args.threads, args.position, n_ctx, vocab))],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    for name, proc in workers.items():
        assert json.loads(proc.stdout.readline())["ready"], name
    names, blocks = list(workers), {name: [] for name in workers}
    for r in range(args.rounds):
        for name in (names if r % 2 == 0 else names[::-1]):
            workers[name].stdin.write(f"{args.steps}\n")
            workers[name].stdin.flush()
            blocks[name].append(float(np.median(json.loads(workers[name].stdout.readline()))))
    for proc in workers.values():
        proc.stdin.close()
        proc.wait()
    ratios = np.array(blocks[names[0]]) / np.array(blocks[names[1]])
    last = args.position + args.rounds * args.steps
    print(f"{args.threads} thread(s), positions {args.position}-{last}, {args.rounds} rounds of {args.steps} steps")
    for name in names:
        print(f"  {name}: median of block medians {np.median(blocks[name]):.3f} ms "
              f"(blocks {min(blocks[name]):.3f}-{max(blocks[name]):.3f})")
    print(f"  {names[0]} / {names[1]}: x{np.median(ratios):.2f} (rounds {ratios.min():.2f}-{ratios.max():.2f})")


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--serve":
        serve(sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5]), int(sys.argv[6]), int(sys.argv[7]))
    else:
        main()
