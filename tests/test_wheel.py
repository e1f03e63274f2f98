"""The built wheel, installed where no C compiler can be reached, runs edgelin's CPU kernels: the library it
carries, built once by the wheel's CMake build (CMakeLists.txt) and verified against the record that build wrote
(edgelin.ortops.packaged), never one compiled at first use (edgelin.ortops.cache).

Slow (a wheel build, a fresh venv from the package registry or pip's cache, an export): `make test-all`, not CI's
tier. Needs pip to reach the registry (or its cache) for the venv's dependencies."""

from __future__ import annotations

import os
import platform
import shutil
import subprocess
import sys
import venv
import zipfile
from pathlib import Path

import pytest

from helpers import make_checkpoint
from wheels import build_wheel

ROOT = Path(__file__).resolve().parents[1]
RUNTIME = ("onnxruntime", "numpy", "tokenizers", "typer", "rich")  # edgelin[runtime]: what validate imports
COMPILERS = ("cc", "gcc", "clang", "c99", "tcc")

pytestmark = pytest.mark.slow


def compiler_free_path(folder: Path) -> str:
    """PATH for the installed CLI: the venv's bin only (no cc, gcc or clang in reach)."""
    assert not [c for c in COMPILERS if shutil.which(c, path=str(folder))], "the venv's bin holds a C compiler"
    return str(folder)


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="the wheel carries the kernels on x86-64")
def test_the_installed_wheel_runs_the_kernels_it_carries_without_a_compiler(tmp_path):
    wheel = build_wheel(tmp_path)
    names = set(zipfile.ZipFile(wheel).namelist())
    assert {"edgelin/ortops/libedgelin_ortops.so", "edgelin/ortops/libedgelin_ortops.json",
            "edgelin/devices/profiles/jetson-orin.toml", "optimum/commands/register/register_edgelin.py"} <= names

    env_dir = tmp_path / "venv"
    venv.EnvBuilder(with_pip=True, system_site_packages=False).create(env_dir)
    python = env_dir / "bin" / "python"
    install = subprocess.run([str(python), "-m", "pip", "install", "-q", "--no-compile", "-c",
                              str(ROOT / "constraints.txt"), str(wheel), *RUNTIME], capture_output=True, text=True)
    assert install.returncode == 0, install.stderr[-3000:]

    folder = tmp_path / "export"
    ckpt = make_checkpoint(tmp_path / "ckpt", tokenizer=False)
    export = subprocess.run([sys.executable, "-m", "edgelin.cli", "export", str(ckpt), "--target", "onnx", "--out",
                             str(folder), "--no-tokenizer"], capture_output=True, text=True,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert export.returncode == 0, export.stderr[-3000:]

    cache = tmp_path / "xdg"
    cache.mkdir()
    env = {"PATH": compiler_free_path(env_dir / "bin"), "HOME": str(tmp_path), "XDG_CACHE_HOME": str(cache),
           "LANG": "C.UTF-8"}
    validate = subprocess.run([str(env_dir / "bin" / "edgelin"), "validate", str(folder)], capture_output=True,
                              text=True, cwd=tmp_path, env=env)
    assert validate.returncode == 0, validate.stdout[-2000:] + validate.stderr[-2000:]
    (runner,) = [line for line in validate.stdout.splitlines() if line.startswith("runner: ")]
    assert runner.startswith("runner: onnxruntime + edgelin ops (") or "no AVX2" in runner, runner
    # the kernels came from the package, not from a compile at first use (nothing in the cache)
    where = subprocess.run([str(python), "-c", "from edgelin import ortops; found = ortops.locate(); "
                            "print(found.reason, found.path)"], capture_output=True, text=True, cwd=tmp_path, env=env)
    reason, path = where.stdout.split()
    assert reason == "packaged" and Path(path).is_relative_to(env_dir), where.stderr
    assert list(cache.rglob("*.so")) == []
