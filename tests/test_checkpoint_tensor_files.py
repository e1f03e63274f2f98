"""edgelin.checkpoint.TensorFiles (issue 46): an upstream checkpoint's tensors read one at a time, when the converter
pops them, so a large checkpoint is never held whole beside the float32 model; its faults stay one line."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file

from edgelin.checkpoint import TensorFiles, _all_finite
from edgelin.errors import EdgelinError


@pytest.fixture()
def folder(tmp_path):
    tensors = {"a": torch.arange(12, dtype=torch.float32).reshape(3, 4).to(torch.bfloat16),
               "b": torch.full((5,), 2.5, dtype=torch.float16), "c": torch.randn(2, 2)}
    save_file(tensors, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    (tmp_path / "config.json").write_text("{}")
    return tmp_path


def test_each_tensor_is_read_when_popped_and_equals_the_file(folder):
    files = TensorFiles.of(folder)
    want = load_file(str(folder / "model.safetensors"))
    assert sorted(files) == ["a", "b", "c"] and len(files) == 3 and "a" in files
    copy = files.copy()
    got = files.pop("b")
    assert got.dtype == torch.float16 and torch.equal(got, want["b"])
    assert "b" not in files and "b" in copy  # a copy keeps its own names (the converter's Weights takes one)
    assert torch.equal(copy.pop("a"), want["a"]) and list(copy) == ["b", "c"]


def test_a_file_damaged_after_the_header_check_is_one_line_at_the_read(folder):
    files = TensorFiles.of(folder)
    (folder / "model.safetensors").write_bytes(b"\x00" * 8)  # replaced between the check and the read
    with pytest.raises(EdgelinError, match="cannot read a from .*corrupt or truncated safetensors"):
        files.pop("a")


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_finiteness_is_checked_in_slices_up_to_the_last_element(bad):
    values = torch.zeros(10_001)
    assert _all_finite(values, piece=1000)
    values[-1] = bad  # in the last, partial slice
    assert not _all_finite(values, piece=1000)
    assert not _all_finite(values.reshape(73, 137), piece=1000)
