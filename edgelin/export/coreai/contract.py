"""The Core AI export's contract as both sides read it (torch-free, no coreai at import): coreai.json beside
manifest.json, the state names inside the program, and the quiet loading of Apple's runtime.

coreai.json:
  asset            the .aimodel folder (Apple's portable asset: program bytecode + metadata)
  compiled         the runtime form compiled on export for this platform (`model.aimodelx`: Core AI's Linux
                   CPU runtime loads it in milliseconds; compiling the asset takes seconds to minutes), with the
                   platform and coreai-core version it was compiled by, or null (macOS compiles the asset itself)
  batch            1 (a runner runs a batch row by row) or "dynamic" (any batch in one call)
  functions        {name: {kind: step|prefill, length}}: one entry point per enumerated prompt length
  states           [{input, feature, dims, dtype}]: each manifest state tensor, its state name in the program and
                   its dims there (batch symbolic; a full-attention KV cache at the export's capacity)
  ids_dtype        int32 (the program's token and position inputs)
  position_ids     whether the entry points take position_ids
  kv_capacity      the full-attention KV cache's capacity (--context), or null
  weights          with --quantize only: {precision, quantization}, the manifest's extra entries of that name
                   (edgelin.export.coreai.weights: the compressed matrices by parameter name, bits, block size)
"""

from __future__ import annotations

import contextlib
import json
import os
import platform
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from edgelin.errors import EdgelinError

CONTRACT = "coreai.json"
CONTRACT_FORMAT = "edgelin-coreai"
CONTRACT_VERSION = 1
ASSET = "model.aimodel"
COMPILED = "model.aimodelx"
FIX = "re-export the folder with `edgelin export coreai`"


def feature_name(name: str) -> str:
    """A manifest tensor name as a Core AI state name (identifiers only: '.' -> '_')."""
    return name.replace(".", "_")


def this_platform() -> str:
    """The platform a compiled runtime form belongs to, e.g. linux-x86_64."""
    return f"{sys.platform}-{platform.machine().lower()}"


def load_contract(folder: Path) -> dict[str, Any]:
    """coreai.json, checked for what the runner relies on (names that stay inside the folder)."""
    path = Path(folder) / CONTRACT
    try:
        contract = json.loads(path.read_text())
        if contract.get("format") != CONTRACT_FORMAT or contract.get("version") != CONTRACT_VERSION:
            raise ValueError(f"format {contract.get('format')!r} version {contract.get('version')!r}")
        names = [contract["asset"]] + ([contract["compiled"]["file"]] if contract.get("compiled") else [])
        for name in names:
            if not isinstance(name, str) or Path(name).name != name or name in (".", ".."):
                raise ValueError(f"file name {name!r} escapes the export folder")
        if "step" not in contract["functions"]:
            raise ValueError("no step entry point")
    except FileNotFoundError:
        raise EdgelinError(f"no {CONTRACT} in {folder}", "a Core AI export describes its model there", FIX) from None
    except (OSError, KeyError, TypeError, AttributeError, ValueError) as exc:
        raise EdgelinError(f"{path} is malformed", f"{type(exc).__name__}: {exc}", FIX) from exc
    return contract


@contextlib.contextmanager
def native_stderr_quiet() -> Iterator[None]:
    """Apple's runtime writes a line per loaded function ("ODIE [default]: Loading function ...") to the process'
    stderr from native code; the run side's stderr holds edgelin's lines only, so fd 2 points at /dev/null
    while functions load (Python's own sys.stderr is untouched: an error still reaches the user)."""
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(os.devnull, "wb") as null:
            os.dup2(null.fileno(), 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
