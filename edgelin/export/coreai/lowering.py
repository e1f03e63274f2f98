"""The Core AI lowering: delta-rule layers through Apple's `GatedDeltaUpdate` composite where their tensors match
it, edgelin's own forms otherwise.

coreai-torch emits a `coreai_torch.composite_ops.GatedDeltaUpdate` call as the composite op "gated_delta_update"
(a private graph with a composite declaration, which Apple's runtime may replace by its fused kernel; the graph
itself, a token loop, is what runs where it does not) when the module instance is in the traced module's tree
and marked for externalization (edgelin.export.coreai.convert). The composite is the op Apple's own coreai-models
Qwen3.5 emits for its linear-attention layers.

What matches (decided per call from the tensors, as every engine decides; no family is named): the delta rule
(beta present), a scalar per-head log-decay g [..., 1] or none (g = 0), no erase gate, float32. Its math is
edgelin's `recurrent_step` token by token (decay first, then the delta rule, readout q^T S after the update);
two differences are cancelled here:
- it scales q by d_k^-0.5 itself: q is fed times d_k^0.5 (edgelin's mixer has already scaled q as the family
  says; exact for d_k a power of 4, otherwise one rounding);
- it can L2-normalise q and k itself: use_qk_l2_norm=False, declared in the composite's attributes, since the
  mixer has already normalised them as the family says. (Apple's Qwen3.5 declares no attribute and normalises
  in the op; for the L2-normalised families, Gated DeltaNet and DeltaNet, normalising again changes q and k by
  ~1e-6 relative, so a kernel that normalised regardless would still agree.)
Layouts: edgelin's [B, T, H, d] become the composite's [B, H, T, d] (g and beta [B, H, T]); its output comes
back as [B, T, H, d_v], edgelin's layout.

Per-key decays (GLA, KDA), the additive rule, the erase gate (Gated DeltaNet-2) and the normaliser run the
static chunk loop and the reference step (edgelin.export.static_chunks), as before this lowering.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import Any

import torch

from edgelin.export.static_chunks import StaticChunkEngine

Tensor = torch.Tensor
COMPOSITE = "gated_delta_update"  # the composite op's name (Apple's coreai-models declares the same)


def composite_module() -> torch.nn.Module:
    """A fresh GatedDeltaUpdate that leaves q and k as the mixer made them (module docstring)."""
    with warnings.catch_warnings():  # coreai_torch warns on import that it was validated up to torch 2.13.0
        warnings.simplefilter("ignore")
        from coreai_torch.composite_ops import GatedDeltaUpdate
    return GatedDeltaUpdate(use_qk_l2_norm=False)


def _available() -> bool:
    from importlib.util import find_spec

    return find_spec("coreai_torch") is not None


def externalize_specs() -> list:
    """What convert marks: every GatedDeltaUpdate in the module tree, as the named composite."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import coreai_torch
        from coreai_torch.composite_ops import GatedDeltaUpdate
    return [coreai_torch.ExternalizeSpec(GatedDeltaUpdate, composite_op_name=COMPOSITE,
                                         composite_attrs=["use_qk_l2_norm"])]


def takes_composite(state: Tensor, k: Tensor, g: Tensor | None, beta: Tensor | None,
                    erase: Tensor | None) -> bool:
    """Whether the layer's tensors are the composite's: delta rule, scalar or no decay, no erase gate, float32."""
    return (beta is not None and erase is None and (g is None or g.shape[-1] == 1)
            and state.dtype == k.dtype == torch.float32 and state.shape[-2] == k.shape[-1])


@dataclass(frozen=True)
class CoreaiEngine(StaticChunkEngine):
    """StaticChunkEngine, except that matching layers run step, token loop and prefill through the composite.

    `composite`: the GatedDeltaUpdate instance the traced module holds (convert puts one into each entry point's
    module and passes it here, so every call site is that instance's, which coreai-torch externalizes one graph
    per call site); None: a fresh one per call (same math, nothing to externalize: tests of the engine alone), or
    edgelin's forms where coreai-torch is not installed (the lowering traced without converting).
    `composite_ops` False: edgelin's forms for every layer (the static chunk loop: the path before the composite).
    """

    name: str = "coreai-gated-delta-update"
    composite_ops: bool = True
    composite: Any = field(default=None, compare=False, repr=False)

    def _takes(self, state: Tensor, k: Tensor, g: Tensor | None, beta: Tensor | None, erase: Tensor | None) -> bool:
        return (self.composite_ops and takes_composite(state, k, g, beta, erase)
                and (self.composite is not None or _available()))

    def _run(self, state: Tensor, q: Tensor, k: Tensor, v: Tensor, g: Tensor | None,
             beta: Tensor) -> tuple[Tensor, Tensor]:
        """q, k [B, T, H, d_k], v [B, T, H, d_v], g [B, T, H, 1] or None, beta [B, T, H] -> ([B, T, H, d_v], S)."""
        module = self.composite if self.composite is not None else composite_module()
        q = q * k.shape[-1] ** 0.5  # cancels the composite's own d_k^-0.5
        log_decay = torch.zeros_like(beta) if g is None else g.squeeze(-1)
        heads_first = (t.transpose(1, 2) for t in (q, k, v, log_decay, beta))
        # `state + 0`: with a model-state input fed straight into the composite, coreai-core 1.0.0b3's rewrite
        # fails on a model with 3+ such layers ("input types did not match callee signature"); an add between
        # them avoids it (tests/export/coreai/test_coreai_composite.py converts three such layers)
        return module(*heads_first, state + 0)

    def step(self, state: Tensor, q: Tensor, k: Tensor, v: Tensor, g: Tensor | None = None,
             beta: Tensor | None = None, erase: Tensor | None = None) -> tuple[Tensor, Tensor]:
        if not self._takes(state, k, g, beta, erase):
            return super().step(state, q, k, v, g, beta, erase)
        o, state = self._run(state, *(t.unsqueeze(1) for t in (q, k, v)), None if g is None else g.unsqueeze(1),
                             beta.unsqueeze(1))
        return o.squeeze(1), state

    def recurrent(self, state: Tensor, q: Tensor, k: Tensor, v: Tensor, g: Tensor | None = None,
                  beta: Tensor | None = None, erase: Tensor | None = None) -> tuple[Tensor, Tensor]:
        if not self._takes(state, k, g, beta, erase):
            return super().recurrent(state, q, k, v, g, beta, erase)
        return self._run(state, q, k, v, g, beta)

    def chunked(self, state: Tensor, q: Tensor, k: Tensor, v: Tensor, g: Tensor | None = None,
                beta: Tensor | None = None, chunk_size: int = 64,
                erase: Tensor | None = None) -> tuple[Tensor, Tensor]:
        if not self._takes(state, k, g, beta, erase):
            return super().chunked(state, q, k, v, g, beta, chunk_size, erase)
        return self._run(state, q, k, v, g, beta)
