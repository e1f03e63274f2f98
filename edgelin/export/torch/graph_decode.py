"""One whole-model decode step captured in a CUDA graph and replayed per token.

Decode at B=1 is launch-bound: a step is hundreds of tiny kernels (norms, GEMVs, the recurrence),
each a few microseconds of CPU launch work. A CUDA graph replays them all with one launch.
The graph needs fixed addresses, so the token ids, positions and recurrent state live in static
buffers; the captured step runs the model's public forward (mode="recurrent", T=1), then copies
the new state into the static state buffers and advances the positions, all inside the graph.
"""

from __future__ import annotations

import torch

from edgelin.kernels._common import KernelError

Tensor = torch.Tensor
def decode_state(model: torch.nn.Module, batch: int, device=None) -> list[dict[str, Tensor]]:
    """Zeros for every state tensor: accumulators (recurrent state, normaliser) in float32, the
    caches that only hold past inputs (conv state, KV ring buffer) in the weights' dtype, so that
    a half-precision model runs."""
    return model.initial_state(batch, device=device, dtype=next(model.parameters()).dtype)


class GraphDecoder:
    """decoder = GraphDecoder(model, batch=1); decoder.reset(state, start)
    logits = decoder.step(token_ids)   # [B] or [B, 1] -> [B, vocab] (a static buffer: copy it to keep it)
    """

    def __init__(self, model: torch.nn.Module, batch: int = 1, warmup: int = 2, pool=None):
        params = list(model.parameters())
        if not params or not params[0].is_cuda:
            raise KernelError("GraphDecoder needs a model on a CUDA device", "CUDA graphs capture GPU work only",
                              "call model.cuda() first")
        device = params[0].device
        self.model, self.batch = model, batch
        self.ids = torch.zeros(batch, 1, dtype=torch.long, device=device)
        self.start = torch.zeros(batch, dtype=torch.long, device=device)
        self.state = decode_state(model, batch, device)
        self.graph = torch.cuda.CUDAGraph()
        with torch.no_grad():
            # Warm up on a side stream (as torch's docs ask): first calls compile Triton kernels,
            # pick cuBLAS algorithms and allocate; none of that may happen during capture.
            side = torch.cuda.Stream(device)
            side.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(side):
                for _ in range(warmup):
                    self._forward()
            torch.cuda.current_stream(device).wait_stream(side)
            with torch.cuda.graph(self.graph, pool=pool):
                logits, new_state = self._forward()
                for layer, new in zip(self.state, new_state):
                    for name, tensor in layer.items():
                        tensor.copy_(new[name])
                self.start.add_(1)
        self.logits = logits

    def _forward(self) -> tuple[Tensor, list[dict[str, Tensor]]]:
        return self.model(self.ids, self.state, self.start, mode="recurrent", last_only=True)

    def reset(self, state: list[dict[str, Tensor]] | None = None, start: Tensor | int = 0) -> None:
        """Load a state (e.g. after a prefill; None: zeros) and the position of the next token."""
        with torch.no_grad():
            for i, layer in enumerate(self.state):
                for name, tensor in layer.items():
                    if state is None:
                        tensor.zero_()
                    else:
                        tensor.copy_(state[i][name])
            self.start.copy_(torch.as_tensor(start, device=self.start.device).expand(self.batch))

    def step(self, token_ids: Tensor) -> Tensor:
        """Feed one token per row; returns the logits buffer [B, vocab] (overwritten next step)."""
        self.ids.copy_(token_ids.view(self.batch, 1))
        self.graph.replay()
        return self.logits

    def current_state(self) -> list[dict[str, Tensor]]:
        """A copy of the recurrent state after the last step."""
        return [{name: t.clone() for name, t in layer.items()} for layer in self.state]
