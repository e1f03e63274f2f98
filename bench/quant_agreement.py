"""Teacher-forced agreement of quantised runtimes with float32, on held-out text: a finer measure than
bench/peers.py's 64-token greedy continuation (where one near-tie flips every token after it).

    python bench/quant_agreement.py CKPT --tokens DATA/tokens.npz --work /work/peers/work-s23/<model> \\
        [--runtimes edgelin-int4,edgelin-int4-e8,edgelin-int8,llama-q4_0,llama-q8_0] [--windows 4] [--length 256]
        [--context 2177]

--windows windows of --length tokens from the `val` split of bench/peer_checkpoints.py's tokens.npz (evenly
spaced); every runtime reads each window from a fresh state and gives its logits at every position (edgelin: one
step per token; llama.cpp: one batch with every position's logits). The reference is transformers' fp32 forward
pass on the same windows. Printed per runtime: top-1 agreement with the reference and the mean KL divergence
KL(reference || runtime) in nats per token, over all positions. Each runtime runs in its own process (llama.cpp in
bench/peers.py's llama venv), the artifacts bench/peers.py prepared in --work (it builds missing ones). Not a test.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))


def windows(tokens: Path, count: int, length: int) -> np.ndarray:
    val = np.load(tokens)["val"].astype(np.int64)
    starts = np.linspace(0, len(val) - length - 1, count).astype(int)
    return np.stack([val[s:s + length] for s in starts])


def edgelin_logits(folder: str, ids: np.ndarray) -> np.ndarray:
    from edgelin.runtime import open_runner

    runner = open_runner(Path(folder), threads=1)
    out = []
    for row in ids:
        state = runner.new_state(1)
        out.append(np.stack([runner.step(np.array([t]), state, np.array([p]))[0] for p, t in enumerate(row)]))
    return np.stack(out)


def llama_logits(gguf: str, ids: np.ndarray) -> np.ndarray:
    import llama_cpp

    llm = llama_cpp.Llama(gguf, n_ctx=ids.shape[1] + 8, n_threads=1, n_batch=ids.shape[1], logits_all=True,
                          verbose=False)
    out = []
    for row in ids:
        llm.reset()
        llm.eval([int(t) for t in row])
        out.append(np.array(llm.scores[:len(row)], np.float32))
    return np.stack(out)


def reference_logits(ckpt: str, ids: np.ndarray) -> np.ndarray:
    from peer_checkpoints import block_fla

    block_fla()
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(ckpt, torch_dtype=torch.float32).eval()
    with torch.no_grad():
        return np.stack([model(torch.from_numpy(row[None])).logits[0].numpy() for row in ids])


def worker(kind: str, artifact: str, ids_file: str, out_file: str) -> None:
    ids = np.load(ids_file)
    fn = {"edgelin": edgelin_logits, "llama": llama_logits, "reference": reference_logits}[kind]
    np.save(out_file, fn(artifact, ids).astype(np.float32))


def compare(reference: np.ndarray, logits: np.ndarray) -> tuple[float, float]:
    """(top-1 agreement, mean KL(reference || logits) in nats) over every position."""
    def log_softmax(x: np.ndarray) -> np.ndarray:
        x = x.astype(np.float64)
        x = x - x.max(-1, keepdims=True)
        return x - np.log(np.exp(x).sum(-1, keepdims=True))

    p, q = log_softmax(reference), log_softmax(logits)
    agree = float((reference.argmax(-1) == logits.argmax(-1)).mean())
    return agree, float((np.exp(p) * (p - q)).sum(-1).mean())


def main() -> None:
    if sys.argv[1:2] == ["--worker"]:
        worker(*sys.argv[2:6])
        return
    from peers import PY, prepare

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkpoint", type=Path)
    parser.add_argument("--tokens", type=Path, required=True, help="tokens.npz with a `val` split")
    parser.add_argument("--work", type=Path, required=True, help="bench/peers.py's artifacts folder")
    parser.add_argument("--runtimes", default="edgelin-int4,edgelin-int4-e8,edgelin-int8,llama-q4_0,llama-q8_0")
    parser.add_argument("--windows", type=int, default=4)
    parser.add_argument("--length", type=int, default=256)
    parser.add_argument("--context", type=int, default=2177,
                        help="edgelin's static KV cache for models with full attention (>= --length; the default "
                             "is what `bench/peers.py --positions 1` prepares, so its exports are reused)")
    args = parser.parse_args()
    ids = windows(args.tokens, args.windows, args.length)
    context = max(args.context, args.length)
    with tempfile.TemporaryDirectory() as scratch:
        np.save(Path(scratch) / "ids.npy", ids)

        def run(kind: str, artifact: str, python: str) -> np.ndarray:
            out = Path(scratch) / "out.npy"
            subprocess.run([python, __file__, "--worker", kind, artifact, str(Path(scratch) / "ids.npy"), str(out)],
                           check=True)
            return np.load(out)

        reference = run("reference", str(args.checkpoint.resolve()), sys.executable)
        print(f"{args.checkpoint.name}: {args.windows} windows x {args.length} tokens of held-out text; "
              f"reference: transformers fp32")
        results = {}
        for kind in args.runtimes.split(","):
            artifact, err = prepare(kind, args.checkpoint.resolve(), args.work.resolve(), context)
            if artifact is None:
                print(f"{kind}: cannot prepare: {err}")
                continue
            logits = run("llama" if kind.startswith("llama") else "edgelin", str(artifact),
                         PY["llama"] if kind.startswith("llama") else sys.executable)
            agree, kl = compare(reference, logits)
            results[kind] = {"top1": agree, "kl": kl}
            print(f"{kind:18s} top-1 agreement {agree:6.1%}   KL {kl:.4f} nats/token")
        print(json.dumps(results))


if __name__ == "__main__":
    main()
