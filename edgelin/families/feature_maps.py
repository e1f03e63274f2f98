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
from torch import nn

Tensor = torch.Tensor


@dataclass(frozen=True)
class FeatureMap:
    name: str
    summary: str
    out_dim: Callable[[int], int]
    # fn(x, aux, is_query): x is [..., d]; aux is the fixed random projection (needs_projection),
    # the learned module of this side (q or k) when `module` is set, else None.
    fn: Callable[[Tensor, object, bool], Tensor]
    needs_projection: bool = False
    dim_label: str = "d_k"  # the state width, for documentation tables
    module: Callable[[int], nn.Module] | None = None  # learned maps: a module per q and per k


class Hadamard(nn.Module):
    """fla's 'elementwise_product' map: (W1 x + b1) * (W2 x + b2)."""

    def __init__(self, dim: int):
        super().__init__()
        self.layer1, self.layer2 = nn.Linear(dim, dim), nn.Linear(dim, dim)

    def forward(self, x: Tensor) -> Tensor:
        return self.layer1(x) * self.layer2(x)


class Hedgehog(nn.Module):
    """Hedgehog (Zhang et al., 2024): softmax([2 W x, -2 W x]), initialised as identity."""

    def __init__(self, dim: int):
        super().__init__()
        self.layer = nn.Linear(dim, dim)
        nn.init.eye_(self.layer.weight)
        nn.init.zeros_(self.layer.bias)

    def forward(self, x: Tensor) -> Tensor:
        y = 2 * self.layer(x)
        return torch.cat([y, -y], dim=-1).softmax(-1)


class T2R(nn.Module):
    """T2R (Kasai et al., 2021): relu(W x)."""

    def __init__(self, dim: int):
        super().__init__()
        self.layer = nn.Linear(dim, dim, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.layer(x).relu()


def _dpfp(x: Tensor, _aux: object, _is_query: bool, nu: int = 4) -> Tensor:
    # Deterministic parameter-free projection (Schlag et al., 2021).
    x = torch.cat([x.relu(), (-x).relu()], dim=-1)
    rolled = torch.cat([x.roll(shifts=j, dims=-1) for j in range(1, nu + 1)], dim=-1)
    return torch.cat([x] * nu, dim=-1) * rolled


def _learned(x: Tensor, module: object, _is_query: bool) -> Tensor:
    return module(x)


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
        FeatureMap("elu", "phi(x) = elu(x)", lambda d: d, lambda x, _p, _q: F.elu(x)),
        FeatureMap("silu", "phi(x) = x * sigmoid(x)", lambda d: d, lambda x, _p, _q: F.silu(x)),
        FeatureMap("poly2", "[1, x, x(x)x / sqrt 2]: Taylor-2 of exp", lambda d: 1 + d + d * d, _poly2,
                   dim_label="1+d_k+d_k^2"),
        FeatureMap("favor", "FAVOR+ positive random features", lambda d: d, _favor, needs_projection=True),
        FeatureMap("dpfp", "DPFP, nu = 4", lambda d: 8 * d, _dpfp, dim_label="8 d_k"),
        FeatureMap("hadamard", "learned (W1 x) * (W2 x)", lambda d: d, _learned, module=Hadamard),
        FeatureMap("hedgehog", "learned softmax([2Wx, -2Wx])", lambda d: 2 * d, _learned, dim_label="2 d_k",
                   module=Hedgehog),
        FeatureMap("t2r", "learned relu(W x)", lambda d: d, _learned, module=T2R),
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
