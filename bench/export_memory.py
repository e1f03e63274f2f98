"""Where an export's memory goes (issue 46): `edgelin export` run in this process through the library, its resident
memory sampled every 10 ms by a thread (anonymous and file-backed pages, /proc/self/status), the peak of each step the
export reports to its progress callback. The process's own peak (VmHWM) is printed beside it.

    python bench/export_memory.py CHECKPOINT OUT --quantize int4 [--json FILE]

Linux only (/proc). OUT must not exist (the export's own rules apply). Random-weight checkpoints: pass --force
(their quality gate measures noise).
"""

from __future__ import annotations

import argparse
import json
import threading
import time
from pathlib import Path


def resident() -> tuple[int, int, int]:
    """(anonymous, file-backed, peak) resident bytes of this process."""
    fields = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines() if ":" in line)
    kib = {key: int(fields[key].split()[0]) for key in ("RssAnon", "RssFile", "VmHWM")}
    return kib["RssAnon"] << 10, kib["RssFile"] << 10, kib["VmHWM"] << 10


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkpoint", type=Path)
    parser.add_argument("out", type=Path)
    parser.add_argument("--quantize", choices=("fp16", "int8", "int4"))
    parser.add_argument("--force", action="store_true")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()

    stage, peaks, order = ["starting"], {}, []

    def sample() -> None:
        while True:
            anon, file, _ = resident()
            what = stage[0]
            if what not in peaks:
                peaks[what] = (0, 0)
                order.append(what)
            if anon + file > sum(peaks[what]):
                peaks[what] = (anon, file)
            time.sleep(0.01)

    threading.Thread(target=sample, daemon=True).start()
    from edgelin.devices import export_settings
    from edgelin.export.pipeline import export_checkpoint

    def progress(done: int, total: int, what: str) -> None:
        stage[0] = what

    began = time.monotonic()
    export_checkpoint(args.checkpoint, args.out, target="onnx", force=args.force, include_tokenizer=False,
                      settings=export_settings(None, "onnx", None, args.quantize, force=args.force),
                      on_progress=progress)
    seconds = time.monotonic() - began
    stage[0] = "done"
    time.sleep(0.05)
    peak = resident()[2]
    rows = [{"step": what, "anon_bytes": peaks[what][0], "file_bytes": peaks[what][1]} for what in order]
    for row in rows:
        print(f"{(row['anon_bytes'] + row['file_bytes']) / 2**30:6.2f} GiB (anon {row['anon_bytes'] / 2**30:.2f}, "
              f"file {row['file_bytes'] / 2**30:.2f})  {row['step']}")
    print(f"peak RSS (VmHWM) {peak / 2**30:.2f} GiB; {seconds:.0f} s")
    if args.json:
        import subprocess
        import sys

        sys.path.insert(0, str(Path(__file__).resolve().parent))
        from real_sizes import ROOT, machine

        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                                text=True).stdout.strip()
        args.json.write_text(json.dumps({"checkpoint": args.checkpoint.name, "quantize": args.quantize,
                                         "seconds": round(seconds, 1), "peak_rss_bytes": peak, "steps": rows,
                                         "commit": commit, "machine": machine(),
                                         "when": time.strftime("%Y-%m-%d")}, indent=1) + "\n")


if __name__ == "__main__":
    main()
