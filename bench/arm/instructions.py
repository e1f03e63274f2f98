"""Instructions retired per decoded token on an emulated ARM CPU: edgelin's ARM kernels against ONNX Runtime's own
(the same export file, EDGELIN_ORT_OPS=0) and, given a GGUF of the same model and weight precision, llama.cpp built
for aarch64, counted by a QEMU plugin (bench/arm/insn_count.c) under qemu-user.

An instruction count, never a time: emulation runs every instruction at its own cost, so the figure says how much
work each path does per token (vector width, loop overhead, what is fused), not how fast a board runs it (memory
bandwidth, cache, issue width, frequency). Each (export, runtime) runs twice in a fresh emulated process, 1
thread: a 16-token prompt then `low` and `high` teacher-forced steps; per token = (count(high) - count(low)) /
(high - low), so start-up, loading and the prompt cancel out.

Needs what `make test-arm` sets up (build/arm-tier: the arm64 userland, the aarch64 wheels, edgelin's cross-built
wheel), Debian's `qemu-user` (the dynamic qemu-aarch64: the static one loads no plugin) and QEMU 7.2's public
qemu-plugin.h in the git-ignored .qemu-headers/ (fetched here from Debian's qemu source package when missing).

    python bench/arm/instructions.py out/tiny-int4 out/tiny-int8 [--cpu cortex-a76] [--steps 8,40] [--json F]
    python bench/arm/instructions.py EXPORT --llama MODEL.gguf --llama-build DIR   # DIR: llama.cpp built for aarch64

edgelin's steps run from Python (the runner, numpy and ONNX Runtime's session per token: counted, as on a board);
llama.cpp's from a C program (bench/arm/llama_steps.c). llama.cpp cross-built here, e.g. the llama-cpp-python 0.3.36
source that bench/peers.md sets up: `cmake -S vendor/llama.cpp -B DIR -DCMAKE_TOOLCHAIN_FILE=<aarch64 gcc and g++>
-DGGML_NATIVE=OFF -DGGML_CPU_ARM_ARCH=armv8.2-a+dotprod+fp16 -DGGML_OPENMP=OFF -DLLAMA_CURL=OFF
-DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_SERVER=OFF` then
`cmake --build DIR` (needs g++-aarch64-linux-gnu).
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


def llama_program(build: Path, source: Path) -> Path:
    """bench/arm/llama_steps.c built for aarch64 against a cross-built llama.cpp (its include/ and bin/)."""
    program = TIER / "llama_steps"
    top = source if (source / "include" / "llama.h").is_file() else build
    subprocess.run(["aarch64-linux-gnu-gcc", "-O2", f"-I{top / 'include'}", f"-I{top / 'ggml' / 'include'}",
                    "-o", str(program), str(Path(__file__).with_name("llama_steps.c")), f"-L{build / 'bin'}",
                    "-lllama", f"-Wl,-rpath,{build / 'bin'}"], check=True)
    return program


def count(command: list[str], cpu: str, env_extra: dict[str, str], root: Path, library: Path,
          what: str) -> tuple[int, str]:
    """(instructions the emulated process executed, the last line it printed: the runner's label)"""
    with tempfile.TemporaryDirectory() as scratch:
        out = Path(scratch) / "count.txt"
        env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "EDGELIN_", "QEMU_"))}
        # one thread everywhere: numpy's OpenBLAS workers, spinning while they wait, would be counted too (they made
        # the same product's count vary by 20% between runs); a fixed hash seed keeps Python's own work the same
        env.update(QEMU_CPU=cpu, OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1", PYTHONHASHSEED="0", **env_extra)
        done = subprocess.run(["qemu-aarch64", "-L", str(root), "-plugin", f"{library},out={out}", *command],
                              env=env, capture_output=True, text=True)
        if done.returncode != 0:
            sys.exit(f"error: {what} under qemu ({cpu}) failed: {done.stderr.strip()[-400:]}")
        return int(out.read_text()), done.stdout.strip().splitlines()[-1]


def per_token(command: list[str], low: int, high: int, cpu: str, env: dict[str, str], root: Path, library: Path,
              what: str) -> tuple[float, str]:
    a, _ = count([*command, str(low)], cpu, env, root, library, what)
    b, label = count([*command, str(high)], cpu, env, root, library, what)
    return (b - a) / (high - low), label


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("exports", nargs="+", type=Path)
    parser.add_argument("--cpu", default="cortex-a76")
    parser.add_argument("--steps", default="8,40", help="LOW,HIGH teacher-forced steps (per token: the difference)")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--llama", type=Path, help="a GGUF of the same model (e.g. Q4_0 beside an int4 export)")
    parser.add_argument("--llama-build", type=Path, help="llama.cpp's build folder, cross-built for aarch64")
    parser.add_argument("--llama-source", type=Path, help="llama.cpp's source (include/), if not the build's")
    parser.add_argument("--runtimes", default="edgelin,onnxruntime,llama.cpp",
                        help="which to count (llama.cpp only with --llama)")
    args = parser.parse_args()
    low, high = (int(n) for n in args.steps.split(","))
    root, sites = userland()
    library = plugin()
    python = [str(root / "usr/bin/python3"), "-P", "-c", WORKER]
    site_env = {"PYTHONPATH": ":".join(str(s) for s in sites), "PYTHONNOUSERSITE": "1"}
    rows = []
    print(f"instructions per decoded token, emulated {args.cpu}, 1 thread, steps {low} -> {high} (counts, not time)")
    for export in args.exports:
        row = {"export": str(export), "cpu": args.cpu, "steps": [low, high], "per_token": {}, "labels": {}}
        for name, extra in (("edgelin", {}), ("onnxruntime", {"EDGELIN_ORT_OPS": "0"})):
            if name not in args.runtimes.split(","):
                continue
            row["per_token"][name], row["labels"][name] = per_token([*python, str(export)], low, high, args.cpu,
                                                                    {**site_env, **extra}, root, library,
                                                                    str(export))
        if args.llama and "llama.cpp" in args.runtimes.split(","):
            program = llama_program(args.llama_build, args.llama_source or args.llama_build)
            row["per_token"]["llama.cpp"], row["labels"]["llama.cpp"] = per_token(
                [str(program), str(args.llama)], low, high, args.cpu, {}, root, library, str(args.llama))
            row["llama"] = str(args.llama)
        rows.append(row)
        base = row["per_token"].get("edgelin")
        for name, value in row["per_token"].items():
            ratio = f"x{value / base:6.3f} of edgelin's" if base else ""
            print(f"  {export.name:<28} {name:<12} {value / 1e6:10.2f} M  {ratio}  ({row['labels'][name]})")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2) + "\n")


if __name__ == "__main__":
    main()
