"""The per-user cache of edgelin's compiled operator library, and the checks made before anything in it is loaded.

A cached library is native code that ctypes / ONNX Runtime dlopen (its constructors run at load), so nothing in
the cache is loaded unverified:

- Where: `$XDG_CACHE_HOME/edgelin/ortops/<fingerprint>/` when XDG_CACHE_HOME is an absolute path (a relative one
  is ignored, as the XDG spec says), else `~/.cache/edgelin/ortops/<fingerprint>/`. HOME must already be a
  folder, and XDG_CACHE_HOME a folder or a missing one in an existing folder (created 0700, as the spec says):
  edgelin never creates a tree above it (an impossible HOME would otherwise grow one), and with no usable base
  nothing is built. The folders below it are created private (0700).
- Who: the folders edgelin creates under the base and every file in them must be owned by this user, not be
  symbolic links, and not be writable by group or others; anything else is refused, not repaired.
- What: the build writes `build.json` (the library's sha256 and size, the machine) atomically before it moves the
  library into place; a library is loaded only if its bytes match that record (a replaced, damaged or truncated
  file is refused before any dlopen, and never overwritten: the user removes the folder to rebuild).
- A failed build is recorded (`failed.json`) in the folder of its fingerprint (sources, flags, machine and the
  compiler binary's resolved path, size and mtime) and not retried until one of those changes (a timed-out one:
  or the timeout grows); the compiler runs under a timeout (EDGELIN_ORT_OPS_BUILD_TIMEOUT seconds) in its own
  process group, one build per folder at a time (flock on the folder), and a build first removes edgelin's own
  temporaries left by a killed one.

Runtime-side module: no torch, no onnx.
"""

from __future__ import annotations

import contextlib
import json
import os
import platform
import re
import signal
import stat
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Iterator

RECORD = "build.json"
FAILED = "failed.json"
TIMEOUT_ENV = "EDGELIN_ORT_OPS_BUILD_TIMEOUT"
DEFAULT_TIMEOUT_S = 300.0  # a full -O3 build takes ~10-20 s on a 2-core VM; a small ARM board several times that
STALE_AGE_S = 3600.0  # a temporary of edgelin's this old is left over, whatever its pid says
_TEMPORARY = re.compile(r"^\.(?P<name>[\w.]+)\.(?P<pid>\d+)\.\w+\.tmp$")  # staged(): .NAME.PID.RANDOM.tmp
FIX = "set EDGELIN_ORT_OPS=/path/to/libedgelin_ortops.so (or 0 to run ONNX Runtime's own kernels)"


class CacheError(RuntimeError):
    """The cache cannot be used, or what it holds is refused: one line that says why and what to do."""


class BuildFailed(RuntimeError):
    """The compiler failed or timed out (`timed_out`)."""

    def __init__(self, message: str, timed_out: bool = False):
        super().__init__(message)
        self.timed_out = timed_out


def build_timeout() -> float:
    """Seconds the compiler may run (EDGELIN_ORT_OPS_BUILD_TIMEOUT, default DEFAULT_TIMEOUT_S)."""
    setting = os.environ.get(TIMEOUT_ENV, "").strip()
    if not setting:
        return DEFAULT_TIMEOUT_S
    try:
        seconds = float(setting)
    except ValueError:
        seconds = float("nan")
    if not 0 < seconds < float("inf"):
        raise CacheError(f"{TIMEOUT_ENV}={setting[:40]!r} is not a positive number of seconds: unset it (default "
                         f"{DEFAULT_TIMEOUT_S:.0f}) or give one, e.g. {TIMEOUT_ENV}=600")
    return seconds


def base() -> Path:
    """The folder the cache goes under, per the rules in the module docstring: XDG_CACHE_HOME (already a folder)
    when it is an absolute path, else ~/.cache under a HOME that is already a folder."""
    xdg = os.environ.get("XDG_CACHE_HOME", "")
    if os.path.isabs(xdg):
        if not os.path.isdir(xdg) and os.path.isdir(os.path.dirname(os.path.normpath(xdg))):
            with contextlib.suppress(FileExistsError):  # XDG: create a missing base 0700, one level only
                os.mkdir(xdg, 0o700)
        if not os.path.isdir(xdg):
            raise CacheError(f"no cache folder for the kernels: XDG_CACHE_HOME={xdg} is not a folder and its parent "
                             f"is none either (edgelin creates one level only): create it, set XDG_CACHE_HOME to a "
                             f"folder of yours, or {FIX}")
        return Path(xdg)
    home = os.environ.get("HOME") or os.path.expanduser("~")
    if not os.path.isabs(home) or not os.path.isdir(home):
        raise CacheError(f"no cache folder for the kernels: HOME={home} is not a folder (edgelin does not create "
                         f"it): set XDG_CACHE_HOME to a folder of yours, or {FIX}")
    return Path(home) / ".cache"


def check_private(path: Path, folder: bool) -> None:
    """`path` is this user's own folder (or regular file), not a link, and writable only by its owner."""
    what = "folder" if folder else "file"
    try:
        info = os.lstat(path)
    except OSError as exc:
        raise CacheError(f"cannot read {path}: {exc.strerror}") from exc
    if stat.S_ISLNK(info.st_mode):
        problem = "is a symbolic link"
    elif not (stat.S_ISDIR(info.st_mode) if folder else stat.S_ISREG(info.st_mode)):
        problem = f"is not a {what}"
    elif info.st_uid != os.geteuid():
        problem = f"is owned by another user (uid {info.st_uid})"
    elif info.st_mode & 0o022:
        problem = f"is writable by group or others (mode {stat.S_IMODE(info.st_mode):o})"
    else:
        return
    raise CacheError(f"edgelin's kernel cache {what} {path} {problem}, so nothing in it is loaded: remove it (edgelin "
                     f"rebuilds its own, private) or {FIX}")


def folder(fingerprint: str) -> Path:
    """The cache folder of one build fingerprint: created private where missing (never the base), checked."""
    path = base()
    if not path.is_dir():  # ~/.cache under an existing HOME (XDG_CACHE_HOME is checked above): XDG's default
        with contextlib.suppress(FileExistsError):
            os.mkdir(path, 0o700)
    for part in ("edgelin", "ortops", fingerprint):
        path = path / part
        with contextlib.suppress(FileExistsError):
            os.mkdir(path, 0o700)
        check_private(path, folder=True)
    return path


def digest(path: Path) -> str:
    from edgelin.integrity import sha256_of  # torch-free, like this module

    return sha256_of(path)


# ELF e_machine values of the architectures edgelin builds for, by platform.machine()'s names
_ELF_MACHINES = {62: "x86_64", 183: "aarch64", 3: "i386", 40: "arm"}
_MACHINE_ALIASES = {"amd64": "x86_64", "x64": "x86_64", "arm64": "aarch64"}


def this_machine() -> str:
    name = platform.machine().lower()
    return _MACHINE_ALIASES.get(name, name)


def elf_machine(path: Path) -> str | None:
    """The architecture an ELF shared library is built for (platform.machine()'s names), from its header; None when
    it is no ELF file or an architecture not named here (nothing to compare)."""
    try:
        with open(path, "rb") as handle:
            header = handle.read(20)
    except OSError:
        return None
    if len(header) < 20 or header[:4] != b"\x7fELF":
        return None
    return _ELF_MACHINES.get(int.from_bytes(header[18:20], "little" if header[5] == 1 else "big"))


def wrong_architecture(path: Path) -> str | None:
    """The architecture `path` is built for when it is not this process's (a cross-compiler as CC, a cache or
    wheel copied from another machine), else None."""
    built_for = elf_machine(path)
    return built_for if built_for is not None and built_for != this_machine() else None


def check_record(path: Path, record_path: Path, what: str, maker: str, fix: str) -> tuple[dict, str]:
    """(the build record, the library's sha256) when `path` is the library `record_path` records (its machine, size
    and sha256); CacheError, naming `what` the library is and `fix`, when the record is unreadable or they differ.
    One check for the cache's builds and the wheel's (edgelin.ortops.packaged)."""
    try:
        record = json.loads(record_path.read_text())
        expected, size, machine = str(record["sha256"]), int(record["bytes"]), str(record["machine"])
    except (OSError, ValueError, TypeError, KeyError) as exc:
        raise CacheError(f"the build record {record_path} is unreadable ({type(exc).__name__}), so {path} was not "
                         f"loaded: {fix}") from exc
    if machine != platform.machine():
        raise CacheError(f"{what} was built for {machine[:20]}, this is {platform.machine()}, so it was not loaded: "
                         f"{fix}")
    built_for = wrong_architecture(path)
    if built_for is not None:  # its record says this machine, its code is another's
        raise CacheError(f"{what} is code for {built_for}, this is {this_machine()}, so it was not loaded: {fix}")
    actual_size = path.stat().st_size
    actual = digest(path) if actual_size == size else None
    if actual != expected:
        change = f"{actual_size} bytes, recorded {size}" if actual is None else "its sha256 differs"
        raise CacheError(f"{what} is not the one {maker} ({change}: damaged or replaced), so it was not loaded: {fix}")
    return record, actual


def verified(where: Path, library: str) -> tuple[Path, str] | None:
    """(the library, its sha256) when it is there and matches the record edgelin wrote when it built it; None when
    it is not there (a build is due); CacheError when it is there but not what edgelin built."""
    path = where / library
    if not os.path.lexists(path):
        return None
    check_private(path, folder=False)
    record_path = where / RECORD
    remove = f"remove the folder {where} (edgelin rebuilds it) or {FIX}"
    if not os.path.lexists(record_path):
        raise CacheError(f"the cached library {path} has no build record ({RECORD}) from edgelin, so it was not "
                         f"loaded: {remove}")
    check_private(record_path, folder=False)
    _, actual = check_record(path, record_path, f"the cached library {path}", "edgelin built", remove)
    return path, actual


def staged(where: Path, name: str) -> Path:
    """A new empty temporary for `name` in `where`, named .NAME.PID.RANDOM.tmp (clean_stale knows it by that)."""
    handle, path = tempfile.mkstemp(prefix=f".{name}.{os.getpid()}.", suffix=".tmp", dir=where)
    os.close(handle)
    return Path(path)


def write_atomically(where: Path, name: str, text: str) -> None:
    temporary = staged(where, name)
    try:
        temporary.write_text(text)
        os.chmod(temporary, 0o600)
        os.replace(temporary, where / name)
    finally:
        temporary.unlink(missing_ok=True)


def write_record(where: Path, library: Path, compiler: list[str]) -> str:
    """Record the staged `library`'s sha256 (before it is moved into place); returns it."""
    sha = digest(library)
    write_atomically(where, RECORD, json.dumps({"sha256": sha, "bytes": library.stat().st_size,
                                                "machine": platform.machine(), "compiler": compiler}))
    return sha


def recorded_failure(where: Path, timeout: float) -> str | None:
    """The reason of an earlier failed build of this fingerprint (not retried), or None. A timed-out build is
    retried once the timeout is longer than the one it ran under."""
    path = where / FAILED
    if not os.path.lexists(path):
        return None
    check_private(path, folder=False)
    try:
        failure = json.loads(path.read_text())
        reason, timed_out, under = str(failure["reason"]), bool(failure["timed_out"]), float(failure["timeout_s"])
    except (OSError, ValueError, TypeError, KeyError):
        return None  # unreadable: build again (and record again)
    if timed_out and timeout > under:
        return None
    return (f"{reason} (recorded in {path}: not retried until the sources or the compiler change"
            f"{f' or {TIMEOUT_ENV} exceeds {under:g}' if timed_out else ''}; remove that file to retry)")


def record_failure(where: Path, failure: BuildFailed, timeout: float) -> None:
    write_atomically(where, FAILED, json.dumps({"reason": str(failure), "timed_out": failure.timed_out,
                                                "timeout_s": timeout}))


def clean_stale(where: Path) -> None:
    """Remove edgelin's own temporaries (staged()'s names, this user's files) whose process is gone or that are
    older than STALE_AGE_S: what a killed build left."""
    for entry in os.scandir(where):
        match = _TEMPORARY.match(entry.name)
        if match is None:
            continue
        try:
            info = entry.stat(follow_symlinks=False)
            if not stat.S_ISREG(info.st_mode) or info.st_uid != os.geteuid():
                continue
            if _alive(int(match["pid"])) and time.time() - info.st_mtime < STALE_AGE_S:
                continue
            os.unlink(entry.path)
        except (OSError, ValueError):  # gone meanwhile, or not ours to remove: the build goes on
            continue


def _alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process now: ours (this user's file) is gone
        return False
    except OverflowError:
        return False
    return True


@contextlib.contextmanager
def locked(where: Path, wait: float) -> Iterator[None]:
    """One build per cache folder at a time: an exclusive flock on the folder (released when the process ends,
    however it ends), waited for up to `wait` seconds."""
    import fcntl  # POSIX: imported here so that importing edgelin.ortops (its DOMAIN) works everywhere

    handle = os.open(where, os.O_RDONLY)
    try:
        deadline = time.monotonic() + wait
        while True:
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise CacheError(f"another process has been building the kernels in {where} for over "
                                     f"{wait:g} s: wait for it, or {FIX}") from None
                time.sleep(0.2)
        yield
    finally:
        os.close(handle)


def run_compiler(command: list[str], timeout: float) -> None:
    """Run the compiler in its own process group; the whole group is killed when it runs past `timeout`."""
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               start_new_session=True)
    try:
        out, err = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.communicate()
        raise BuildFailed(f"{command[0]} ran past {timeout:g} s and was stopped (a longer limit: "
                          f"{TIMEOUT_ENV}=SECONDS)", timed_out=True) from None
    except BaseException:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait()
        raise
    if process.returncode != 0:
        message = " ".join((err or out).split())[:300]
        raise BuildFailed(f"{command[0]} failed (exit {process.returncode}): {message}")
