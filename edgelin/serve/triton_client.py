"""Stream the tokens of one sequence from the Triton Inference Server model that `edgelin export --serve triton`
wrote (this file is copied to DIR/triton/client.py). Needs `pip install 'tritonclient[grpc]' tokenizers numpy`
and a running server (docs/serving.md):

    python DIR/triton/client.py --prompt "def main(" -n 64 [--url localhost:8001] [--sequence-id 7]

The server keeps the sequence's state between requests. The Python-backend repository (--serve triton) takes
the whole prompt in one request and answers each step with the next token only; the native one (--serve
triton-native) takes one token per request and answers with the logits. Greedy decoding; the text streams to stdout.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

MODEL = "model"  # filled in by edgelin export
PREFILL = True  # filled in by edgelin export: whether the model takes several tokens in one request
TOKENIZER = Path(__file__).resolve().parent.parent / "tokenizer.json"  # the export's tokenizer


def step(client, grpc, tokens: list[int], sequence_id: int, start: bool, end: bool) -> int:
    """Send `tokens` (one request); the argmax of the answer's last position."""
    ids = grpc.InferInput("input_ids", [1, len(tokens)], "INT64")
    ids.set_data_from_numpy(np.array([tokens], np.int64))
    output = "next_token" if PREFILL else "logits"
    result = client.infer(MODEL, [ids], outputs=[grpc.InferRequestedOutput(output)], sequence_id=sequence_id,
                          sequence_start=start, sequence_end=end)
    return int(np.argmax(result.as_numpy(output).reshape(-1))) if not PREFILL else int(result.as_numpy(output)[0, 0])


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
    if PREFILL:  # the prompt in one request
        token = step(client, grpc, prompt, args.sequence_id, start=True, end=False)
    else:  # one request per token (the native repository has no prefill model)
        for i, t in enumerate(prompt):
            token = step(client, grpc, [t], args.sequence_id, start=i == 0, end=False)
    ids: list[int] = []
    for i in range(args.max_new_tokens):
        ids.append(token)
        sys.stdout.write(tokenizer.decode(ids[-1:]))
        sys.stdout.flush()
        # the last request ends the sequence: the server frees its state slot
        token = step(client, grpc, [token], args.sequence_id, start=False, end=i == args.max_new_tokens - 1)
    sys.stdout.write("\n")


if __name__ == "__main__":
    main()
