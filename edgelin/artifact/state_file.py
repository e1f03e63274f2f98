"""The portable state file (`.edgestate`): a conversation's state, where it stands and whose it is, in one
safetensors file (docs/state.md, "The state file").

Tensors: each state tensor under its graph input name (past_key_values.LAYER.NAME, batch first), and `tokens`
([batch, n] int64, the tokens so far) when they were kept. The header's metadata (safetensors' string map):
`format` (edgelin-state), `version`, `position`, `batch`, `artifact` (the export's identity: manifest_identity),
`source` (the checkpoint's sha256), `target`, `precision`, `weights` (the weight quantisation in words),
`vocab_size`, `state` (the state spec: name, dims, dtype per tensor) and `content_sha256` (of every tensor's
bytes, name order: a flipped bit or a truncated file is refused, never half-read).

A file loads into the export that wrote it (same identity), or into another export of the same checkpoint with
the same weights, precision and state tensors (the same export copied to another machine, or run by another
runtime); anything else is refused in one line before the runner sees it. Torch-free: the run side reads it.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from edgelin.errors import EdgelinError

if TYPE_CHECKING:
    from edgelin.artifact.manifest import Manifest

FORMAT = "edgelin-state"
VERSION = 1
SUFFIX = ".edgestate"
TOKENS = "tokens"


def manifest_identity(manifest: "Manifest") -> str:
    """sha256 of the manifest's content (it records every file's sha256: the export, wherever it is copied)."""
    return hashlib.sha256(json.dumps(manifest.to_dict(), sort_keys=True).encode()).hexdigest()


def _weights(manifest: "Manifest") -> str:
    from edgelin.artifact.quality import quantized_weights

    entry = manifest.extra.get("quantization")
    return quantized_weights(entry) if isinstance(entry, dict) and entry.get("bits") else "as the graphs"


def _spec(manifest: "Manifest") -> list[list[Any]]:
    return [[t.name, list(t.dims), str(t.dtype)] for t in manifest.state_inputs]


def _content_digest(tensors: dict[str, np.ndarray]) -> str:
    digest = hashlib.sha256()
    for name in sorted(tensors):
        value = np.ascontiguousarray(tensors[name])
        digest.update(f"{name}\0{value.dtype.str}\0{list(value.shape)}\0".encode())
        digest.update(value.tobytes())
    return digest.hexdigest()


@dataclass(frozen=True)
class StateFile:
    """What a state file holds: the state tensors (batch first), the position they stand at, the tokens so far
    (None: not kept) and the identity of the export that wrote them."""

    state: dict[str, np.ndarray]
    position: int
    tokens: np.ndarray | None
    meta: dict[str, str]

    @property
    def batch(self) -> int:
        return int(self.meta["batch"])


def write(path: Path, manifest: "Manifest", state: dict[str, np.ndarray], position: int,
          tokens: np.ndarray | None = None, overwrite: bool = False) -> Path:
    """Write a state file (atomically: a complete file or none). An existing file is replaced only when it is a
    state file itself or `overwrite` says so (never a file edgelin did not write)."""
    from safetensors.numpy import save_file

    path = check_writable(Path(path), overwrite)
    batch = len(next(iter(state.values()))) if state else 1
    tensors = {name: np.ascontiguousarray(value) for name, value in state.items()}
    if tokens is not None:
        tensors[TOKENS] = np.ascontiguousarray(tokens, dtype=np.int64).reshape(batch, -1)
    meta = {"format": FORMAT, "version": str(VERSION), "position": str(int(position)), "batch": str(batch),
            "artifact": manifest_identity(manifest), "source": str(manifest.source.get("sha256", "")),
            "target": manifest.target, "precision": manifest.precision, "weights": _weights(manifest),
            "vocab_size": str(manifest.vocab_size), "state": json.dumps(_spec(manifest)),
            "content_sha256": _content_digest(tensors)}
    partial = path.with_name(f".{path.name}.partial")
    try:
        save_file(tensors, str(partial), metadata=meta)
        os.replace(partial, path)
    finally:
        partial.unlink(missing_ok=True)
    return path


def check_writable(path: Path, overwrite: bool = False) -> Path:
    """Refuse, before anything runs, a save that would replace a file edgelin did not write (or a folder), or
    land in a folder that does not exist."""
    if path.is_dir() or (path.exists() and not overwrite and not _is_state_file(path)):
        raise EdgelinError(f"{path} exists and is not an edgelin state file", "saving would overwrite it",
                           "choose another file name (e.g. one ending in .edgestate)")
    if not path.parent.is_dir():
        raise EdgelinError(f"the folder of {path} does not exist", "the state file would have nowhere to go",
                           f"create {path.parent} first, or pick another path")
    return path


def _is_state_file(path: Path) -> bool:
    try:
        return _header(path).get("format") == FORMAT
    except EdgelinError:
        return False


def _open(path: Path) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    from safetensors import SafetensorError
    from safetensors.numpy import load_file

    meta = _header(path)
    try:
        return load_file(str(path)), meta
    except (SafetensorError, OSError, ValueError) as exc:
        raise _unreadable(path, exc) from exc


def position_of(path: Path) -> int:
    """The position a state file stands at, read from its header alone (the tensors are checked by read())."""
    try:
        return int(_header(Path(path))["position"])
    except (KeyError, ValueError) as exc:
        raise EdgelinError(f"{path}'s header has no valid position", "the file was not written by edgelin",
                           "save the state again") from exc


def _header(path: Path) -> dict[str, str]:
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), framework="np") as handle:
            return dict(handle.metadata() or {})
    except (SafetensorError, OSError, ValueError) as exc:
        raise _unreadable(path, exc) from exc


def _unreadable(path: Path, exc: Exception) -> EdgelinError:
    return EdgelinError(f"{path} cannot be read as a state file ({exc})", "it is truncated, corrupted or not a "
                        "safetensors file", "save the state again (edgelin generate --save-state FILE)")


def read(path: Path) -> StateFile:
    """A state file's contents, checked whole (format, version, content digest) before anything is returned."""
    path = Path(path)
    if not path.is_file():
        raise EdgelinError(f"state file {path} does not exist", "there is nothing to load",
                           "pass the path a save wrote (edgelin generate --save-state FILE)")
    tensors, meta = _open(path)
    if meta.get("format") != FORMAT:
        raise EdgelinError(f"{path} is not an edgelin state file", f"its header names format {meta.get('format')!r}",
                           "pass a file written by --save-state or Conversation.save")
    if meta.get("version") != str(VERSION):
        raise EdgelinError(f"{path} is state file version {meta.get('version')}", f"this edgelin reads version "
                           f"{VERSION}", "save the state again with this edgelin")
    if meta.get("content_sha256") != _content_digest(tensors):
        raise EdgelinError(f"{path}'s tensors do not match the digest in its header", "the file was corrupted or "
                           "edited after it was written", "save the state again")
    tokens = tensors.pop(TOKENS, None)
    try:
        position = int(meta["position"])
        int(meta["batch"])
    except (KeyError, ValueError) as exc:
        raise EdgelinError(f"{path}'s header has no valid position or batch", "the file was not written by edgelin",
                           "save the state again") from exc
    return StateFile(tensors, position, tokens, meta)


def check_fits(saved: StateFile, manifest: "Manifest", path: Path | str = "the state file") -> str:
    """Refuse, in one line, a saved state that is not this export's (or an equal one's): another model, weights,
    precision or state layout. Returns how it matched: "the same export" or "another export of the same model"."""
    meta = saved.meta
    if meta.get("artifact") == manifest_identity(manifest):
        return "the same export"
    fix = "load it into the export that saved it, or start a new conversation on this one"
    if meta.get("source") != str(manifest.source.get("sha256", "")):
        raise EdgelinError(f"{path} holds the state of another model (checkpoint {meta.get('source', '?')[:12]}, "
                           f"this export's is {str(manifest.source.get('sha256', '?'))[:12]})",
                           "a state means something only to the weights that made it", fix)
    for key, here in (("weights", _weights(manifest)), ("precision", manifest.precision),
                      ("vocab_size", str(manifest.vocab_size))):
        if meta.get(key) != here:
            raise EdgelinError(f"{path} was saved with {key} {meta.get(key)}, this export has {here}",
                               "the state was computed by other arithmetic than this export's", fix)
    if meta.get("state") != json.dumps(_spec(manifest)):
        raise EdgelinError(f"{path}'s state tensors differ from this export's (names, dims or dtypes)",
                           "this export's graphs could not take them", fix)
    return "another export of the same model"
