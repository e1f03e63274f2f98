"""Verifying an export folder before it runs: every file the export wrote must still be the file it wrote.

At export, manifest.json records `sha256`: the digest of every regular file in the folder (by its path relative to
the folder, "/"-separated; a Core ML package's, the TensorRT and Triton subfolders' and a baseline's files too),
but manifest.json itself and edgelin's bookkeeping of written files (outputs.RECORD, which `edgelin build` updates).
When the run side opens the folder (runtime.load_artifact: validate, bench, generate, build), `verify_folder`:

- refuses a listed file that is missing or is not a regular file (a FIFO is never opened: reading one would hang);
- hashes every listed file (1 MiB blocks) and refuses one whose digest differs, naming it;
- remembers each file's digest by its identity (device, inode, size, mtime, ctime) in the per-user cache
  ($XDG_CACHE_HOME/edgelin/verified/, mode 0700), so opening the same unchanged folder again only stats its files.
  Nothing is ever written into the export folder.

Files the manifest does not list (the user's own, `edgelin build`'s engines) are not looked at. The manifest itself is
the root of trust: this catches corruption, truncation and swapped files, not a forged manifest. A folder exported by
an older edgelin (no `sha256` in its manifest) opens with one warning saying its files cannot be verified; the digests
it does record (extra.weights', extra.reference_vectors') are still checked.

`checking(verify=False)` (the CLI's --no-verify) skips the hashing and leaves a missing file to the runners (which name
it); a FIFO, device or folder in a listed file's place is still refused.
No torch here: this is the run side.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import stat
import tempfile
import warnings
from collections.abc import Callable, Iterator
from contextvars import ContextVar
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from edgelin.errors import EdgelinError
from edgelin.outputs import RECORD

if TYPE_CHECKING:
    from edgelin.artifact.manifest import Manifest

MANIFEST = "manifest.json"  # the root of trust: the folder's own manifest records no digest of itself
BOOKKEEPING = RECORD  # edgelin's record of the files it wrote, in any folder: `edgelin build` rewrites tensorrt/'s
CACHE_FORMAT = "edgelin-verified"
MISMATCH_FIX = "re-export, or copy the folder again"
_KINDS = ((stat.S_ISFIFO, "a FIFO (named pipe)"), (stat.S_ISCHR, "a character device"),
          (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"), (stat.S_ISDIR, "a folder"))


class IntegrityWarning(UserWarning):
    """An export folder opened without verification (an older manifest). The CLI prints it as a `warning:` line."""


@dataclass(frozen=True)
class Checking:
    """How folders are opened in this context: `verify` (hash the files; False: --no-verify) and where a warning
    goes (None: Python's warnings, as IntegrityWarning)."""

    verify: bool = True
    warn: Callable[[str], None] | None = None


_CHECKING: ContextVar[Checking] = ContextVar("edgelin_integrity_checking", default=Checking())
_WARNED: set[str] = set()  # folders already warned about in this process (a command opens a folder several times)
_DIGESTS: dict[tuple[int, ...], str] = {}  # this process's verdicts, by file identity


@contextlib.contextmanager
def checking(verify: bool = True, warn: Callable[[str], None] | None = None) -> Iterator[None]:
    """Open folders inside this block with (or, verify=False, without) hashing their files; warnings to `warn`."""
    token = _CHECKING.set(Checking(verify, warn))
    try:
        yield
    finally:
        _CHECKING.reset(token)


# ---- export side -----------------------------------------------------------------------------------------------
def digest_folder(folder: Path) -> dict[str, str]:
    """{relative path: sha256} of every regular file under `folder` but its manifest.json and BOOKKEEPING files
    (manifest.json's `sha256`).
    A file hard-linked twice (a Triton repository's weights) is read once."""
    folder = Path(folder)
    digests: dict[str, str] = {}
    by_inode: dict[tuple[int, int], str] = {}
    for root, dirs, names in os.walk(folder):
        dirs.sort()
        for name in sorted(names):
            path = Path(root) / name
            info = path.lstat()
            relative = path.relative_to(folder).as_posix()
            if relative == MANIFEST or name == BOOKKEEPING or not stat.S_ISREG(info.st_mode):
                continue
            key = (info.st_dev, info.st_ino)
            if key not in by_inode:
                with open(path, "rb") as fh:
                    by_inode[key] = _sha256(fh)
            digests[relative] = by_inode[key]
    return digests


def _sha256(fh: Any) -> str:
    return hashlib.file_digest(fh, "sha256").hexdigest()


def sha256_of(path: Path) -> str:
    """A file's sha256, streamed: the one file hash edgelin records and checks (manifests, build records, caches)."""
    with open(path, "rb") as fh:
        return _sha256(fh)


def safe_relative(name: Any) -> bool:
    """A "/"-separated path inside a folder: relative, no empty, "." or ".." part, no backslash (a Windows
    separator), no NUL."""
    if not isinstance(name, str) or not name or "\\" in name or "\0" in name or name.startswith("/"):
        return False
    return all(part not in ("", ".", "..") for part in name.split("/"))


# ---- run side --------------------------------------------------------------------------------------------------
def verify_folder(folder: Path, manifest: "Manifest") -> None:
    """Refuse, in one line naming the file, a listed file that is missing, not a regular file or (unless
    --no-verify) not the bytes the export wrote (module docstring)."""
    folder = Path(folder)
    settings = _CHECKING.get()
    digests = manifest.sha256
    if digests is None:  # an older export: never open a FIFO or a device; verify the digests it does record
        for name in _legacy_names(manifest):
            _check_kind(folder, name, allow_folder=True, missing_ok=not settings.verify)
        digests = _legacy_digests(manifest)
        recorded = (f"the digests of {' and '.join(sorted(digests))} only: its other files" if digests
                    else "no file digests: its files")
        if settings.verify:
            _warn(settings, folder, f"{folder} was exported by edgelin {manifest.edgelin_version}, whose manifest "
                                    f"records {recorded} cannot be verified (re-export it to have every file verified)")
    if not settings.verify:  # --no-verify: only what would hang or crash a reader (the runners name a missing file)
        for name in sorted(digests):
            _check_kind(folder, name, missing_ok=True)
        return
    infos = {name: _check_kind(folder, name) for name in sorted(digests)}
    cache = VerdictCache(folder)
    for name, info in infos.items():
        digest = cache.get(name, info) or _hash_file(folder / name, name, cache)
        if digest != digests[name]:
            raise EdgelinError(f"{folder / name} does not match its manifest",
                               "sha256 differs (changed, truncated or replaced)", MISMATCH_FIX)
    cache.save()


def _legacy_names(manifest: "Manifest") -> list[str]:
    """The top-level names an older manifest lists: its `files`, else its graphs, tokenizer and weights file."""
    if manifest.files is not None:
        return [n for n in manifest.files if n not in (MANIFEST, BOOKKEEPING)]
    weights = manifest.extra.get("weights") if isinstance(manifest.extra.get("weights"), dict) else {}
    names = [g.file for g in manifest.graphs.values()] + [manifest.tokenizer, weights.get("file")]
    return sorted({n for n in names if isinstance(n, str)})


def _legacy_digests(manifest: "Manifest") -> dict[str, str]:
    """The digests an older manifest records in `extra`: its weights file's and its reference vectors'."""
    entries = (manifest.extra.get(key) for key in ("weights", "reference_vectors"))
    return {e["file"]: e["sha256"] for e in entries if isinstance(e, dict) and safe_relative(e.get("file"))
            and "/" not in e["file"] and isinstance(e.get("sha256"), str)}


def _check_kind(folder: Path, name: str, allow_folder: bool = False, missing_ok: bool = False) -> os.stat_result | None:
    """The listed file's stat; refused: missing (None where `missing_ok`), or not a regular file (a folder too,
    unless `allow_folder`)."""
    path = folder / name
    try:
        info = os.stat(path)
    except (FileNotFoundError, NotADirectoryError):
        if missing_ok:
            return None
        raise EdgelinError(f"{path} is missing", "the export's manifest lists it", MISMATCH_FIX) from None
    except OSError as exc:
        raise EdgelinError(f"cannot read {path}", exc.strerror or str(exc),
                           "make the export folder readable (check its permissions)") from None
    if stat.S_ISREG(info.st_mode) or (allow_folder and stat.S_ISDIR(info.st_mode)):
        return info
    kind = next((what for test, what in _KINDS if test(info.st_mode)), "not a regular file")
    raise EdgelinError(f"{path} is not a regular file", f"it is {kind}; the export wrote a file there",
                       "put the exported file back: copy the folder again, or re-export")


def _identity(info: os.stat_result) -> tuple[int, ...]:
    return (info.st_dev, info.st_ino, info.st_size, info.st_mtime_ns, info.st_ctime_ns)


def _hash_file(path: Path, name: str, cache: "VerdictCache") -> str:
    """The file's sha256, read through a non-blocking open (a FIFO swapped in after the stat cannot hang it)."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
    except OSError as exc:
        raise EdgelinError(f"cannot read {path}", exc.strerror or str(exc),
                           "make the export folder readable (check its permissions)") from None
    with os.fdopen(fd, "rb") as fh:
        before = os.fstat(fd)
        if not stat.S_ISREG(before.st_mode):
            raise EdgelinError(f"{path} is not a regular file", "it changed while it was being opened",
                               "put the exported file back: copy the folder again, or re-export")
        try:
            digest = _sha256(fh)
        except OSError as exc:
            raise EdgelinError(f"cannot read {path}", exc.strerror or str(exc),
                               "check the disk the export folder is on") from None
        if _identity(os.fstat(fd)) == _identity(before):  # unchanged while read: a verdict worth keeping
            cache.put(name, before, digest)
    return digest


def _warn(settings: Checking, folder: Path, message: str) -> None:
    key = str(folder.resolve())
    if key in _WARNED:
        return
    _WARNED.add(key)
    if settings.warn is not None:
        settings.warn(message)
    else:
        warnings.warn(message, IntegrityWarning, stacklevel=3)


def cache_root() -> Path:
    """edgelin's per-user cache of verdicts: $XDG_CACHE_HOME/edgelin/verified (default ~/.cache)."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "edgelin" / "verified"


class VerdictCache:
    """One folder's verdicts: {relative path: [identity..., sha256]} in cache_root()/<hash of the folder's path>.json.
    Best effort: a cache that cannot be read, written or trusted (not the user's own, or writable by others) is
    simply not used; the files are then hashed every time."""

    def __init__(self, folder: Path):
        self.folder = str(Path(folder).resolve())
        self.path = cache_root() / (hashlib.sha256(self.folder.encode()).hexdigest()[:32] + ".json")
        self.entries: dict[str, list] = {}
        self.changed = False
        with contextlib.suppress(OSError, ValueError, TypeError, AttributeError):
            if _trusted(self.path.parent):
                data = json.loads(self.path.read_text())
                if data.get("format") == CACHE_FORMAT and data.get("folder") == self.folder:
                    self.entries = {k: v for k, v in data["files"].items() if isinstance(v, list) and len(v) == 6}

    def get(self, name: str, info: os.stat_result) -> str | None:
        key = _identity(info)
        if key in _DIGESTS:
            return _DIGESTS[key]
        entry = self.entries.get(name)
        if entry is not None and tuple(entry[:5]) == key and isinstance(entry[5], str):
            _DIGESTS[key] = entry[5]
            return entry[5]
        return None

    def put(self, name: str, info: os.stat_result, digest: str) -> None:
        _DIGESTS[_identity(info)] = digest
        self.entries[name] = [*_identity(info), digest]
        self.changed = True

    def save(self) -> None:
        if not self.changed:
            return
        with contextlib.suppress(OSError):
            folder = self.path.parent  # edgelin/verified/ and edgelin/: private where created here
            if not folder.parent.is_dir():
                folder.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
            if not folder.is_dir():
                folder.mkdir(mode=0o700, exist_ok=True)
            if not _trusted(folder):
                return
            handle, staged = tempfile.mkstemp(prefix=".verified-", suffix=".tmp", dir=folder)
            try:
                with os.fdopen(handle, "w") as fh:
                    json.dump({"format": CACHE_FORMAT, "folder": self.folder, "files": self.entries}, fh)
                os.replace(staged, self.path)
            except OSError:
                with contextlib.suppress(OSError):
                    os.unlink(staged)


def _trusted(folder: Path) -> bool:
    """The cache folder is the user's own and nobody else can write to it."""
    info = os.stat(folder)
    owner = getattr(os, "getuid", lambda: info.st_uid)()
    return stat.S_ISDIR(info.st_mode) and info.st_uid == owner and not info.st_mode & (stat.S_IWGRP | stat.S_IWOTH)
