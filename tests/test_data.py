"""edgelin/data.py: the corpus and held-out split the trainer and the quality figures share, read without the
trainer (a recipe's [data] section only)."""

from __future__ import annotations

from pathlib import Path

import pytest

from edgelin.data import DataConfig, recipe_data, split_files


def _recipe(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "recipe.toml"
    path.write_text(text)
    return path


def test_a_recipes_data_section_is_read_without_the_trainer(tmp_path):
    path = _recipe(tmp_path, '[model]\nhidden_size = 64\n[data]\nmax_bytes = 200000\nval_fraction = 0.1\n')
    assert recipe_data(path) == DataConfig(max_bytes=200_000, val_fraction=0.1)
    assert recipe_data(_recipe(tmp_path, "[train]\nsteps = 3\n")) == DataConfig()  # no [data]: the defaults


@pytest.mark.parametrize("text", ["[data]\nmax_bytes = 'many'\n", "[data]\nval_fraction = 0.9\n",
                                  "[data]\nmax_bytes = 0\n", "[data]\nsplit = 2\n", "data = 3\n", "[data\n"],
                         ids=["wrong-type", "fraction-out-of-range", "no-bytes", "unknown-key", "not-a-table",
                              "not-toml"])
def test_a_data_section_that_gives_no_split_reads_as_none(tmp_path, text):
    """None, not an error: the quality figures then fall back to random tokens."""
    assert recipe_data(_recipe(tmp_path, text)) is None
    assert recipe_data(tmp_path / "missing.toml") is None


def test_the_split_holds_out_whole_files():
    files = [(f"f{i}.py", "x" * 100) for i in range(20)]
    train, held_out = split_files(files, 0.1)
    assert len(held_out) == 2 and len(train) == 18
