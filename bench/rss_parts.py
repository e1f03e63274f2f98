"""Where an export's resident memory goes: RSS (anonymous and file-backed, from /proc/self/status; Linux) after
each stage of one edgelin run in this process: Python, numpy, ONNX Runtime, the runner (its sessions and the mapped
weights), a prefill of N tokens, then 64 decode steps. A benchmark (not a test): docs/performance.md#cpu-step-latency.

    python bench/rss_parts.py EXPORT_DIR [THREADS] [PROMPT_TOKENS]

Side by side: each NAME=PYTHON:EXPORT_DIR in a fresh process (PYTHON: an interpreter, or a script that runs one,
e.g. with PYTHONPATH set to another checkout for a "before"), alternating for --rounds; printed per export the
median peak RSS and prefill tokens/s, and each against the first:

    python bench/rss_parts.py --compare new=.venv/bin/python:DIR_A old=runs/py-before.sh:DIR_B \\
        [--threads 1] [--tokens 2048] [--rounds 3]
"""

import json
import resource
import subprocess
import sys
import time
from pathlib import Path


def rss_mib() -> dict[str, int]:
    with open("/proc/self/status") as fh:
        fields = dict(line.split(":", 1) for line in fh)
    return {k: int(fields[k].split()[0]) // 1024 for k in ("VmRSS", "RssAnon", "RssFile", "VmHWM")}


def stages(folder: Path, threads: int, tokens: int) -> None:
    print("python", rss_mib())
    import numpy as np
    print("numpy", rss_mib())
    import onnxruntime  # noqa: F401
    print("onnxruntime", rss_mib())
    from edgelin.runtime import open_runner, prefill
    runner = open_runner(folder, threads=threads)
    print("open_runner", rss_mib())
    state = runner.new_state(1)
    ids = np.random.default_rng(0).integers(0, runner.manifest.vocab_size, (1, tokens))
    start = time.perf_counter()
    prefill(runner, ids, state)
    seconds = time.perf_counter() - start
    print(f"prefill {tokens}", rss_mib())
    for t in range(64):
        runner.step(np.array([1]), state, np.array([tokens + t]))
    print("64 steps", rss_mib())
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print("peak (ru_maxrss) MiB", int(peak))
    print(json.dumps({"peak_mib": peak, "prefill_tok_s": tokens / seconds}))


def compare(specs: list[str], threads: int, tokens: int, rounds: int) -> None:
    import numpy as np

    runs: dict[str, list[dict]] = {}
    order = [spec.split("=", 1) for spec in specs]
    for r in range(rounds):
        for name, rest in (order if r % 2 == 0 else order[::-1]):
            python, folder = rest.split(":", 1)
            done = subprocess.run([python, __file__, folder, str(threads), str(tokens)], capture_output=True,
                                  text=True)
            if done.returncode != 0:
                raise SystemExit(f"{name}: {(done.stderr or done.stdout).strip().splitlines()[-1]}")
            runs.setdefault(name, []).append(json.loads(done.stdout.strip().splitlines()[-1]))
    first = order[0][0]
    peak0 = np.median([x["peak_mib"] for x in runs[first]])
    speed0 = np.median([x["prefill_tok_s"] for x in runs[first]])
    print(f"{threads} thread(s), {tokens}-token prompt, 64 steps, {rounds} rounds (fresh process each, alternating)")
    for name, _ in order:
        peaks, speeds = [x["peak_mib"] for x in runs[name]], [x["prefill_tok_s"] for x in runs[name]]
        print(f"  {name}: peak RSS {np.median(peaks):.1f} MiB ({min(peaks):.1f}-{max(peaks):.1f}), prefill "
              f"{np.median(speeds):,.0f} tok/s ({min(speeds):,.0f}-{max(speeds):,.0f}); vs {first}: peak "
              f"x{np.median(peaks) / peak0:.2f}, prefill x{np.median(speeds) / speed0:.2f}")


def main() -> None:
    if sys.argv[1:2] == ["--compare"]:
        import argparse

        parser = argparse.ArgumentParser()
        parser.add_argument("--compare", nargs="+", required=True, metavar="NAME=PYTHON:EXPORT_DIR")
        parser.add_argument("--threads", type=int, default=1)
        parser.add_argument("--tokens", type=int, default=2048)
        parser.add_argument("--rounds", type=int, default=3)
        args = parser.parse_args()
        compare(args.compare, args.threads, args.tokens, args.rounds)
        return
    stages(Path(sys.argv[1]), int(sys.argv[2]) if len(sys.argv) > 2 else 1,
           int(sys.argv[3]) if len(sys.argv) > 3 else 2048)


if __name__ == "__main__":
    main()
