"""A full-attention layer's fixed-capacity cache (edgelin.model.attention.fixed_capacity: Apple's targets) against
the growing cache it replaces: the same outputs for a prompt and the steps after it, at two batch sizes, and rows
the sequence has not reached left as they were."""

import pytest
import torch

from edgelin.model.attention import SoftmaxAttention, fixed_capacity
from edgelin.model.config import AttentionConfig

CAPACITY = 24


def layer(gate: bool) -> SoftmaxAttention:
    torch.manual_seed(0)
    cfg = AttentionConfig(num_heads=4, num_kv_heads=2, head_dim=16, window=None, qk_norm=True, output_gate=gate)
    return SoftmaxAttention(32, cfg).eval()


@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("gate", [False, True])
def test_fixed_capacity_matches_growing_cache(batch, gate):
    attn = layer(gate)
    torch.manual_seed(1)
    prompt, steps = torch.randn(batch, 7, 32), torch.randn(batch, 9, 32)
    empty = {"key": torch.zeros(batch, 2, 0, 16), "value": torch.zeros(batch, 2, 0, 16)}
    # A marker in the rows no token reaches: the fixed cache must neither read nor change them.
    marker = torch.full((batch, 2, CAPACITY, 16), 7.0)
    fixed = {"key": marker.clone(), "value": marker.clone()}
    with torch.no_grad():
        want, grown = attn(prompt, empty, torch.zeros(batch, dtype=torch.long))
        with fixed_capacity(attn, CAPACITY) as layers:
            assert layers == 1 and attn.capacity == CAPACITY
            got, fixed = attn(prompt, fixed, torch.zeros(batch, dtype=torch.long))
        assert attn.capacity is None  # restored on exit
        assert torch.allclose(got, want, atol=1e-5), (got - want).abs().max()
        for t in range(steps.shape[1]):
            position = torch.full((batch,), 7 + t, dtype=torch.long)
            want, grown = attn(steps[:, t:t + 1], grown, position, mode="recurrent")
            with fixed_capacity(attn, CAPACITY):
                got, fixed = attn(steps[:, t:t + 1], fixed, position, mode="recurrent")
            assert torch.allclose(got, want, atol=1e-5), (t, (got - want).abs().max())
    held = 7 + steps.shape[1]
    assert torch.equal(fixed["key"][:, :, :held], grown["key"])
    assert torch.equal(fixed["value"][:, :, :held], grown["value"])
    assert bool((fixed["key"][:, :, held:] == 7.0).all())


def test_rows_of_a_batch_at_different_positions():
    """Each row writes at its own position: row 1 prefilled 3 tokens earlier than row 0 matches its own run."""
    attn = layer(False)
    torch.manual_seed(2)
    x = torch.randn(2, 5, 32)
    cache = {"key": torch.zeros(2, 2, CAPACITY, 16), "value": torch.zeros(2, 2, CAPACITY, 16)}
    with torch.no_grad(), fixed_capacity(attn, CAPACITY):
        # row 0 at position 0, row 1 already holding 3 tokens (its own first 3 inputs)
        _, row1 = attn(x[1:, :3], {k: v[1:] for k, v in cache.items()}, torch.zeros(1, dtype=torch.long))
        both = {k: torch.cat([cache[k][:1], row1[k]]) for k in cache}
        got, _ = attn(x[:, 3:5], both, torch.tensor([0, 3]))
        alone0, _ = attn(x[:1, 3:5], {k: v[:1] for k, v in cache.items()}, torch.zeros(1, dtype=torch.long))
        alone1, _ = attn(x[1:, :5], {k: v[1:] for k, v in cache.items()}, torch.zeros(1, dtype=torch.long))
    assert torch.allclose(got[:1], alone0, atol=1e-5)
    assert torch.allclose(got[1:], alone1[:, 3:5], atol=1e-5)
