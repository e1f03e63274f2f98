"""edgelin's one-token 4-bit and 8-bit products (edgelin/ortops/q4_gemv.c, q8_gemv.c) from memory, two builds of the
library side by side in one process: a before/after of a kernel change (not a test).

    python bench/q4_rows.py --before OLD/libedgelin_ortops.so [--shapes 2048x8512,4096x2048,2048x50288]
                            [--bits 4,8] [--mib 256] [--rounds 15] [--json FILE]

The current sources' library is built as the runner builds it (edgelin.ortops.build); --before names another
build (e.g. the cache entry of an earlier commit: ~/.cache/edgelin/ortops/<hash>/libedgelin_ortops.so), or
leave it out to time the current one alone. Each shape KxN (inputs x outputs) gets as many matrices as fill
--mib MiB (never less than 2), so one pass streams them from memory as a decode step does, not from the caches.
Each round times one pass per library (the order alternates); printed per shape and bit width: the median ms
per pass, the weight bytes (codes, scales, zero points) per second, the median over rounds of the per-round
ratio new / before, and whether both gave the same outputs (bit for bit), beside the machine's plain read rate
over the same bytes (numpy: the floor a product cannot beat). One thread. --json also writes the rows, the commit
and the machine (bench/real_sizes.py doc renders bench/results/real-sizes/q4-rows.json into docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from edgelin import ortops

sys.path.insert(0, str(Path(__file__).resolve().parent))
from real_sizes import ROOT, machine  # noqa: E402  (the same machine line as the real-size cells)


@dataclass(frozen=True)
class Matrices:
    """Random MatMulNBits tensors for `count` [K -> N] products of `bits` bits (blocks of 32)."""

    K: int
    N: int
    bits: int
    weights: list[np.ndarray]
    scales: list[np.ndarray]
    zero_points: list[np.ndarray]

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for group in (self.weights, self.scales, self.zero_points) for t in group)


def matrices(K: int, N: int, bits: int, mib: int, rng: np.random.Generator) -> Matrices:
    nb = (K + 31) // 32
    zero_bytes = (nb + 1) // 2 if bits == 4 else nb
    one = N * nb * (16 if bits == 4 else 32) + N * nb * 4 + N * zero_bytes
    count = max(2, mib * 2**20 // one)
    return Matrices(K, N, bits, [rng.integers(0, 256, (N, nb, 4 * bits), dtype=np.uint8) for _ in range(count)],
                    [rng.uniform(0.01, 0.1, N * nb).astype(np.float32) for _ in range(count)],
                    [rng.integers(0, 256, (N, zero_bytes), dtype=np.uint8) for _ in range(count)])


def load(path: str) -> ctypes.CDLL:
    lib = ctypes.CDLL(path, mode=ctypes.RTLD_LOCAL)
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    lib.edgelin_q4_scratch_bytes.restype, lib.edgelin_q4_scratch_bytes.argtypes = ctypes.c_size_t, [i64]
    for bits in (4, 8):
        getattr(lib, f"edgelin_q{bits}_quantize").argtypes = [ptr, i64, ptr]
        getattr(lib, f"edgelin_q{bits}_rows").argtypes = [ptr, i64, ptr, ptr, ptr, i64, i64, ptr]
    return lib


def one_pass(lib: ctypes.CDLL, m: Matrices, x: np.ndarray, y: np.ndarray) -> float:
    scratch = np.zeros(lib.edgelin_q4_scratch_bytes(m.K) + 64, np.uint8)
    quantize, rows = getattr(lib, f"edgelin_q{m.bits}_quantize"), getattr(lib, f"edgelin_q{m.bits}_rows")
    began = time.perf_counter()
    for w, s, z in zip(m.weights, m.scales, m.zero_points):
        quantize(x.ctypes.data, m.K, scratch.ctypes.data)
        rows(scratch.ctypes.data, m.K, w.ctypes.data, s.ctypes.data, z.ctypes.data, 0, m.N, y.ctypes.data)
    return time.perf_counter() - began


def read_floor(m: Matrices) -> float:
    """Seconds numpy takes to read every byte of the matrices once (a sum over 8-byte words)."""
    began = time.perf_counter()
    for group in (m.weights, m.scales, m.zero_points):
        for t in group:
            flat = t.reshape(-1).view(np.uint8)
            np.bitwise_xor.reduce(flat[: flat.size // 8 * 8].view(np.uint64))
    return time.perf_counter() - began


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", help="another build of libedgelin_ortops.so to compare with")
    parser.add_argument("--shapes", default="2048x8512,4096x2048,2048x50288")
    parser.add_argument("--bits", default="4,8")
    parser.add_argument("--mib", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--json", type=Path, help="also write the rows, commit and machine here")
    args = parser.parse_args()
    rows: list[dict] = []
    libs = {"new": load(str(ortops.build()))}
    if args.before:
        libs = {"before": load(args.before), **libs}
    rng = np.random.default_rng(0)
    for bits in (int(b) for b in args.bits.split(",")):
        for shape in args.shapes.split(","):
            K, N = (int(v) for v in shape.split("x"))
            m = matrices(K, N, bits, args.mib, rng)
            x = rng.standard_normal(K).astype(np.float32)
            outputs = {name: np.empty(N, np.float32) for name in libs}
            times: dict[str, list[float]] = {name: [] for name in libs}
            floors = []
            for r in range(args.rounds):
                for name in (list(libs) if r % 2 == 0 else list(libs)[::-1]):
                    times[name].append(one_pass(libs[name], m, x, outputs[name]))
                floors.append(read_floor(m))
            gb = m.nbytes / 1e9
            row = {"bits": bits, "K": K, "N": N, "matrices": len(m.weights), "bytes": m.nbytes,
                   "read_gb_per_s": gb / float(np.median(floors))}
            line = [f"{bits}-bit K={K} N={N} x{len(m.weights)} ({m.nbytes / 2**20:.0f} MiB):"]
            for name in libs:
                row[f"{name}_ms"] = float(np.median(times[name])) * 1e3
                line.append(f"{name} {row[f'{name}_ms']:.2f} ms ({gb / row[f'{name}_ms'] * 1e3:.1f} GB/s)")
            if args.before:
                row["ratio"] = float(np.median(np.array(times["new"]) / np.array(times["before"])))
                row["same_outputs"] = bool(np.array_equal(outputs["new"], outputs["before"]))
                line.append(f"new/before x{row['ratio']:.3f} "
                            f"({'same outputs' if row['same_outputs'] else 'OUTPUTS DIFFER'})")
            line.append(f"read floor {row['read_gb_per_s']:.1f} GB/s")
            print("  ".join(line), flush=True)
            rows.append(row)
    if args.json:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                                text=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--", "edgelin/ortops"], cwd=ROOT,
                               capture_output=True, text=True).stdout.strip()
        args.json.write_text(json.dumps({"command": "python bench/q4_rows.py " + " ".join(sys.argv[1:]),
                                         "commit": commit + ("+" if dirty else ""), "machine": machine(),
                                         "rounds": args.rounds, "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
