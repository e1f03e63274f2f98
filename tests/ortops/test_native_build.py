"""The native code's one build (CMakeLists.txt) and the packaged CPU kernel library: built from the sources the
compile-at-first-use path compiles, and loaded only once it matches the record its build wrote
(edgelin.ortops.packaged). The whole wheel, installed without a compiler: tests/test_wheel.py (slow)."""

from __future__ import annotations

import hashlib
import json
import platform
import re
from pathlib import Path

import pytest

from edgelin import ortops
from edgelin.ortops import cache, packaged

ROOT = Path(__file__).resolve().parents[2]
SOURCE_FILES = [ROOT / "edgelin" / "ortops" / name for name in (*ortops.SOURCES, *ortops.HEADERS)]


def cmake_sources(variable: str = "EDGELIN_ORTOPS_SOURCES") -> tuple[str, ...]:
    text = (ROOT / "edgelin" / "ortops" / "CMakeLists.txt").read_text()
    block = re.search(rf"set\({variable}\s+(?:#[^\n]*\n)?([^)]*)\)", text)
    assert block is not None
    return tuple(block.group(1).split())


def test_cmake_builds_the_sources_the_first_use_build_compiles():
    assert cmake_sources() == ortops.SOURCES
    assert cmake_sources("EDGELIN_ORTOPS_HEADERS") == ortops.HEADERS
    folder = ROOT / "edgelin" / "ortops"  # every C file, the ARM ones in arm/ included, is built and fingerprinted
    assert {p.relative_to(folder).as_posix() for p in folder.rglob("*.c")} == set(ortops.SOURCES)
    assert {p.relative_to(folder).as_posix() for p in folder.rglob("*.h")} == set(ortops.HEADERS)


def sources_hex_sha256(sources: list[Path]) -> str:
    """The build's recipe (edgelin/ortops/CMakeLists.txt): sha256 of the hex of the sources' bytes, in order."""
    return hashlib.sha256("".join(path.read_bytes().hex() for path in sources).encode()).hexdigest()


def shipped(folder: Path, content: bytes = b"a library", **record: object) -> Path:
    """A package folder holding a 'library' and the record a build of the sources beside it writes for it (fields
    overridable)."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / packaged.LIBRARY).write_bytes(content)
    fields = {"sha256": hashlib.sha256(content).hexdigest(), "bytes": len(content), "machine": platform.machine(),
              "sources_hex_sha256": sources_hex_sha256(SOURCE_FILES)}
    (folder / packaged.RECORD).write_text(json.dumps({**fields, **record}))
    return folder


def test_a_packaged_library_that_matches_its_record_is_found(tmp_path):
    folder = shipped(tmp_path)
    assert packaged.find(folder) == (folder / packaged.LIBRARY, hashlib.sha256(b"a library").hexdigest())


def test_a_package_without_a_library_falls_back_to_the_cache(tmp_path):
    assert packaged.find(tmp_path) is None


@pytest.mark.parametrize("change", ["same size, other bytes", "truncated", "no record", "other machine",
                                    "unreadable record"])
def test_a_packaged_library_unlike_its_record_is_refused(tmp_path, change):
    folder = shipped(tmp_path)
    library, record = folder / packaged.LIBRARY, folder / packaged.RECORD
    if change == "same size, other bytes":
        library.write_bytes(b"a librarx")
    elif change == "truncated":
        library.write_bytes(b"a lib")
    elif change == "no record":
        record.unlink()
    elif change == "other machine":
        shipped(tmp_path, machine="riscv128")
    else:
        record.write_text("{")
    with pytest.raises(cache.CacheError, match=r"was not loaded: .*reinstall edgelin"):
        packaged.find(folder)


@pytest.fixture
def no_compiler(tmp_path, monkeypatch) -> Path:
    """A stand-in CC that only logs its calls (a compile at first use would call it) and an empty cache."""
    log = tmp_path / "calls.log"
    cc = tmp_path / "cc"
    cc.write_text(f"#!/bin/sh\necho call >> '{log}'\nexit 1\n")
    cc.chmod(0o755)
    (tmp_path / "xdg").mkdir()
    monkeypatch.setenv("CC", str(cc))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    monkeypatch.delenv(ortops.ENV, raising=False)
    return log


def test_locate_loads_the_packaged_library_without_compiling(tmp_path, monkeypatch, no_compiler):
    folder = shipped(tmp_path / "site" / "edgelin" / "ortops")
    monkeypatch.setattr(packaged, "folder", lambda: folder)
    found = ortops.locate()
    assert found == ortops.OpsLibrary(folder / packaged.LIBRARY, "packaged", hashlib.sha256(b"a library").hexdigest())
    assert not no_compiler.exists()


def test_locate_refuses_a_damaged_packaged_library_and_does_not_compile_another(tmp_path, monkeypatch, no_compiler):
    folder = shipped(tmp_path / "site" / "edgelin" / "ortops")
    (folder / packaged.LIBRARY).write_bytes(b"a librarx")
    monkeypatch.setattr(packaged, "folder", lambda: folder)
    found = ortops.locate()
    assert found.path is None and "sha256 differs" in found.reason and not no_compiler.exists()


def test_a_packaged_library_built_from_other_sources_gives_way_to_a_build_of_these(tmp_path, monkeypatch,
                                                                                     no_compiler):
    """An editable install whose C sources changed after its build: the packaged library is stale, so the first-use
    build compiles the sources as they are (the stand-in compiler is called)."""
    folder = shipped(tmp_path / "site" / "edgelin" / "ortops", sources_hex_sha256="0" * 64)
    monkeypatch.setattr(packaged, "folder", lambda: folder)
    assert packaged.find(folder) is not None  # no sources given: nothing to compare
    assert packaged.find(folder, SOURCE_FILES) is None
    found = ortops.locate()
    assert found.path is None and "could not build it" in found.reason and no_compiler.exists()
