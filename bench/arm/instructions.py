"""Instructions retired per decoded token on an emulated ARM CPU: edgelin's ARM kernels against ONNX Runtime's own
(the same export file, EDGELIN_ORT_OPS=0), counted by a QEMU plugin (bench/arm/insn_count.c) under qemu-user.

An instruction count, never a time: emulation runs every instruction at its own cost, so the figure says how much
work each path does per token (vector width, loop overhead, what is fused), not how fast a board runs it (memory
bandwidth, cache, issue width, frequency). Each (export, runtime) runs twice in a fresh emulated process, 1
thread: a 16-token prompt then `low` and `high` teacher-forced steps; per token = (count(high) - count(low)) /
(high - low), so start-up, loading and the prompt cancel out.

Needs what `make test-arm` sets up (build/arm-tier: the arm64 userland, the aarch64 wheels, edgelin's cross-built
wheel), Debian's `qemu-user` (the dynamic qemu-aarch64: the static one loads no plugin) and QEMU 7.2's public
qemu-plugin.h in the git-ignored .qemu-headers/ (fetched here from Debian's qemu source package when missing).

    python bench/arm/instructions.py out/tiny-int4 out/tiny-int8 [--cpu cortex-a76] [--steps 8,40] [--json F]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tarfile
import tempfile
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TIER = ROOT / "build" / "arm-tier"
HEADERS = ROOT / ".qemu-headers"
QEMU_SOURCE = "http://deb.debian.org/debian/pool/main/q/qemu/qemu_7.2+dfsg.orig.tar.xz"

WORKER = """
import sys
import numpy as np
from pathlib import Path
from edgelin.conversation import Conversation
from edgelin.runtime import open_runner, runner_label
runner = open_runner(Path(sys.argv[1]), threads=1)
talk = Conversation(runner, record=False)
talk.prefill(np.arange(1, 17, dtype=np.int64)[None])
for i in range(int(sys.argv[2])):
    talk.step((7 * i) % 97 + 1)
print(runner_label(runner))
"""


def plugin() -> Path:
    """bench/arm/insn_count.c built against QEMU 7.2's qemu-plugin.h (fetched once into .qemu-headers/)."""
    header = HEADERS / "qemu-plugin.h"
    if not header.is_file():
        HEADERS.mkdir(exist_ok=True)
        with tempfile.TemporaryDirectory() as scratch:
            archive = Path(scratch) / "qemu.tar.xz"
            print(f"progress: fetching qemu-plugin.h from {QEMU_SOURCE}", file=sys.stderr)
            urllib.request.urlretrieve(QEMU_SOURCE, archive)
            with tarfile.open(archive) as tar:
                member = tar.getmember("qemu-7.2.0/include/qemu/qemu-plugin.h")
                header.write_bytes(tar.extractfile(member).read())
    built = TIER / "insn_count.so"
    source = Path(__file__).with_name("insn_count.c")
    if not built.is_file() or built.stat().st_mtime < source.stat().st_mtime:
        subprocess.run(["cc", "-O2", "-shared", "-fPIC", f"-I{HEADERS}", "-o", str(built), str(source)], check=True)
    return built


def userland() -> tuple[Path, list[Path]]:
    root = Path(subprocess.run([str(ROOT / ".ci/arm/userland")], check=True, capture_output=True,
                               text=True).stdout.strip())
    sites = [TIER / "edgelin-site", *sorted(TIER.glob("site-*"))]
    if not (sites[0] / "edgelin").is_dir() or len(sites) < 2:
        sys.exit("error: no aarch64 site in build/arm-tier: run `make test-arm` first (it builds them)")
    return root, sites


def count(export: Path, steps: int, cpu: str, ops: str | None, root: Path, sites: list[Path],
          library: Path) -> tuple[int, str]:
    """(instructions the emulated process executed, the runner's label)"""
    with tempfile.TemporaryDirectory() as scratch:
        out = Path(scratch) / "count.txt"
        env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "EDGELIN_", "QEMU_"))}
        env.update(QEMU_CPU=cpu, PYTHONPATH=":".join(str(s) for s in sites), PYTHONNOUSERSITE="1")
        if ops is not None:
            env["EDGELIN_ORT_OPS"] = ops
        done = subprocess.run(["qemu-aarch64", "-L", str(root), "-plugin", f"{library},out={out}",
                               str(root / "usr/bin/python3"), "-P", "-c", WORKER, str(export), str(steps)],
                              env=env, capture_output=True, text=True)
        if done.returncode != 0:
            sys.exit(f"error: {export} under qemu ({cpu}) failed: {done.stderr.strip()[-400:]}")
        return int(out.read_text()), done.stdout.strip().splitlines()[-1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("exports", nargs="+", type=Path)
    parser.add_argument("--cpu", default="cortex-a76")
    parser.add_argument("--steps", default="8,40", help="LOW,HIGH teacher-forced steps (per token: the difference)")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    low, high = (int(n) for n in args.steps.split(","))
    root, sites = userland()
    library = plugin()
    rows = []
    print(f"instructions per decoded token, emulated {args.cpu}, 1 thread (counts, not time)")
    print(f"{'export':<32} {'edgelin ARM kernels':>20} {'ONNX Runtime own':>18} {'ratio':>7}  label")
    for export in args.exports:
        per = {}
        labels = {}
        for name, ops in (("edgelin", None), ("onnxruntime", "0")):
            a, _ = count(export, low, args.cpu, ops, root, sites, library)
            b, labels[name] = count(export, high, args.cpu, ops, root, sites, library)
            per[name] = (b - a) / (high - low)
        ratio = per["edgelin"] / per["onnxruntime"]
        rows.append({"export": str(export), "cpu": args.cpu, "steps": [low, high], "per_token": per,
                     "ratio": ratio, "labels": labels})
        print(f"{export.name:<32} {per['edgelin'] / 1e6:>18.2f} M {per['onnxruntime'] / 1e6:>16.2f} M "
              f"{ratio:>7.3f}  {labels['edgelin']}")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2) + "\n")


if __name__ == "__main__":
    main()
