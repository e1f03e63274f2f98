"""What Triton Inference Server costs per token: concurrent conversations through `edgelin serve` against the same
model run locally in one process at the same batch, side by side in one run (not a test).

    python bench/serve_triton.py FOLDER --env SERVE_VENV [--concurrency 1,8,32] [--steps 64] [--prompt 16]
        [--rounds 3]

FOLDER: an export written with --serve triton (its [serving] limits decide how many sequences the server holds and
batches: export with a profile whose max_batch_size and max_candidate_sequences reach the largest concurrency).
Per round and concurrency C, alternating which goes first:
- server: C client threads (this process, gRPC), each prefilling its own --prompt random tokens in one request,
  then --steps greedy steps answered with the next token only; tokens/s = C * steps / wall time of the steps
  phase; each step request's latency (client-side wall, send to answer) gives p50 / p99.
- local: one Conversation of batch C over the same folder (edgelin's runner in this process), prefilled, then the
  same number of steps; tokens/s = C * steps / wall; the per-step wall gives p50 / p99.
Printed: the medians over rounds and the server / local ratios. The clients and the server share this machine's
cores with each other (a remote client would not).
"""

from __future__ import annotations

import argparse
import socket
import statistics
import threading
import time
from pathlib import Path

import numpy as np

from edgelin.conversation import Conversation
from edgelin.runtime import open_runner
from edgelin.serve.client import ServedConversation
from edgelin.serve.server import ServeRequest, TritonServer


def _free_ports() -> list[int]:
    sockets = [socket.socket() for _ in range(3)]
    for s in sockets:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in sockets]
    for s in sockets:
        s.close()
    return ports


def served(server: TritonServer, prompts: np.ndarray, steps: int) -> tuple[float, list[float]]:
    """(tokens/s of the steps phase, every step request's latency in ms)."""
    latencies: list[list[float]] = [[] for _ in prompts]
    ready = threading.Barrier(len(prompts) + 1)
    done = threading.Barrier(len(prompts) + 1)

    def client(i: int) -> None:
        with ServedConversation(server.grpc_url, server.model) as conv:
            token = conv.next_token(prompts[i])
            ready.wait()
            for _ in range(steps):
                sent = time.perf_counter()
                token = conv.next_token(token)
                latencies[i].append((time.perf_counter() - sent) * 1e3)
            done.wait()

    threads = [threading.Thread(target=client, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    ready.wait()
    started = time.perf_counter()
    done.wait()
    wall = time.perf_counter() - started
    for t in threads:
        t.join()
    return len(prompts) * steps / wall, [x for row in latencies for x in row]


def local(folder: Path, prompts: np.ndarray, steps: int) -> tuple[float, list[float]]:
    conv = Conversation(open_runner(folder), batch=len(prompts), keep=0, record=False)
    tokens = np.argmax(conv.prefill(prompts), axis=-1)
    latencies = []
    started = time.perf_counter()
    for _ in range(steps):
        sent = time.perf_counter()
        tokens = np.argmax(conv.step(tokens), axis=-1)
        latencies.append((time.perf_counter() - sent) * 1e3)
    return len(prompts) * steps / (time.perf_counter() - started), latencies


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folder", type=Path)
    parser.add_argument("--env", type=Path, required=True, help="The serving environment (make serve-env).")
    parser.add_argument("--concurrency", default="1,8,32")
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--prompt", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    levels = [int(c) for c in args.concurrency.split(",")]
    vocab = open_runner(args.folder).manifest.vocab_size
    rng = np.random.default_rng(0)
    grpc, http, metrics = _free_ports()
    results: dict[tuple[str, int], list[tuple[float, float, float]]] = {}
    with TritonServer(ServeRequest(args.folder, args.env, grpc_port=grpc, http_port=http,
                                   metrics_port=metrics)) as server:
        served(server, rng.integers(0, vocab, (2, args.prompt)), 4)  # warm-up: the model's first batches
        for r in range(args.rounds):
            for c in levels:
                prompts = rng.integers(0, vocab, (c, args.prompt))
                order = [("server", served), ("local", local)][:: 1 if r % 2 == 0 else -1]
                for name, run in order:
                    tps, lat = run(server if name == "server" else args.folder, prompts, args.steps)
                    results.setdefault((name, c), []).append(
                        (tps, float(np.percentile(lat, 50)), float(np.percentile(lat, 99))))
                    print(f"round {r} C={c:<3} {name:<6} {tps:9.1f} tok/s  p50 {np.percentile(lat, 50):7.2f} ms  "
                          f"p99 {np.percentile(lat, 99):7.2f} ms", flush=True)
    print(f"\nmedians over {args.rounds} rounds ({args.steps} steps after a {args.prompt}-token prompt; server: "
          f"{server.model}, next_token answers)")
    print(f"{'C':>3} | {'server tok/s':>12} {'p50 ms':>8} {'p99 ms':>8} | {'local tok/s':>11} {'p50 ms':>8} "
          f"{'p99 ms':>8} | server/local tok/s")
    for c in levels:
        s = [statistics.median(x) for x in zip(*results[("server", c)])]
        loc = [statistics.median(x) for x in zip(*results[("local", c)])]
        print(f"{c:>3} | {s[0]:12.1f} {s[1]:8.2f} {s[2]:8.2f} | {loc[0]:11.1f} {loc[1]:8.2f} {loc[2]:8.2f} | "
              f"x{s[0] / loc[0]:.2f}")


if __name__ == "__main__":
    main()
