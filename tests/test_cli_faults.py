"""Faults around the CLI: a full disk while exporting, hostile text in paths, SIGTERM/SIGHUP, contradictory
flags, usage errors under --json, a symlinked weights file. Each ends in one clear line and a clean folder."""

from __future__ import annotations

import errno
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from rich.text import Span, Text
from typer.testing import CliRunner

from edgelin.cli import app
from edgelin.errors import EdgelinError, Terminated
from edgelin.output import Output, _safe, escape_controls
from helpers import make_checkpoint

REPO = Path(__file__).resolve().parents[1]
cli = CliRunner()


def run(*args: object):
    return cli.invoke(app, [str(a) for a in args], prog_name="edgelin")


def error_line(result, code: int = 2) -> str:
    """The one error line of a failed command (progress lines may precede it)."""
    assert result.exit_code == code, (result.exit_code, result.output)
    assert "Traceback" not in result.output
    lines = [ln for ln in result.stderr.splitlines() if ln.strip() and not ln.startswith(("progress:", "warning:"))]
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("error:"), result.stderr
    return lines[0]


def leftovers(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir()
                  if ".partial-" in p.name or ".tmp-" in p.name or p.name.endswith(".lock"))


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("faults") / "ckpt", "hybrid")


# ---- 1. environment faults while exporting ------------------------------------------------------
PROGRESS = "[torch.onnx] Run decompositions...\n[torch.onnx] Run decompositions... ✅\n"


def failing_export(exc: BaseException, said: str = PROGRESS):
    """A torch.onnx.export that prints the exporter's progress, then fails with `exc`."""
    def export(*args, **kwargs):
        print(said, end="")
        raise exc
    return export


@pytest.mark.parametrize("fault, why, fix", [
    (OSError(errno.ENOSPC, "No space left on device"), "No space left on device", "free some disk space"),
    # the exporter may wrap the write's OSError in its own error: the cause is still the disk
    (RuntimeError("failed to save the model"), "Disk quota exceeded", "within your quota"),
], ids=["enospc", "wrapped-edquot"])
def test_full_disk_during_onnx_export_is_an_environment_fault(checkpoint, tmp_path, monkeypatch, fault, why, fix):
    import torch

    if isinstance(fault, RuntimeError):
        fault.__cause__ = OSError(errno.EDQUOT, "Disk quota exceeded")
    monkeypatch.setattr(torch.onnx, "export", failing_export(fault))
    line = error_line(run("export", checkpoint, "--out", tmp_path / "e"))
    assert line.startswith(f"error: cannot write {tmp_path / 'e'}: {why}"), line
    assert fix in line and "edgelin bug" not in line and "internal error" not in line, line
    assert "torch.onnx" not in line and "✅" not in line, line
    assert not (tmp_path / "e").exists() and leftovers(tmp_path) == []


def test_out_of_memory_during_onnx_export_is_an_environment_fault(checkpoint, tmp_path, monkeypatch):
    import torch

    monkeypatch.setattr(torch.onnx, "export", failing_export(MemoryError()))
    line = error_line(run("export", checkpoint, "--out", tmp_path / "e"))
    assert line.startswith("error: out of memory:") and "edgelin bug" not in line, line
    assert leftovers(tmp_path) == []


def test_a_genuine_export_failure_is_one_line_without_the_progress_log(checkpoint, tmp_path, monkeypatch):
    import torch

    said = PROGRESS + "the op aten::frobnicate has no ONNX form\n" + "[torch.onnx] Translate the graph... ❌\n"
    monkeypatch.setattr(torch.onnx, "export", failing_export(RuntimeError("cannot lower\n  the graph"), said))
    line = error_line(run("export", checkpoint, "--out", tmp_path / "e"))
    assert line.startswith("error: ONNX export of step.onnx failed: RuntimeError: cannot lower the graph "
                           "(exporter: the op aten::frobnicate has no ONNX form). Fix: report this model config "
                           "as an edgelin bug"), line
    assert "✅" not in line and "❌" not in line and "[torch.onnx]" not in line


def test_quantizer_faults(monkeypatch, tmp_path):
    """The quantiser's own failure is one line; an environment fault under it passes through as itself."""
    import numpy as np
    from onnx import TensorProto, helper, numpy_helper
    from onnxruntime.capi import _pybind_state

    from edgelin.export.quantize import quantize_graph
    from edgelin.export.weights import save_graph

    weight = numpy_helper.from_array(np.ones((64, 64), np.float32), "w")
    graph = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["y"], name="m")], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 64])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 64])], [weight])
    path = tmp_path / "g.onnx"
    save_graph(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)]), path)

    def fail(exc):
        def kernel(*args):
            raise exc
        monkeypatch.setattr(_pybind_state, "quantize_matmul_4bits", kernel)

    fail(ValueError("bad\nblock"))
    with pytest.raises(EdgelinError) as refused:
        quantize_graph(path, "int4", 32)
    assert refused.value.why == "ValueError: bad block" and "\n" not in refused.value.line()
    assert "int4 quantisation of w failed" in refused.value.line()
    fail(OSError(errno.ENOSPC, "No space left on device"))
    with pytest.raises(OSError) as raised:
        quantize_graph(path, "int4", 32)
    assert raised.value.errno == errno.ENOSPC
    fail(MemoryError())
    with pytest.raises(MemoryError):
        quantize_graph(path, "int4", 32)


# ---- 2. control characters in user text ---------------------------------------------------------
HOSTILE = "x\x1b[31mRED\x1b]0;pwned\x07\ny\x9b[bold]z[/bold]"


def test_control_characters_in_a_path_are_escaped_in_the_error_line(tmp_path):
    line = error_line(run("validate", tmp_path / HOSTILE))
    assert not any(c in line for c in "\x1b\x07\x9b"), repr(line)
    assert "x\\e[31mRED\\e]0;pwned\\x07\\ny\\x9b[bold]z[/bold]" in line, line  # markup printed literally


def test_control_characters_under_json_stay_in_one_escaped_json_line(tmp_path):
    result = run("validate", tmp_path / HOSTILE, "--json")
    assert result.exit_code == 2 and result.stdout == ""
    raw = result.stderr.strip()
    assert "\n" not in raw and not any(c in raw for c in "\x1b\x07\x9b"), repr(raw)
    assert str(tmp_path / HOSTILE) in json.loads(raw)["error"]  # the exact path, for a program to use


def test_output_layer_escapes_lines_warnings_and_tables(capsys):
    out = Output()
    out.line(Text.assemble(("bold\x1b[2J", "bold"), " rest"))
    out.warning("w\x1b[0m\nnext")
    out.table("title\x1b]0;t\x07", ["col"], [["two\nlines\x1b[5m"]])
    captured = capsys.readouterr()
    assert "\x1b" not in captured.out + captured.err and "\x07" not in captured.out
    assert "bold\\e[2J rest" in captured.out and "title\\e]0;t\\x07" in captured.out
    assert "warning: w\\e[0m\\nnext" in captured.err
    assert "two" in captured.out and "lines\\e[5m" in captured.out  # a cell's own line break stays


def test_escaping_keeps_styles_on_their_characters():
    safe = _safe(Text.assemble(("a\x1bb", "bold"), "\x9bc", ("d", "red")))
    assert safe.plain == "a\\eb\\x9bcd"
    assert safe.spans == [Span(0, 4, "bold"), Span(9, 10, "red")]
    assert escape_controls("a\nb\udc9b", keep_newlines=True) == "a\nb\\x9b"  # a path's undecodable byte


# ---- 3. SIGTERM and SIGHUP clean up like Ctrl-C -------------------------------------------------
@pytest.mark.parametrize("signals", [(signal.SIGTERM,), (signal.SIGHUP,), (signal.SIGHUP, signal.SIGTERM)],
                         ids=["SIGTERM", "SIGHUP", "SIGHUP-then-SIGTERM"])  # the last: a closed terminal, then kill
def test_termination_signal_removes_the_partial_output_and_the_lock(tmp_path, signals):
    signum = signals[0]
    out = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    hangup = signal.signal(signal.SIGHUP, signal.SIG_DFL)  # under nohup the run would inherit SIGHUP ignored
    try:
        proc = subprocess.Popen([sys.executable, "-m", "edgelin.cli", "train",
                                 REPO / "recipes/tiny-gdn-hybrid/recipe.toml", "--steps", "100000", "--out", out],
                                cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    finally:
        signal.signal(signal.SIGHUP, hangup)
    try:
        deadline = time.monotonic() + 240
        while not [p for p in tmp_path.iterdir() if p.name.startswith(".run.edgelin-tmp-")]:
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, "the run never claimed its output"
            time.sleep(0.2)
        time.sleep(1)  # into the training loop
        for sent in signals:
            proc.send_signal(sent)
        stdout, stderr = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 128 + signum, (proc.returncode, stderr)
    assert stderr.strip().splitlines()[-1] == f"error: terminated ({signal.Signals(signum).name})", stderr
    assert "Traceback" not in stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == [], list(tmp_path.iterdir())  # no run, .tmp-, .lock


def test_termination_in_a_command_exits_with_the_signal(monkeypatch):
    import edgelin.catalog

    def killed():
        raise Terminated(signal.SIGTERM)
    monkeypatch.setattr(edgelin.catalog, "family_rows", killed)
    result = run("families")
    assert result.exit_code == 128 + signal.SIGTERM and result.stderr == "error: terminated (SIGTERM)\n"


def test_an_ignored_sighup_stays_ignored():
    """`nohup edgelin train ...` must survive the terminal closing."""
    from edgelin.cli_support import handle_termination

    before = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGHUP)}
    try:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.signal(signal.SIGHUP, signal.SIG_IGN)
        handle_termination()
        assert signal.getsignal(signal.SIGHUP) is signal.SIG_IGN
        assert signal.getsignal(signal.SIGTERM) not in (signal.SIG_DFL, signal.SIG_IGN)
    finally:
        for s, handler in before.items():
            signal.signal(s, handler)


# ---- 4. --greedy takes no sampling options ------------------------------------------------------
@pytest.mark.parametrize("given", [["--temperature", "2"], ["--top-k", "5", "--top-p", "0.5"]])
def test_greedy_refuses_sampling_options(tmp_path, given):
    line = error_line(run("generate", tmp_path, "-p", "hi", "--greedy", *given))
    assert line.startswith(f"error: --greedy with {', '.join(given[::2])}:") and "Fix: drop --greedy" in line, line


def test_sampling_defaults_still_apply(tmp_path, monkeypatch):
    import edgelin.generate

    seen = {}

    def fake(folder, prompt, n, sampling, **kwargs):
        seen["sampling"] = sampling
        raise EdgelinError("stop", "the test has what it needs", "none")
    monkeypatch.setattr(edgelin.generate, "generate", fake)
    run("generate", tmp_path, "-p", "hi")
    assert seen["sampling"] == edgelin.generate.Sampling()
    run("generate", tmp_path, "-p", "hi", "--greedy")
    assert seen["sampling"] == edgelin.generate.Sampling(greedy=True)
    run("generate", tmp_path, "-p", "hi", "--top-k", "0", "--temperature", "1.5")
    assert (seen["sampling"].top_k, seen["sampling"].temperature, seen["sampling"].top_p) == (0, 1.5, 0.95)


# ---- 5. usage errors under --json ---------------------------------------------------------------
@pytest.mark.parametrize("args, message", [
    (["families", "--json", "--bogus"], "No such option: --bogus. Fix: see `edgelin families --help`"),
    (["bogus", "--json"], "No such command 'bogus'. Fix: see `edgelin --help`"),
    (["generate", "--json"], "Missing argument 'folder'. Fix: see `edgelin generate --help`"),
])
def test_usage_errors_under_json_are_a_json_error(args, message):
    result = run(*args)
    assert result.exit_code == 2 and result.stdout == ""
    assert json.loads(result.stderr) == {"error": message}


def test_usage_errors_without_json_stay_plain():
    line = error_line(run("families", "--bogus"))
    assert line == "error: No such option: --bogus. Fix: see `edgelin families --help`"
    # after `--` a "--json" is an argument, not the flag
    assert error_line(run("inspect", "--", "--json", "extra")).startswith("error: Got unexpected extra argument")


# ---- 6. a symlinked weights file ----------------------------------------------------------------
def test_symlinked_weights_get_a_fix_that_fits(checkpoint, tmp_path):
    from edgelin.export.pipeline import export_checkpoint

    folder = export_checkpoint(checkpoint, tmp_path / "onnx").folder
    shutil.move(folder / "weights.bin", tmp_path / "elsewhere.bin")
    (folder / "weights.bin").symlink_to(tmp_path / "elsewhere.bin")
    line = error_line(run("validate", folder))
    assert "escapes model directory" in line, line
    assert line.endswith("Fix: replace the link weights.bin with a copy of the file it points to (the export "
                         "folder's files must be real files inside it), or re-run `edgelin export`"), line
