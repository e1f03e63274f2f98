"""Triton loads shared by the chunked kernels (edgelin/kernels/chunk.py) and their h/o pass
(edgelin/kernels/chunk_ho.py): in a module of their own so that neither of those imports the other."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _ld_lower(A, row0, t0, length, H, BT: tl.constexpr, BC: tl.constexpr):
    """This chunk's T (stored over A): its BC-row blocks on and left of the diagonal, zeros right of them
    (never stored there: the per-key intra kernels write only what the inverse reads)."""
    rows = tl.arange(0, BT)
    m = (t0 + rows < length)[:, None] & (rows[:, None] // BC >= rows[None, :] // BC)
    return tl.load(A + (row0 + rows[:, None] * H) * BT + rows[None, :], mask=m, other=0.0)
