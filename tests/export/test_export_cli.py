"""`edgelin export` in optimum-cli's shape: `edgelin export <target> CKPT` with the flags that target declares
(TargetFlag, owned by its package), `--target X` as the alias, and one ExportRequest handed to the pipeline.
No export runs here: the request is captured, or refused before the checkpoint loads."""

from __future__ import annotations

import re

import pytest
from typer.testing import CliRunner

from edgelin.cli import app
from edgelin.export import request as export_request


def help_of(*args: str) -> str:
    result = CliRunner().invoke(app, ["export", *args, "--help"], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    return result.stdout


def test_a_targets_help_shows_its_own_flags_only():
    onnx, coreml, every = help_of("onnx"), help_of("coreml"), help_of()
    assert "--step-ops" in onnx and "--kv-cache" in onnx and "--precision" in onnx
    assert "--coreml-style" not in onnx and "--trt-inplace" not in onnx
    assert not re.search(r"--target +-t", onnx)  # the alias belongs to `edgelin export CKPT`
    assert "--coreml-style" in coreml and "--step-ops" not in coreml
    assert re.search(r"--target +-t", every)
    assert all(flag in every for flag in ("--step-ops", "--coreml-style", "--trt-inplace"))


@pytest.fixture
def captured(monkeypatch):
    seen: list[export_request.ExportRequest] = []

    def prepare_export(request):
        seen.append(request)
        raise SystemExit(0)  # stop before anything is loaded or written

    monkeypatch.setattr(export_request, "prepare_export", prepare_export)
    return seen


def test_both_spellings_make_the_same_request(tmp_path, captured):
    flags = ["--out", str(tmp_path / "out"), "--kv-cache", "static", "--context", "64", "--precision", "fp16"]
    CliRunner().invoke(app, ["export", "onnx", str(tmp_path / "ckpt"), *flags])
    CliRunner().invoke(app, ["export", str(tmp_path / "ckpt"), "--target", "onnx", *flags])
    CliRunner().invoke(app, ["export", str(tmp_path / "ckpt"), "--out", str(tmp_path / "out")])  # the default target
    first, alias, default = captured
    assert first == alias
    assert (first.target, first.precision, dict(first.target_flags)) == ("onnx", "fp16", {"kv_cache": "static",
                                                                                        "context": 64})
    assert default.target == "onnx" and dict(default.target_flags) == {}


def test_another_targets_flag_is_refused_before_the_checkpoint_loads(tmp_path):
    alias = CliRunner().invoke(app, ["export", str(tmp_path / "missing"), "--target", "tensorrt", "--step-ops",
                                     "standard", "--kv-cache", "static", "--out", str(tmp_path / "out")])
    assert alias.exit_code == 2
    assert "error: --kv-cache/--step-ops apply to --target onnx only, not tensorrt" in alias.stderr \
        or "error: --step-ops/--kv-cache apply to --target onnx only, not tensorrt" in alias.stderr, alias.stderr
    positional = CliRunner().invoke(app, ["export", "tensorrt", str(tmp_path / "missing"), "--step-ops", "standard",
                                          "--out", str(tmp_path / "out")])
    assert positional.exit_code == 2 and "No such option: --step-ops" in positional.stderr, positional.stderr
    unknown = CliRunner().invoke(app, ["export", "onx", str(tmp_path / "missing"), "--out", str(tmp_path / "out")])
    assert unknown.exit_code == 2 and "unknown target 'onx' (closest: 'onnx')" in unknown.stderr
    assert not (tmp_path / "out").exists()
