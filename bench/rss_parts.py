"""Where an export's resident memory goes: RSS (anonymous and file-backed, from /proc/self/status; Linux) after
each stage of one edgelin run in this process: Python, numpy, ONNX Runtime, the runner (its sessions and the mapped
weights), a prefill of N tokens, then 64 decode steps. A benchmark (not a test): docs/benchmarks.md, issue 13.

    python bench/rss_parts.py EXPORT_DIR [THREADS] [PROMPT_TOKENS]
"""

import resource
import sys
from pathlib import Path


def rss_mib() -> dict[str, int]:
    with open("/proc/self/status") as fh:
        fields = dict(line.split(":", 1) for line in fh)
    return {k: int(fields[k].split()[0]) // 1024 for k in ("VmRSS", "RssAnon", "RssFile", "VmHWM")}


def main() -> None:
    folder = Path(sys.argv[1])
    threads = int(sys.argv[2]) if len(sys.argv) > 2 else 1
    tokens = int(sys.argv[3]) if len(sys.argv) > 3 else 2048
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
    prefill(runner, ids, state)
    print(f"prefill {tokens}", rss_mib())
    for t in range(64):
        runner.step(np.array([1]), state, np.array([tokens + t]))
    print("64 steps", rss_mib())
    print("peak (ru_maxrss) MiB", resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024)


if __name__ == "__main__":
    main()
