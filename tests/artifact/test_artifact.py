"""A self-contained export (issue 8.5): the folder carries reference vectors that `validate DIR`
replays with no checkpoint and no torch, `validate DIR --against CKPT` keeps the full check, and
`export --baseline kv` writes the KV-cache baseline that `bench --baseline kv` runs."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import edgelin.bench as bench_module
from edgelin.bench import bench
from edgelin.checkpoint import load_model
from edgelin.errors import EdgelinError
from edgelin.export.pipeline import export_checkpoint
from edgelin.integrity import sha256_of
from helpers import TOKENIZER_VOCAB, make_checkpoint
from test_cli import assert_clean_failure, run

ROOT = Path(__file__).resolve().parents[2]
PROMPT, STEPS = 15, 24  # what export records (edgelin/artifact/reference_vectors.py)


@pytest.fixture(scope="module")
def export(tmp_path_factory) -> tuple[Path, Path]:
    """One export, with the KV baseline, shared by every test here: (checkpoint, folder)."""
    root = tmp_path_factory.mktemp("artifact")
    ckpt = make_checkpoint(root / "ckpt", "hybrid", tokenizer=False, vocab_size=TOKENIZER_VOCAB)
    return ckpt, export_checkpoint(ckpt, root / "out", baselines=("kv",)).folder


def copy_with(folder: Path, dest: Path, edit=None) -> Path:
    """A copy of the export whose reference arrays went through `edit(arrays)`; the manifest's sha256
    is updated, so only the recorded values differ (as if the graphs disagreed with them)."""
    shutil.copytree(folder, dest)
    if edit is not None:
        with np.load(dest / "reference.npz") as npz:
            arrays = {k: npz[k] for k in npz.files}
        edit(arrays)
        np.savez_compressed(dest / "reference.npz", **arrays)
        rehash(dest)
    return dest


def rehash(folder: Path) -> None:
    """Both digests of reference.npz in the manifest: the reference vectors' entry and every file's map (checked when
    the folder is opened, edgelin.integrity)."""
    manifest = json.loads((folder / "manifest.json").read_text())
    manifest["extra"]["reference_vectors"]["sha256"] = manifest["sha256"]["reference.npz"] = \
        sha256_of(folder / "reference.npz")
    (folder / "manifest.json").write_text(json.dumps(manifest))


# ---- the recorded file ------------------------------------------------------------------------------
def test_reference_vectors_are_recorded_small_and_listed(export):
    ckpt, folder = export
    path = folder / "reference.npz"
    assert path.stat().st_size < 200 << 10  # the tiny model: ~60 KiB (the shipped one: ~2.1 MiB, README)
    manifest = json.loads((folder / "manifest.json").read_text())
    assert manifest["extra"]["reference_vectors"] == {"file": "reference.npz", "sha256": sha256_of(path)}
    assert "reference.npz" in manifest["files"]
    with np.load(path) as npz:
        meta = json.loads(str(npz["meta"]))
        assert meta["batches"] == [1, 3] and (meta["prompt_len"], meta["steps"]) == (PROMPT, STEPS)
        assert meta["threshold"] == 1e-4 and meta["seed"] == 0
        for batch in (1, 3):
            assert npz[f"b{batch}/ids"].shape == (batch, PROMPT + STEPS)
            assert npz[f"b{batch}/step_logits"].shape == (STEPS, batch, 256)
        assert npz["b3/state/step24/past_key_values.0.recurrent_state"].shape == (3, 2, 8, 8)
        ids, recorded = npz["b3/ids"], npz["b3/prefill_logits"]
    # the recorded values are the checkpoint's: its forward over the recorded prompt, run here
    model = load_model(ckpt)[0]
    with torch.no_grad():
        logits = model(torch.from_numpy(ids[:, :PROMPT]))[0][:, -1].numpy()
    np.testing.assert_allclose(recorded, logits, rtol=0, atol=1e-5 * np.abs(logits).max())


# ---- validate DIR: the replay --------------------------------------------------------------------------
def test_validate_replays_batch_1_and_3_exactly(export):
    result = run("validate", export[1], "--json")
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["passed"] and report["against"] == "reference vectors" and report["batches"] == [1, 3]
    metrics = report["metrics"]
    assert {(m["check"], m["batch"]) for m in metrics} == {
        (check, batch) for check in ("prefill", "rollout", "prefill-vs-steps") for batch in (1, 3)}
    states = {m["output"] for m in metrics if m["check"] == "rollout" and m["batch"] == 3}
    assert "present.1.key" in states and "present.0.recurrent_state" in states
    assert max(m["max_rel"] for m in metrics) < 1e-5  # fp32 graphs vs the fp32 reference
    rollout = next(m for m in metrics if (m["check"], m["output"], m["batch"]) == ("rollout", "logits", 3))
    assert 0 <= rollout["worst_step"] < STEPS


def test_a_recorded_logit_off_by_1_percent_fails_validate(export, tmp_path):
    def tamper(arrays):
        arrays["b3/step_logits"][7, 2] *= 1.01

    folder = copy_with(export[1], tmp_path / "tampered", tamper)
    result = run("validate", folder, "--json")
    assert result.exit_code == 1, result.output
    failed = [m for m in json.loads(result.stdout)["metrics"] if not m["passed"]]
    assert [(m["check"], m["output"], m["batch"], m["worst_step"]) for m in failed] == [("rollout", "logits", 3, 7)]
    assert_clean_failure(run("validate", folder), "1 of 31 checks failed (rollout/logits@3)", code=1)


def test_a_recorded_state_off_by_1_percent_fails_validate(export, tmp_path):
    def tamper(arrays):
        arrays["b1/state/prefill/past_key_values.0.recurrent_state"] *= 1.01

    result = run("validate", copy_with(export[1], tmp_path / "tampered", tamper))
    assert_clean_failure(result, "1 of 31 checks failed (prefill/present.0.recurrent_state@1)", code=1)


def _truncated(folder: Path) -> None:
    data = (folder / "reference.npz").read_bytes()
    (folder / "reference.npz").write_bytes(data[: len(data) // 2])


def _truncated_and_rehashed(folder: Path) -> None:
    _truncated(folder)
    rehash(folder)


def _no_manifest_entry(folder: Path) -> None:
    manifest = json.loads((folder / "manifest.json").read_text())
    del manifest["extra"]["reference_vectors"]
    (folder / "manifest.json").write_text(json.dumps(manifest))


def _wrong_shape(folder: Path) -> None:
    with np.load(folder / "reference.npz") as npz:
        arrays = {k: npz[k] for k in npz.files}
    arrays["b3/step_logits"] = arrays["b3/step_logits"][:, :2]
    np.savez_compressed(folder / "reference.npz", **arrays)
    rehash(folder)


@pytest.mark.parametrize("damage, needles", [
    (lambda f: (f / "reference.npz").unlink(), ("reference.npz are missing",)),
    (_truncated, ("reference.npz differ from the ones exported", "sha256")),
    (_truncated_and_rehashed, ("reference.npz are corrupt",)),
    (_wrong_shape, ("reference.npz are corrupt", "b3/step_logits has shape [24, 2, 256], expected [24, 3, 256]")),
    (_no_manifest_entry, ("manifest.json records no reference vectors",)),
], ids=["missing", "truncated", "truncated-rehashed", "wrong-shape", "no-manifest-entry"])
def test_missing_or_corrupt_reference_vectors_are_one_line(export, tmp_path, damage, needles):
    folder = copy_with(export[1], tmp_path / "damaged")
    damage(folder)
    # --no-verify: the replay's own checks of the file (the folder check would name a changed file first:
    # tests/test_integrity.py)
    assert_clean_failure(run("validate", folder, "--no-verify"), *needles,
                         "Fix: re-export, or validate against the checkpoint with --against CKPT")


def test_against_only_options_are_refused_without_against(export):
    assert_clean_failure(run("validate", export[1], "--steps", "8", "--batch", "3"),
                         "--steps applies to --against only", "drop --steps, --batch")


# ---- validate DIR --against CKPT: the full check ----------------------------------------------------------
@pytest.mark.parametrize("batch", [1, 3])
def test_against_the_checkpoint_at_batch_1_and_3(export, batch):
    ckpt, folder = export
    result = run("validate", folder, "--against", ckpt, "--batch", batch, "--steps", "9", "--prompt-len", "5",
                 "--json")
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["passed"] and report["against"] == str(ckpt) and report["batches"] == [batch]
    assert {m["check"] for m in report["metrics"]} == {"prefill", "rollout", "final", "prefill-vs-steps"}
    assert max(m["max_rel"] for m in report["metrics"]) < 1e-5


# ---- no torch, no checkpoint ---------------------------------------------------------------------------------
def test_validate_and_bench_baseline_without_torch_or_checkpoint(export, tmp_path):
    """In a process where `import torch` fails, with the checkpoint moved away: validate DIR replays,
    bench --baseline kv runs the baseline exported with the folder, and validate --against says it
    needs torch in one line."""
    ckpt, folder = export
    poison = tmp_path / "poison" / "torch"
    poison.mkdir(parents=True)
    (poison / "__init__.py").write_text("raise ImportError('torch is poisoned in this test')\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(poison.parent), str(ROOT)])}

    def cli(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, *args], capture_output=True, text=True, env=env, cwd=tmp_path,
                              timeout=300)

    assert "torch is poisoned" in cli("-c", "import torch").stderr  # the poison is first on the path
    away = ckpt.with_name("ckpt-moved-away")
    ckpt.rename(away)
    try:
        validated = cli("-m", "edgelin.cli", "validate", str(folder))
        benched = cli("-m", "edgelin.cli", "bench", str(folder), "--baseline", "kv", "--positions", "1,30",
                      "--iters", "3", "--warmup", "1", "--prefill-tokens", "0", "--json")
        against = cli("-m", "edgelin.cli", "validate", str(folder), "--against", str(away))
    finally:
        away.rename(ckpt)
    assert validated.returncode == 0, validated.stderr[-3000:]
    assert "all 31 checks passed" in validated.stdout
    assert benched.returncode == 0, benched.stderr[-3000:]
    rows = {(r["model"], r["position"]): r["state_bytes"] for r in json.loads(benched.stdout)["positions"]}
    assert rows[("edgelin", 1)] == rows[("edgelin", 30)]  # constant state
    # the baseline's cache grows: 3 softmax layers x (key + value) x 2 heads x 8 dims x 4 bytes per position
    assert rows[("kv-baseline", 1)] == 384 and rows[("kv-baseline", 30)] == 30 * 384
    # the full check needs torch: one line saying so (not an internal error)
    assert against.returncode == 2 and against.stderr.count("\n") == 1, against.stderr
    assert against.stderr.startswith("error: validate --against needs PyTorch") and "Fix: install" in against.stderr


# ---- the KV baseline as an export artifact -----------------------------------------------------------------
def test_the_kv_baseline_is_an_export_of_its_own(export):
    folder = export[1]
    manifest = json.loads((folder / "manifest.json").read_text())
    assert manifest["extra"]["baselines"] == {"kv": "baseline-kv"} and "baseline-kv/manifest.json" in manifest["files"]
    inner = json.loads((folder / "baseline-kv" / "manifest.json").read_text())
    assert [layer["type"] for layer in inner["model"]["layers"]] == ["softmax"] * 3
    assert inner["model"]["constant_memory"] is False and inner["model"]["vocab_size"] == 256
    assert sorted(os.listdir(folder / "baseline-kv")) == inner["files"]


def test_bench_baseline_kv_needs_it_exported(export, tmp_path):
    folder = copy_with(export[1], tmp_path / "no-baseline")
    shutil.rmtree(folder / "baseline-kv")
    # the folder's check finds the files the manifest lists gone first; under --no-verify bench's own check does
    assert_clean_failure(run("bench", folder, "--baseline", "kv", "--positions", "1"),
                         "baseline-kv/manifest.json is missing", "re-export")
    assert_clean_failure(run("bench", folder, "--baseline", "kv", "--positions", "1", "--no-verify"),
                         "baseline-kv is missing", "re-export with --baseline kv")
    manifest = json.loads((folder / "manifest.json").read_text())
    del manifest["extra"]["baselines"]
    (folder / "manifest.json").write_text(json.dumps(manifest))
    assert_clean_failure(run("bench", folder, "--baseline", "kv", "--positions", "1", "--no-verify"),
                         "has no kv baseline", "re-export with --baseline kv")


def test_bench_refuses_a_kv_position_that_does_not_fit(export, monkeypatch):
    """The KV baseline's cache at 1e5 positions is checked against the memory available (here
    pretended to be 64 MiB) before anything is measured."""
    monkeypatch.setattr(bench_module, "available_memory", lambda: 64 << 20)
    monkeypatch.setattr(bench_module, "measure", lambda *a: pytest.fail("measured before the check"))
    with pytest.raises(EdgelinError, match=r"kv-baseline: position 100000 does not fit in memory: .* need about "
                                           r"[\d.]+ GiB, and 64.0 MiB is available"):
        bench(export[1], [1, 100_000], baseline="kv")


def test_force_replaces_an_export_with_its_baseline_but_not_a_foreign_folder(export, tmp_path, monkeypatch):
    """--force replaces a folder whose baseline-kv/ edgelin wrote (listed, and itself wholly an
    export); a folder of the user's inside is still refused by name."""
    from edgelin.export.onnx import target as onnx_target

    monkeypatch.setattr(onnx_target, "export_onnx_graph", lambda *a: Path(a[4]).write_bytes(b"fake graph"))
    monkeypatch.setattr(onnx_target, "finish_graphs", lambda *a, **k: {})  # no weights to share out of fakes
    ckpt, folder = export
    out = copy_with(folder, tmp_path / "out")
    assert run("export", ckpt, "--out", out, "--force", "--baseline", "kv").exit_code == 0
    assert (out / "baseline-kv" / "step.onnx").read_bytes() == b"fake graph"  # replaced
    (out / "baseline-kv" / "notes").mkdir()
    assert_clean_failure(run("export", ckpt, "--out", out, "--force"), "will not replace", "baseline-kv")
    assert (out / "baseline-kv" / "notes").is_dir()
