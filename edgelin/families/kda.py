"""Kimi Delta Attention (Kimi Linear, 2025): the delta rule with a per-channel decay.

S_t = diag(a_t) S_{t-1} (I - beta_t k_t k_t^T) + beta_t k_t v_t^T,
log a_t = -exp(A_log) * softplus(W2 W1 x + dt_bias), one value per key channel.
"""

from edgelin.families.spec import Decay, FamilySpec, Gate, OutputGate

SPEC = FamilySpec(
    name="kda",
    summary="per-key-channel decayed delta rule; low-rank gate; gated RMSNorm out",
    qk_norm="l2",
    short_conv=True,
    decay=Decay.PER_KEY,
    gate=Gate.SOFTPLUS,
    gate_low_rank=16,
    delta_rule=True,
    output_norm=True,
    output_gate=OutputGate.AFTER_NORM,
    chunk_size=32,
)
