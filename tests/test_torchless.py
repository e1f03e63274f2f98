"""A runtime-only install: `validate`, `bench`, `generate` and `build` run an exported folder in a
process where importing torch fails (what edgelin[runtime] gives a Jetson, a Raspberry Pi or an
Android board), and the packaging keeps torch out of the base install and the runtime extra."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from edgelin.export.pipeline import export_checkpoint
from helpers import make_checkpoint
from test_import_graph import MODULES, RUN_SIDE, RUN_SIDE_MAY_IMPORT

ROOT = Path(__file__).resolve().parents[1]
POISON = "torch is poisoned in this test: a runtime-only install has no torch"


@pytest.fixture(scope="module")
def torchless(tmp_path_factory) -> tuple[Path, dict[str, str]]:
    """An export made here (with torch), and an environment whose first PYTHONPATH entry holds a
    `torch` package that raises ImportError when imported."""
    root = tmp_path_factory.mktemp("torchless")
    folder = export_checkpoint(make_checkpoint(root / "ckpt", "hybrid"), root / "out").folder
    poison = root / "poison" / "torch"
    poison.mkdir(parents=True)
    # what an absent torch raises (ModuleNotFoundError, name "torch"), with a message that says why
    (poison / "__init__.py").write_text(f"raise ModuleNotFoundError({POISON!r}, name='torch')\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(poison.parent), str(ROOT)]), "EDGELIN_DEBUG": ""}
    return folder, env


def run(env: dict[str, str], *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], env=env, capture_output=True, text=True, timeout=300)


def test_the_poisoned_torch_comes_first(torchless):
    """Without this the tests below would prove nothing: torch really cannot be imported there."""
    _, env = torchless
    result = run(env, "-c", "import torch")
    assert result.returncode == 1 and POISON in result.stderr
    result = run(env, "-c", "import edgelin.cli, edgelin.runtime, edgelin.bench, edgelin.generate, sys; "
                            "print(sorted(m for m in sys.modules if m.split('.')[0] == 'torch'))")
    assert result.returncode == 0 and result.stdout.strip() == "[]", result.stderr


def test_every_run_side_module_imports_without_torch(torchless):
    """The run side (validate, replay, bench, generate, runtime, quality, data, report, serve, the artifact
    formats: test_import_graph.RUN_SIDE) imports where torch cannot, and pulls in neither torch nor the
    trainer nor an export module but the runner base and the registry."""
    _, env = torchless
    modules = sorted(m for m in MODULES if any(m == r or m.startswith(r + ".") for r in RUN_SIDE))
    assert {"edgelin.validate", "edgelin.replay", "edgelin.artifact.quality", "edgelin.data"} <= set(modules)
    result = run(env, "-c", f"import importlib, json, sys; [importlib.import_module(m) for m in {modules!r}]; "
                            "print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] == 'torch' or "
                            "m.startswith(('edgelin.train', 'edgelin.export.')))))")
    assert result.returncode == 0, result.stderr
    assert set(json.loads(result.stdout)) <= RUN_SIDE_MAY_IMPORT, result.stdout


def test_bench_runs_without_torch(torchless):
    folder, env = torchless
    result = run(env, "-m", "edgelin.cli", "bench", str(folder), "--positions", "1,40", "--iters", "5",
                 "--warmup", "2", "--prefill-tokens", "16")
    assert result.returncode == 0, result.stderr
    assert "p50 ms" in result.stdout and "prefill" in result.stdout


def test_generate_runs_without_torch(torchless):
    folder, env = torchless
    result = run(env, "-m", "edgelin.cli", "generate", str(folder), "--prompt", "def f(", "-n", "8", "--greedy")
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("def f(") and "8 tokens" in result.stderr


def test_validate_runs_without_torch(torchless):
    """The replay of the reference vectors recorded at export (no checkpoint, no torch)."""
    folder, env = torchless
    result = run(env, "-m", "edgelin.cli", "validate", str(folder))
    assert result.returncode == 0, result.stderr + result.stdout
    assert "checks passed" in result.stdout


def test_build_says_onnx_has_no_build_phase(torchless):
    folder, env = torchless
    result = run(env, "-m", "edgelin.cli", "build", str(folder))
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == f"{folder}: the onnx target has no build phase; the exported files run as they are"


def test_build_for_a_device_that_does_not_take_the_target_is_refused(torchless):
    """As generate and bench refuse it: an ONNX export built "for" the iphone profile (Core ML only)."""
    folder, env = torchless
    result = run(env, "-m", "edgelin.cli", "build", str(folder), "--device", "iphone")
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(lines) == 1, result.stderr
    assert "device iphone does not list target onnx" in lines[0] and "Fix:" in lines[0]


def test_inspect_of_an_export_folder_runs_without_torch(torchless):
    folder, env = torchless
    result = run(env, "-m", "edgelin.cli", "inspect", str(folder))
    assert result.returncode == 0, result.stderr
    assert "onnx export, precision" in result.stdout and "weights.bin" in result.stdout


@pytest.mark.parametrize("args", [("families",), ("inspect", "CKPT"), ("train", "RECIPE", "--steps", "1")],
                         ids=["families", "inspect-checkpoint", "train"])
def test_commands_that_need_torch_say_so_in_one_line(torchless, tmp_path, args):
    """Not an "internal error": the install lacks torch by design; the line says how to get it."""
    _, env = torchless
    spelled = [str(ROOT / "recipes/tiny-gdn-hybrid") if a == "CKPT" else
               str(ROOT / "recipes/tiny-gdn-hybrid/recipe.toml") if a == "RECIPE" else a for a in args]
    result = subprocess.run([sys.executable, "-m", "edgelin.cli", *spelled, "--out", str(tmp_path / "run")]
                            if args[0] == "train" else [sys.executable, "-m", "edgelin.cli", *spelled],
                            env=env, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(lines) == 1, result.stderr
    assert lines[0].startswith(f"error: `edgelin {args[0]}` needs torch here") and "edgelin[onnx]" in lines[0]
    assert "internal error" not in result.stderr and list(tmp_path.iterdir()) == []


def test_export_without_torch_names_the_export_phase(tmp_path, monkeypatch):
    """The export phase does need torch: on a runtime-only install (torch not found), `export` is
    refused with one line naming the phase and the extra, before any exporter module is imported."""
    import importlib.util

    from typer.testing import CliRunner

    from edgelin.cli import app

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "torch" else real(name, *a))
    result = CliRunner().invoke(app, ["export", str(ROOT / "recipes" / "tiny-gdn-hybrid"), "--out",
                                      str(tmp_path / "never")])
    assert result.exit_code == 2, result.output
    assert result.stderr.strip() == (
        "error: the onnx target cannot export here (export phase): torch is not installed (pip install "
        "'edgelin[onnx]'). Fix: export it on a machine with edgelin[onnx] installed (any OS), or pick another "
        "--target")
    assert not (tmp_path / "never").exists()


def test_packaging_keeps_torch_out_of_the_runtime_install():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    names = lambda reqs: {r.split(";")[0].split("[")[0].split(">")[0].split("<")[0].split("=")[0].strip()  # noqa: E731
                          for r in reqs}
    base, extras = names(project["dependencies"]), project["optional-dependencies"]
    assert base == {"numpy", "typer", "rich", "tokenizers"}
    assert names(extras["runtime"]) == {"onnxruntime"}
    assert {"torch", "safetensors", "onnx", "onnxruntime", "onnxscript", "onnx-ir"} <= names(extras["onnx"])
