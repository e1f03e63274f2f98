"""The measurement behind the state-precision table: roll a model out step by step with its
recurrent state rounded to a lower dtype after every step, next to the same rollout in float32.

What is rounded: every state tensor of every layer (recurrent states, normalisers, short-conv taps,
softmax KV caches), because an export with `state_dtype = "float16"` stores all of them in that
dtype (edgelin.artifact.state). The step math itself stays float32, as it does in an fp16-state
export that computes in fp32: only the value carried from one step to the next loses bits.

Every variant runs as a row of one batch: per token stream, a float32 reference row and one row per
rounded dtype, all fed the same token at every step (teacher forcing, so the error measures the
state's drift, not a text that went another way). A greedy stream's next token is the argmax of its
float32 row. Each row is compared with its unrounded twin: the same batch, rolled out alongside with
no rounding, so the twin is the same computation at the same batch position. (Comparing with the
stream's reference row instead mixed in the CPU kernels' position-dependent rounding: on an Intel
Xeon, identical inputs in odd and even rows differed by 3e-8 from step 25 on.) So a "float32" row
rounded through `.to(float32)` equals its twin bit for bit: the tests use that to prove the rounding
path is the only difference.

Error (per step, per row): max |logits - fp32 logits| / RMS(fp32 logits) over the vocabulary;
reported as its maximum over the steps and its value at the last step. Top-1 agreement: the fraction
of steps whose argmax equals the float32 row's. Non-finite logits count as error inf and disagreement.

Needs torch; `edgelin.precision` (the verdicts the exporter reads) does not import this module.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from edgelin.model.lm import CausalLM, State

DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass(frozen=True)
class TokenStream:
    """The tokens fed at every step: `tokens` first; after them, when `greedy`, the argmax of the
    float32 reference row (greedy continuation of a prompt), else the stream must be long enough."""

    tokens: tuple[int, ...]
    greedy: bool = False


@dataclass(frozen=True)
class Drift:
    """One stream and one state dtype against float32 (see the module docstring for the metrics)."""

    stream: str
    state_dtype: str
    steps: int
    max_rel_error: float
    final_rel_error: float
    top1_agreement: float
    worst_step: int  # where max_rel_error was reached (0-based)


def round_state(state: "State", rows: Mapping[str, Sequence[int]]) -> "State":
    """A copy of `state` whose batch rows `rows[dtype]` went through `dtype` and back to their own
    dtype (the bits a state stored in `dtype` keeps); other rows unchanged."""
    out = []
    for layer in state:
        new = {}
        for name, tensor in layer.items():
            tensor = tensor.clone()
            for dtype, index in rows.items():
                idx = torch.as_tensor(index, dtype=torch.long)
                tensor[idx] = tensor[idx].to(DTYPES[dtype]).to(tensor.dtype)
            new[name] = tensor
        out.append(new)
    return out


def measure_drift(model: "CausalLM", streams: Mapping[str, TokenStream], steps: int,
                  dtypes: Sequence[str] = ("float16", "bfloat16")) -> list[Drift]:
    """Roll `model` (eval mode, float32 weights) `steps` tokens through its step path (mode
    'recurrent', one token per call) per stream, with the state of each dtype's row rounded after
    every step. Returns one Drift per (stream, dtype), in that order."""
    unknown = [d for d in dtypes if d not in DTYPES]
    if unknown or steps < 1:
        raise ValueError(f"dtypes must be among {list(DTYPES)} and steps >= 1 (got {unknown}, {steps})")
    for name, stream in streams.items():
        if not stream.tokens or (not stream.greedy and len(stream.tokens) < steps):
            raise ValueError(f"stream {name!r}: {len(stream.tokens)} tokens for {steps} steps")
    names = list(streams)
    width = 1 + len(dtypes)  # rows per stream: the float32 reference, then one per dtype
    ref_rows = [s * width for s in range(len(names))]
    rows = {d: [s * width + 1 + j for s in range(len(names))] for j, d in enumerate(dtypes)}
    batch = len(names) * width
    errors = torch.empty(steps, batch, dtype=torch.float64)
    agree = torch.empty(steps, batch, dtype=torch.bool)
    state, twin_state = model.initial_state(batch), model.initial_state(batch)
    ids = torch.tensor([streams[n].tokens[0] for n in names])
    with torch.inference_mode():
        for step in range(steps):
            tokens = ids.repeat_interleave(width)[:, None]
            positions = torch.full((batch,), step)
            logits, state = model(tokens, state, positions, mode="recurrent")
            state = round_state(state, rows)
            ref, twin_state = model(tokens, twin_state, positions, mode="recurrent")
            logits, ref = logits[:, 0].double(), ref[:, 0].double()
            finite = torch.isfinite(logits).all(-1)
            err = (logits - ref).abs().amax(-1) / ref.pow(2).mean(-1).sqrt().clamp_min(1e-30)
            errors[step] = torch.where(finite, err, torch.inf)
            agree[step] = finite & (logits.argmax(-1) == ref.argmax(-1))
            if step + 1 < steps:
                ids = torch.tensor([_next_token(streams[n], step + 1, int(ref[r].argmax()))
                                    for n, r in zip(names, ref_rows)])
    out = []
    for s, name in enumerate(names):
        for j, dtype in enumerate(dtypes):
            row = s * width + 1 + j
            col = errors[:, row]
            out.append(Drift(name, dtype, steps, float(col.max()), float(col[-1]),
                             float(agree[:, row].double().mean()), int(col.argmax())))
    return out


def _next_token(stream: TokenStream, position: int, greedy_choice: int) -> int:
    return stream.tokens[position] if position < len(stream.tokens) else greedy_choice
