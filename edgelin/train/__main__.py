"""`python -m edgelin.train RECIPE.toml ...` (edgelin/train/trainer.py's command line)."""

from edgelin.train.trainer import _main

_main()
