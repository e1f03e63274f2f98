"""`optimum-cli export edgelin`: registered through optimum's `optimum.commands.register` namespace package by
edgelin's distribution, and the same export as `edgelin export`."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from edgelin.errors import EdgelinError
from helpers import make_checkpoint

pytest.importorskip("optimum.commands.base", reason="optimum (the optimum or dev extra) is not installed")
OPTIMUM_CLI = shutil.which("optimum-cli", path=str(Path(sys.executable).parent))


def optimum_cli(args: list[str], capsys: pytest.CaptureFixture[str] | None = None) -> int:
    """optimum-cli in this process (its main() reads sys.argv); the exit code."""
    from optimum.commands.optimum_cli import main

    argv = sys.argv
    sys.argv = ["optimum-cli", *args]
    try:
        main()
        return 0
    except SystemExit as exc:
        return int(exc.code or 0)
    finally:
        sys.argv = argv


@pytest.mark.skipif(OPTIMUM_CLI is None, reason="no optimum-cli next to this Python")
def test_optimum_cli_lists_edgelin() -> None:
    listed = subprocess.run([OPTIMUM_CLI, "export", "--help"], capture_output=True, text=True, timeout=120)
    assert listed.returncode == 0 and "edgelin" in listed.stdout, listed.stdout + listed.stderr
    own = subprocess.run([OPTIMUM_CLI, "export", "edgelin", "--help"], capture_output=True, text=True, timeout=120)
    assert own.returncode == 0
    for flag in ("--model", "--task", "--device", "--dtype", "--target", "--device-profile", "output"):
        assert flag in own.stdout, flag


def test_arguments_map_onto_edgelin_export() -> None:
    from optimum.commands.register.register_edgelin import edgelin_argv

    assert edgelin_argv("ck", "out") == ["export", "ck", "--out", "out", "--target", "onnx"]
    assert edgelin_argv("ck", "out", device="cuda", dtype="fp32") == \
        ["export", "ck", "--out", "out", "--target", "onnx", "--device", "desktop-gpu", "--precision", "fp32"]
    assert edgelin_argv("ck", "out", device="cpu", dtype="float16", target="tensorrt", serve="triton")[4:] == \
        ["--target", "tensorrt", "--device", "desktop-cpu", "--precision", "fp16", "--serve", "triton"]
    with pytest.raises(EdgelinError, match="--task text-classification: edgelin exports one task, "
                                           "text-generation-with-past"):
        edgelin_argv("ck", "out", task="text-classification")
    with pytest.raises(EdgelinError, match="--dtype bf16"):
        edgelin_argv("ck", "out", dtype="bf16")
    with pytest.raises(EdgelinError, match="--device cuda with --device-profile desktop-cpu"):
        edgelin_argv("ck", "out", device="cuda", device_profile="desktop-cpu")


def test_other_task_is_one_line(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    code = optimum_cli(["export", "edgelin", "--model", str(tmp_path), str(tmp_path / "o"), "--task", "fill-mask"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and err.startswith("error: --task fill-mask: ") and "\n" not in err, err
    assert not (tmp_path / "o").exists()


@pytest.mark.slow  # two tiny exports
def test_same_artifact_as_edgelin_export(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from edgelin.cli import app

    ckpt = make_checkpoint(tmp_path / "ckpt", "gla", tokenizer=False)
    assert optimum_cli(["export", "edgelin", "--model", str(ckpt), str(tmp_path / "via-optimum")]) == 0
    with pytest.raises(SystemExit) as done:
        app(args=["export", str(ckpt), "--out", str(tmp_path / "via-edgelin")])
    assert done.value.code in (0, None)
    capsys.readouterr()
    a, b = tmp_path / "via-optimum", tmp_path / "via-edgelin"
    ma, mb = (json.loads((d / "manifest.json").read_text()) for d in (a, b))
    assert ma == mb  # every manifest field: graphs, state, source (path, sha256), weights' account, reference's hash
    assert sorted(p.name for p in a.iterdir()) == sorted(p.name for p in b.iterdir())
    for name in ("weights.bin", "reference.npz", "step.onnx", "prefill.onnx"):
        assert (a / name).read_bytes() == (b / name).read_bytes(), name


def test_unknown_target_names_the_optimum_command() -> None:
    """edgelin's own refusal would point at `optimum-cli export edgelin export --help`, which does not exist."""
    from optimum.commands.register.register_edgelin import edgelin_argv

    with pytest.raises(EdgelinError, match=r"--target tflite.*coreml, onnx, tensorrt, torch.*`optimum-cli export edgelin --help`"):
        edgelin_argv("ckpt", "out", target="tflite")


def test_errors_name_optimum_clis_own_syntax(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    """`edgelin export`'s refusals, run through optimum-cli, name this command's syntax: its positional
    output (not edgelin's --out), --device-profile (edgelin's --device) and `optimum-cli export edgelin
    --help` (not a nonexistent `... edgelin export --help`)."""
    ckpt = make_checkpoint(tmp_path / "ckpt", "gla", tokenizer=False)
    (tmp_path / "taken").mkdir()
    cases = [([str(tmp_path / "taken")], "Fix: pick another output, or pass --force to replace it"),
             ([str(ckpt / "inside")], f"error: output {ckpt / 'inside'} is inside the source {ckpt}: "),
             ([str(tmp_path / "a"), "--serve", "tfserving"], "Fix: see `optimum-cli export edgelin --help`"),
             ([str(tmp_path / "b"), "--device-profile", "jetson-orin", "--target", "coreml"],
              "Fix: pick one of those --target values, or another --device-profile")]
    for args, wanted in cases:
        code = optimum_cli(["export", "edgelin", "--model", str(ckpt), *args])
        err = capsys.readouterr().err
        errors = [line for line in err.splitlines() if line.startswith("error:")]
        assert code == 2 and len(errors) == 1 and wanted in errors[0], err
        assert "--out" not in err and "edgelin export" not in err and "--device " not in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt", "taken"]  # nothing written


def test_spelling_leaves_paths_alone() -> None:
    from optimum.commands.register.register_edgelin import optimum_spelling

    assert optimum_spelling("--out /x/--out-y is inside /a--precision: pass --precision fp16 or (--device iphone)") \
        == "output /x/--out-y is inside /a--precision: pass --dtype fp16 or (--device-profile iphone)"
