"""Faults of the process around a command, each one line `error: WHAT: WHY. Fix: FIX`, never an internal
error or a library's own abort: a --prompt that is not UTF-8, a stdout that cannot encode the text, libraries
that cannot be mapped under a low `ulimit -v`, a working folder deleted under the shell. Each runs the real
entry point in a subprocess (these faults live in the process: argv bytes, stream encodings, rlimits, cwd)."""

from __future__ import annotations

import errno
import os
import resource
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from edgelin.cli_support import environment_error, library_load_fault
from helpers import make_checkpoint

ROOT = Path(__file__).resolve().parents[1]
PROMPT = "h\u00e9llo \u2603"  # é and a snowman: neither is ASCII, the snowman is not Latin-1 either


@pytest.fixture(scope="module")
def exported(tmp_path_factory) -> tuple[Path, Path]:
    """(checkpoint, its ONNX export), built once: the hybrid checkpoint tests/test_cli_faults.py exports too
    (its graphs come from the run's graph cache)."""
    from edgelin.export.pipeline import export_checkpoint

    root = tmp_path_factory.mktemp("process")
    checkpoint = make_checkpoint(root / "ckpt", "hybrid")
    return checkpoint, export_checkpoint(checkpoint, root / "onnx").folder


def edgelin(*args: str | bytes | Path, env: dict[str, str] | None = None, cwd: Path | None = None,
            preexec_fn=None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "edgelin.cli", *map(_arg, args)], capture_output=True,
                          env={**os.environ, "PYTHONPATH": str(ROOT), **(env or {})}, cwd=cwd,
                          preexec_fn=preexec_fn, timeout=300)


def _arg(value: str | bytes | Path) -> str | bytes:
    return str(value) if isinstance(value, Path) else value


def error_line(proc: subprocess.CompletedProcess, code: int = 2) -> str:
    """The one `error:` line of a failed run (progress lines may precede it), decoded leniently."""
    stderr = proc.stderr.decode(errors="replace")
    assert proc.returncode == code, (proc.returncode, stderr)
    assert "Traceback" not in stderr and "internal error" not in stderr and "FATAL" not in stderr, stderr
    lines = [ln for ln in stderr.splitlines() if ln.strip() and not ln.startswith("progress:")]
    assert len(lines) == 1 and lines[0].startswith(("error:", '{"error"')), stderr
    return lines[0]


# ---- a. a --prompt that is not UTF-8 -----------------------------------------------------------------
def test_a_prompt_that_is_not_utf8_is_refused_in_one_line(exported):
    # $'\xff\xfe abc': Python holds the bytes as surrogates, which the tokenizer refused with a TypeError
    proc = edgelin("generate", exported[1], "--prompt", b"\xff\xfe abc", "-n", "2", "--greedy")
    line = error_line(proc)
    assert line.startswith("error: --prompt is not valid UTF-8: byte 0xff "), line
    assert "Fix: pass UTF-8 text" in line, line
    assert proc.stdout == b""  # nothing echoed


def test_a_utf8_prompt_under_an_ascii_locale_is_read_as_the_utf8_it_is(exported):
    # Without UTF-8 mode a C locale decodes argv as ASCII: the UTF-8 bytes typed are read back as UTF-8.
    proc = edgelin("generate", exported[1], "--prompt", PROMPT.encode(), "-n", "2", "--greedy",
                   env={"LC_ALL": "C", "LANG": "C", "PYTHONCOERCECLOCALE": "0", "PYTHONUTF8": "0",
                        "PYTHONIOENCODING": "utf-8"})
    assert proc.returncode == 0, proc.stderr.decode(errors="replace")
    assert proc.stdout.decode().startswith(PROMPT), proc.stdout


def test_a_the_library_refuses_surrogates_before_opening_the_folder(tmp_path):
    # edgelin.generate.generate called from Python with undecodable bytes held as surrogates
    from edgelin.errors import EdgelinError
    from edgelin.generate import generate

    with pytest.raises(EdgelinError, match="the prompt is not valid text"):
        generate(tmp_path / "no-export", "\udcff\udcfe abc")


def test_a_folder_path_that_is_not_utf8_is_refused_in_one_line(exported, tmp_path):
    # Linux allows any bytes in a name; ONNX Runtime's session (and the verdict cache) take UTF-8 text: it ended in
    # an internal UnicodeEncodeError / TypeError
    folder = os.fsdecode(bytes(tmp_path) + b"/caf\xe9")
    shutil.copytree(exported[1], folder)
    line = error_line(edgelin("validate", os.fsencode(folder)))
    assert line.startswith("error: the folder path ") and "caf\\xe9 is not valid UTF-8: byte e9" in line, line
    assert "Fix: move or rename the folder to a UTF-8 path" in line, line


# ---- b. a stdout that cannot encode the text ---------------------------------------------------------
@pytest.mark.parametrize("encoding", ["ascii", "latin-1"])
def test_b_generated_text_on_a_narrow_stdout_prints_escapes(exported, encoding):
    proc = edgelin("generate", exported[1], "--prompt", PROMPT, "-n", "2", "--greedy",
                   env={"PYTHONIOENCODING": encoding})
    assert proc.returncode == 0, proc.stderr.decode(errors="replace")
    assert "error" not in proc.stderr.decode(errors="replace")
    echoed = PROMPT.encode(encoding, errors="backslashreplace")  # ascii: h\xe9llo \u2603
    assert proc.stdout.startswith(echoed), proc.stdout


def test_b_tables_and_paths_on_an_ascii_stdout_print_escapes(exported, tmp_path):
    # every command, not only generate: inspect prints the folder's path (onnx-é) in a line and a table
    folder = tmp_path / "onnx-\u00e9"
    shutil.copytree(exported[1], folder)
    proc = edgelin("inspect", folder, env={"PYTHONIOENCODING": "ascii"})
    assert proc.returncode == 0, proc.stderr.decode(errors="replace")
    assert proc.stdout.decode("ascii").startswith(f"{tmp_path}/onnx-\\xe9: onnx export"), proc.stdout


# ---- d. libraries that cannot be mapped under a low `ulimit -v` --------------------------------------
ADDRESS_SPACE_KIB = 400_000  # enough for Python, numpy and typer; too little for libtorch_cpu.so's mapping


def _limit_address_space() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (ADDRESS_SPACE_KIB * 1024, resource.RLIM_INFINITY))


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the loader's words are glibc's")
@pytest.mark.parametrize("command", ["export", "validate --against"])
def test_d_torch_unmappable_under_ulimit_v_is_an_environment_fault(exported, tmp_path, command):
    checkpoint, folder = exported
    # export: the checkpoint path does not exist, so a torch that did load fails fast (and this test too);
    # validate --against used to blame a missing PyTorch ("needs PyTorch") for the limit
    args = (["export", tmp_path / "no-checkpoint", "--out", tmp_path / "out"] if command == "export"
            else ["validate", folder, "--against", checkpoint])
    proc = edgelin(*args, preexec_fn=_limit_address_space, env={"OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1"})
    line = error_line(proc)
    assert line.startswith("error: cannot load libtorch"), line
    assert f"`ulimit -v` is {ADDRESS_SPACE_KIB} KiB" in line and "Fix: raise the limit" in line, line
    assert "needs PyTorch" not in line and not (tmp_path / "out").exists()


@pytest.mark.parametrize("fault", [
    ImportError("/venv/lib/onnxruntime/capi/onnxruntime_pybind11_state.cpython-311-x86_64-linux-gnu.so: "
                "failed to map segment from shared object", name="onnxruntime.capi.onnxruntime_pybind11_state"),
    OSError("libedgelin_ops.so: cannot map zero-fill pages"),  # ctypes.CDLL: an OSError without an errno
], ids=["importerror", "ctypes"])
def test_d_the_library_is_named_and_the_limit_given(monkeypatch, fault):
    monkeypatch.setattr("edgelin.cli_support._address_space_limit", lambda: "200000")
    wrapped = RuntimeError("the runner failed")
    wrapped.__cause__ = fault
    for exc in (fault, wrapped):
        error = library_load_fault(exc)
        assert error is not None and error.exit_code == 2
        assert error.what.startswith("cannot load ") and error.what.endswith(".so"), error.what
        assert "`ulimit -v` is 200000 KiB" in error.why and "raise the limit" in error.fix, error.line()
    assert environment_error(OSError(errno.ENOMEM, "Cannot allocate memory")).fix.startswith("raise the limit")
    assert environment_error(MemoryError()).fix.startswith("raise the limit")


@pytest.mark.parametrize("fault", [ImportError("cannot import name 'x' from 'y'"),
                                   ImportError("libgomp.so.1: cannot allocate memory in static TLS block"),
                                   OSError(errno.ENOENT, "No such file or directory")])
def test_d_other_load_failures_are_not_blamed_on_memory(fault):
    assert library_load_fault(fault) is None


# ---- e. a working folder deleted under the shell -----------------------------------------------------
@pytest.mark.parametrize("json_flag", ["", " --json"])
def test_e_a_deleted_working_folder_is_one_line_before_any_library_loads(tmp_path, json_flag):
    gone = tmp_path / "gone"
    gone.mkdir()
    # `families` imports torch, whose oneMKL aborted with "Intel oneMKL FATAL ERROR: Cannot load libtorch_cpu.so"
    proc = subprocess.run(["sh", "-c", f'cd "$1" && rmdir "$1" && exec "$2" -m edgelin.cli families{json_flag}',
                           "sh", str(gone), sys.executable], capture_output=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    line = error_line(proc)
    assert "the current folder no longer exists" in line and "Fix: cd to an existing folder" in line, line
    assert line.startswith('{"error": ' if json_flag else "error: "), line

