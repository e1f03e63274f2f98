"""The Core ML export's contract as both sides read it (torch-free, no coremltools at import): the
contract file beside manifest.json (coreml.json), the tensors' feature names, and how coremltools is
opened on a package without writing into the export folder. The target writes it, the check and the
runners read it."""

from __future__ import annotations

import contextlib
import json
import logging
import shutil
import tempfile
import warnings
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

from edgelin.errors import EdgelinError

CONTRACT = "coreml.json"  # the package's contract next to manifest.json
CONTRACT_FORMAT = "edgelin-coreml"
CONTRACT_VERSION = 1
FIX = "re-export the folder with `edgelin export coreml`"


def feature_name(name: str) -> str:
    """The Core ML feature name of a manifest tensor name (identifiers only: '.' -> '_')."""
    return name.replace(".", "_")


def coremltools_module() -> ModuleType:
    """coremltools, its own log lines below ERROR and its Python warnings kept off stderr (the run side's stderr
    holds edgelin's error/warning/progress lines only): off macOS its import logs eight "Failed to load
    _MLModelProxy ..." lines (no Core ML runtime here, as expected: the conversion is checked instead) and one on
    an untested torch version (a converter's concern); CoremlRunner says itself when predictions cannot run."""
    logging.getLogger("coremltools").setLevel(logging.ERROR)  # its modules log through this logger or children
    # coremltools imports torchao where it is installed (coreai-opt brings it), whose import logs "Failed to load
    # ..._C_mxfp8...so" (kernels built for another Python) and warns on a torch API: neither concerns a Core ML run.
    for noisy in ("torchao", "torch.utils._pytree"):  # the latter: torchao's enum registration, on torch 2.13
        logging.getLogger(noisy).setLevel(logging.ERROR)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import coremltools
        import coremltools.models.model  # noqa: F401  (the proxies' log lines come from these imports)
    return coremltools


@contextlib.contextmanager
def package_view(package: Path) -> Iterator[Path]:
    """A private view of a .mlpackage for coremltools to open: its package loader (libmodelpackage's ModelPackage,
    behind `MLModel(path)` and `load_spec`) rewrites the package's Manifest.json whenever it opens one (the same
    bytes, a new mtime), and nothing may write into an export folder. The view, in a private temporary folder:
    a copy of Manifest.json and links to everything else (Data/: the model and its weights, read in place)."""
    with tempfile.TemporaryDirectory(prefix="edgelin-mlpackage-") as tmp:
        view = Path(tmp) / Path(package).name
        view.mkdir()
        for entry in Path(package).iterdir():
            if entry.name == "Manifest.json":
                shutil.copyfile(entry, view / entry.name)
            else:
                (view / entry.name).symlink_to(entry.resolve(), target_is_directory=entry.is_dir())
        yield view


def _fail(what: str, why: str) -> EdgelinError:
    return EdgelinError(what, why, FIX)


def load_contract(folder: Path) -> dict[str, Any]:
    path = Path(folder) / CONTRACT
    try:
        contract = json.loads(path.read_text())
        if contract.get("format") != CONTRACT_FORMAT or contract.get("version") != CONTRACT_VERSION:
            raise ValueError(f"format {contract.get('format')!r} version {contract.get('version')!r}")
        for entry in contract["functions"].values():
            name = entry["package"]
            if Path(name).name != name or name in (".", "..") or not name.endswith(".mlpackage"):
                raise ValueError(f"package name {name!r} escapes the export folder")
    except FileNotFoundError:
        raise _fail(f"no {CONTRACT} in {folder}", "a Core ML export describes its package there") from None
    except (OSError, KeyError, TypeError, AttributeError, ValueError) as exc:
        raise _fail(f"{path} is malformed", f"{type(exc).__name__}: {exc}") from exc
    return contract
