"""docs/manifest.schema.json describes the manifest.json edgelin writes: a fresh export's manifest (and its KV
baseline's) validates, and a manifest with a field of the wrong type or a missing field does not."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import jsonschema
import pytest

from edgelin.export.pipeline import export_checkpoint
from helpers import TOKENIZER_VOCAB, make_checkpoint

ROOT = Path(__file__).resolve().parents[2]
SCHEMA = json.loads((ROOT / "docs" / "manifest.schema.json").read_text(encoding="utf-8"))


@pytest.fixture(scope="module")
def manifests(tmp_path_factory) -> tuple[dict, dict]:
    """The export tests/artifact/test_artifact.py makes (the hybrid with its KV baseline: the graph cache traces it once a
    run): (its manifest, the baseline's)."""
    root = tmp_path_factory.mktemp("schema")
    ckpt = make_checkpoint(root / "ckpt", "hybrid", tokenizer=False, vocab_size=TOKENIZER_VOCAB)
    folder = export_checkpoint(ckpt, root / "out", baselines=("kv",)).folder
    read = lambda path: json.loads(path.read_text(encoding="utf-8"))  # noqa: E731
    return read(folder / "manifest.json"), read(folder / "baseline-kv" / "manifest.json")


def errors(manifest: dict) -> list[str]:
    validator = jsonschema.Draft202012Validator(SCHEMA)
    return [f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in validator.iter_errors(manifest)]


def test_the_schema_is_a_valid_json_schema():
    jsonschema.Draft202012Validator.check_schema(SCHEMA)


def test_an_exported_manifest_and_its_baseline_validate(manifests):
    manifest, baseline = manifests
    assert errors(manifest) == []
    assert errors(baseline) == []
    assert manifest["extra"]["reference_vectors"]["file"] == "reference.npz"  # the fields the schema types are there


@pytest.mark.parametrize("edit, where", [
    (lambda m: m["model"].__setitem__("vocab_size", "2048"), "model/vocab_size"),
    (lambda m: m.__setitem__("manifest_version", 2), "manifest_version"),
    (lambda m: m["state"][0].__setitem__("dims", ["batch", -4]), "state/0/dims/1"),
    (lambda m: m["graphs"]["step"].__setitem__("file", "../step.onnx"), "graphs/step/file"),
    (lambda m: m["sha256"].__setitem__("weights.bin", "not-a-digest"), "sha256/weights.bin"),
    (lambda m: m["model"].pop("constant_memory"), "model"),
])
def test_a_manifest_with_a_wrong_field_is_rejected(manifests, edit, where):
    manifest = copy.deepcopy(manifests[0])
    edit(manifest)
    found = errors(manifest)
    assert found and any(e.startswith(f"{where}:") for e in found), found
