"""Building edgelin's wheel in a test (tests/test_wheel.py, tests/devices/test_devices.py)."""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# what a wheel build reads: the package, the namespace package optimum-cli scans, the device profiles, CMake
SOURCES = ("edgelin", "optimum", "devices", "CMakeLists.txt", "pyproject.toml", "README.md")


def build_wheel(out: Path, *cmake_defines: str) -> Path:
    """The wheel of a copy of the sources (pip wheel writes its build folder into the tree it builds), with
    `cmake_defines` ("NAME=VALUE"). Without build isolation when this environment has the build's tools (the dev
    extra), else pip fetches them from the registry."""
    src = out / "src"
    for name in SOURCES:
        if (ROOT / name).is_dir():
            shutil.copytree(ROOT / name, src / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc", "*.so"))
        else:
            shutil.copy(ROOT / name, src / name)
    isolation = ["--no-build-isolation"] if importlib.util.find_spec("scikit_build_core") else []
    defines = [f"--config-settings=cmake.define.{d}" for d in cmake_defines]
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", *isolation, *defines, "-w",
                           str(out / "wheel"), str(src)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (wheel,) = (out / "wheel").glob("edgelin-*.whl")
    return wheel
