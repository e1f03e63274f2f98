"""Performer (Choromanski et al., 2021): FAVOR+ positive random features approximate softmax.

The projection is an orthogonal Gaussian matrix drawn once from a seed and stored as a buffer in
the checkpoint, so export and reference use the same features.
"""

from edgelin.families.spec import FamilySpec

SPEC = FamilySpec(
    name="performer",
    summary="linear attention with FAVOR+ features exp(Wx - |x|^2/2) and a normaliser",
    feature_map="favor",
    normalizer=True,
    scale_queries=False,
)
