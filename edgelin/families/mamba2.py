"""Mamba2 / SSD (Dao & Gu, 2024) as linear attention: q = C, k = B, v = x * dt.

S_t = exp(A dt_t) S_{t-1} + (dt_t x_t) B_t^T, o_t = S_t^T C_t + D x_t; conv over (x, B, C).
"""

from edgelin.families.spec import Decay, FamilySpec, Gate, OutputGate

SPEC = FamilySpec(
    name="mamba2",
    summary="scalar decay exp(A dt) per head, v = x dt, D skip; conv state; rmsnorm(y silu(z))",
    scale_queries=False,
    short_conv=True,
    decay=Decay.SCALAR,
    gate=Gate.SOFTPLUS,
    value_dt=True,
    skip_d=True,
    output_norm=True,
    output_gate=OutputGate.BEFORE_NORM,
    output_norm_scope="group",  # one RMSNorm over the heads of each B/C group, per-channel weights
)
