"""Device profiles: package data (in the wheel, read through importlib.resources), every field checked
(unknown fields refused by name), and `export_settings`, where a profile becomes export choices."""

from __future__ import annotations

import json
import subprocess
import sys
import zipfile
from importlib.resources import files
from pathlib import Path

import pytest
from typer.testing import CliRunner

from conftest import family_layers, tiny_config
from wheels import build_wheel
from edgelin.cli import app
from edgelin.export.onnx.target import OnnxTarget
from edgelin.devices import (DEVICES_DIR, FIELDS, ExportSettings, check_state_dims, export_settings,
                             get_device, load_devices)
from edgelin.errors import EdgelinError
from edgelin.model.lm import CausalLM

REPO = Path(__file__).resolve().parents[2]
BUILT_IN = {"android", "desktop-cpu", "desktop-gpu", "iphone", "jetson-orin", "mac"}
VALID = {"title": '"Test board"', "kind": '"jetson"', "targets": '["tensorrt", "onnx"]', "compute": '"cuda"',
         "precision": '"fp16"', "state_dtype": '"float32"', "memory_gib": "8", "sm": "87"}  # TOML values


def write_profile(folder: Path, name: str = "board", drop: tuple[str, ...] = (), **fields: str) -> Path:
    """A profile file: VALID's fields minus `drop`, with `fields` (TOML values) changed or added."""
    values = {**{k: v for k, v in VALID.items() if k not in drop}, **fields}
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{name}.toml"
    path.write_text("".join(f"{k} = {v}\n" for k, v in values.items()))
    return path


def refusal(folder: Path) -> str:
    with pytest.raises(EdgelinError) as info:
        load_devices(folder)
    return info.value.line()


# ---- package data ---------------------------------------------------------------------------------
def test_builtin_profiles_come_from_the_installed_package():
    # one copy in git, the top-level devices/: read there from a source checkout, from the package once installed
    assert DEVICES_DIR in (files("edgelin.devices") / "profiles", REPO / "devices")
    profiles = load_devices()
    assert set(profiles) == BUILT_IN
    orin = profiles["jetson-orin"]
    assert (orin.targets, orin.compute, orin.precision, orin.state_dtype, orin.sm) == (
        ("tensorrt", "onnx"), "cuda", "fp16", "float32", 87)
    assert profiles["iphone"].state_dim_multiple == 32 and profiles["android"].threads == 4
    assert Path(orin.source) == Path(str(DEVICES_DIR)) / "jetson-orin.toml"
    assert not list((REPO / "edgelin" / "devices").glob("*.toml"))  # no second copy inside the package's source


def test_wheel_ships_the_profiles_and_they_load_from_it(tmp_path):
    wheel = build_wheel(tmp_path, "EDGELIN_BUILD_ORTOPS=OFF")  # the profiles only: no kernels to compile
    names = set(zipfile.ZipFile(wheel).namelist())
    assert {f"edgelin/devices/profiles/{d}.toml" for d in BUILT_IN} | {"edgelin/devices/profiles/README.md"} <= names
    assert not [n for n in names if n.startswith("edgelin/ortops/lib")]
    site = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(site)
    # -S: no site-packages, so no editable install pointing back at the repo; only the unpacked wheel.
    code = ("import json, sys; sys.path.insert(0, sys.argv[1]); import edgelin.devices as d; "
            "print(json.dumps([str(d.DEVICES_DIR), sorted(d.load_devices()), d.get_device('jetson-orin').sm]))")
    proc = subprocess.run([sys.executable, "-S", "-c", code, str(site)], capture_output=True, text=True,
                          cwd=tmp_path, env={"PATH": "/usr/bin:/bin"})
    assert proc.returncode == 0, proc.stderr
    folder, loaded, sm = json.loads(proc.stdout)
    assert Path(folder) == site / "edgelin" / "devices" / "profiles" and set(loaded) == BUILT_IN and sm == 87


def test_readme_documents_every_field():
    readme = (REPO / "devices" / "README.md").read_text()
    missing = [name for name in FIELDS if f"| `{name}` |" not in readme]
    assert missing == []


# ---- validation -----------------------------------------------------------------------------------
def test_a_valid_user_profile_loads(tmp_path):
    profile = load_devices(write_profile(tmp_path).parent)["board"]
    assert (profile.targets, profile.sm, profile.memory_gib, profile.threads, profile.state_dim_multiple) == (
        ("tensorrt", "onnx"), 87, 8.0, 0, 1)


def test_unknown_field_is_refused_with_the_closest_name(tmp_path):
    path = write_profile(tmp_path, precison='"fp16"', drop=("precision",))
    line = refusal(tmp_path)
    assert f"device profile {path}: unknown field 'precison' (closest: 'precision')" in line
    assert "rename it to 'precision'" in line


def test_unknown_field_through_the_cli_is_one_line(tmp_path, monkeypatch):
    write_profile(tmp_path, "pi5", statedim_multiple="32")
    monkeypatch.setenv("EDGELIN_DEVICES", str(tmp_path))
    result = CliRunner().invoke(app, ["devices"])
    line = " ".join(result.stderr.split())
    assert result.exit_code == 2 and "Traceback" not in result.output
    assert line.startswith("error: device profile ") and "unknown field 'statedim_multiple'" in line
    assert "(closest: 'state_dim_multiple')" in line and "Fix:" in line


@pytest.mark.parametrize("field, value, needle", [
    ("precision", '"fp8"', "precision = 'fp8': precision must be one of: fp32, fp16, bf16"),
    ("state_dtype", '"bfloat16"', "state_dtype must be one of: float32, float16 (closest: 'float16')"),
    ("kind", '"laptop"', "kind must be one of: desktop, jetson, phone, server"),
    ("compute", '"npu"', "compute must be one of: cpu, cuda, ane, gpu"),
    ("targets", '["onnx", "tensorrtt"]', "'tensorrtt' is not a target; targets are: coreai, coreml, onnx, tensorrt "
                                         "(closest: 'tensorrt')"),
    ("targets", '[]', "targets must be a non-empty list"),
    ("targets", '["onnx", "onnx"]', "names a target twice"),
    ("sm", "30", "sm = 30: sm must be an integer in 53..120"),
    ("sm", "8.7", "sm must be an integer in 53..120"),
    ("threads", "-1", "threads must be an integer in 0..1024"),
    ("threads", "true", "threads must be an integer in 0..1024"),
    ("threads", "9223372036854775807", "threads must be an integer in 0..1024"),  # was an internal error in bench
    ("state_dim_multiple", "0", "state_dim_multiple must be an integer >= 1"),
    ("memory_gib", "0", "memory_gib must be a number of GiB > 0"),
    ("memory_gib", "nan", "memory_gib must be a number of GiB > 0"),
    ("memory_gib", '"8"', "memory_gib must be a number of GiB > 0"),
    ("title", '""', "title must be a non-empty string"),
    ("notes", '"one note"', "notes must be a list of strings"),
])
def test_bad_value_is_refused_with_what_is_allowed(tmp_path, field, value, needle):
    path = write_profile(tmp_path, **{field: value})
    line = refusal(tmp_path)
    assert line.startswith(f"device profile {path}: {field} = ") and needle in line


@pytest.mark.parametrize("changes, drop, needle", [
    ({}, ("memory_gib",), "missing field 'memory_gib'"),
    ({"compute": '"cpu"', "targets": '["onnx"]'}, (), "sm = 87 with compute = 'cpu': sm is a CUDA compute capability"),
    ({"compute": '"cpu"'}, ("sm",), "targets lists 'tensorrt' with compute = 'cpu': TensorRT runs on NVIDIA GPUs"),
    ({"title": '"unterminated'}, (), "is not valid TOML"),
])
def test_missing_fields_contradictions_and_bad_toml_are_refused(tmp_path, changes, drop, needle):
    write_profile(tmp_path, drop=drop, **changes)
    assert needle in refusal(tmp_path)


def test_user_folder_adds_and_overrides_profiles(tmp_path, monkeypatch):
    write_profile(tmp_path, "desktop-cpu", kind='"desktop"', compute='"cpu"', targets='["onnx"]',
                  precision='"fp32"', threads="3", drop=("sm",))
    write_profile(tmp_path, "pi5")
    monkeypatch.setenv("EDGELIN_DEVICES", str(tmp_path))
    profiles = load_devices()
    assert set(profiles) == BUILT_IN | {"pi5"}
    assert profiles["desktop-cpu"].threads == 3 and profiles["desktop-cpu"].source == str(tmp_path / "desktop-cpu.toml")
    assert profiles["android"].threads == 4  # built-ins not overridden stay
    monkeypatch.setenv("EDGELIN_DEVICES", str(tmp_path / "nope"))
    with pytest.raises(EdgelinError, match="EDGELIN_DEVICES=.*nope is not a folder"):
        load_devices()


def test_unknown_device_name_gets_the_closest():
    with pytest.raises(EdgelinError, match="unknown device 'jetson-nano' \\(closest: 'jetson-orin'\\)"):
        get_device("jetson-nano")


# ---- export_settings: the one place a profile becomes export choices ------------------------------
def test_no_profile_keeps_todays_defaults():
    assert export_settings(None, "onnx") == ExportSettings("fp32", "float32", 1, {}, 0, None)
    assert export_settings(None, "onnx", "fp32").precision == "fp32"


def test_fp16_profile_with_onnx_exports_fp16_graphs():
    # ONNX writes fp16 graphs (issue 11): the profile's precision is taken, never silently dropped to fp32
    orin = export_settings(get_device("jetson-orin"), "onnx")
    assert (orin.precision, orin.state_dtype, orin.quantize) == ("fp16", "float32", None)
    assert export_settings(get_device("desktop-gpu"), "onnx").precision == "fp16"


def test_a_precision_the_target_cannot_write_is_refused_with_what_it_can(monkeypatch):
    # a target that writes fp32 only (as onnx did before issue 11): the profile's fp16 is refused, not replaced
    monkeypatch.setattr(OnnxTarget, "precisions", ("fp32",))
    with pytest.raises(EdgelinError) as info:
        export_settings(get_device("jetson-orin"), "onnx")
    line = info.value.line()
    assert line.startswith("device jetson-orin asks for precision fp16 (its profile's default), which the onnx "
                           "target cannot export: ")
    assert line.endswith("Fix: pass --precision fp32 to export fp32 graphs for jetson-orin")
    with pytest.raises(EdgelinError, match="--precision fp16, which the onnx target cannot export"):
        export_settings(get_device("android"), "onnx", "fp16")  # a flag the target refuses is named as a flag


def test_flags_override_the_profile():
    orin = get_device("jetson-orin")
    settings = export_settings(orin, "onnx", "fp32")
    assert (settings.precision, settings.state_dtype, settings.device) == ("fp32", "float32", "jetson-orin")
    assert export_settings(orin, "tensorrt", "fp32").precision == "fp32"
    assert export_settings(get_device("android"), "onnx", "fp16").precision == "fp16"  # the flag wins
    with pytest.raises(EdgelinError, match="--precision int8: precision must be one of: fp32, fp16, bf16"):
        export_settings(orin, "onnx", "int8")


def test_profile_values_reach_the_settings():
    # jetson-orin asks fp16, which the tensorrt target exports (fp16 graphs, the plugin's state fp32)
    orin16 = export_settings(get_device("jetson-orin"), "tensorrt")
    assert (orin16.precision, orin16.state_dtype) == ("fp16", "float32")
    trt = export_settings(get_device("jetson-orin"), "tensorrt", "fp32")
    assert (trt.precision, trt.state_dtype, trt.target_options) == ("fp32", "float32", {"sm": 87})
    assert export_settings(get_device("desktop-gpu"), "tensorrt", "fp32").target_options == {"sm": 90}
    ane = export_settings(get_device("iphone"), "coreml")
    assert (ane.precision, ane.state_dtype, ane.state_dim_multiple, ane.target_options) == (
        "fp16", "float16", 32, {"compute": "ane", "model_state": True})
    # the Mac exports both Apple targets at fp32 compute with float32 state (Core AI's only compute precision;
    # Core ML's explicit style, on the GPU's compute units)
    mac_ai, mac_ml = (export_settings(get_device("mac"), target) for target in ("coreai", "coreml"))
    assert (mac_ai.precision, mac_ai.state_dtype, mac_ai.target_options) == ("fp32", "float32", {})
    assert (mac_ml.precision, mac_ml.state_dtype, mac_ml.target_options) == ("fp32", "float32", {"compute": "gpu"})
    android = export_settings(get_device("android"), "onnx")
    assert android.threads == 4 and android.manifest_entry() == {
        "name": "android", "precision": "fp32", "state_dtype": "float32", "state_dim_multiple": 1, "threads": 4,
        "target_options": {}, "quantize": None, "block_size": 32}


def test_target_the_device_does_not_list_is_refused():
    with pytest.raises(EdgelinError, match="device iphone does not list target onnx: its profile lists: coreml"):
        export_settings(get_device("iphone"), "onnx", "fp32")


def test_float16_state_with_onnx_is_refused(tmp_path):
    write_profile(tmp_path, compute='"cpu"', targets='["onnx"]', precision='"fp32"', state_dtype='"float16"',
                  drop=("sm",))
    with pytest.raises(EdgelinError, match="device board asks for state_dtype float16, which the onnx target"):
        export_settings(load_devices(tmp_path)["board"], "onnx")


def test_state_dim_multiple_is_met_or_refused_with_the_dims():
    hybrid = CausalLM(tiny_config(family_layers("hybrid"))).state_tensors()  # widths: 8, conv 3, kv 16, 8
    check_state_dims(hybrid, ExportSettings(state_dim_multiple=1))
    check_state_dims(CausalLM(tiny_config(family_layers("gla"))).state_tensors(),
                     ExportSettings(state_dim_multiple=8, device="npu"))  # every width is 8: accepted
    with pytest.raises(EdgelinError) as info:
        check_state_dims(hybrid, ExportSettings(state_dim_multiple=16, device="npu"))
    assert info.value.line().startswith("device npu needs state widths that are multiples of 16: these are not: "
                                        "layer 0 recurrent_state 8, layer 0 conv_state 3, layer 2 recurrent_state 8 "
                                        "(the innermost dim of each state tensor)")


def test_devices_json_gives_nested_tables_as_objects():
    result = CliRunner().invoke(app, ["devices", "--json"])
    profiles = json.loads(result.stdout)
    assert result.exit_code == 0 and profiles
    serving = profiles[0]["serving"]  # was the dataclass's repr, a string
    assert isinstance(serving, dict) and serving["max_batch_size"] >= 1 and isinstance(serving["preferred_batch_sizes"], list)


def test_a_profile_saved_with_a_byte_order_mark_loads(tmp_path):
    from edgelin.devices import get_device

    shipped = (REPO / "devices" / "desktop-cpu.toml").read_text()
    (tmp_path / "notepad.toml").write_bytes(b"\xef\xbb\xbf" + shipped.encode())  # Windows Notepad's UTF-8
    assert get_device("notepad", tmp_path).targets == get_device("desktop-cpu").targets


# ---- [serving]: every limit within the Triton field it becomes -----------------------------------------------
CPU_BOARD = {"compute": '"cpu"', "targets": '["onnx"]', "precision": '"fp32"'}


def write_serving(folder: Path, serving: str) -> Path:
    path = write_profile(folder, "server", drop=("sm",), **CPU_BOARD)
    path.write_text(path.read_text() + "[serving]\n" + serving)
    return path


@pytest.mark.parametrize("serving, needle", [
    # Triton's int32 fields (2**31 parsed as a negative or refused by protobuf's text parser)
    ("max_batch_size = 2147483648\nmax_candidate_sequences = 2147483648\n",
     "max_batch_size must be an integer in 1..2147483647 (Triton's max_batch_size is an int32)"),
    ("max_candidate_sequences = 2147483648\n", "max_candidate_sequences must be an integer in 1..2147483647"),
    ("preferred_batch_sizes = [4, 4294967296]\n", "preferred_batch_sizes must be integers in 1..2147483647"),
    # uint64 microseconds that Triton counts in int64 nanoseconds
    ("max_queue_delay_us = 9223372036854776\n", "max_queue_delay_us must be an integer in 1..9223372036854775 "
                                                "(Triton keeps the delay in int64 nanoseconds)"),
    ("max_sequence_idle_us = 18446744073709551616\n", "max_sequence_idle_us must be an integer in 1..9223372036854775"),
    ("instances = 100000\n", "instances must be an integer in 1..1024"),
])
def test_serving_limits_out_of_range_are_refused_when_the_profile_is_read(tmp_path, serving, needle):
    path = write_serving(tmp_path, serving)
    line = refusal(tmp_path)
    assert line.startswith(f"device profile {path}: serving = ") and needle in line


def test_serving_limits_at_their_ranges_load(tmp_path):
    write_serving(tmp_path, "max_batch_size = 2147483647\nmax_candidate_sequences = 2147483647\n"
                            "preferred_batch_sizes = [1, 2147483647]\nmax_queue_delay_us = 9223372036854775\n"
                            "max_sequence_idle_us = 9223372036854775\ninstances = 1024\n")
    serving = load_devices(tmp_path)["server"].serving
    assert (serving.max_batch_size, serving.max_sequence_idle_us, serving.instances) == (2**31 - 1, 2**63 // 1000, 1024)


def test_export_with_an_out_of_range_profile_is_one_line_and_writes_nothing(tmp_path, monkeypatch):
    write_serving(tmp_path / "devices", "max_batch_size = 4294967296\nmax_candidate_sequences = 4294967296\n")
    monkeypatch.setenv("EDGELIN_DEVICES", str(tmp_path / "devices"))
    result = CliRunner().invoke(app, ["export", str(tmp_path / "ckpt"), "--out", str(tmp_path / "out"),
                                      "--device", "server", "--serve", "triton"])
    errors = [ln for ln in result.stderr.splitlines() if ln.startswith("error:")]
    assert result.exit_code == 2 and len(errors) == 1 and "max_batch_size must be an integer in 1..2147483647" \
        in errors[0], result.output
    assert not (tmp_path / "out").exists()


# ---- --device '': an empty name is a mistake, never "no device" ----------------------------------------------
@pytest.mark.parametrize("name", ["", "  "])
@pytest.mark.parametrize("command", [["export", "ckpt", "--out", "out"], ["bench", "folder"],
                                     ["generate", "folder", "-p", "hi"], ["build", "folder"]])
def test_an_empty_device_name_is_refused_with_the_profiles(tmp_path, monkeypatch, command, name):
    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(app, [*command, "--device", name])
    errors = [ln for ln in result.stderr.splitlines() if ln.startswith("error:")]
    assert result.exit_code == 2 and len(errors) == 1, result.output
    assert errors[0].startswith(f"error: --device {name!r}: the device name is empty. Fix: use one of: ")
    assert all(profile in errors[0] for profile in BUILT_IN) and not (tmp_path / "out").exists()


def test_an_empty_training_device_is_refused():
    from edgelin.train import training_device

    with pytest.raises(EdgelinError, match="training device '': the device name is empty"):
        training_device("")
    assert str(training_device(None)) == "cpu"
