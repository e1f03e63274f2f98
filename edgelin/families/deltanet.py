"""DeltaNet (Schlag et al., 2021; Yang et al., 2024): S_t = S_{t-1}(I - b k k^T) + b k v^T."""

from edgelin.families.spec import FamilySpec

SPEC = FamilySpec(
    name="deltanet",
    summary="delta rule S += beta k (v - S^T k)^T; short conv + SiLU, L2-normalised q, k",
    qk_norm="l2",
    short_conv=True,
    delta_rule=True,
    output_norm=True,
    chunk_size=32,
)
