"""Gated Linear Attention (Yang et al., 2024): S_t = diag(a_t) S_{t-1} + k_t v_t^T.

a_t = sigmoid(W2 W1 x)^(1/16): a low-rank, data-dependent gate per key channel.
"""

from edgelin.families.spec import Decay, FamilySpec, Gate, OutputGate

SPEC = FamilySpec(
    name="gla",
    summary="S = diag(a_t) S + k v^T, log a_t = logsigmoid(low-rank(x)) / 16",
    decay=Decay.PER_KEY,
    gate=Gate.LOGSIGMOID,
    gate_low_rank=16,
    gate_normalizer=16.0,
    output_norm=True,
    output_gate=OutputGate.AFTER_NORM,
)
