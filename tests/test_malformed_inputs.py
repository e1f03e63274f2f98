"""Malformed inputs found by an audit: each is one `error: WHAT: WHY. Fix: FIX` line and exit 2, never an
internal error (exit 3). Manifests, exported weights, recipes' seeds, checkpoint index and config files,
a Hugging Face hub-cache snapshot (shards linked into ../blobs/, which must load) and results files."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any, Callable

import numpy as np
import pytest
from safetensors.torch import load_file, save_file

from edgelin.checkpoint import load_model
from edgelin.errors import EdgelinError
from edgelin.export.pipeline import export_checkpoint
from helpers import make_checkpoint
from test_cli import assert_clean_failure, run


@pytest.fixture(scope="module")
def exported(tmp_path_factory) -> Path:
    """One tiny hybrid export with a tokenizer (the tests copy it before editing)."""
    root = tmp_path_factory.mktemp("malformed")
    return export_checkpoint(make_checkpoint(root / "ckpt", "hybrid"), root / "out").folder


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


# ---- manifest.json ------------------------------------------------------------------------------------
def _weights(edit: Callable[[dict], Any]) -> Callable[[dict], Any]:
    def change(data: dict) -> dict:
        data["extra"]["weights"] = edit(data["extra"]["weights"])
        return data

    return change


def _set(key: str, value: Any) -> Callable[[dict], dict]:
    return lambda data: {**data, key: value}


MANIFEST_EDITS = {  # id -> (edit of the parsed manifest, words the error line must hold)
    "a list": (lambda data: [], ("malformed", "a JSON object")),
    "a string": (lambda data: "x", ("malformed", "a JSON object")),
    "null": (lambda data: None, ("malformed", "a JSON object")),
    "graphs a list": (_set("graphs", []), ("malformed", "graphs is []")),
    "extra a string": (_set("extra", "x"), ("malformed", 'extra is "x"')),
    "precision a list": (_set("precision", ["x"]), ("malformed", 'precision is ["x"]')),
    "weights a string": (_weights(lambda w: "x"), ("malformed", 'extra.weights is "x"')),
    "tensor entry short": (_weights(lambda w: {**w, "tensors_by_graph": {"step.onnx": [[1, 2]]}}),
                           ("malformed", 'extra.weights.tensors_by_graph["step.onnx"][0] is [1, 2]')),
    "weights bytes a string": (_weights(lambda w: {**w, "bytes": "x"}), ("malformed", "extra.weights.bytes")),
}


@pytest.mark.parametrize("command", ["validate", "inspect"])
@pytest.mark.parametrize("case", list(MANIFEST_EDITS))
def test_malformed_manifest_is_one_line(exported, tmp_path, case, command):
    edit, needles = MANIFEST_EDITS[case]
    out = _copy(exported, tmp_path / "out")
    (out / "manifest.json").write_text(json.dumps(edit(json.loads((out / "manifest.json").read_text()))))
    assert_clean_failure(run(command, out), str(out / "manifest.json"), *needles)


def test_escaping_weights_file_is_named_in_a_short_line(exported, tmp_path):
    """The line names the field and its value, not the whole weights entry (it was ~4,300 characters)."""
    out = _copy(exported, tmp_path / "out")
    data = json.loads((out / "manifest.json").read_text())
    data["extra"]["weights"]["file"] = "../exp1/weights.bin"
    (out / "manifest.json").write_text(json.dumps(data))
    result = run("validate", out)
    assert_clean_failure(result, "extra.weights.file", "../exp1/weights.bin", "escapes")
    assert len(result.stderr.strip().splitlines()[-1]) < 300 and "tensors_by_graph" not in result.stderr


def test_too_deeply_nested_manifest_is_malformed(exported, tmp_path):
    out = _copy(exported, tmp_path / "out")
    (out / "manifest.json").write_text("[" * 100_000 + "]" * 100_000)
    assert_clean_failure(run("inspect", out), "malformed", "nested too deeply")


# ---- generate on corrupt weights ----------------------------------------------------------------------
def test_generate_refuses_non_finite_logits(exported, tmp_path):
    """Corrupt weights of the right size pass the load's size check under --no-verify (no hash; by default the
    folder check refuses the changed file, tests/test_integrity.py): every float weight in weights.bin set to NaN,
    as zeroed weights made the shipped recipe's logits NaN."""
    out = _copy(exported, tmp_path / "out")
    entry = json.loads((out / "manifest.json").read_text())["extra"]["weights"]
    with open(out / "weights.bin", "r+b") as fh:
        for tensors in entry["tensors_by_graph"].values():
            for _, offset, length, dtype, _ in tensors:
                if dtype == "float32":
                    fh.seek(offset)
                    fh.write(np.full(length // 4, np.nan, np.float32).tobytes())
    result = run("generate", out, "--prompt", "def", "-n", "4", "--no-verify")
    assert_clean_failure(result, "NaN/inf logits at new token 1", "edgelin validate")
    assert result.stdout == ""  # refused before the prompt is echoed


# ---- train --seed ---------------------------------------------------------------------------------------
@pytest.fixture
def recipe(tmp_path) -> Path:
    from test_train import TINY

    path = tmp_path / "recipe.toml"
    path.write_text(TINY)
    return path


@pytest.mark.parametrize("seed", ["-1", str(2**64), "99999999999999999999"])
def test_train_refuses_a_seed_torch_and_numpy_cannot_take(recipe, tmp_path, seed):
    assert_clean_failure(run("train", recipe, "--out", tmp_path / "ckpt", "--seed", seed),
                         f"--seed {seed} is out of range", str(2**64 - 1))
    assert not (tmp_path / "ckpt").exists()


def test_recipe_seed_out_of_range(recipe, tmp_path):
    recipe.write_text(recipe.read_text().replace("seed = 0", "seed = -1"))
    assert_clean_failure(run("train", recipe, "--out", tmp_path / "ckpt"), "[train] seed = -1", str(2**64 - 1))


def test_recipe_too_large_for_the_machine_is_refused(recipe, tmp_path):
    recipe.write_text(recipe.read_text().replace("hidden_size = 32", "hidden_size = 1_000_000_000_000"))
    assert_clean_failure(run("train", recipe, "--out", tmp_path / "ckpt"), str(recipe), "parameters",
                         "GiB of memory")
    assert not (tmp_path / "ckpt").exists()


# ---- checkpoints: the shard index, config.json ------------------------------------------------------------
@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("ckpt") / "ckpt", "hybrid", tokenizer=False)


@pytest.mark.parametrize("index, needles", [
    ([], ("malformed", "weight_map")),
    ({"weight_map": []}, ("malformed", "weight_map")),
    ({"weight_map": {"a": 5}}, ("malformed", "maps a tensor to 5")),
    ({"weight_map": {"a": "../x.safetensors"}}, ("'../x.safetensors' escapes the checkpoint folder",)),
    ({"weight_map": {"a": "/etc/passwd"}}, ("'/etc/passwd' escapes the checkpoint folder",)),
    ({"weight_map": {"a": "sub/../../x.safetensors"}}, ("escapes the checkpoint folder",)),
])
def test_malformed_shard_index_is_one_line_naming_it(checkpoint, tmp_path, index, needles):
    ckpt = _copy(checkpoint, tmp_path / "ckpt")
    (ckpt / "model.safetensors.index.json").write_text(json.dumps(index))
    assert_clean_failure(run("inspect", ckpt), str(ckpt / "model.safetensors.index.json"), *needles)


def test_hub_cache_snapshot_of_symlinked_shards_loads(checkpoint, tmp_path):
    """Hugging Face's cache: snapshots/<rev>/ holds links into ../../blobs/<hash>; the names in the index
    stay inside the snapshot, so the shards load although their targets lie outside it."""
    tensors = load_file(str(checkpoint / "model.safetensors"))
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    blobs, snapshot = tmp_path / "hub" / "blobs", tmp_path / "hub" / "snapshots" / "abc123"
    blobs.mkdir(parents=True)
    snapshot.mkdir(parents=True)
    files = {"config.json": (checkpoint / "config.json").read_bytes(),
             "model.safetensors.index.json": json.dumps(
                 {"metadata": {}, "weight_map": {t: shard for shard, ts in shards.items() for t in ts}}).encode()}
    for i, (shard, members) in enumerate(shards.items()):
        save_file({t: tensors[t] for t in members}, str(blobs / f"shard{i}"), metadata={"format": "pt"})
        (snapshot / shard).symlink_to(f"../../blobs/shard{i}")
    for i, (name, content) in enumerate(files.items()):
        (blobs / f"blob{i}").write_bytes(content)
        (snapshot / name).symlink_to(f"../../blobs/blob{i}")
    model, _ = load_model(snapshot)
    reference, _ = load_model(checkpoint)
    assert all((a == b).all() for a, b in zip(model.state_dict().values(), reference.state_dict().values()))
    result = run("inspect", snapshot, "--json")
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["supported"] is True


@pytest.mark.parametrize("command", ["inspect", "export"])
def test_config_nested_too_deeply_is_malformed(checkpoint, tmp_path, command):
    ckpt = _copy(checkpoint, tmp_path / "ckpt")
    (ckpt / "config.json").write_text("[" * 100_000 + "]" * 100_000)
    args = ["--out", tmp_path / "out"] if command == "export" else []
    assert_clean_failure(run(command, ckpt, *args), str(ckpt / "config.json"), "malformed", "nested too deeply")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("field, value", [("hidden_size", 10**12), ("vocab_size", 10**13),
                                          ("intermediate_size", 10**12)])
def test_config_too_large_for_the_machine_is_refused_before_allocating(checkpoint, tmp_path, field, value):
    """Loading it (export) is refused by this machine's memory; describing it (inspect, which loads nothing:
    edgelin.checkpoint.describe_model) by the bytes its weight files hold."""
    ckpt = _copy(checkpoint, tmp_path / "ckpt")
    config = json.loads((ckpt / "config.json").read_text())
    config[field] = value
    (ckpt / "config.json").write_text(json.dumps(config))
    assert_clean_failure(run("inspect", ckpt), str(ckpt / "config.json"), "parameters", "weight files hold",
                         "check the sizes")
    with pytest.raises(EdgelinError, match="GiB of memory.*check the sizes"):
        load_model(ckpt)


# ---- report: results files with wrong field types -----------------------------------------------------------
def _bench(edit: Callable[[dict], None]) -> Callable[[], dict]:
    from test_report import bench_result

    def make() -> dict:
        data = bench_result()
        edit(data)
        return data

    return make


def _validate(edit: Callable[[dict], None]) -> Callable[[], dict]:
    from test_report import validate_result

    def make() -> dict:
        data = validate_result()
        edit(data)
        return data

    return make


RESULT_EDITS = {  # id -> (the bad result, the field the line names)
    "prefill tps a string": (_bench(lambda d: d.update(prefill_tokens_per_s="x")), "prefill_tokens_per_s"),
    "steps tps a string": (_bench(lambda d: d.update(steps_tokens_per_s="x")), "steps_tokens_per_s"),
    "steps tps missing": (_bench(lambda d: d.pop("steps_tokens_per_s")), "steps_tokens_per_s"),
    "position row a string": (_bench(lambda d: d["positions"].__setitem__(0, "x")), "positions[0]"),
    "top1 a string": (_validate(lambda d: d.update(quality={"top1": "x"})), "quality.top1"),
    "quality a string": (_validate(lambda d: d.update(quality="x")), "quality"),
    "metrics a string": (_validate(lambda d: d.update(metrics="x")), "metrics"),
    "max_rel a string": (_validate(lambda d: d["metrics"][0].update(max_rel="x")), "metrics[0].max_rel"),
}


@pytest.mark.parametrize("case", list(RESULT_EDITS))
def test_results_with_wrong_field_types_are_one_line(tmp_path, case):
    from test_report import one_line_error, run_plain

    make, field = RESULT_EDITS[case]
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(make()))
    one_line_error(run_plain("report", bad, "--out", tmp_path / "rep"), str(bad), "malformed", f"{field} ")
    assert not (tmp_path / "rep").exists()
