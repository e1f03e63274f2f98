"""Softmax attention for hybrid stacks and the KV-cache baseline.

Two cache policies, chosen by `AttentionConfig.window`:
- window W (hybrids): the cache is a ring buffer of W slots; position p lives in slot p % W. Memory
  is constant, so a hybrid decodes in constant memory like a pure linear model. The reference
  forward uses the same sliding-window mask, so step and full-sequence outputs agree exactly.
  Prefill is block-local (each block of W queries sees the previous block and itself): linear in T.
- window None (baseline only): full context, the cache grows by one row per token.

A growing cache can also be exported for ONNX Runtime's in-place, fixed-capacity KV cache
(`edgelin export --kv-cache static`): inside `grouped_query_attention(model)` the ONNX export emits
the full-context attention as one `com.microsoft::GroupQueryAttention` node (q/k norm and partial
rotary stay outside it: do_rotary=0) that writes the new keys and values at the sequence's position
and attends over the valid length only. Fed a past of the valid length, the node is the growing
cache's concat + attention; fed one buffer of the export's capacity as both past and present (the
ONNX runner's IO binding), it updates that buffer in place. Eager torch is unchanged.

Apple's targets (Core AI, Core ML) hold the cache in model state of a fixed capacity N instead
(`fixed_capacity(model, N)` while tracing): the state is [batch, Hkv, N, d_h], a call writes its
tokens into rows start .. start + T - 1 (a gather and a where: no scatter, no dynamic shapes) and
attends over the rows up to each query's position. Rows beyond the sequence's length are never
read, so a sequence's position must equal the number of tokens its cache holds and stay below N
(the runners check both). Up to N tokens this is the growing cache's attention exactly.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn

from edgelin.families import StateTensor
from edgelin.model.config import AttentionConfig
from edgelin.model.layers import RMSNorm, Rotary, positions_from

Tensor = torch.Tensor


# The contrib op a growing cache's attention is exported as under grouped_query_attention().
GQA_OP = "com.microsoft::GroupQueryAttention"


@contextlib.contextmanager
def grouped_query_attention(model: nn.Module) -> Iterator[int]:
    """While tracing for ONNX inside this block, every full-context (window None) attention layer of
    `model` exports as one GroupQueryAttention node. Yields how many layers that covers."""
    layers = [m for m in model.modules() if isinstance(m, SoftmaxAttention) and m.cfg.window is None]
    for layer in layers:
        layer.export_op = GQA_OP  # a plain attribute: part of what the traced graph depends on
    try:
        yield len(layers)
    finally:
        for layer in layers:
            layer.export_op = None


@contextlib.contextmanager
def fixed_capacity(model: nn.Module, capacity: int) -> Iterator[int]:
    """While tracing inside this block, every full-context (window None) attention layer of `model` keeps its KV
    cache as a fixed-capacity state of `capacity` rows (module docstring). Yields how many layers that covers."""
    layers = [m for m in model.modules() if isinstance(m, SoftmaxAttention) and m.cfg.window is None]
    for layer in layers:
        layer.capacity = capacity
    try:
        yield len(layers)
    finally:
        for layer in layers:
            layer.capacity = None


class SoftmaxAttention(nn.Module):
    def __init__(self, hidden_size: int, cfg: AttentionConfig, eps: float = 1e-6):
        super().__init__()
        self.cfg = cfg
        self.export_op: str | None = None  # GQA_OP inside grouped_query_attention()
        self.capacity: int | None = None  # rows of a fixed-capacity cache inside fixed_capacity()
        self.q_proj = nn.Linear(hidden_size, cfg.num_heads * cfg.head_dim, bias=cfg.qkv_bias)
        self.k_proj = nn.Linear(hidden_size, cfg.num_kv_heads * cfg.head_dim, bias=cfg.qkv_bias)
        self.v_proj = nn.Linear(hidden_size, cfg.num_kv_heads * cfg.head_dim, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(cfg.num_heads * cfg.head_dim, hidden_size, bias=False)
        self.rotary = Rotary(cfg.rotary_dim or cfg.head_dim, cfg.rope_theta)
        if cfg.qk_norm:
            qk_eps = cfg.qk_norm_eps if cfg.qk_norm_eps is not None else eps
            self.q_norm, self.k_norm = RMSNorm(cfg.head_dim, qk_eps), RMSNorm(cfg.head_dim, qk_eps)
        if cfg.output_gate:
            self.g_proj = nn.Linear(hidden_size, cfg.num_heads * cfg.head_dim, bias=False)

    def state_tensors(self) -> list[StateTensor]:
        length = self.cfg.window if self.cfg.window is not None else "past_sequence"
        shape = ("batch", self.cfg.num_kv_heads, length, self.cfg.head_dim)
        return [StateTensor("key", shape, "key"), StateTensor("value", shape, "value")]

    def forward(
        self, x: Tensor, state: dict[str, Tensor], start: Tensor | None = None, mode: str = "chunked"
    ) -> tuple[Tensor, dict[str, Tensor]]:
        cfg = self.cfg
        batch, length, _ = x.shape
        positions = positions_from(start, batch, length, x.device)
        q = self.q_proj(x).view(batch, length, cfg.num_heads, cfg.head_dim)
        k = self.k_proj(x).view(batch, length, cfg.num_kv_heads, cfg.head_dim)
        if cfg.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rotary(q, positions), self.rotary(k, positions)
        v = self.v_proj(x).view(batch, length, cfg.num_kv_heads, cfg.head_dim)
        if cfg.window is None and self.export_op == GQA_OP and torch.onnx.is_in_onnx_export():
            out, new_state = self._gqa(q, k, v, state, positions[:, 0])
            if cfg.output_gate:
                out = out * torch.sigmoid(self.g_proj(x))
            return self.o_proj(out), new_state
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # [B, heads, T, D]
        if cfg.window is None and self.capacity is not None:
            out, new_state = self._fixed(q, k, v, state, positions[:, 0])
        elif cfg.window is None:
            out, new_state = self._full(q, k, v, state)
        elif mode == "recurrent" and length == 1:
            out, new_state = self._ring_step(q, k, v, state, positions[:, 0])
        else:
            out, new_state = self._ring_prefill(q, k, v, state, positions[:, 0])
        out = out.transpose(1, 2).reshape(batch, length, -1)
        if cfg.output_gate:
            out = out * torch.sigmoid(self.g_proj(x))
        return self.o_proj(out), new_state

    def _attend(self, q: Tensor, k: Tensor, v: Tensor, valid: Tensor) -> Tensor:
        groups = self.cfg.num_heads // self.cfg.num_kv_heads
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        scores = (q @ k.transpose(-1, -2)) * self.cfg.head_dim**-0.5
        # An additive mask built at the mask's own (head-less) shape: broadcasting an Add over heads
        # is much cheaper in runtimes than a broadcast Where over the full score tensor.
        bias = torch.where(valid, 0.0, float("-inf")).to(scores.dtype)
        return torch.softmax(scores + bias, dim=-1) @ v

    def _full(self, q: Tensor, k: Tensor, v: Tensor, state: dict[str, Tensor]):
        keys, values = torch.cat([state["key"], k], 2), torch.cat([state["value"], v], 2)
        past, length = state["key"].shape[2], q.shape[2]
        valid = torch.arange(past + length, device=q.device) <= past + torch.arange(length, device=q.device)[:, None]
        return self._attend(q, keys, values, valid), {"key": keys, "value": values}

    def _fixed(self, q: Tensor, k: Tensor, v: Tensor, state: dict[str, Tensor], start: Tensor):
        """The cache as fixed-capacity state [B, Hkv, N, D]: this call's T keys and values go to rows start ..
        start + T - 1, and query t attends over rows 0 .. start + t (module docstring)."""
        capacity, length = state["key"].shape[2], q.shape[2]
        slots = torch.arange(capacity, device=q.device)
        offset = slots.unsqueeze(0) - start.unsqueeze(1)  # [B, N]: the new token each row receives
        write = ((offset >= 0) & (offset < length)).view(-1, 1, capacity, 1)
        pick = offset.clamp(0, length - 1).view(-1, 1, capacity, 1).expand(-1, k.shape[1], -1, k.shape[3])
        keys = torch.where(write, k.to(state["key"].dtype).gather(2, pick), state["key"])
        values = torch.where(write, v.to(state["value"].dtype).gather(2, pick), state["value"])
        queries = start.view(-1, 1, 1, 1) + torch.arange(length, device=q.device).view(1, 1, length, 1)
        valid = slots.view(1, 1, 1, capacity) <= queries  # [B, 1, T, N]
        return self._attend(q, keys.to(q.dtype), values.to(q.dtype), valid), {"key": keys, "value": values}

    def _gqa(self, q: Tensor, k: Tensor, v: Tensor, state: dict[str, Tensor], start: Tensor):
        """_full as one GroupQueryAttention node: q [B, T, H, D], k/v [B, T, Hkv, D] -> out [B, T, H*D].
        The new keys and values go to cache rows start .. start + T - 1 (`seqlens_k`: the last one per
        sequence), so a sequence's position must equal the number of tokens its cache holds (the runner
        checks it); the present has the past's length plus T, or the past's own length when the runtime
        gives both one buffer of enough capacity (written in place)."""
        cfg = self.cfg
        batch, length = q.shape[:2]
        # An fp16 graph keeps this cache float32 (edgelin.export.onnx.target.graph_modules): the node runs on
        # the cache's dtype, so only this call's q/k/v are cast, never the whole cache.
        compute = q.dtype
        q, k, v = (t.to(state["key"].dtype) for t in (q, k, v))
        seqlens = (start + (length - 1)).to(torch.int32)
        total = (seqlens.max() + 1).reshape(())
        past = state["key"].shape[2]
        kv_shape = (batch, cfg.num_kv_heads, past + length, cfg.head_dim)
        out, keys, values = torch.onnx.ops.symbolic_multi_out(
            GQA_OP, [q.reshape(batch, length, -1), k.reshape(batch, length, -1), v.reshape(batch, length, -1),
                     state["key"], state["value"], seqlens, total],
            {"num_heads": cfg.num_heads, "kv_num_heads": cfg.num_kv_heads, "scale": float(cfg.head_dim**-0.5),
             "do_rotary": 0, "local_window_size": -1},
            dtypes=(q.dtype, k.dtype, v.dtype), shapes=((batch, length, cfg.num_heads * cfg.head_dim), kv_shape,
                                                         kv_shape), version=1)
        return out.to(compute), {"key": keys, "value": values}

    def _ring_step(self, q: Tensor, k: Tensor, v: Tensor, state: dict[str, Tensor], position: Tensor):
        window = self.cfg.window
        slots = torch.arange(window, device=q.device)
        write = (slots == position.unsqueeze(1) % window).view(-1, 1, window, 1)  # [B, 1, W, 1]
        keys, values = torch.where(write, k, state["key"]), torch.where(write, v, state["value"])
        held = position.unsqueeze(1) - (position.unsqueeze(1) - slots) % window  # position in each slot
        valid = (held >= 0).view(-1, 1, 1, window)
        return self._attend(q, keys, values, valid), {"key": keys, "value": values}

    def _ring_prefill(self, q: Tensor, k: Tensor, v: Tensor, state: dict[str, Tensor], start: Tensor):
        window, (batch, heads, length, dim) = self.cfg.window, q.shape
        kv_heads = k.shape[1]
        slots = torch.arange(window, device=q.device)
        # The cache in time order: positions start - W .. start - 1.
        order = ((start.unsqueeze(1) + slots) % window).view(batch, 1, window, 1).expand(-1, kv_heads, -1, dim)
        keys = torch.cat([state["key"].gather(2, order), k], 2)  # [B, Hkv, W + T, D]
        values = torch.cat([state["value"].gather(2, order), v], 2)

        blocks = (length + window - 1) // window
        within = torch.arange(window, device=q.device)
        q_index = torch.arange(blocks, device=q.device).unsqueeze(1) * window + within  # [N, W]
        k_index = torch.arange(blocks, device=q.device).unsqueeze(1) * window + torch.arange(2 * window, device=q.device)
        pad = q.new_zeros(batch, heads, window, dim)
        q_blocks = torch.cat([q, pad], 2)[:, :, q_index]  # [B, H, N, W, D]
        kv_pad = keys.new_zeros(batch, kv_heads, 2 * window, dim)
        k_blocks = torch.cat([keys, kv_pad], 2)[:, :, k_index]  # [B, Hkv, N, 2W, D]
        v_blocks = torch.cat([values, kv_pad], 2)[:, :, k_index]
        q_pos = (start.view(batch, 1, 1) + q_index).unsqueeze(-1)  # [B, N, W, 1]
        # Padding keys continue the positions, so a padding query always sees itself (no NaN rows).
        k_pos = (start.view(batch, 1, 1) - window + k_index).unsqueeze(-2)  # [B, N, 1, 2W]
        valid = (k_pos <= q_pos) & (k_pos > q_pos - window) & (k_pos >= 0)
        out = self._attend(q_blocks, k_blocks, v_blocks, valid.unsqueeze(1))  # [B, H, N, W, D]
        out = out.reshape(batch, heads, blocks * window, dim)[:, :, :length]

        # The new ring: the last W keys, position p in slot p % W.
        ring = ((slots - start.unsqueeze(1) - length) % window).view(batch, 1, window, 1).expand(-1, kv_heads, -1, dim)
        tail_keys, tail_values = keys[:, :, length:], values[:, :, length:]
        return out, {"key": tail_keys.gather(2, ring), "value": tail_values.gather(2, ring)}
