"""The torch target (the GPU reference) through `edgelin bench`, on a CUDA machine (docs/performance.md#gpu-decode).

Builds bench/decode.py's 147.6 M Gated DeltaNet model (random init, seed 0), saves it as a checkpoint,
exports it with `edgelin export --target torch --precision fp16`, then runs `edgelin bench` at positions
1, 1024, 8192 for batch 1 and 8 (JSON per batch under --out). A benchmark, not a test.

    python bench/torch_target.py --out runs/torch-target
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))


def main() -> None:
    import torch
    from decode import build_model

    from edgelin.checkpoint import save_checkpoint

    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True, help="a new folder: checkpoint, export, bench JSON")
    parser.add_argument("--batches", default="1,8")
    args = parser.parse_args()
    args.out.mkdir(parents=True)
    save_checkpoint(build_model(torch.float32).cpu(), args.out / "checkpoint")
    cli = [sys.executable, "-m", "edgelin.cli"]
    began = time.time()
    subprocess.run(cli + ["export", str(args.out / "checkpoint"), "--target", "torch", "--precision", "fp16",
                          "--out", str(args.out / "export")], check=True)
    print(f"export: {time.time() - began:.0f} s", flush=True)
    for batch in args.batches.split(","):
        result = subprocess.run(cli + ["bench", str(args.out / "export"), "--positions", "1,1024,8192", "--iters", "100",
                                       "--warmup", "10", "--batch", batch, "--prefill-tokens", "2048", "--json"],
                                capture_output=True, text=True, check=True)
        (args.out / f"bench-b{batch}.json").write_text(result.stdout)
        print(f"batch {batch}: {args.out / f'bench-b{batch}.json'}", flush=True)


if __name__ == "__main__":
    main()
