"""The operator library an installed edgelin carries (built once by the wheel's build: CMakeLists.txt), and the
check made before it is loaded.

The build writes `libedgelin_ortops.json` beside the library: its sha256, size and machine, from the installed
bytes, and the sha256 of the C sources it was built from. The library is loaded only if it matches that record (a
damaged or replaced file is refused, with the fix). A package without one (a source checkout that was never built),
or one built from other sources than those beside it (an editable install whose C code changed since), falls back
to the compile-at-first-use cache (edgelin.ortops.cache), which builds the sources as they are. No ownership check, unlike the cache: the package's folder is the installer's, like the
Python code beside it.

Runtime-side module: no torch, no onnx.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from importlib.resources import files
from pathlib import Path

from edgelin.ortops.cache import CacheError, check_record

LIBRARY = "libedgelin_ortops.so"
RECORD = "libedgelin_ortops.json"
REINSTALL = ("reinstall edgelin (pip install --force-reinstall edgelin), or set EDGELIN_ORT_OPS=0 to run ONNX "
             "Runtime's own kernels")


def folder() -> Path | None:
    """The installed package's edgelin/ortops folder holding the built library (an editable install's build
    output included: importlib.resources sees both), or None when there is none."""
    found = files(__package__ or "edgelin.ortops") / LIBRARY
    return Path(str(found)).parent if found.is_file() else None


def sources_digest(sources: Sequence[Path]) -> str:
    """What the build records as `sources_hex_sha256`: the sha256 of the sources' bytes, concatenated in order, as
    lowercase hex (CMake reads them as hex: edgelin/ortops/CMakeLists.txt)."""
    return hashlib.sha256(b"".join(path.read_bytes() for path in sources).hex().encode()).hexdigest()


def find(where: Path | None = None, sources: Sequence[Path] = ()) -> tuple[Path, str] | None:
    """(the packaged library, its verified sha256), None when the package carries none or one built from other
    `sources` (SOURCES then HEADERS) than these; CacheError when it carries one unlike what its build recorded."""
    where = folder() if where is None else where
    if where is None or not (where / LIBRARY).is_file():
        return None
    library, record_path = where / LIBRARY, where / RECORD
    record, actual = check_record(library, record_path, f"the packaged library {library}", "its build recorded",
                                  REINSTALL)
    built_from = record.get("sources_hex_sha256")
    if not isinstance(built_from, str):
        raise CacheError(f"the build record {record_path} names no sources digest, so {library} was not loaded: "
                         f"{REINSTALL}")
    if sources and all(path.is_file() for path in sources) and sources_digest(sources) != built_from:
        return None  # built before the C sources beside it changed: the first-use build compiles them as they are
    return library, actual
