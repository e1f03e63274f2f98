"""Linear transformer (Katharopoulos et al., 2020): phi(q)^T S_t / phi(q)^T z_t, phi = elu + 1.

The feature map is a knob (identity, relu, poly2, ...); without the normaliser the output
is RMS-normalised instead (TransNormer style), which keeps identity maps stable.
"""

from edgelin.families.spec import FamilySpec

SPEC = FamilySpec(
    name="linear_attn",
    summary="S += phi(k) v^T, z += phi(k); o = phi(q)^T S / phi(q)^T z",
    feature_map="elu1",
    normalizer=True,
    scale_queries=False,
)
