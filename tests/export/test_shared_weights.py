"""One mapping of weights.bin for the ONNX runner's step and prefill sessions (issue 13, peak RSS): each
session gets OrtValues over slices of the runner's read-only mapping (add_initializer, used in place), so a
weight shared by both graphs is one set of pages, mapped once; outputs are bit-identical to each session
mapping the file itself; a truncated weights file is still refused in one line."""

from __future__ import annotations

import gc
import shutil
from pathlib import Path

import numpy as np
import pytest

from edgelin.errors import EdgelinError
from edgelin.integrity import checking
from edgelin.artifact.manifest import Manifest
from edgelin.export.onnx.runner import SHARED_ENV
from edgelin.export.pipeline import export_checkpoint
from edgelin.runtime import open_runner, prefill
from helpers import make_checkpoint


@pytest.fixture(scope="module")
def exported(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("shared")
    # the checkpoint of test_runtime_checks.py's `exported`: the run's graph cache traces it once for both files
    return export_checkpoint(make_checkpoint(root / "ckpt", "hybrid"), root / "out").folder


def _rollout(runner) -> list[np.ndarray]:
    ids = np.random.default_rng(1).integers(0, runner.manifest.vocab_size, (2, 9))
    state = runner.new_state(2)
    logits, _ = prefill(runner, ids, state, start=0)
    out = [logits]
    token = logits.reshape(2, -1, logits.shape[-1])[:, -1].argmax(-1)
    for position in range(9, 13):
        step = runner.step(token, state, np.full(2, position, np.int64))
        out.append(step)
        token = step.argmax(-1)
    return out


def _mappings(path: Path) -> list[dict[str, int]]:
    """This process's mappings of `path` (/proc/self/smaps): start address, end, Rss and Pss in KiB."""
    found, current = [], None
    with open("/proc/self/smaps") as fh:
        for line in fh:
            parts = line.split()
            if "-" in parts[0] and len(parts) > 3 and ":" in parts[3]:  # a mapping's header line
                current = None
                if parts[-1] == str(path):
                    start, end = (int(x, 16) for x in parts[0].split("-"))
                    current = {"start": start, "end": end}
                    found.append(current)
            elif current is not None and parts[0] in ("Rss:", "Pss:"):
                current[parts[0][:-1]] = int(parts[1])
    return found


@pytest.mark.skipif(not Path("/proc/self/smaps").exists(), reason="reads Linux's /proc/self/smaps")
def test_both_sessions_read_one_mapping(exported, tmp_path, monkeypatch):
    folder = tmp_path / "copy"  # a path no other runner in this process has mapped
    shutil.copytree(exported, folder)
    weights = (folder / "weights.bin").resolve()
    entry = Manifest.load(folder).extra["weights"]

    monkeypatch.setenv(SHARED_ENV, "0")  # before: ONNX Runtime maps the file once per session
    alone = open_runner(folder)
    assert alone.weights is None and not alone.shared
    expected = _rollout(alone)
    assert len(_mappings(weights)) >= 2  # the check below can fail: here each session has its own mapping
    del alone
    gc.collect()
    assert _mappings(weights) == []

    monkeypatch.delenv(SHARED_ENV)
    runner = open_runner(folder)
    base, size = runner.weights.ctypes.data, entry["bytes"]
    assert runner.weights.shape == (size,) and not runner.weights.flags.writeable
    # Every external tensor of both graphs is an OrtValue over the mapping; a tensor both graphs read (the
    # manifest counts them at export, from the graph files) is one address for both.
    kinds = ("step", "prefill")
    addresses = {kind: {value.data_ptr() for _, value in runner.shared[kind]} for kind in kinds}
    assert [len(addresses[k]) for k in kinds] == [entry["read_by"][runner.manifest.graphs[k].file] for k in kinds]
    assert len(addresses["step"] & addresses["prefill"]) == entry["shared_tensors"] > 0
    assert all(base <= a < base + size for a in addresses["step"] | addresses["prefill"])

    got = _rollout(runner)
    assert all(np.array_equal(a, b) for a, b in zip(got, expected))  # bit-identical
    # The weights file is mapped once (the runner's mapping), and each of its resident pages once: Pss == Rss.
    maps = _mappings(weights)
    assert len(maps) == 1 and maps[0]["start"] <= base < maps[0]["end"], maps
    assert maps[0]["Pss"] == maps[0]["Rss"] > 0, maps
    del runner, got
    gc.collect()
    maps = _mappings(weights)
    assert maps == [], maps  # closing the runner unmaps it: nothing else kept the file mapped


def test_a_truncated_weights_file_is_refused_before_mapping(exported, tmp_path):
    folder = tmp_path / "copy"
    shutil.copytree(exported, folder)
    weights = folder / "weights.bin"
    weights.write_bytes(weights.read_bytes()[:-64])
    with checking(verify=False), pytest.raises(EdgelinError, match="weights.bin has .* bytes, the manifest says") \
            as info:
        open_runner(folder)  # --no-verify: the runner's own check (by default the folder check names the file first)
    assert "\n" not in str(info.value)


def test_export_shares_fused_weights_once(exported):
    """Fused projections (edgelin.export.fuse_matmuls) through the pipeline: both graphs fused alike, so every
    weights.bin tensor is read by both and the file holds each fused matrix once (about the model's float
    parameters, not more)."""
    import json

    import onnx

    from edgelin.export.fuse_matmuls import FUSED_MODULES

    weights = json.loads((exported / "manifest.json").read_text())["extra"]["weights"]
    assert weights["shared_tensors"] == weights["tensors"] == weights["read_by"]["step.onnx"] == weights["read_by"]["prefill.onnx"]
    for file in ("step.onnx", "prefill.onnx"):
        graph = onnx.load(str(exported / file), load_external_data=False).graph
        assert any(any(p.key == FUSED_MODULES for p in n.metadata_props) for n in graph.node), file
    params = (exported.parent / "ckpt" / "model.safetensors").stat().st_size  # float32 parameters (+ a header)
    assert weights["bytes"] <= 1.1 * params, (weights["bytes"], params)


def test_the_graphs_keep_no_weights_and_no_data_files_of_their_own(exported):
    """The export writes each graph's weights to a data file first (no 2 GiB protobuf limit at real sizes) and
    streams them into weights.bin: what is left is the graphs with only their small constants inside, every
    large tensor in weights.bin, and no other data file."""
    import onnx

    from edgelin.export.weights import MIN_EXTERNAL, WEIGHTS

    assert sorted(p.name for p in exported.glob("*.data")) == []
    for file in ("step.onnx", "prefill.onnx"):
        graph = onnx.load(str(exported / file), load_external_data=False).graph
        inside = [t for t in graph.initializer if t.data_location != onnx.TensorProto.EXTERNAL]
        assert all(len(t.raw_data) < MIN_EXTERNAL for t in inside), file
        outside = {e.value for t in graph.initializer for e in t.external_data if e.key == "location"}
        assert outside == {WEIGHTS}, (file, outside)
        assert (exported / file).stat().st_size < 2 << 20, file  # structure only
