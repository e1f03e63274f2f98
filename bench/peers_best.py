"""Each runtime's fastest round across saved `bench/peers.py --rounds N --json FILE` reports, and edgelin / peer at
the same weight precision on those: a benchmark summary (not a test) for a host with two speeds, where a round's
median can straddle them. A runtime's fastest round is its speed when nothing slowed the host; taking it for every
runtime alike compares those speeds. Prints per runtime the lowest p50 per position and the highest prefill
tokens/s, then the ratios (< 1: edgelin ahead for latency; > 1 for prefill).

    python bench/peers_best.py REPORT.json [REPORT.json ...] [--threads 2]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from peers import PRECISION


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("reports", type=Path, nargs="+")
    parser.add_argument("--threads", default="2")
    args = parser.parse_args()
    best: dict[str, dict] = {}
    for path in args.reports:
        for row in json.loads(path.read_text())["rows"]:
            for result in row.get("rounds", {}).get(args.threads, []):
                if "latency" not in result:
                    continue
                entry = best.setdefault(row["runtime"], {"prefill": 0.0, "p50": {}, "rounds": 0})
                entry["rounds"] += 1
                entry["prefill"] = max(entry["prefill"], result["prefill_tok_s"])
                for position, cell in result["latency"].items():
                    entry["p50"][position] = min(entry["p50"].get(position, float("inf")), cell["p50"])
    for runtime, entry in best.items():
        cells = " ".join(f"@{p} {v:.2f}" for p, v in entry["p50"].items())
        print(f"{runtime} (best of {entry['rounds']} rounds, {args.threads} threads): {cells} ms; prefill "
              f"{entry['prefill']:,.0f} tok/s")
    for ours, entry in best.items():
        if not ours.startswith("edgelin"):
            continue
        precision = PRECISION[ours.split("-")[1]]
        for peer, other in best.items():
            if peer.startswith("edgelin") or PRECISION.get(peer.split("-")[1]) != precision:
                continue
            cells = " ".join(f"@{p} {v / other['p50'][p]:.2f}" for p, v in entry["p50"].items() if p in other["p50"])
            print(f"{ours} / {peer}: {cells}; prefill {entry['prefill'] / other['prefill']:.2f}")


if __name__ == "__main__":
    main()
