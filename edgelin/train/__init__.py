"""The trainer (`edgelin train`, `python -m edgelin.train`; the `train` extra: torch and safetensors): recipes
as data (recipes/*/recipe.toml), one generic trainer (edgelin/train/trainer.py). Nothing in the export or run
side imports this package; the corpus and held-out split they share with it live in edgelin/data.py."""

from edgelin.train.trainer import Recipe, TrainResult, build_corpus, lr_at, train, training_device

__all__ = ["Recipe", "TrainResult", "build_corpus", "lr_at", "train", "training_device"]
