"""The two exported graphs and their I/O contract.

Step:    (input_ids [batch], [position_ids [batch]], past_key_values.*) -> (logits [batch, vocab], present.*)
Prefill: (input_ids [batch, sequence], [position_ids [batch]], past_key_values.*)
                                                                 -> (logits of the last position, present.*)
Names follow optimum / onnxruntime-genai: `past_key_values.{layer}.{name}` in, `present.{layer}.{name}`
out (spelled only by edgelin.artifact.state), and each present feeds the past of the same name on the
next call. position_ids (the position of the first token) exists only when a layer needs it (softmax
attention, rotary families). Prefill takes a state too, so a long prompt can be prefilled piecewise
in bounded memory. How a recurrence is lowered while these modules are traced is the target's
choice (edgelin.export.lowering); the modules only pick the form: recurrent (step) or chunked.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from edgelin.artifact.state import state_input_name, state_output_name, state_tensors
from edgelin.artifact.tensors import TensorIO, grown_dims  # the contract's types: torch-free, for runtimes
from edgelin.model.lm import CausalLM

Tensor = torch.Tensor


def graph_io(model: CausalLM, kind: str, state_dtype: str = "float32",
             kv_dtype: str | None = None) -> tuple[list[TensorIO], list[TensorIO]]:
    """The graph's inputs and outputs; `kv_dtype` (ONNX --kv-cache static --kv-dtype) replaces the dtype of the
    growing KV caches' tensors (dims with past_sequence)."""
    ids_dims = ("batch",) if kind == "step" else ("batch", "sequence")
    inputs = [TensorIO("input_ids", ids_dims, "int64", "input_ids")]
    if model.needs_position:
        inputs.append(TensorIO("position_ids", ("batch",), "int64", "position_ids"))
    outputs = [TensorIO("logits", ("batch", model.config.vocab_size), "float32", "logits")]
    new_tokens = "1" if kind == "step" else "sequence"
    for layer, tensors in enumerate(state_tensors(model, state_dtype)):
        for t in tensors:
            if kv_dtype is not None and "past_sequence" in t.dims:
                t = dataclasses.replace(t, dtype=kv_dtype)
            past = state_input_name(layer, t.name)
            meta = {"layer": layer, "state_name": t.name, "state_role": t.role}
            inputs.append(TensorIO(past, t.dims, t.dtype, "state", **meta))
            outputs.append(TensorIO(state_output_name(layer, t.name), grown_dims(t.dims, new_tokens), t.dtype, "state",
                                    feeds=past, **meta))
    return inputs, outputs


class _Graph(nn.Module):
    def __init__(self, model: CausalLM):
        super().__init__()
        self.model = model
        self.layout = [[t.name for t in layer] for layer in model.state_tensors()]

    def _run(self, ids: Tensor, start: Tensor | None, flat: tuple[Tensor, ...], mode: str):
        state, it = [], iter(flat)
        for names in self.layout:
            state.append({name: next(it) for name in names})
        logits, new_state = self.model(ids, state, start, mode=mode, last_only=True)
        return (logits, *[layer[name] for layer, names in zip(new_state, self.layout) for name in names])


class StepModel(_Graph):
    """One token per sequence; the recurrent form."""

    def forward(self, input_ids: Tensor, *args: Tensor):
        start, flat = (args[0], args[1:]) if self.model.needs_position else (None, args)
        return self._run(input_ids.unsqueeze(1), start, flat, "recurrent")


class PrefillModel(_Graph):
    """A whole prompt per call; the chunked parallel form."""

    def forward(self, input_ids: Tensor, *args: Tensor):
        start, flat = (args[0], args[1:]) if self.model.needs_position else (None, args)
        return self._run(input_ids, start, flat, "chunked")


GRAPHS = {"step": StepModel, "prefill": PrefillModel}
