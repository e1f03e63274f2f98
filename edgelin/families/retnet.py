"""RetNet (Sun et al., 2023): S_t = gamma_h S_{t-1} + k_t v_t^T, a fixed decay per head."""

from edgelin.families.spec import Decay, FamilySpec, OutputGate

SPEC = FamilySpec(
    name="retnet",
    summary="S = gamma_h S + k v^T with gamma_h = 1 - 2^(-5-h); rotary q, k; gated RMSNorm out",
    rotary=True,
    decay=Decay.FIXED,
    output_norm=True,
    output_gate=OutputGate.AFTER_NORM,
)
