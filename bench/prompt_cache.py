"""`edgelin generate --prompt-cache` against a plain run, side by side in one process (not a test).

    python bench/prompt_cache.py FOLDER [--system-tokens 4000] [--rounds 5] [--new-tokens 16] [--threads 1]

The system prompt: the first --system-tokens tokens of docs/precision.md (repeated if short) as the export's
tokenizer cuts them; the cache is made once from it (`-n 0`). Each round then runs the system prompt plus a new
question plainly and from the cache, alternating which goes first; printed per round: the tokens prefilled, the
prefill wall time (ms) of both, their ratio, and whether both gave the same greedy tokens; then the medians.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

from edgelin.generate import Sampling, StateFiles, generate
from edgelin.tokenizer import TextTokenizer

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folder", type=Path)
    parser.add_argument("--system-tokens", type=int, default=4000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    tokenizer = TextTokenizer(args.folder / "tokenizer.json")
    ids = tokenizer.encode((ROOT / "docs" / "precision.md").read_text())
    while len(ids) < args.system_tokens:
        ids = ids + ids
    system = tokenizer.decode(ids[:args.system_tokens])
    greedy = Sampling(greedy=True)
    with tempfile.TemporaryDirectory() as tmp:
        cache = Path(tmp) / "system.edgestate"
        made = generate(args.folder, system, 0, greedy, threads=args.threads, states=StateFiles(prompt_cache=cache))
        print(f"cache: {made.prefilled_tokens} tokens prefilled in {made.prefill_seconds * 1e3:.1f} ms, "
              f"{cache.stat().st_size / 1024:.0f} KiB")
        ratios, plain_ms, cached_ms = [], [], []
        for r in range(args.rounds):
            prompt = f"{system}\n# Question {r}: what does the state hold?\n"
            runs = {}
            for kind in (("plain", "cached") if r % 2 == 0 else ("cached", "plain")):
                states = StateFiles(prompt_cache=cache) if kind == "cached" else StateFiles()
                runs[kind] = generate(args.folder, prompt, args.new_tokens, greedy, stop_at_eos=False,
                                      threads=args.threads, states=states)
            plain, cached = runs["plain"], runs["cached"]
            plain_ms.append(plain.prefill_seconds * 1e3)
            cached_ms.append(cached.prefill_seconds * 1e3)
            ratios.append(cached.prefill_seconds / plain.prefill_seconds)
            print(f"round {r}: plain {plain.prefilled_tokens} tokens {plain_ms[-1]:.1f} ms, cached "
                  f"{cached.prefilled_tokens} tokens ({cached.reused_tokens} reused) {cached_ms[-1]:.1f} ms, "
                  f"cached / plain x{ratios[-1]:.3f}, same tokens: {plain.token_ids == cached.token_ids}")
        print(f"median: plain {statistics.median(plain_ms):.1f} ms, cached {statistics.median(cached_ms):.1f} ms, "
              f"cached / plain x{statistics.median(ratios):.3f}")


if __name__ == "__main__":
    main()
