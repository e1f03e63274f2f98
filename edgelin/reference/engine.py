"""Engines: the object through which the model's mixer runs a recurrence.

An engine bundles the forms a layer needs: `step` (one token), `recurrent` (a token loop),
`chunked` (the parallel prefill form) and the normaliser's three forms. The mixer never calls
`edgelin.reference.recurrence` directly; it asks for an engine (`edgelin.model.mixer.select_engine`):
a target's lowering installs one while its graphs are traced (`edgelin.export.lowering`), and
otherwise the kernel dispatch picks GPU kernels or this module's `TORCH` (`edgelin.kernels.dispatch`).

`TorchEngine` is the reference math itself; its `loop` says how the chunked form runs its chunk
loop (a Python loop here; ONNX's lowering passes torch's scan). Engines are frozen dataclasses:
they carry no state, so one value can be shared by every layer and thread.

`erase` (Gated DeltaNet-2's per-key-channel erase gate) is the newest input: the mixer passes it
by keyword, and only when a layer has one. An engine whose forms do not take it (a target step
plugin, a GPU kernel without the flag) is refused by `takes_erase` before it could mis-compute.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Protocol

import torch

from edgelin.reference import recurrence
from edgelin.reference.recurrence import ChunkLoop, python_loop

Tensor = torch.Tensor


class Engine(Protocol):
    """What the mixer calls. Layouts and flags as in `edgelin.reference.recurrence`."""

    name: str

    def step(self, state: Tensor, q: Tensor, k: Tensor, v: Tensor, g: Tensor | None = None,
             beta: Tensor | None = None, erase: Tensor | None = None) -> tuple[Tensor, Tensor]: ...

    def recurrent(self, state: Tensor, q: Tensor, k: Tensor, v: Tensor, g: Tensor | None = None,
                  beta: Tensor | None = None, erase: Tensor | None = None) -> tuple[Tensor, Tensor]: ...

    def chunked(self, state: Tensor, q: Tensor, k: Tensor, v: Tensor, g: Tensor | None = None,
                beta: Tensor | None = None, chunk_size: int = 64,
                erase: Tensor | None = None) -> tuple[Tensor, Tensor]: ...

    def normalizer_step(self, z: Tensor, q: Tensor, k: Tensor, g: Tensor | None = None) -> tuple[Tensor, Tensor]: ...

    def normalizer_recurrent(self, z: Tensor, q: Tensor, k: Tensor,
                             g: Tensor | None = None) -> tuple[Tensor, Tensor]: ...

    def normalizer_chunked(self, z: Tensor, q: Tensor, k: Tensor, g: Tensor | None = None,
                           chunk_size: int = 64) -> tuple[Tensor, Tensor]: ...


@dataclass(frozen=True)
class TorchEngine:
    """The pure-torch reference forms; `loop` runs the chunk loop of the chunked forms."""

    name: str = "torch"
    loop: ChunkLoop = python_loop

    def step(self, state: Tensor, q: Tensor, k: Tensor, v: Tensor, g: Tensor | None = None,
             beta: Tensor | None = None, erase: Tensor | None = None) -> tuple[Tensor, Tensor]:
        return recurrence.recurrent_step(state, q, k, v, g, beta, erase)

    def recurrent(self, state: Tensor, q: Tensor, k: Tensor, v: Tensor, g: Tensor | None = None,
                  beta: Tensor | None = None, erase: Tensor | None = None) -> tuple[Tensor, Tensor]:
        return recurrence.recurrent(state, q, k, v, g, beta, erase)

    def chunked(self, state: Tensor, q: Tensor, k: Tensor, v: Tensor, g: Tensor | None = None,
                beta: Tensor | None = None, chunk_size: int = 64,
                erase: Tensor | None = None) -> tuple[Tensor, Tensor]:
        return recurrence.chunked(state, q, k, v, g, beta, chunk_size, loop=self.loop, erase=erase)

    def normalizer_step(self, z: Tensor, q: Tensor, k: Tensor, g: Tensor | None = None) -> tuple[Tensor, Tensor]:
        return recurrence.normalizer_step(z, q, k, g)

    def normalizer_recurrent(self, z: Tensor, q: Tensor, k: Tensor,
                             g: Tensor | None = None) -> tuple[Tensor, Tensor]:
        return recurrence.normalizer_recurrent(z, q, k, g)

    def normalizer_chunked(self, z: Tensor, q: Tensor, k: Tensor, g: Tensor | None = None,
                           chunk_size: int = 64) -> tuple[Tensor, Tensor]:
        return recurrence.normalizer_chunked(z, q, k, g, chunk_size, loop=self.loop)


TORCH = TorchEngine()


def takes_erase(engine: Engine, form: str) -> bool:
    """Whether `engine`'s `form` ("step", "recurrent", "chunked") accepts the erase gate: a subclass
    that overrides a form without the `erase` parameter (a plugin step, a kernel) does not."""
    return "erase" in inspect.signature(getattr(engine, form)).parameters
