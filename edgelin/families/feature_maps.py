"""Feature maps phi applied to queries and keys before the recurrence.

Each map declares the state width it produces from a head dimension, so state shapes derive from
the spec without running anything.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

Tensor = torch.Tensor


@dataclass(frozen=True)
class FeatureMap:
    name: str
    summary: str
    out_dim: Callable[[int], int]
    # fn(x, projection, is_query): x is [..., d]; projection is the fixed random matrix or None.
    fn: Callable[[Tensor, Tensor | None, bool], Tensor]
    needs_projection: bool = False
    dim_label: str = "d_k"  # the state width, for documentation tables


def _poly2(x: Tensor, _proj: Tensor | None, _is_query: bool) -> Tensor:
    # phi(q).phi(k) = 1 + s + s^2 / 2 with s = q.k / sqrt(d): the degree-2 Taylor series of exp.
    d = x.shape[-1]
    x = x * d**-0.25
    outer = (x.unsqueeze(-1) * x.unsqueeze(-2)).flatten(-2) / math.sqrt(2.0)
    return torch.cat([torch.ones_like(x[..., :1]), x, outer], dim=-1)


def _favor(x: Tensor, proj: Tensor | None, is_query: bool) -> Tensor:
    # FAVOR+ positive random features: exp(w.x - |x|^2 / 2) / sqrt(m), x pre-scaled by d^-1/4.
    assert proj is not None, "FAVOR+ needs its projection buffer"
    d, m = x.shape[-1], proj.shape[0]
    x = x * d**-0.25
    logits = x @ proj.t() - 0.5 * (x * x).sum(-1, keepdim=True)
    if is_query:
        # A per-token shift cancels between numerator and normaliser; keys get none (causality).
        logits = logits - logits.amax(-1, keepdim=True).detach()
    return torch.exp(logits) * m**-0.5


FEATURE_MAPS: dict[str, FeatureMap] = {
    fm.name: fm
    for fm in (
        FeatureMap("identity", "phi(x) = x", lambda d: d, lambda x, _p, _q: x),
        FeatureMap("elu1", "phi(x) = elu(x) + 1", lambda d: d, lambda x, _p, _q: F.elu(x) + 1.0),
        FeatureMap("relu", "phi(x) = relu(x)", lambda d: d, lambda x, _p, _q: F.relu(x)),
        FeatureMap("silu", "phi(x) = x * sigmoid(x)", lambda d: d, lambda x, _p, _q: F.silu(x)),
        FeatureMap("poly2", "[1, x, x(x)x / sqrt 2]: Taylor-2 of exp", lambda d: 1 + d + d * d, _poly2,
                   dim_label="1+d_k+d_k^2"),
        FeatureMap("favor", "FAVOR+ positive random features", lambda d: d, _favor, needs_projection=True),
    )
}


def orthogonal_random_features(num_features: int, dim: int, seed: int) -> Tensor:
    """Performer's orthogonal Gaussian projection, seeded so a checkpoint re-creates it exactly."""
    gen = torch.Generator().manual_seed(seed)
    blocks = []
    for _ in range(math.ceil(num_features / dim)):
        q, _ = torch.linalg.qr(torch.randn(dim, dim, generator=gen))
        blocks.append(q.t())
    rows = torch.cat(blocks)[:num_features]
    norms = torch.randn(num_features, dim, generator=gen).norm(dim=1, keepdim=True)
    return rows * norms
