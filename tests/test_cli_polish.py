"""The CLI's output layer: user text is never rich markup, usage and environment errors are one line,
progress shows in logs, stdout carries only the product, and the help says what each option takes."""

from __future__ import annotations

import errno
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

import graph_cache
from cached_cli import GREEDY_ENV

from edgelin import __version__
from edgelin.cli import app
from edgelin.output import LogProgress
from edgelin.reference import parity
from helpers import TOKENIZER_VOCAB, make_checkpoint

ROOT = Path(__file__).resolve().parents[1]
SHIPPED = ROOT / "recipes" / "tiny-gdn-hybrid"
cli = CliRunner(env={"COLUMNS": "80"})


def run(*args) -> object:
    return cli.invoke(app, [str(a) for a in args])


def edgelin(*args, columns: int = 80) -> subprocess.Popen:
    """The real console script's code path (edgelin.cli.main) with pipes (not a terminal), as CI runs it;
    its ONNX graphs go through the test run's graph cache (tests/cached_cli.py)."""
    env = {**os.environ, "COLUMNS": str(columns), "PYTHONPATH": str(ROOT)}
    env.pop("EDGELIN_DEBUG", None)
    if graph_cache.cache_dir() is not None:
        env[graph_cache.DIR_ENV] = str(graph_cache.cache_dir())
    env[GREEDY_ENV] = str(parity.GREEDY_STEPS)  # as this file's in-process exports record (tests/conftest.py)
    return subprocess.Popen([sys.executable, str(ROOT / "tests" / "cached_cli.py"), *map(str, args)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True, env=env)


def one_error_line(stderr: str) -> str:
    lines = [ln for ln in stderr.splitlines() if ln.strip() and not ln.startswith(("progress:", "warning:"))]
    assert len(lines) == 1, stderr
    assert lines[0].startswith("error: ") and ". Fix: " in lines[0], stderr
    assert "Traceback" not in stderr and "internal error" not in stderr, stderr
    return lines[0]


@pytest.fixture(scope="module")
def exports(tmp_path_factory):
    """Two exports, run concurrently: a checkpoint whose path holds rich markup, as a subprocess with
    pipes (as in CI); one without a tokenizer, in-process with --json."""
    root = tmp_path_factory.mktemp("polish")
    (root / "a[").mkdir()  # "[/y]" holds a slash: the folder is "a[" / "y] [red]b"
    ckpt = make_checkpoint(root / "a[/y] [red]b", "hybrid")
    # (other files trace the same graphs)
    bare = make_checkpoint(root / "bare", "hybrid", tokenizer=False, vocab_size=TOKENIZER_VOCAB)
    out, bare_out = root / "out [bold]x[/y]", root / "bare-out"
    proc = edgelin("export", ckpt, "--out", out)
    as_json = run("export", bare, "--out", bare_out, "--json")
    stdout, stderr = proc.communicate(timeout=600)
    assert proc.returncode == 0 and as_json.exit_code == 0, (stderr, as_json.output)
    return {"ckpt": ckpt, "out": out, "stdout": stdout, "stderr": stderr,
            "bare_out": bare_out, "json_stdout": as_json.stdout, "json_stderr": as_json.stderr}


# ---- 11: paths and user text are plain text ------------------------------------------------------------
def test_a_markup_path_exports_and_prints_verbatim(exports):
    assert f"Exported {exports['ckpt']} -> {exports['out']}" in exports["stdout"]
    assert (exports["out"] / "manifest.json").is_file()
    assert "Traceback" not in exports["stderr"]


def test_a_markup_path_validates_and_prints_verbatim(exports):
    result = run("validate", exports["out"])
    assert result.exit_code == 0, result.output
    assert f"{exports['out']}: onnx fp32" in result.stdout
    assert re.search(r"│ ok +│", result.stdout) and "all " in result.stdout


def test_the_pip_hint_survives_in_the_error_line(exports, monkeypatch):
    from edgelin.export.base import Phase
    from edgelin.export.onnx.target import OnnxTarget

    monkeypatch.setattr(OnnxTarget, "can_export", lambda self: Phase(False, "onnxruntime is not installed"))
    result = run("export", exports["ckpt"], "--out", exports["out"].parent / "never")
    assert result.exit_code == 2
    assert "edgelin[onnx]" in one_error_line(result.stderr)
    assert not (exports["out"].parent / "never").exists()


def test_the_terminal_progress_bar_shows_markup_verbatim():
    import io

    from rich.console import Console

    from edgelin.output import Output

    out, screen = Output(), io.StringIO()
    out.err = Console(file=screen, force_terminal=True, width=100)
    with out.progress("exporting a[/y] [red]b to onnx", total=4) as update:
        update(2)
    assert "exporting a[/y] [red]b to onnx" in screen.getvalue()


def test_a_table_piped_at_80_columns_splits_no_name():
    from edgelin.catalog import family_rows

    result = run("families")
    assert result.exit_code == 0, result.output
    for name in [r["family"] for r in family_rows()]:
        assert re.search(rf"│ {re.escape(name)} +│", result.stdout), (name, result.stdout)


# ---- 12: parse-time range checks and environment faults -------------------------------------------------
BAD_VALUES = [
    ("validate", "--rtol", "0"), ("validate", "--rtol", "nan"), ("validate", "--rtol", "inf"),
    ("validate", "--rtol", "-1"), ("validate", "--steps", "0"), ("validate", "--prompt-len", "0"),
    ("validate", "--batch", "0"),
    ("bench", "--warmup", "-1"), ("bench", "--threads", "-1"), ("bench", "--iters", "0"), ("bench", "--batch", "0"),
    ("bench", "--prefill-tokens", "-10"), ("bench", "--baseline", "kvv"),
    ("generate", "--max-new-tokens", "-1"), ("generate", "--temperature", "0"), ("generate", "--temperature", "nan"),
    ("generate", "--top-p", "0"), ("generate", "--top-p", "1.5"), ("generate", "--top-k", "-1"),
    ("generate", "--repetition-penalty", "0"), ("generate", "--repetition-penalty", "inf"),
    ("generate", "--threads", "-1"),
    ("export", "--target", "onx"), ("export", "--precision", "fp8"),
]
REQUIRED = {"generate": ["--prompt", "x"], "export": ["--out", "never"]}


@pytest.mark.parametrize("command,option,value", BAD_VALUES, ids=[" ".join(c) for c in BAD_VALUES])
def test_out_of_range_options_are_one_line_usage_errors(tmp_path, command, option, value):
    result = run(command, tmp_path / "folder", *REQUIRED.get(command, []), option, value)
    assert result.exit_code == 2, result.output
    line = one_error_line(result.stderr)
    assert f"'{option}'" in line and f" {command} --help`" in line, line  # CliRunner names it "root"
    assert result.stdout == "" and not (tmp_path / "never").exists()


def test_a_short_option_is_range_checked_too(tmp_path):
    result = run("generate", tmp_path, "-p", "x", "-n", "-1")
    assert result.exit_code == 2 and "'-n'" in one_error_line(result.stderr)


@pytest.mark.parametrize("args,needle", [(["export", "ckpt"], "Missing option '--out'"),
                                         (["exprot"], "No such command 'exprot'"),
                                         (["--debug"], "Missing command")])
def test_usage_errors_are_one_line(args, needle):
    result = run(*args)
    assert result.exit_code == 2 and needle in one_error_line(result.stderr)
    assert "╭" not in result.stderr


@pytest.mark.parametrize("exc,expected", [
    (PermissionError(errno.EACCES, "Permission denied", "/ro/out"),
     "error: cannot use /ro/out: permission denied. Fix: check the path's permissions, or use a location you own"),
    (OSError(errno.ENOSPC, "No space left on device", "/full/out"),
     "error: cannot use /full/out: no space left on the device. Fix: free disk space, or write to another disk"),
    (OSError(errno.EROFS, "Read-only file system", "/ro"),
     "error: cannot use /ro: the file system is read-only. Fix: write to a folder on a writable file system"),
    (NotADirectoryError(errno.ENOTDIR, "Not a directory", "/f/out"),
     "error: cannot use /f/out: a part of the path is a file, not a folder. Fix: pick a path whose parents are "
     "folders"),
    (MemoryError(), "error: out of memory: the machine could not allocate what this command needs. Fix: close "
                    "other programs, or use smaller sizes (--batch, --positions, --steps, -n)"),
], ids=["EACCES", "ENOSPC", "EROFS", "ENOTDIR", "MemoryError"])
def test_environment_faults_are_one_line_exit_2(monkeypatch, exc, expected):
    import edgelin.catalog

    def fail():
        raise exc

    monkeypatch.setattr(edgelin.catalog, "family_rows", fail)
    result = run("families")
    assert result.exit_code == 2, result.output
    assert one_error_line(result.stderr) == expected


# ---- 14: progress off a terminal, clean --json -----------------------------------------------------------
def test_export_off_a_terminal_prints_progress_lines(exports):
    lines = exports["stderr"].splitlines()
    assert lines[0] == f"progress: exporting {exports['ckpt']} to onnx ...", lines
    assert re.fullmatch(r"progress: exporting .* to onnx: done in \d+\.\d s", lines[-1]), lines


def test_export_json_prints_only_json(exports):
    report = json.loads(exports["json_stdout"])  # the whole of stdout is one JSON document
    assert report["folder"] == str(exports["bare_out"]) and report["manifest"]["tokenizer"] is None
    assert [w.startswith("no tokenizer.json in ") for w in report["warnings"]] == [True]  # in the JSON, not stderr
    assert report["inert_fields"] == [] and exports["json_stderr"] == ""


def test_export_wires_no_tokenizer_warnings_and_inert_fields(exports, monkeypatch):
    import edgelin.export.pipeline as pipeline
    from edgelin.artifact.manifest import Manifest

    calls = []

    def fake_export(*args, **kwargs):
        calls.append(kwargs)
        return pipeline.ExportResult(exports["out"], Manifest.load(exports["out"]), {}, ("use_cache", "pad_token_id"),
                                     ("no tokenizer.json in [x]: the export has no tokenizer",))

    monkeypatch.setattr(pipeline, "export_checkpoint", fake_export)
    result = run("export", exports["ckpt"], "--out", exports["out"].parent / "x", "--no-tokenizer")
    assert result.exit_code == 0, result.output
    assert calls[0]["include_tokenizer"] is False
    assert "warning: no tokenizer.json in [x]: the export has no tokenizer\n" in result.stderr
    assert "ignored (inert upstream fields): use_cache, pad_token_id\n" in result.stdout
    report = json.loads(run("export", exports["ckpt"], "--out", exports["out"].parent / "x", "--json").stdout)
    assert calls[1]["include_tokenizer"] is True and report["inert_fields"] == ["use_cache", "pad_token_id"]


def test_inspect_prints_the_path_verbatim_and_the_tokenizer(exports):
    result = run("inspect", exports["ckpt"])
    assert result.exit_code == 0, result.output
    assert result.stdout.startswith(f"{exports['ckpt']}: edgelin (edgelin), ")
    assert "\ntokenizer: ok\n" in result.stdout


def test_log_progress_is_rate_limited_by_deciles():
    lines: list[str] = []
    log = LogProgress(lines.append, "validating", total=40, min_gap=0.0, heartbeat=3600)
    for done in range(1, 41):
        log.update(done)
    log.update(description="comparing")
    log.close(ok=True)
    assert lines[0] == "validating ..."
    counts = [int(m.group(1)) for m in map(re.compile(r"validating: (\d+)/40 ").match, lines) if m]
    assert counts == [4, 8, 12, 16, 20, 24, 28, 32, 36, 40], lines  # one line per 10 %, not per step
    assert lines[-2].startswith("comparing: 40/40 (100%") and lines[-1].startswith("comparing: done in ")


# ---- 15: --version, help, generate's streams and repetition penalty -----------------------------------
def test_version_alone():
    result = run("--version")
    assert result.exit_code == 0 and result.stdout == f"edgelin {__version__}\n"


def test_export_help_shows_choices_and_flags_as_flags():
    proc = edgelin("export", "--help", columns=200)
    stdout, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0
    assert "<bool>" not in stdout
    assert re.search(r"--force +Replace an existing output folder", stdout), stdout
    assert re.search(r"--target +-t +<coreai\|coreml\|onnx\|tensorrt\|torch> ", stdout) and "<fp32|fp16|bf16>" in stdout, stdout
    assert "--no-tokenizer" in stdout


def test_every_option_has_help_text():
    import typer.main

    group = typer.main.get_command(app)
    missing = [f"{name} {p.opts[0]}" for name, cmd in group.commands.items() for p in cmd.params
               if p.param_type_name == "option" and not p.help]
    assert not missing, missing


def test_generate_stdout_is_prompt_and_text_stats_on_stderr(exports):
    as_json = run("generate", exports["out"], "--prompt", "def main(", "-n", "12", "--greedy", "--json")
    plain = run("generate", exports["out"], "--prompt", "def main(", "-n", "12", "--greedy")
    assert as_json.exit_code == 0 and plain.exit_code == 0, plain.output
    assert plain.stdout == "def main(" + json.loads(as_json.stdout)["text"] + "\n"
    assert re.fullmatch(r"12 tokens, [\d,]+ tok/s, prefill \d+ tokens in .* ms, RSS .*\n", plain.stderr), plain.stderr


def test_generate_without_a_tokenizer_fails_before_echoing_the_prompt(exports):
    result = run("generate", exports["bare_out"], "--prompt", "PROMPT-TEXT")
    assert result.exit_code == 2
    assert "has no tokenizer" in one_error_line(result.stderr)
    assert result.stdout == ""


def test_repetition_penalty_values():
    from edgelin.generate import penalize

    logits = np.array([2.0, -2.0, 1.0, -1.0], np.float32)
    seen = np.array([True, True, False, False])
    assert penalize(logits, seen, 2.0).tolist() == [1.0, -4.0, 1.0, -1.0]
    assert penalize(logits, seen, 1.0) is logits


def _repeated_8grams(ids: list[int]) -> int:
    grams = [tuple(ids[i:i + 8]) for i in range(len(ids) - 7)]
    return len(grams) - len(set(grams))


@pytest.mark.slow
def test_repetition_penalty_breaks_the_greedy_loop_of_the_shipped_model(tmp_path):
    from edgelin.export.pipeline import export_checkpoint

    folder = export_checkpoint(SHIPPED, tmp_path / "tiny").folder
    repeats = {}
    for penalty in ("1.0", "1.3"):
        result = run("generate", folder, "-p", "def main(", "-n", "150", "--greedy", "--repetition-penalty", penalty,
                     "--json")
        assert result.exit_code == 0, result.output
        ids = json.loads(result.stdout)["token_ids"]
        assert len(ids) == 150
        repeats[penalty] = _repeated_8grams(ids)
    # measured: 112 repeated 8-grams of 143 without the penalty (a `'w', 'w', ...` loop), 0 with 1.3
    assert repeats["1.0"] >= 80 and repeats["1.3"] <= 10, repeats
