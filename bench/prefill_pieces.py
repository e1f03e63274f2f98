"""Prefill piece lengths side by side: tokens/s and peak RSS of one export's prefill of a prompt, cut into pieces of
at most each --pieces length (edgelin.runtime.prefill's chunk), each run in a fresh process so that its peak RSS is
its own; a benchmark, not a test.

    python bench/prefill_pieces.py EXPORT [--pieces 2048,256] [--tokens 2048] [--threads 1] [--rounds 2]

Rounds interleave the lengths (the order reversed every other round); printed per length: the median prefill
tokens/s, the median peak RSS (ru_maxrss of the child) and the resident memory after the prefill, and the median
over rounds of the per-round ratios to the first length. The prompt: seeded random ids over the vocabulary.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

import numpy as np

CHILD = """
import json, resource, sys, time
import numpy as np
from edgelin.runtime import open_runner, prefill, rss_bytes
folder, tokens, piece, threads = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
runner = open_runner(folder, threads=threads)
ids = np.random.default_rng(0).integers(0, runner.manifest.vocab_size, (1, tokens))
began = time.perf_counter()
prefill(runner, ids, chunk=piece)
took = time.perf_counter() - began
print(json.dumps({"tok_s": tokens / took, "peak": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
                  "after": rss_bytes()}))
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("export")
    parser.add_argument("--pieces", default="2048,256")
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    pieces = [int(p) for p in args.pieces.split(",")]
    runs: dict[int, list[dict]] = {p: [] for p in pieces}
    for r in range(args.rounds):
        for piece in (pieces if r % 2 == 0 else pieces[::-1]):
            out = subprocess.run([sys.executable, "-c", CHILD, args.export, str(args.tokens), str(piece),
                                  str(args.threads)], capture_output=True, text=True, check=True).stdout
            runs[piece].append(json.loads(out.strip().splitlines()[-1]))
            print(f"round {r + 1}, pieces of {piece}: {runs[piece][-1]['tok_s']:.1f} tok/s, peak RSS "
                  f"{runs[piece][-1]['peak'] / 2**20:.0f} MiB", flush=True)
    first = pieces[0]
    for piece in pieces:
        speed = [run["tok_s"] for run in runs[piece]]
        ratio = np.median([run["tok_s"] / base["tok_s"] for run, base in zip(runs[piece], runs[first])])
        print(f"pieces of {piece}: {np.median(speed):.1f} tok/s (x{ratio:.2f} of {first}'s), peak RSS "
              f"{np.median([run['peak'] for run in runs[piece]]) / 2**20:.0f} MiB, after the prefill "
              f"{np.median([run['after'] for run in runs[piece]]) / 2**20:.0f} MiB")


if __name__ == "__main__":
    main()
