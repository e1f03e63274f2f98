"""Gated DeltaNet (Yang et al., 2025; Qwen3.5's linear layers): delta rule with a scalar decay.

S_t = alpha_t S_{t-1} (I - beta_t k_t k_t^T) + beta_t k_t v_t^T,
log alpha_t = -exp(A_log) * softplus(W_a x + dt_bias).
"""

from edgelin.families.spec import Decay, FamilySpec, Gate, OutputGate

SPEC = FamilySpec(
    name="gated_deltanet",
    summary="alpha_t-decayed delta rule, alpha per head and token; gated RMSNorm out",
    qk_norm="l2",
    short_conv=True,
    decay=Decay.SCALAR,
    gate=Gate.SOFTPLUS,
    delta_rule=True,
    output_norm=True,
    output_gate=OutputGate.AFTER_NORM,
    chunk_size=32,
)
