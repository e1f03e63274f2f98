"""Issue 51 item 4: every file of an export folder is verified before it runs (edgelin/integrity.py). The export
records each file's sha256 in manifest.json; validate, generate, bench and build refuse a changed file in one line
naming it (or, --no-verify, run it); a FIFO or device in a listed file's place is named as such and never opened; a
verdict is cached by the file's identity in the per-user cache, never in the folder; an older manifest opens with
one warning. (The Core ML side, validate writing nothing and a quiet stderr: tests/export/coreml/test_coreml.py.)"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from edgelin.cli import app
from edgelin.errors import EdgelinError
from edgelin.export.pipeline import export_checkpoint
from edgelin.runtime import load_artifact
from helpers import make_checkpoint

ROOT = Path(__file__).resolve().parents[1]
MISMATCH = "weights.bin does not match its manifest: sha256 differs"
# each command with the least work it can do once the folder opens
COMMANDS = {
    "validate": ["validate"],
    "generate": ["generate", "--prompt", "x", "-n", "2", "--greedy"],
    "bench": ["bench", "--positions", "1", "--iters", "1", "--warmup", "0", "--prefill-tokens", "0"],
}


@pytest.fixture(scope="module")
def exported(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("integrity")
    ckpt = make_checkpoint(root / "ckpt", "hybrid")  # with a tokenizer: generate runs too
    # test_runtime_checks.py and test_artifact.py export the same one: its graphs are traced once a run
    return export_checkpoint(ckpt, root / "out", baselines=("kv",)).folder


def run(command: str, folder: Path, *extra: str):
    words = COMMANDS[command]
    return CliRunner().invoke(app, [words[0], str(folder), *words[1:], *extra])


def error_lines(result) -> list[str]:
    return [ln for ln in result.stderr.splitlines() if ln.strip() and not ln.startswith(("progress:", "warning:"))]


def flipped_copy(exported: Path, dst: Path, name: str = "weights.bin") -> Path:
    """A copy of the export with one bit of `name` flipped (a quantised code, a float's low bit)."""
    shutil.copytree(exported, dst)
    data = bytearray((dst / name).read_bytes())
    data[len(data) // 2] ^= 0x01
    (dst / name).write_bytes(bytes(data))
    return dst


def snapshot(folder: Path) -> dict[str, tuple[bytes, int]]:
    return {p.relative_to(folder).as_posix(): (p.read_bytes(), p.stat().st_mtime_ns)
            for p in sorted(folder.rglob("*")) if p.is_file()}


def test_export_records_the_sha256_of_every_file_it_wrote(exported):
    recorded = json.loads((exported / "manifest.json").read_text())["sha256"]
    on_disk = {p.relative_to(exported).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
               for p in exported.rglob("*") if p.is_file() and p != exported / "manifest.json"}
    assert recorded == on_disk
    assert {"weights.bin", "baseline-kv/weights.bin", "baseline-kv/manifest.json"} <= set(recorded)  # the baseline's


@pytest.mark.parametrize("command", list(COMMANDS))
def test_a_changed_weights_file_is_refused_in_one_line(exported, tmp_path, command):
    folder = flipped_copy(exported, tmp_path / "flipped")
    result = run(command, folder)
    assert result.exit_code == 2, (result.exit_code, result.output)
    lines = error_lines(result)
    assert len(lines) == 1 and lines[0].startswith("error:") and "Fix:" in lines[0], result.stderr
    assert f"{folder}/{MISMATCH}" in lines[0] and "Traceback" not in result.output


@pytest.mark.parametrize("command", list(COMMANDS))
def test_no_verify_runs_the_changed_folder(exported, tmp_path, command):
    folder = flipped_copy(exported, tmp_path / "flipped")
    result = run(command, folder, "--no-verify")
    # validate may find the flipped weight in its figures (exit 1); it is never refused for the file itself
    assert result.exit_code in ((0, 1) if command == "validate" else (0,)), result.output
    assert MISMATCH not in result.output and "no such option" not in result.output.lower()


def test_a_changed_file_in_a_subfolder_is_refused(exported, tmp_path):
    folder = flipped_copy(exported, tmp_path / "flipped", "baseline-kv/step.onnx")
    with pytest.raises(EdgelinError, match="baseline-kv/step.onnx does not match its manifest"):
        load_artifact(folder)


def test_a_truncated_or_missing_file_is_refused(exported, tmp_path):
    folder = shutil.copytree(exported, tmp_path / "copy")
    (folder / "tokenizer.json").write_bytes((folder / "tokenizer.json").read_bytes()[:-1])
    with pytest.raises(EdgelinError, match="tokenizer.json does not match its manifest"):
        load_artifact(folder)
    (folder / "tokenizer.json").unlink()
    with pytest.raises(EdgelinError, match=r"tokenizer.json is missing: the export's manifest lists it"):
        load_artifact(folder)


def test_a_fifo_in_place_of_the_weights_is_named_and_never_opened(exported, tmp_path):
    folder = shutil.copytree(exported, tmp_path / "copy")
    (folder / "weights.bin").unlink()
    os.mkfifo(folder / "weights.bin")
    for flags in ([], ["--no-verify"]):  # the kind is checked either way: reading a FIFO would hang
        done = subprocess.run([sys.executable, "-m", "edgelin.cli", "validate", str(folder), *flags],
                              env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True,
                              timeout=120, stdin=subprocess.DEVNULL)
        assert done.returncode == 2, done.stderr
        lines = [ln for ln in done.stderr.splitlines() if ln.startswith("error:")]
        assert lines == [ln for ln in done.stderr.splitlines() if ln.strip() and not ln.startswith("progress:")]
        assert len(lines) == 1 and "weights.bin is not a regular file: it is a FIFO" in lines[0], done.stderr


def test_a_second_open_reads_the_cached_verdicts(exported, tmp_path, monkeypatch):
    """The first open hashes every listed file and caches each verdict in the per-user cache (0700, never in the
    folder); a later process (the in-process memo cleared) only stats them; a touched file is hashed again."""
    from edgelin import integrity  # here: on the code before it, the other tests fail one by one

    cache = tmp_path / "xdg"
    monkeypatch.setenv("XDG_CACHE_HOME", str(cache))
    folder = shutil.copytree(exported, tmp_path / "copy")
    (folder / "notes.txt").write_text("the user's own file: not listed, not read\n")
    listed = json.loads((folder / "manifest.json").read_text())["sha256"]
    hashed: list[object] = []
    original = integrity._sha256
    monkeypatch.setattr(integrity, "_sha256", lambda fh: hashed.append(fh) or original(fh))
    monkeypatch.setattr(integrity, "_DIGESTS", {})
    before = snapshot(folder)
    load_artifact(folder)
    assert len(hashed) == len(listed)
    verified = cache / "edgelin" / "verified"
    assert stat.S_IMODE(verified.stat().st_mode) == 0o700
    (entry,) = verified.iterdir()
    assert sorted(json.loads(entry.read_text())["files"]) == sorted(listed)  # not notes.txt
    monkeypatch.setattr(integrity, "_DIGESTS", {})  # as a new process
    load_artifact(folder)
    assert len(hashed) == len(listed)  # nothing hashed again
    os.utime(folder / "step.onnx")  # a new mtime: its verdict no longer applies
    monkeypatch.setattr(integrity, "_DIGESTS", {})
    load_artifact(folder)
    assert len(hashed) == len(listed) + 1
    assert {name: data for name, data in snapshot(folder).items() if name != "step.onnx"} == \
        {name: data for name, data in before.items() if name != "step.onnx"}  # nothing written into the folder


def test_a_cached_verdict_does_not_hide_a_change(exported, tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    folder = shutil.copytree(exported, tmp_path / "copy")
    load_artifact(folder)
    data = bytearray((folder / "weights.bin").read_bytes())
    data[0] ^= 0x01
    (folder / "weights.bin").write_bytes(bytes(data))  # same size; new mtime and ctime
    with pytest.raises(EdgelinError, match=MISMATCH):
        load_artifact(folder)


def test_an_older_manifest_opens_with_one_warning(exported, tmp_path):
    folder = shutil.copytree(exported, tmp_path / "older")
    data = json.loads((folder / "manifest.json").read_text())
    del data["sha256"]
    (folder / "manifest.json").write_text(json.dumps(data))
    result = run("validate", folder)
    assert result.exit_code == 0, result.output
    warnings = [ln for ln in result.stderr.splitlines() if ln.startswith("warning:")]
    assert len(warnings) == 1 and "cannot be verified" in warnings[0], result.stderr
    assert not error_lines(result)
    # the digest an older manifest does record (extra.weights.sha256) is still checked
    flipped = flipped_copy(folder, tmp_path / "older-flipped")
    result = run("validate", flipped)
    assert result.exit_code == 2 and MISMATCH in error_lines(result)[0], result.output


@pytest.mark.parametrize("name", ["../outside.bin", "/etc/passwd", "a/../../b", "a\\..\\b"])
def test_a_digest_path_that_escapes_the_folder_is_malformed(exported, tmp_path, name):
    folder = shutil.copytree(exported, tmp_path / "copy")
    data = json.loads((folder / "manifest.json").read_text())
    data.setdefault("sha256", {})[name] = "0" * 64
    (folder / "manifest.json").write_text(json.dumps(data))
    with pytest.raises(EdgelinError, match="is malformed.*escapes the export folder"):
        load_artifact(folder)
