"""Stream the tokens of one sequence from the Triton Inference Server model that `edgelin export --serve triton`
wrote (this file is copied to DIR/triton/client.py). Needs `pip install 'tritonclient[grpc]' tokenizers numpy`
and a running server (docs/serving.md):

    python DIR/triton/client.py --prompt "def main(" -n 64 [--url localhost:8001] [--sequence-id 7]

Every token, the prompt's included, is one request of the sequence: the server keeps the recurrent state (and
the position) between requests, so a request carries one token id. Greedy decoding; the text streams to stdout.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

MODEL = "model"  # filled in by edgelin export
TOKENIZER = Path(__file__).resolve().parent.parent / "tokenizer.json"  # the export's tokenizer


def step(client, grpc, token: int, sequence_id: int, start: bool, end: bool) -> np.ndarray:
    ids = grpc.InferInput("input_ids", [1, 1], "INT64")
    ids.set_data_from_numpy(np.array([[token]], np.int64))
    result = client.infer(MODEL, [ids], outputs=[grpc.InferRequestedOutput("logits")], sequence_id=sequence_id,
                          sequence_start=start, sequence_end=end)
    return result.as_numpy("logits")[0]


def main() -> None:
    import tritonclient.grpc as grpc
    from tokenizers import Tokenizer

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--prompt", required=True)
    parser.add_argument("-n", "--max-new-tokens", type=int, default=64)
    parser.add_argument("--url", default="localhost:8001")
    parser.add_argument("--sequence-id", type=int, default=1, help="One id per concurrent sequence (> 0).")
    parser.add_argument("--tokenizer", type=Path, default=TOKENIZER)
    args = parser.parse_args()
    tokenizer = Tokenizer.from_file(str(args.tokenizer))
    client = grpc.InferenceServerClient(args.url)
    prompt = tokenizer.encode(args.prompt).ids
    if not prompt:
        sys.exit("error: --prompt encodes to no tokens")
    sys.stdout.write(args.prompt)
    logits = None
    for i, token in enumerate(prompt):  # the prompt, one step per token (the server has no prefill model)
        logits = step(client, grpc, token, args.sequence_id, start=i == 0, end=False)
    ids: list[int] = []
    for i in range(args.max_new_tokens):
        token = int(np.argmax(logits))
        ids.append(token)
        sys.stdout.write(tokenizer.decode(ids[-1:]))
        sys.stdout.flush()
        # the last request ends the sequence: the server frees its state slot
        logits = step(client, grpc, token, args.sequence_id, start=False, end=i == args.max_new_tokens - 1)
    sys.stdout.write("\n")


if __name__ == "__main__":
    main()
