"""flash-linear-attention checkpoints (filled in below)."""

CONVERTERS: list = []
