"""The CLI end to end on a tiny checkpoint, and every kind of bad input: one clear line on stderr,
a non-zero exit, no traceback, and no partial artifact left behind."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from edgelin.cli import app
from edgelin.errors import EdgelinError
from edgelin.runtime import open_runner, prefill
from helpers import TOKENIZER_VOCAB, make_checkpoint

cli = CliRunner()


def run(*args: str):
    return cli.invoke(app, [str(a) for a in args])


def assert_clean_failure(result, *needles: str, code: int = 2) -> None:
    assert result.exit_code == code, (result.exit_code, result.output)
    err = result.stderr
    assert "Traceback" not in err and "Traceback" not in result.stdout
    # progress and warning lines may precede it; the error itself is exactly one line
    errors = [ln for ln in err.splitlines() if ln.strip() and not ln.startswith(("progress:", "warning:"))]
    assert len(errors) == 1, err
    line = errors[0]
    assert line.startswith("error:") and "Fix:" in line, err
    for needle in needles:
        assert needle in line, (needle, line)


def no_partials(folder: Path) -> bool:
    return not [p for p in folder.iterdir() if ".partial-" in p.name or ".tmp-" in p.name or ".edgelin-" in p.name]


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    root = tmp_path_factory.mktemp("cli")
    ckpt = make_checkpoint(root / "ckpt", "hybrid")
    result = run("export", ckpt, "--out", root / "out", "--json")
    assert result.exit_code == 0, result.output
    return root, ckpt, root / "out"


def test_export_writes_graphs_manifest_tokenizer(exported):
    _, _, out = exported
    assert sorted(p.name for p in out.iterdir()) == ["manifest.json", "prefill.onnx", "reference.npz", "step.onnx",
                                                     "tokenizer.json", "weights.bin"]


def test_validate_json_reports_every_check(exported):
    result = run("validate", exported[2], "--against", exported[1], "--steps", "24", "--prompt-len", "9", "--json")
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["passed"] and len(report["metrics"]) >= 4 * 3
    worst = max(m["max_rel"] for m in report["metrics"])
    assert 0 <= worst < 1e-4


def test_validate_fails_with_exit_1_when_the_threshold_is_impossible(exported):
    result = run("validate", exported[2], "--rtol", "1e-30")
    assert_clean_failure(result, "checks failed", code=1)


def test_bench_json(exported):
    """(--baseline kv, exported with the folder: tests/artifact/test_artifact.py)"""
    result = run("bench", exported[2], "--positions", "1,40", "--iters", "5", "--warmup", "1",
                 "--prefill-tokens", "16", "--json")
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    rows = {(r["model"], r["position"]): r for r in report["positions"]}
    assert set(rows) == {("edgelin", 1), ("edgelin", 40)}
    assert rows[("edgelin", 1)]["state_bytes"] == rows[("edgelin", 40)]["state_bytes"]
    assert report["prefill_tokens_per_s"]["edgelin"] > 0


def test_generate_streams_and_is_deterministic(exported):
    first = run("generate", exported[2], "--prompt", "def main(", "-n", "12", "--greedy", "--json")
    second = run("generate", exported[2], "--prompt", "def main(", "-n", "12", "--greedy", "--json")
    assert first.exit_code == 0, first.output
    a, b = json.loads(first.stdout), json.loads(second.stdout)
    assert a["new_tokens"] == 12 and a["token_ids"] == b["token_ids"]
    plain = run("generate", exported[2], "--prompt", "def main(", "-n", "12", "--greedy")
    assert plain.stdout.startswith("def main(") and a["text"] in plain.stdout


def test_families_and_devices_json():
    fams = json.loads(run("families", "--json").stdout)
    assert {f["family"] for f in fams} >= {"gla", "gated_deltanet", "mamba2", "softmax"}
    devs = json.loads(run("devices", "--json").stdout)
    assert {d["name"] for d in devs} >= {"jetson-orin", "iphone", "android", "desktop-cpu", "desktop-gpu"}


def test_console_script_runs_as_a_process(exported):
    proc = subprocess.run([sys.executable, "-m", "edgelin.cli", "validate", str(exported[2] / "nope")],
                          capture_output=True, text=True)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr and "no manifest.json" in proc.stderr


# ---- bad input ------------------------------------------------------------------------------------
@pytest.fixture
def ckpt(tmp_path):
    return make_checkpoint(tmp_path / "ckpt", "gla", tokenizer=False)


def export_fails(tmp_path, ckpt, *needles, args=()):
    out = tmp_path / "out"
    result = run("export", ckpt, "--out", out, *args)
    assert_clean_failure(result, *needles)
    assert not out.exists() and no_partials(tmp_path)


def test_missing_checkpoint(tmp_path):
    export_fails(tmp_path, tmp_path / "missing", "does not exist")


def test_missing_config(tmp_path, ckpt):
    (ckpt / "config.json").unlink()
    export_fails(tmp_path, ckpt, "no config.json")


def test_corrupt_config(tmp_path, ckpt):
    (ckpt / "config.json").write_text("{not json")
    export_fails(tmp_path, ckpt, "not valid JSON")


def test_corrupt_weights(tmp_path, ckpt):
    data = (ckpt / "model.safetensors").read_bytes()
    (ckpt / "model.safetensors").write_bytes(data[: len(data) // 2])
    export_fails(tmp_path, ckpt, "cannot read", "corrupt")


def test_unknown_model_type(tmp_path, ckpt):
    cfg = json.loads((ckpt / "config.json").read_text())
    (ckpt / "config.json").write_text(json.dumps({**cfg, "model_type": "llama"}))
    export_fails(tmp_path, ckpt, "'llama' is not supported", "supported:")


def test_unknown_family(tmp_path, ckpt):
    cfg = json.loads((ckpt / "config.json").read_text())
    (ckpt / "config.json").write_text(json.dumps({**cfg, "layer_types": ["gla", "glaa"]}))
    export_fails(tmp_path, ckpt, "unknown layer family 'glaa'", "closest: 'gla'", "mamba2")


def test_unknown_config_field(tmp_path, ckpt):
    cfg = json.loads((ckpt / "config.json").read_text())
    (ckpt / "config.json").write_text(json.dumps({**cfg, "use_xpos": True}))
    export_fails(tmp_path, ckpt, "unknown fields use_xpos")


def test_weights_do_not_match_config(tmp_path, ckpt):
    cfg = json.loads((ckpt / "config.json").read_text())
    (ckpt / "config.json").write_text(json.dumps({**cfg, "intermediate_size": 48}))
    export_fails(tmp_path, ckpt, "do not match config.json", "shape mismatch")


def test_pickle_checkpoint_is_refused(tmp_path, ckpt):
    (ckpt / "model.safetensors").rename(ckpt / "pytorch_model.bin")
    export_fails(tmp_path, ckpt, "only pickle weights", "safetensors")


def test_remote_code_is_refused(tmp_path, ckpt):
    cfg = json.loads((ckpt / "config.json").read_text())
    (ckpt / "config.json").write_text(json.dumps({**cfg, "auto_map": {"AutoModel": "evil.Model"}}))
    export_fails(tmp_path, ckpt, "auto_map", "never runs code")


def test_unknown_target(tmp_path, ckpt):
    export_fails(tmp_path, ckpt, "'--target'", "'onx' is not one of 'coreai', 'coreml', 'onnx'", args=("--target", "onx"))


def test_device_without_the_target(tmp_path, ckpt):
    export_fails(tmp_path, ckpt, "does not list target onnx", args=("--device", "iphone"))


def test_existing_output_needs_force(tmp_path):
    # the tiny hybrid without a tokenizer: test_cli_polish.py exports the same one (its graphs traced once a run)
    ckpt = make_checkpoint(tmp_path / "ckpt", "hybrid", tokenizer=False, vocab_size=TOKENIZER_VOCAB)
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("x")
    assert_clean_failure(run("export", ckpt, "--out", out), "already exists", "--force")
    assert (out / "keep.txt").exists()
    # --force replaces only a folder edgelin wrote (tests/test_outputs.py has the details)
    assert_clean_failure(run("export", ckpt, "--out", out, "--force"), "will not replace", "keep.txt")
    assert (out / "keep.txt").read_text() == "x"
    (out / "keep.txt").unlink()
    result = run("export", ckpt, "--out", out, "--force")
    assert result.exit_code == 0, result.output
    assert (out / "manifest.json").exists() and no_partials(tmp_path)


def test_failed_export_leaves_nothing(tmp_path, ckpt, monkeypatch):
    from edgelin.export.onnx import target as onnx_target

    def explode(*_a, **_k):
        raise EdgelinError("boom", "simulated exporter failure", "none")

    monkeypatch.setattr(onnx_target, "export_onnx_graph", explode)
    export_fails(tmp_path, ckpt, "boom")


def test_manifest_state_shape_mismatch(exported, tmp_path):
    out = tmp_path / "edited"
    shutil.copytree(exported[2], out)
    manifest = json.loads((out / "manifest.json").read_text())
    for t in manifest["graphs"]["step"]["inputs"]:
        if t["name"] == "past_key_values.0.recurrent_state":
            t["dims"][2] += 1
    (out / "manifest.json").write_text(json.dumps(manifest))
    assert_clean_failure(run("validate", out), "manifest and step graph disagree",
                         "past_key_values.0.recurrent_state")


def test_manifest_file_escaping_the_folder(exported, tmp_path):
    out = tmp_path / "evil"
    shutil.copytree(exported[2], out)
    manifest = json.loads((out / "manifest.json").read_text())
    manifest["graphs"]["step"]["file"] = "../../step.onnx"
    (out / "manifest.json").write_text(json.dumps(manifest))
    assert_clean_failure(run("bench", out, "--positions", "1"), "escapes the export folder")


def test_nan_in_state_is_refused(exported):
    runner = open_runner(exported[2])
    state = runner.new_state(1)
    values = runner.read_state(state)
    values["past_key_values.0.recurrent_state"][:] = np.nan
    with pytest.raises(EdgelinError, match="contains NaN"):
        runner.write_state(state, values)


def test_nan_in_weights_is_refused(tmp_path, ckpt):
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(ckpt / "model.safetensors"))
    tensors["model.norm.weight"][0] = float("nan")
    save_file(tensors, str(ckpt / "model.safetensors"))
    export_fails(tmp_path, ckpt, "NaN or Inf")


def test_token_ids_out_of_range(exported):
    runner = open_runner(exported[2])
    with pytest.raises(EdgelinError, match="out of range"):
        prefill(runner, np.full((1, 3), 10**6, np.int64))


def test_source_checkpoint_changed_since_export(exported, tmp_path):
    root, ckpt, out = exported
    moved = tmp_path / "ck"
    shutil.copytree(ckpt, moved)
    (moved / "config.json").write_text((moved / "config.json").read_text().replace('"rms_norm_eps": 1e-06',
                                                                                   '"rms_norm_eps": 1e-05'))
    assert_clean_failure(run("validate", out, "--steps", "4", "--against", moved), "differs from the one exported")


def test_train_command_writes_a_loadable_checkpoint(tmp_path):
    recipe = tmp_path / "recipe.toml"
    from helpers import TINY  # the trainer tests' tiny recipe, cut to a few steps

    recipe.write_text(TINY.replace("steps = 30", "steps = 4").replace("eval_every = 10", "eval_every = 2"))
    result = run("train", recipe, "--out", tmp_path / "ckpt", "--json")
    assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout)
    assert summary["final_val_loss"] > 0 and (tmp_path / "ckpt" / "model.safetensors").exists()
    assert run("inspect", tmp_path / "ckpt", "--json").exit_code == 0
    bad = tmp_path / "bad.toml"
    bad.write_text(recipe.read_text().replace("steps = 4", "stepz = 4"))
    assert_clean_failure(run("train", bad), "stepz")
