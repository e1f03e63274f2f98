"""The tensorrt target's engine path: export writes tensorrt/ (plugin sources, build_engine.py,
COMMANDS.md with trtexec/polygraphy lines); `edgelin build` builds the plugin library here and
says in one line that the engines need TensorRT; an upstream checkpoint exports the same way."""

from __future__ import annotations

import hashlib
import json
import os
import py_compile
import shutil
from pathlib import Path

import pytest
from typer.testing import CliRunner

from edgelin.cli import app
from edgelin.export.pipeline import export_checkpoint
from helpers import make_checkpoint

HEADERS = Path(__file__).resolve().parents[3] / ".trt-headers" / "v10.3.0" / "include"
LIB = "tensorrt/libedgelin_trt_plugin_trt10.so"
# The hybrid tiny model's step inputs, written out by hand: batch 1/1/8, everything else fixed.
STATE = [("past_key_values.0.recurrent_state", "2x8x8"), ("past_key_values.0.conv_state", "48x3"),
         ("past_key_values.1.key", "1x8x16"), ("past_key_values.1.value", "1x8x16"),
         ("past_key_values.2.recurrent_state", "2x8x8")]


def _states(batch: int) -> str:
    return ",".join(f"{n}:{batch}x{d}" for n, d in STATE)


def _tensorrt_available() -> str | None:
    try:
        import tensorrt  # noqa: F401
    except ImportError:
        return "the tensorrt Python package is not installed here (a Jetson or an NGC container has it)"
    return None if os.path.exists("/dev/nvidia0") else "no NVIDIA GPU here"


@pytest.fixture(scope="module")
def exported(tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("trtbuild")
    ckpt = make_checkpoint(root / "ckpt", "hybrid")  # gated_deltanet, softmax, gla
    return ckpt, export_checkpoint(ckpt, root / "out", "tensorrt").folder


def test_export_writes_the_engine_path(exported):
    _, folder = exported
    trt = folder / "tensorrt"
    for name in ("plugins/tensorrt/CMakeLists.txt", "plugins/tensorrt/src/edgelin_trt_plugin.cpp",
                 "kernels/cuda/step.cu", "kernels/cuda/step.cuh", "kernels/cuda/edgelin_step.h",
                 "build_engine.py", "COMMANDS.md"):
        assert (trt / name).is_file(), name
    assert "tensorrt/COMMANDS.md" in json.loads((folder / "manifest.json").read_text())["files"]
    py_compile.compile(str(trt / "build_engine.py"), cfile=str(folder.parent / "be.pyc"), doraise=True)
    text = (trt / "build_engine.py").read_text()
    assert "load_library" in text and "import torch" not in text and "import edgelin" not in text
    assert '"input_ids": [[1, 1], [1, 128], [8, 2048]]' in text  # prefill's full profile
    assert '"past_key_values.2.recurrent_state": [[1, 2, 8, 8], [1, 2, 8, 8], [8, 2, 8, 8]]' in text
    assert "INPLACE = False" in text  # exported without --trt-inplace: no aliasing, no preview feature
    spec = json.loads((trt / "engines.json").read_text())
    assert spec["inplace"] is False and spec["graphs"]["step"]["aliased"] == {}


def test_commands_have_the_shapes_written_out(exported):
    _, folder = exported
    text = (folder / "tensorrt" / "COMMANDS.md").read_text()
    step = (f"trtexec --onnx=step.onnx --dynamicPlugins={LIB} "
            f"--minShapes=input_ids:1,position_ids:1,{_states(1)} --optShapes=input_ids:1,position_ids:1,{_states(1)} "
            f"--maxShapes=input_ids:8,position_ids:8,{_states(8)} --saveEngine=step.engine")
    prefill = (f"trtexec --onnx=prefill.onnx --dynamicPlugins={LIB} "
               f"--minShapes=input_ids:1x1,position_ids:1,{_states(1)} "
               f"--optShapes=input_ids:1x128,position_ids:1,{_states(1)} "
               f"--maxShapes=input_ids:8x2048,position_ids:8,{_states(8)} --saveEngine=prefill.engine")
    poly = (f"polygraphy run step.onnx --trt --onnxrt --plugins {LIB} --input-shapes input_ids:[1] position_ids:[1] "
            "past_key_values.0.recurrent_state:[1,2,8,8] past_key_values.0.conv_state:[1,48,3] "
            "past_key_values.1.key:[1,1,8,16] past_key_values.1.value:[1,1,8,16] "
            "past_key_values.2.recurrent_state:[1,2,8,8]")
    lines = text.splitlines()
    assert step in lines and prefill in lines and poly in lines
    assert "--preview" not in text


@pytest.mark.slow
def test_cli_build_makes_the_plugin_and_says_the_engine_needs_tensorrt(exported, tmp_path):
    if not (HEADERS / "NvInferRuntime.h").is_file() or shutil.which("nvcc") is None or shutil.which("cmake") is None:
        pytest.skip(f"building the plugin needs nvcc, cmake and TensorRT headers in {HEADERS}")
    if _tensorrt_available() is None:
        pytest.skip("TensorRT is installed here: the engine test (requires_tensorrt) covers this machine")
    _, exported_folder = exported
    folder = tmp_path / "out"
    shutil.copytree(exported_folder, folder)
    manifest = (folder / "manifest.json").read_bytes()
    result = CliRunner().invoke(app, ["build", str(folder), "--trt-include", str(HEADERS), "--archs", "87"])
    assert result.exit_code == 0, result.output  # the library built: a partial success
    assert f"built {folder}: {LIB}" in result.output
    assert "not built: the engines need TensorRT: the tensorrt Python package is not installed here" in result.output
    assert (folder / LIB).is_file() and not list(folder.glob("*.engine"))
    record = json.loads((folder / "tensorrt" / "build.json").read_text())
    assert (record["plugin"], record["trt_major"], record["archs"], record["engines"]) == \
        ("libedgelin_trt_plugin_trt10.so", 10, ["87"], {})
    assert (folder / "manifest.json").read_bytes() == manifest  # build never rewrites the manifest
    assert CliRunner().invoke(app, ["validate", str(folder)]).exit_code == 0
    # The built folder is still edgelin's: --force may replace it, unless the user put a file in it.
    ckpt, _ = exported
    (folder / "tensorrt" / "my-notes.txt").write_text("the user's")
    refused = CliRunner().invoke(app, ["export", str(ckpt), "--target", "tensorrt", "--out", str(folder), "--force"])
    assert refused.exit_code == 2 and "edgelin did not write tensorrt" in refused.output, refused.output
    (folder / "tensorrt" / "my-notes.txt").unlink()
    again = CliRunner().invoke(app, ["export", str(ckpt), "--target", "tensorrt", "--out", str(folder), "--force"])
    assert again.exit_code == 0, again.output
    assert not (folder / LIB).exists()  # a fresh export: the library is built again by `edgelin build`


def test_cli_build_without_headers_is_one_line(exported, tmp_path):
    _, folder = exported
    result = CliRunner().invoke(app, ["build", str(folder), "--trt-include", str(tmp_path), "--archs", "87"])
    assert result.exit_code == 2
    assert f"error: no TensorRT headers in {tmp_path}: NvInferRuntime.h or NvInferVersion.h is missing" in result.output
    assert not (folder / "tensorrt" / "build.json").exists()


def _build_here(monkeypatch, folder: Path) -> None:
    """`edgelin build` as on a machine with TensorRT and a GPU, but with the stand-in (tests/trt_standin.py)
    for TensorRT, in this process and in the engine builder's child process (a `tensorrt` module first on
    PYTHONPATH that installs it), and the fake plugin library for nvcc + cmake + headers."""
    import trt_standin
    from edgelin.export.base import Phase
    from edgelin.export.tensorrt.target import TensorrtTarget

    trt_standin.install(monkeypatch)
    shim = folder.parent / "shim"
    shim.mkdir()
    (shim / "tensorrt.py").write_text(  # replaces itself in sys.modules, as trt_standin.install does in-process
        f"import sys\nsys.path.insert(0, {str(Path(__file__).resolve().parents[2])!r})\nimport trt_standin\n\n\n"
        "class Setter:\n    def setitem(self, mapping, key, value):\n        mapping[key] = value\n\n\n"
        "trt_standin.install(Setter())\n")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(shim), os.environ.get("PYTHONPATH", "")]))
    monkeypatch.setattr(TensorrtTarget, "can_build", lambda self, device=None: Phase(True))
    monkeypatch.setattr("edgelin.export.tensorrt.build.find_headers", lambda include: HEADERS)
    monkeypatch.setattr("edgelin.export.tensorrt.build.gpu_visible", lambda: True)
    monkeypatch.setattr("edgelin.plugins.tensorrt.header_version", lambda include: (10, 3))
    monkeypatch.setattr("edgelin.plugins.tensorrt.build_plugin",
                        lambda root, headers, archs, major: trt_standin.fake_plugin_library(root, major))


def _forge_digests(folder: Path) -> None:
    """What someone who can write the whole folder can do: the manifest's sha256 map re-made for the edited files, so
    the folder passes its check when it is opened and the build's own checks are what is tested."""
    manifest = json.loads((folder / "manifest.json").read_text())
    manifest["sha256"] = {name: hashlib.sha256((folder / name).read_bytes()).hexdigest() for name in manifest["sha256"]}
    (folder / "manifest.json").write_text(json.dumps(manifest))


def test_cli_build_never_runs_code_from_the_export_folder(exported, tmp_path, monkeypatch):
    """An export folder is data: `edgelin build` builds the engines with edgelin's own builder on the
    folder's engines.json, never the folder's tensorrt/build_engine.py, and imports nothing from the folder
    (the builder's working folder) in its child process either."""
    import trt_standin

    _, exported_folder = exported
    folder = tmp_path / "out"
    shutil.copytree(exported_folder, folder)
    marker = tmp_path / "ran-code-from-the-folder"
    planted = f"open({str(marker)!r}, 'a').write(__name__ + '\\n')\n"
    for name in ("tensorrt/build_engine.py", "argparse.py", "json.py", "tensorrt/argparse.py"):
        (folder / name).write_text(planted)
    _forge_digests(folder)  # build_engine.py is listed: its digest re-made, as a forged folder would have it
    _build_here(monkeypatch, folder)
    result = CliRunner().invoke(app, ["build", str(folder), "--archs", "87"])
    assert not marker.exists(), marker.read_text()
    assert result.exit_code == 0, result.output
    assert f"built {folder}: {LIB}, step.engine, prefill.engine" in result.output
    spec = json.loads((folder / "tensorrt" / "engines.json").read_text())
    for graph in ("step", "prefill"):  # what the stand-in builder was given: the export's profiles
        engine = trt_standin.engine_spec(folder / f"{graph}.engine")
        assert engine["profiles"] == spec["graphs"][graph]["profiles"] and engine["onnx"].endswith(f"{graph}.onnx")
    assert json.loads((folder / "tensorrt" / "build.json").read_text())["engines"] == \
        {"step": "step.engine", "prefill": "prefill.engine"}


@pytest.mark.parametrize("edit, why", [
    (lambda s: s["graphs"]["step"].update(engine="../escaped.engine"),
     "step's engine is '../escaped.engine', the manifest says 'step.engine'"),
    (lambda s: s["graphs"]["step"].update(engine="manifest.json"), "step's engine is 'manifest.json'"),
    (lambda s: s["graphs"]["prefill"].update(file="/etc/passwd"), "prefill's file is '/etc/passwd'"),
    (lambda s: s["graphs"]["step"].update(weights="../../weights.bin"), "step's weights is '../../weights.bin'"),
    (lambda s: s["graphs"]["step"]["profiles"][0].update(input_ids=[[2], [1], [1]]), "min <= opt <= max"),
    (lambda s: s["graphs"]["step"]["profiles"][0].pop("input_ids"), "every input of step.onnx"),
    (lambda s: s["graphs"].update(extra={}), "`graphs` must name some of step, prefill"),
    (lambda s: s.update(inplace="yes"), "a true/false `inplace`"),
])
def test_cli_build_checks_engines_json_before_building(exported, tmp_path, monkeypatch, edit, why):
    _, exported_folder = exported
    folder = tmp_path / "out"
    shutil.copytree(exported_folder, folder)
    spec_path = folder / "tensorrt" / "engines.json"
    spec = json.loads(spec_path.read_text())
    edit(spec)
    spec_path.write_text(json.dumps(spec))
    _forge_digests(folder)
    _build_here(monkeypatch, folder)
    result = CliRunner().invoke(app, ["build", str(folder), "--archs", "87"])
    assert result.exit_code == 2, result.output
    assert f"error: {spec_path} is malformed: " in result.output and why in result.output, result.output
    assert not (folder / LIB).exists() and not (folder / "tensorrt" / "build.json").exists()
    assert not list(folder.glob("*.engine")) and not (tmp_path / "escaped.engine").exists()


@pytest.mark.requires_tensorrt
def test_engine_builds_and_matches_onnxruntime(exported, tmp_path):
    why = _tensorrt_available()
    if why:
        pytest.skip(f"requires_tensorrt: {why}")
    from edgelin.export.tensorrt.build import build_folder

    _, exported_folder = exported
    folder = tmp_path / "out"
    shutil.copytree(exported_folder, folder)
    include = os.environ.get("TENSORRT_INCLUDE_DIR")
    result = build_folder(folder, None, Path(include) if include else None)
    assert result.missing is None and result.files["step"] == "step.engine"
    # The folder now opens on the TensorRT runner (engines, plugin, device buffers, CUDA graph steps),
    # and the recorded vectors replay through it at batch 1 and 3.
    from edgelin.export.tensorrt.runner import TRT_LABEL, TensorrtRunner
    from edgelin.replay import replay
    from edgelin.runtime import open_runner

    runner = open_runner(folder)
    assert isinstance(runner, TensorrtRunner)
    report = replay(folder, rtol=1e-4)
    assert report.passed, [m for m in report.metrics if not m.passed]
    assert report.runner.startswith(TRT_LABEL), report.runner
    print(report.runner)  # whether TensorRT took the CUDA graph capture


@pytest.mark.slow  # ~35 s: a transformers model through the full export
def test_upstream_qwen35_exports_the_same_way(tmp_path):
    pytest.importorskip("transformers")
    from edgelin.replay import replay
    from upstream_hf import tiny_qwen35

    tiny_qwen35(tmp_path / "qwen")
    folder = export_checkpoint(tmp_path / "qwen", tmp_path / "out", "tensorrt").folder
    assert (folder / "tensorrt" / "build_engine.py").is_file() and (folder / "tensorrt" / "COMMANDS.md").is_file()
    import onnx

    nodes = [n for n in onnx.load(str(folder / "step.onnx")).graph.node if n.op_type == "EdgelinStep"]
    assert len(nodes) == 2  # two linear_attention layers, the full_attention one has none
    report = replay(folder, rtol=1e-4)
    assert report.passed, [m for m in report.metrics if not m.passed]
