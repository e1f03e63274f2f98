"""edgelin's TensorRT plugin library without TensorRT: built with CMake + nvcc against each TensorRT
header folder in .trt-headers/ (git-ignored; see docs/targets/tensorrt.md for how to get them), checked
with nm/readelf (exports, no nvinfer1 reference, no libnvinfer link), and driven by the C++ harness
in tests/plugins/tensorrt/trt_harness/ through every method TensorRT's builder and runtime call. The enqueue half
of the harness (--gpu) needs a GPU and is run on one by hand (docs/targets/tensorrt.md)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from edgelin.errors import EdgelinError
from edgelin.plugins import tensorrt as trt

ROOT = Path(__file__).resolve().parents[3]
HEADER_ROOT = ROOT / ".trt-headers"
HARNESS = Path(__file__).resolve().parent / "trt_harness" / "harness.cpp"
HEADERS = sorted(p for p in HEADER_ROOT.glob("*/include") if (p / "NvInferRuntime.h").is_file())
NO_HEADERS = ("no TensorRT headers in .trt-headers/: the plugin build check needs them; get NVIDIA/TensorRT's "
              "include/ at a 10.3 tag and the newest one: git --git-dir=<TensorRT clone> archive v10.3.0 include "
              "| tar -x -C .trt-headers/v10.3.0 (docs/targets/tensorrt.md)")
NVCC = shutil.which("nvcc")
CMAKE = shutil.which("cmake")


def needs_toolchain():
    if NVCC is None:
        pytest.skip("nvcc not found on PATH: the plugin is compiled with the CUDA toolkit")
    if CMAKE is None:
        pytest.skip("cmake not found on PATH: the plugin is built with CMake (pip install cmake)")


@pytest.fixture(scope="module", params=HEADERS or [None], ids=[p.parent.name for p in HEADERS] or ["none"])
def built(request, tmp_path_factory):
    """(library, headers, major) built once per header folder: one arch (87, Orin) keeps it short."""
    if request.param is None:
        pytest.skip(NO_HEADERS)
    needs_toolchain()
    include = request.param
    major, _ = trt.header_version(include)
    lib = trt.build_plugin(tmp_path_factory.mktemp(f"trt{major}"), include, ["87"], major)
    return lib, include, major


@pytest.fixture(scope="module")
def harness(built, tmp_path_factory):
    _, include, major = built
    exe = tmp_path_factory.mktemp(f"harness{major}") / "harness"
    cmd = [NVCC, "-std=c++17", "-O1", str(HARNESS), "-isystem", str(include), "-o", str(exe),
           "-Xlinker", "-export-dynamic", "-ldl"]  # exported: the harness plays libnvinfer's version query
    done = subprocess.run(cmd, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    return exe


@pytest.mark.slow
def test_plugin_exports_only_the_loader_interface_and_links_no_tensorrt(built):
    lib, _, major = built
    assert lib.name == f"libedgelin_trt_plugin_trt{major}.so"
    defined = subprocess.run(["nm", "-D", "--defined-only", str(lib)], capture_output=True, text=True).stdout
    for name in ("getCreators", "setLoggerFinder"):
        assert re.search(rf"\sT {name}$", defined, re.MULTILINE), f"{name} not exported"
    assert "edgelin_step_launch" not in defined  # the launcher stays private to the library
    undefined = subprocess.run(["nm", "-DC", "--undefined-only", str(lib)], capture_output=True, text=True).stdout
    assert undefined and "nvinfer1::" not in undefined
    dynamic = subprocess.run(["readelf", "-d", str(lib)], capture_output=True, text=True).stdout
    # libstdc++ is linked as the host toolchain does it (a shared libstdc++ here; CUDA 13 with Ubuntu's g++ 13 on
    # the GPU machine links it statically): either way none of it is exported (below)
    assert "libnvinfer" not in dynamic
    info = trt.check_library(lib, major)
    assert (info.trt_major, info.abi_version, info.exports) == (major, 3, ("getCreators", "setLoggerFinder"))
    # nothing else: the host compiler's libstdc++ instantiations stay local (src/exports.map), whichever it is
    names = sorted(line.split()[-1] for line in defined.splitlines() if line.strip())
    assert names == ["edgelin_trt_plugin_marker", "getCreators", "setLoggerFinder"], names


@pytest.mark.slow
def test_harness_walks_every_builder_and_runtime_method(built, harness):
    lib, _, major = built
    run = subprocess.run([str(harness), str(lib)], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-2000:]
    assert f"marker: edgelin-trt-plugin:trt_major={major};abi=3;" in run.stdout
    assert "PASS build/runtime walk over 77 variants" in run.stdout  # 62 + 15 with the erase gate (GDN-2)
    assert "PASS out-of-range attributes" in run.stdout
    assert run.stdout.rstrip().endswith("HARNESS OK") and "FAIL" not in run.stdout


@pytest.mark.slow
def test_library_refuses_a_tensorrt_of_another_major_before_anything_runs(built, harness):
    lib, _, major = built
    env = {**os.environ, "EDGELIN_FAKE_TRT_MAJOR": str(major + 1)}
    run = subprocess.run([str(harness), str(lib), "--refusal"], capture_output=True, text=True, timeout=60, env=env)
    assert run.returncode == 0, run.stdout[-3000:]
    assert f"built for TensorRT {major}, loaded into TensorRT {major + 1}" in run.stdout
    with pytest.raises(EdgelinError, match=f"built for TensorRT {major}, not {major + 1}"):
        trt.check_library(lib, major + 1)


@pytest.mark.slow
def test_check_library_refuses_another_launcher_abi(built, monkeypatch):
    lib, _, major = built
    monkeypatch.setattr(trt, "step_abi_version", lambda: 4)
    with pytest.raises(EdgelinError, match="step-launcher ABI 3, this edgelin has 4"):
        trt.check_library(lib, major)


# ---- bad input, no compile needed ---------------------------------------------------------------
def fake_headers(folder: Path, major: int, minor: int, enterprise: bool = False) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "NvInferRuntime.h").write_text("#error not real TensorRT headers\n")
    if enterprise:  # TensorRT 11's spelling
        text = (f"#define TRT_MAJOR_ENTERPRISE {major}\n#define TRT_MINOR_ENTERPRISE {minor}\n"
                "#define NV_TENSORRT_MAJOR TRT_MAJOR_ENTERPRISE\n#define NV_TENSORRT_MINOR TRT_MINOR_ENTERPRISE\n")
    else:
        text = f"#define NV_TENSORRT_MAJOR {major} //!< major\n#define NV_TENSORRT_MINOR {minor}\n"
    (folder / "NvInferVersion.h").write_text(text)
    return folder


def test_header_version_reads_both_spellings(tmp_path):
    assert trt.header_version(fake_headers(tmp_path / "a", 10, 3)) == (10, 3)
    assert trt.header_version(fake_headers(tmp_path / "b", 11, 1, enterprise=True)) == (11, 1)


def test_build_refuses_bad_input_with_one_line_errors(tmp_path, monkeypatch):
    with pytest.raises(EdgelinError, match="unsupported compute capability 75") as err:
        trt.build_plugin(tmp_path / "out", tmp_path, ["75"], 10)
    assert "\n" not in str(err.value) and "87" in err.value.fix
    with pytest.raises(EdgelinError, match="TensorRT 9 is not supported"):
        trt.build_plugin(tmp_path / "out", tmp_path, ["87"], 9)
    monkeypatch.setattr(trt.shutil, "which", lambda name: None if name == "cmake" else "/bin/true")
    with pytest.raises(EdgelinError, match="cmake not found"):
        trt.build_plugin(tmp_path / "out", tmp_path, ["87"], 10)
    monkeypatch.setattr(trt.shutil, "which", lambda name: "/bin/true" if name == "cmake" else None)
    monkeypatch.delenv("CUDACXX", raising=False)
    monkeypatch.setattr(trt.os, "access", lambda path, mode: False)
    with pytest.raises(EdgelinError, match="nvcc not found") as err:
        trt.build_plugin(tmp_path / "out", tmp_path, ["87"], 10)
    assert "CUDA toolkit" in err.value.fix
    monkeypatch.undo()
    if NVCC is None or CMAKE is None:
        return  # the header checks come after the toolchain checks
    with pytest.raises(EdgelinError, match="no TensorRT headers") as err:
        trt.build_plugin(tmp_path / "out", tmp_path / "nowhere", ["87"], 10)
    assert "NvInferRuntime.h" in err.value.fix
    with pytest.raises(EdgelinError, match="are TensorRT 11.1, not 10"):
        trt.build_plugin(tmp_path / "out", fake_headers(tmp_path / "h11", 11, 1, enterprise=True), ["87"], 10)
    with pytest.raises(EdgelinError, match="TensorRT 10.2 is too old"):
        trt.build_plugin(tmp_path / "out", fake_headers(tmp_path / "h102", 10, 2), ["87"], 10)
    assert not (tmp_path / "out").exists()


def test_build_never_replaces_a_file_it_did_not_write(tmp_path):
    needs_toolchain()
    out = tmp_path / "out"
    out.mkdir()
    theirs = out / "libedgelin_trt_plugin_trt10.so"
    theirs.write_bytes(b"someone else's library")
    with pytest.raises(EdgelinError, match="is not an edgelin plugin library"):
        trt.build_plugin(out, fake_headers(tmp_path / "h", 10, 3), ["87"], 10)
    assert theirs.read_bytes() == b"someone else's library"


@pytest.mark.slow
def test_failed_build_leaves_no_partial_library(tmp_path):
    """Headers that do not compile: one-line error, and the output folder holds nothing afterwards."""
    needs_toolchain()
    out = tmp_path / "out"
    with pytest.raises(EdgelinError, match="building the TensorRT plugin failed") as err:
        trt.build_plugin(out, fake_headers(tmp_path / "h", 10, 3), ["87"], 10)
    assert "\n" not in str(err.value)
    assert list(out.iterdir()) == []


def test_check_library_refuses_a_library_exporting_more_than_the_loader_interface(tmp_path):
    """A build without the version script (a host compiler that gives libstdc++'s instantiations default
    visibility): its extra exports are refused before TensorRT loads it."""
    from trt_standin import fake_plugin_library

    (tmp_path / "ok").mkdir()
    trt.check_library(fake_plugin_library(tmp_path / "ok"), 10)  # the loader interface and the marker only
    (tmp_path / "leaky").mkdir()
    leaky = fake_plugin_library(tmp_path / "leaky", extra="int _ZNSt6vectorIiSaIiEE17_M_realloc_insert = 1;\n")
    with pytest.raises(EdgelinError, match=r"exports 1 symbols beyond TensorRT's loader interface "
                                           r"\(first: _ZNSt6vectorIiSaIiEE17_M_realloc_insert\)"):
        trt.check_library(leaky, 10)


def test_check_library_refuses_a_file_that_is_not_the_plugin(tmp_path):
    other = tmp_path / "libother.so"
    other.write_bytes(b"\x7fELF not ours")
    with pytest.raises(EdgelinError, match="is not an edgelin TensorRT plugin library"):
        trt.check_library(other, 10)
    with pytest.raises(EdgelinError, match="cannot read the plugin library"):
        trt.check_library(tmp_path / "missing.so", 10)


def test_families_say_how_tensorrt_runs_each_step():
    """Part 1's table: per family, the kernel's flags and what stays in plain ONNX ops."""
    from edgelin.catalog import family_rows

    rows = {r["family"]: r["tensorrt_step"] for r in family_rows()}
    assert rows["gated_deltanet"].startswith("kernel (gate=1 delta=1)")
    assert rows["gated_deltanet2"].startswith("kernel (gate=1 delta=1 erase=1)") and "erase gate" in rows[
        "gated_deltanet2"]
    assert rows["kda"].startswith("kernel (gate=2 delta=1)")
    assert rows["gla"].startswith("kernel (gate=2 delta=0)")
    assert rows["retnet"].startswith("kernel (gate=1 delta=0)") and "fixed log-decay" in rows["retnet"]
    assert rows["linear_attn"].startswith("kernel (gate=0 delta=0)") and "normaliser" in rows["linear_attn"]
    assert "normaliser" not in rows["deltanet"] and "short convolution" in rows["deltanet"]
    assert rows["softmax"].startswith("ONNX ops")
