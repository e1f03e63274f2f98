"""Small building blocks shared by mixers and the LM: RMSNorm, rotary embedding, short conv."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

Tensor = torch.Tensor


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        # The mean of squares in float32 (fp16 graphs: x^2 overflows fp16 from |x| = 256); a no-op for fp32.
        # x / sqrt(.), not x * rsqrt(.): ONNX Runtime fuses this form (Pow, ReduceMean, Add, Sqrt, Div, Mul)
        # into one SimplifiedLayerNormalization node; the rsqrt form stays six nodes in every step graph.
        wide = x.float()
        return (wide / torch.sqrt(wide.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype) * self.weight


class GroupRMSNorm(nn.Module):
    """RMSNorm over `groups` equal slices of the last dim, one weight per channel (Mamba2's gated norm)."""

    def __init__(self, dim: int, groups: int, eps: float = 1e-6):
        super().__init__()
        self.groups, self.eps = groups, eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        if self.groups == 1:  # RMSNorm's own form: ONNX Runtime fuses it (one node; the reshapes would stop that)
            wide = x.float()
            return (wide / torch.sqrt(wide.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype) * self.weight
        grouped = x.reshape(*x.shape[:-1], self.groups, -1).float()  # float32 statistics, as RMSNorm
        grouped = grouped / torch.sqrt(grouped.pow(2).mean(-1, keepdim=True) + self.eps)  # as RMSNorm
        return grouped.reshape(x.shape).to(x.dtype) * self.weight


class Rotary(nn.Module):
    """Rotary position embedding (rotate-half layout) at absolute positions, on the first `dim`
    channels of each head (partial rotary leaves the rest as is)."""

    def __init__(self, dim: int, theta: float):
        super().__init__()
        self.dim = dim
        inv_freq = 1.0 / theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, x: Tensor, positions: Tensor) -> Tensor:
        """x [B, T, H, D]; positions [B, T] (int64)."""
        angles = positions.to(torch.float32).unsqueeze(-1) * self.inv_freq  # [B, T, dim/2]
        cos = torch.cat([angles.cos()] * 2, -1).unsqueeze(2).to(x.dtype)  # angles in float32, applied in x's
        sin = torch.cat([angles.sin()] * 2, -1).unsqueeze(2).to(x.dtype)
        rot, rest = x[..., : self.dim], x[..., self.dim:]
        half = self.dim // 2
        rotated = torch.cat([-rot[..., half:], rot[..., :half]], -1)
        return torch.cat([rot * cos + rotated * sin, rest], -1)


def positions_from(start: Tensor | None, batch: int, length: int, device) -> Tensor:
    """[B, T] absolute positions given each row's start position [B] (None: start at 0)."""
    steps = torch.arange(length, device=device).unsqueeze(0)
    return steps.expand(batch, length) if start is None else start.unsqueeze(1) + steps


def short_conv(x: Tensor, weight: Tensor, conv_state: Tensor, bias: Tensor | None = None,
               taps: bool = False, window_sum: bool = False) -> tuple[Tensor, Tensor]:
    """Causal depthwise conv + SiLU. x [B, T, C], weight [C, W], conv_state [B, C, W-1]: the
    last W-1 inputs before x. Returns (y [B, T, C], new conv_state).
    taps=True sums the W shifted products instead of calling conv1d: the same numbers, and for a
    single decode token a handful of elementwise ops instead of a grouped Conv node.
    window_sum=True (one token, T = 1: the ONNX step's form, edgelin.export.lowering) multiplies the
    whole window by the weights and sums it in one reduction: 3 nodes for the W taps' 3W - 1
    (the same products, summed in another order: rounding-level differences)."""
    width = weight.shape[-1]
    padded = torch.cat([conv_state, x.transpose(1, 2)], dim=-1)  # [B, C, W-1+T]
    if window_sum:
        y = (padded * weight).sum(-1) if bias is None else (padded * weight).sum(-1) + bias  # [B, C]
        return F.silu(y).unsqueeze(1), padded[..., 1:]
    if taps:
        length = x.shape[1]
        y = sum(padded[..., j:j + length] * weight[:, j:j + 1] for j in range(width))
        y = y if bias is None else y + bias.unsqueeze(-1)
    else:
        y = F.conv1d(padded, weight.unsqueeze(1), bias, groups=weight.shape[0])
    return F.silu(y).transpose(1, 2), padded[..., padded.shape[-1] - (width - 1):]
