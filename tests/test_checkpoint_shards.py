"""Sharded safetensors checkpoints (issue 46's bad input): shards of different dtypes load exactly, and a
truncated shard, an index naming a missing file, an index that disagrees with its shards or a tensor held
twice are each one line, found from the safetensors headers before any tensor is read."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from edgelin.checkpoint import INDEX, WEIGHTS, load_model, weight_files
from edgelin.errors import EdgelinError
from helpers import make_checkpoint

FIRST, SECOND = "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"


@pytest.fixture(scope="module")
def single(tmp_path_factory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("shards") / "ckpt", "hybrid", tokenizer=False)


def shard(single: Path, folder: Path, dtypes: tuple[torch.dtype, torch.dtype] = (torch.float32,) * 2,
          index: bool = True) -> dict[str, list[str]]:
    """`single`'s tensors split in two files (first half, second half) of the given dtypes, + index."""
    folder.mkdir()
    (folder / "config.json").write_bytes((single / "config.json").read_bytes())
    tensors = load_file(str(single / WEIGHTS))
    names = sorted(tensors)
    parts = {FIRST: names[:len(names) // 2], SECOND: names[len(names) // 2:]}
    for (file, members), dtype in zip(parts.items(), dtypes):
        save_file({n: tensors[n].to(dtype) for n in members}, str(folder / file), metadata={"format": "pt"})
    if index:
        write_index(folder, {n: f for f, members in parts.items() for n in members})
    return parts


def write_index(folder: Path, weight_map: dict[str, str]) -> None:
    (folder / INDEX).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


def test_bf16_and_fp16_shards_load_as_their_exact_values(single, tmp_path):
    """Accepted: bf16 and fp16 both widen to float32 exactly, so the mixed checkpoint loads equal to one
    float32 file holding the same (rounded) values."""
    parts = shard(single, tmp_path / "mixed", (torch.bfloat16, torch.float16))
    original = load_file(str(single / WEIGHTS))
    rounded = {n: original[n].to(torch.bfloat16 if n in parts[FIRST] else torch.float16).float() for n in original}
    (tmp_path / "rounded").mkdir()
    (tmp_path / "rounded" / "config.json").write_bytes((single / "config.json").read_bytes())
    save_file(rounded, str(tmp_path / "rounded" / WEIGHTS))
    mixed, _ = load_model(tmp_path / "mixed")
    reference, _ = load_model(tmp_path / "rounded")
    for (name, a), b in zip(mixed.state_dict().items(), reference.state_dict().values()):
        assert torch.equal(a, b), name
    changed = [n for n in original if not torch.equal(original[n], rounded[n])]
    assert any(n in parts[FIRST] for n in changed) and any(n in parts[SECOND] for n in changed)


def _truncate(folder: Path, parts: dict) -> tuple[str, ...]:
    data = (folder / SECOND).read_bytes()
    (folder / SECOND).write_bytes(data[:len(data) - 64])
    return (f"cannot read {folder / SECOND}", "corrupt or truncated")


def _header_only(folder: Path, parts: dict) -> tuple[str, ...]:
    data = (folder / FIRST).read_bytes()
    (folder / FIRST).write_bytes(data[:6])
    return (f"cannot read {folder / FIRST}", "corrupt or truncated")


def _index_names_a_missing_file(folder: Path, parts: dict) -> tuple[str, ...]:
    write_index(folder, {n: (FIRST if f == FIRST else "model-00002-of-00003.safetensors")
                         for f, members in parts.items() for n in members})
    return ("missing shards model-00002-of-00003.safetensors",)


def _index_places_a_tensor_wrongly(folder: Path, parts: dict) -> tuple[str, ...]:
    moved = parts[SECOND][0]
    write_index(folder, {n: (FIRST if n == moved else f) for f, members in parts.items() for n in members})
    return (f"{folder / INDEX} does not match its shards", f"places {moved} in {FIRST}, but {SECOND} holds it")


def _index_leaves_a_tensor_out(folder: Path, parts: dict) -> tuple[str, ...]:
    left = parts[FIRST][0]
    write_index(folder, {n: f for f, members in parts.items() for n in members if n != left})
    return ("does not match its shards", f"{FIRST} holds {left}, which the index does not list")


def _tensor_in_two_files(folder: Path, parts: dict) -> tuple[str, ...]:
    (folder / INDEX).unlink()
    twice = parts[FIRST][0]
    tensors = load_file(str(folder / SECOND))
    save_file({**tensors, twice: load_file(str(folder / FIRST))[twice]}, str(folder / SECOND))
    return (f"tensor {twice} is in both {FIRST} and {SECOND}", "stale")


def _empty_index(folder: Path, parts: dict) -> tuple[str, ...]:
    write_index(folder, {})
    return (f"{folder / INDEX} is malformed", "lists no tensors")


@pytest.mark.parametrize("fault", [_truncate, _header_only, _index_names_a_missing_file, _index_places_a_tensor_wrongly,
                                   _index_leaves_a_tensor_out, _tensor_in_two_files, _empty_index],
                         ids=lambda f: f.__name__.strip("_"))
def test_a_bad_shard_or_index_is_one_line_before_any_tensor_is_read(single, tmp_path, fault):
    folder = tmp_path / "ckpt"
    needles = fault(folder, shard(single, folder))
    for step in (weight_files, load_model):  # weight_files: what every reader of the weights calls first
        with pytest.raises(EdgelinError) as caught:
            step(folder)
        line = str(caught.value)
        assert "\n" not in line and all(n in line for n in needles), line
