"""edgelin.ortops' cache of the compiled kernel library (edgelin/ortops/cache.py): nothing in it is loaded before
it is verified; where it lives; the build's timeout, recorded failures and left-over temporaries.

A stand-in compiler (a shell script that writes some bytes where `-o` points and logs each call) keeps these tests
to milliseconds: the library's bytes only matter where a test loads them, and there a real tiny C library whose
constructor writes a marker file proves a refused library is never dlopened."""

from __future__ import annotations

import hashlib
import json
import os
import platform
import shutil
import stat
import subprocess
import threading
import time
from pathlib import Path

import onnxruntime as ort
import pytest

from edgelin import ortops
from edgelin.export.onnx import runner as onnx_runtime
from edgelin.ortops import cache

MARKER_SOURCE = """#include <stdio.h>
__attribute__((constructor)) static void betray(void) {
    FILE *f = fopen(MARKER, "w");
    if (f) { fputs("loaded\\n", f); fclose(f); }
}
"""


def stand_in_compiler(folder: Path, body: str = "printf 'a library' > \"$out\"") -> Path:
    """A `CC` that logs its call to calls.log, finds `-o OUT` and runs `body` (with $out set)."""
    script = folder / "cc"
    script.write_text("#!/bin/sh\n"
                      f"echo call >> '{folder / 'calls.log'}'\n"
                      'while [ $# -gt 0 ]; do if [ "$1" = "-o" ]; then out="$2"; fi; shift; done\n'
                      f"{body}\n")
    script.chmod(0o755)
    return script


def calls(folder: Path) -> int:
    log = folder / "calls.log"
    return len(log.read_text().splitlines()) if log.exists() else 0


@pytest.fixture
def cached(tmp_path, monkeypatch) -> Path:
    """A private XDG_CACHE_HOME and the stand-in compiler; returns the compiler's folder (calls.log)."""
    (tmp_path / "xdg").mkdir()
    tools = tmp_path / "tools"
    tools.mkdir()
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    monkeypatch.setenv("CC", str(stand_in_compiler(tools)))
    monkeypatch.delenv(ortops.ENV, raising=False)
    monkeypatch.delenv(cache.TIMEOUT_ENV, raising=False)
    monkeypatch.setattr(ortops.packaged, "find", lambda *args, **kwargs: None)  # a checkout: none packaged
    return tools


def marker_library(tmp_path: Path) -> tuple[Path, Path]:
    """A real shared library whose constructor writes a marker file when it is loaded: (library, marker)."""
    cc = shutil.which("cc")
    if cc is None:
        pytest.skip("needs a C compiler (cc) to build the library whose constructor would show a load")
    marker = tmp_path / "LOADED"
    source = tmp_path / "betray.c"
    source.write_text(MARKER_SOURCE)
    library = tmp_path / "betray.so"
    subprocess.run([cc, "-shared", "-fPIC", f'-DMARKER="{marker}"', "-o", str(library), str(source)], check=True)
    return library, marker


def load_as_the_runner_does(found: ortops.OpsLibrary) -> str:
    """What OnnxRunner does with locate()'s answer: does the library take the ops (kernel_path: ctypes.CDLL), the
    label, the registration with ONNX Runtime (dlopen); returns the label."""
    onnx_runtime._takes_ops(found)
    ortops.register(ort.SessionOptions(), found)
    return onnx_runtime._label(found)


def test_a_replaced_cached_library_is_never_loaded(cached, tmp_path):
    library = ortops.build()
    evil, marker = marker_library(tmp_path)
    shutil.copyfile(evil, library)
    found = ortops.locate()
    label = load_as_the_runner_does(found)
    assert not marker.exists(), "the replaced library was loaded: its constructor ran"
    assert found.path is None and "is not the one edgelin built" in found.reason
    assert "edgelin ops not loaded: the cached library" in label and f"remove the folder {library.parent}" in label
    with pytest.raises(cache.CacheError, match="not the one edgelin built"):
        ortops.build()  # the tests' and benches' entry refuses it too
    assert library.read_bytes() == evil.read_bytes()  # refused, never overwritten: not edgelin's to delete


def test_a_library_of_the_recorded_size_with_other_bytes_is_refused(cached):
    library = ortops.build()
    library.write_bytes(b"x" * library.stat().st_size)
    found = ortops.locate()
    assert found.path is None and "its sha256 differs" in found.reason


def test_a_truncated_cached_library_is_refused_before_it_is_loaded(cached):
    library = ortops.build()
    with open(library, "r+b") as handle:
        handle.truncate(4)
    found = ortops.locate()
    assert found.path is None and "(4 bytes, recorded 9: damaged or replaced)" in found.reason


def test_a_cached_library_without_edgelins_build_record_is_refused(cached):
    library = ortops.build()
    (library.parent / cache.RECORD).unlink()
    found = ortops.locate()
    assert found.path is None and f"has no build record ({cache.RECORD})" in found.reason


def test_a_library_changed_after_verification_is_not_registered(cached, tmp_path):
    found = ortops.locate()
    assert found.loaded and found.sha256 == json.loads((found.path.parent / cache.RECORD).read_text())["sha256"]
    evil, marker = marker_library(tmp_path)
    shutil.copyfile(evil, found.path)
    registered = ortops.register(ort.SessionOptions(), found)
    assert not marker.exists()
    assert registered.path is None and "changed after edgelin verified it" in registered.reason


def test_the_cache_folders_are_private_and_the_build_is_recorded(cached, tmp_path, capsys):
    found = ortops.locate()
    assert "progress: compiling edgelin's CPU kernels (once) ..." in capsys.readouterr().err
    folders = [tmp_path / "xdg" / "edgelin", tmp_path / "xdg" / "edgelin" / "ortops", found.path.parent]
    assert [oct(p.stat().st_mode & 0o777) for p in folders] == ["0o700"] * 3
    record = json.loads((found.path.parent / cache.RECORD).read_text())
    assert record["bytes"] == 9 and record["machine"] == platform.machine()
    assert ortops.locate() == found and calls(cached) == 1  # reused, verified
    assert "progress:" not in capsys.readouterr().err


@pytest.mark.parametrize("loosen", ["folder", "library", "record", "parent"])
def test_a_cache_writable_by_others_is_refused(cached, loosen):
    library = ortops.build()
    target = {"folder": library.parent, "library": library, "record": library.parent / cache.RECORD,
              "parent": library.parent.parent}[loosen]
    target.chmod(target.stat().st_mode | 0o020)
    found = ortops.locate()
    assert found.path is None and f"{target} is writable by group or others" in found.reason


def test_a_cache_owned_by_another_user_is_refused(cached, monkeypatch):
    library = ortops.build()
    monkeypatch.setattr(os, "geteuid", lambda: library.stat().st_uid + 1)
    found = ortops.locate()
    assert found.path is None and "is owned by another user" in found.reason


def test_a_symbolic_link_in_place_of_the_library_is_refused(cached, tmp_path):
    library = ortops.build()
    moved = tmp_path / "elsewhere.so"
    library.rename(moved)
    library.symlink_to(moved)
    found = ortops.locate()
    assert found.path is None and f"{library} is a symbolic link" in found.reason


def test_a_library_built_for_another_machine_is_never_picked_up(cached, monkeypatch):
    monkeypatch.setattr(platform, "machine", lambda: "x86_64")
    x86 = ortops.build()
    monkeypatch.setattr(platform, "machine", lambda: "aarch64")
    arm = ortops.build()
    assert arm.parent != x86.parent and calls(cached) == 2  # the machine is part of the fingerprint
    # the x86 build copied into the aarch64 folder (its record says x86_64): refused
    for name in (ortops.LIBRARY, cache.RECORD):
        shutil.copyfile(x86.parent / name, arm.parent / name)
    found = ortops.locate()
    assert found.path is None and "was built for x86_64, this is aarch64" in found.reason


# The first 20 bytes of an ELF shared library's header (64-bit, little-endian, ET_DYN) with e_machine `machine`
def _elf_header(machine: int) -> bytes:
    return b"\x7fELF\x02\x01\x01" + bytes(9) + (3).to_bytes(2, "little") + machine.to_bytes(2, "little")


def test_a_compiler_that_builds_another_architectures_code_is_refused_in_one_line(cached, monkeypatch):
    """An emulated aarch64 process reaches the host's x86 cc (as the ARM tier's first run did): the library it
    builds is never recorded or loaded, the failure is recorded once, in one line with the fix."""
    monkeypatch.setattr(platform, "machine", lambda: "aarch64")
    x86_code = cached / "x86.so"
    x86_code.write_bytes(_elf_header(62) + b"rest of a library")
    monkeypatch.setenv("CC", str(stand_in_compiler(cached, f"cat '{x86_code}' > \"$out\"")))
    found = ortops.locate()
    assert found.path is None
    assert "builds code for x86_64, this is aarch64: set CC to a compiler for aarch64" in found.reason
    assert "\n" not in found.reason
    assert not list(Path(os.environ["XDG_CACHE_HOME"]).rglob(ortops.LIBRARY))  # nothing left to load
    assert ortops.locate().reason == found.reason and calls(cached) == 1  # recorded, not rebuilt every run


def test_a_cached_library_of_another_architectures_code_is_refused(cached, monkeypatch):
    """A library whose record says this machine but whose code is another's (copied by hand): refused before any
    dlopen, with the folder to remove."""
    monkeypatch.setattr(platform, "machine", lambda: "x86_64")
    library = ortops.build()
    record = json.loads((library.parent / cache.RECORD).read_text())
    arm_code = _elf_header(183) + b"rest of a library"
    library.write_bytes(arm_code)
    record.update(sha256=hashlib.sha256(arm_code).hexdigest(), bytes=len(arm_code))
    (library.parent / cache.RECORD).write_text(json.dumps(record))
    found = ortops.locate()
    assert found.path is None
    assert f"the cached library {library} is code for aarch64, this is x86_64" in found.reason
    assert f"remove the folder {library.parent}" in found.reason


def test_a_hanging_compiler_is_stopped_at_the_timeout(cached, monkeypatch, capsys):
    monkeypatch.setenv("CC", str(stand_in_compiler(cached, "exec sleep 30")))
    monkeypatch.setenv(cache.TIMEOUT_ENV, "0.5")
    start = time.monotonic()
    found = ortops.locate()
    assert time.monotonic() - start < 10
    assert found.path is None and "ran past 0.5 s and was stopped" in found.reason
    assert "progress: compiling edgelin's CPU kernels (once) ..." in capsys.readouterr().err


def test_a_timeout_that_is_not_a_number_is_reported(cached, monkeypatch):
    monkeypatch.setenv(cache.TIMEOUT_ENV, "soon")
    found = ortops.locate()
    assert found.path is None and f"{cache.TIMEOUT_ENV}='soon' is not a positive number of seconds" in found.reason
    assert calls(cached) == 0


def test_a_failed_build_is_recorded_and_not_retried_until_the_compiler_changes(cached, monkeypatch):
    compiler = stand_in_compiler(cached, "echo 'cc: error: out of cheese' >&2; exit 1")
    monkeypatch.setenv("CC", str(compiler))
    first, second = ortops.locate(), ortops.locate()
    assert calls(cached) == 1
    assert first.path is None and "out of cheese" in first.reason
    assert second.path is None and "out of cheese" in second.reason and "not retried until" in second.reason
    compiler.write_text(compiler.read_text() + "# upgraded\n")  # another size and mtime: another compiler
    ortops.locate()
    assert calls(cached) == 2


def test_a_timed_out_build_is_retried_with_a_longer_timeout(cached, monkeypatch):
    monkeypatch.setenv("CC", str(stand_in_compiler(cached, "sleep 2.5; printf 'a library' > \"$out\"")))
    monkeypatch.setenv(cache.TIMEOUT_ENV, "1")  # a second: time for the script to log its call on a busy machine
    assert ortops.locate().path is None and ortops.locate().path is None
    assert calls(cached) == 1
    monkeypatch.setenv(cache.TIMEOUT_ENV, "30")
    assert ortops.locate().loaded and calls(cached) == 2


def test_concurrent_first_runs_build_once_and_load_the_same_library(cached, monkeypatch):
    monkeypatch.setenv("CC", str(stand_in_compiler(cached, "sleep 0.5; printf 'a library' > \"$out\"")))
    found: list[ortops.OpsLibrary] = []
    runs = [threading.Thread(target=lambda: found.append(ortops.locate())) for _ in range(2)]
    for run in runs:
        run.start()
    for run in runs:
        run.join()
    assert calls(cached) == 1 and len(found) == 2 and found[0] == found[1] and found[0].loaded


def test_a_build_removes_the_temporaries_a_killed_build_left(cached, monkeypatch):
    gone = subprocess.Popen(["true"])
    gone.wait()
    where = cache.folder(ortops._fingerprint(ortops._compiler()))
    dead = where / f".{ortops.LIBRARY}.{gone.pid}.abc123.tmp"
    old = where / f".{cache.RECORD}.{os.getpid()}.def456.tmp"
    live = where / f".{ortops.LIBRARY}.{os.getpid()}.ghi789.tmp"
    other = where / "notes.tmp"
    for path in (dead, old, live, other):
        path.write_text("left over")
    os.utime(old, (time.time() - 2 * cache.STALE_AGE_S,) * 2)
    assert ortops.locate().loaded
    assert not dead.exists() and not old.exists() and live.exists() and other.exists()


def test_a_relative_xdg_cache_home_is_ignored(cached, tmp_path, monkeypatch):
    (tmp_path / "home").mkdir()
    (tmp_path / "cwd").mkdir()
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("XDG_CACHE_HOME", "relative-cache")
    monkeypatch.chdir(tmp_path / "cwd")
    library = ortops.build()
    assert library.is_relative_to(tmp_path / "home" / ".cache" / "edgelin" / "ortops")
    assert os.listdir(tmp_path / "cwd") == []


@pytest.mark.parametrize("setting", ["HOME", "XDG_CACHE_HOME"])
def test_with_no_usable_cache_base_nothing_is_created_or_built(cached, tmp_path, monkeypatch, setting):
    impossible = tmp_path / "nonexistent" / "x"
    monkeypatch.setenv(setting, str(impossible))
    if setting == "HOME":
        monkeypatch.delenv("XDG_CACHE_HOME")
    found = ortops.locate()
    assert found.path is None and f"{setting}={impossible} is not a folder" in found.reason
    assert "set XDG_CACHE_HOME" in found.reason or "create it" in found.reason
    assert f"set {ortops.ENV}=" in found.reason
    assert not (tmp_path / "nonexistent").exists() and calls(cached) == 0


def test_a_library_the_user_names_is_their_choice(cached, tmp_path, monkeypatch):
    named = tmp_path / "mine.so"
    named.write_bytes(b"not verified: the user named it")
    named.chmod(0o666)
    monkeypatch.setenv(ortops.ENV, str(named))
    assert ortops.locate() == ortops.OpsLibrary(named, ortops.ENV)


def test_a_missing_xdg_cache_home_in_an_existing_folder_is_created_private(cached, tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "fresh"))  # the spec: create a missing base, 0700
    library = ortops.build()
    assert library.is_relative_to(tmp_path / "fresh" / "edgelin" / "ortops")
    assert stat.S_IMODE(os.stat(tmp_path / "fresh").st_mode) == 0o700
