"""The one place that claims, writes and replaces output folders (`export`, `train`).

Rules, so a user's data is never lost:
- `--out` may not be, sit inside, or contain a protected path (the source checkpoint), and a folder that
  is replaced as a whole may not be or contain the current folder.
- An existing output needs `--force`, and `--force` only replaces what edgelin itself wrote: an export
  folder with our manifest.json and nothing else, or the files of a checkpoint edgelin trained. A folder
  replaced as a whole is checked again at the swap (files added while the run wrote are kept).
- One writer per output at a time: an flock on `.NAME.lock` beside it (the kernel drops it when the
  holder dies, so a killed run never leaves a lock that blocks the next one). A file at that name that is
  not such a lock (a symlink, a hard link, other content) is refused, never written through or removed.
- Parent folders a failed run created are removed again (when empty).
- Everything is written into `.NAME.edgelin-partial-PID` (`-tmp-` for checkpoints) and renamed into place
  once complete; leftovers of killed runs (their pid is gone) are removed by the next run. Ctrl-C, SIGTERM
  and SIGHUP wait for the final swap to finish or be undone (a signal half-way would leave it moved aside).
- Every OSError (read-only filesystem, permissions, disk full, a file where a folder should be)
  becomes one EdgelinError line naming the path, the OS reason and what to do.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import re
import shutil
import signal
import stat
import threading
from collections.abc import Callable, Collection, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from edgelin.errors import EdgelinError

# `.NAME.edgelin-partial-PID` and the like: the "edgelin-" tag keeps a user's own `.NAME.old-123` out of it
LEFTOVER = re.compile(r"\.(?P<name>.+)\.edgelin-(?:partial|tmp|old)-(?P<pid>\d+)")
CHECKPOINT_FILES = ("config.json", "model.safetensors", "tokenizer.json", "training_log.json")
TRAINING_LOG = "training_log.json"


@dataclass(frozen=True)
class OutputKind:
    label: str  # "export": used in "another export is writing ..."
    noun: str  # what --force may replace
    temp_tag: str  # .NAME.edgelin-<temp_tag>-PID
    whole_folder: bool  # True: the folder is swapped as a whole; False: files are written into it
    owned: Callable[[Path], tuple[frozenset[str], str]]  # (names edgelin wrote, why not ours if empty)
    reads: str = "the model"  # what the protected paths hold, for the refusal's line


def inside_path(name: Any) -> bool:
    """A '/'-separated path inside the export folder (a `files` entry, e.g. triton/NAME/config.pbtxt): not
    absolute (nor a Windows drive), no '..', '.' or empty part, no backslash or NUL."""
    return (isinstance(name, str) and bool(name) and not name.startswith("/") and not any(c in name for c in "\\:\0")
            and all(part not in ("", ".", "..") for part in name.split("/")))


def _owned_export(folder: Path) -> tuple[frozenset[str], str]:
    """An export folder is ours when its manifest.json says so; it lists the files the export wrote
    (`files`), or for older exports the manifest, the graphs and the tokenizer it names."""
    try:
        data = json.loads(read_regular(folder / "manifest.json"))
    except FileNotFoundError:
        return frozenset(), "it has no manifest.json"
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        return frozenset(), f"its manifest.json is unreadable ({type(exc).__name__})"
    if not isinstance(data, dict) or data.get("format") != "edgelin-export":
        return frozenset(), "its manifest.json is not an edgelin export manifest"
    files = data.get("files")
    if not (isinstance(files, list) and all(isinstance(n, str) for n in files)):
        graphs = data.get("graphs") if isinstance(data.get("graphs"), dict) else {}
        files = [g.get("file") for g in graphs.values() if isinstance(g, dict)] + [data.get("tokenizer")]
    names = {n for n in files if inside_path(n)} | {"manifest.json"}
    recorded = written_record(folder)
    names |= {n for n in recorded if _plain_name(n)} | ({RECORD} if recorded else set())
    return frozenset(names), ""


def _owned_checkpoint(folder: Path) -> tuple[frozenset[str], str]:
    """A checkpoint is ours when edgelin trained it: config.json of model_type "edgelin" plus
    training_log.json, which lists the files the run wrote (older logs: the four training writes)."""
    try:
        config = json.loads(read_regular(folder / "config.json"))
        log = json.loads(read_regular(folder / TRAINING_LOG))
    except FileNotFoundError as exc:
        return frozenset(), f"it has no {Path(exc.filename or '?').name}"
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        return frozenset(), f"its config.json or {TRAINING_LOG} is unreadable ({type(exc).__name__})"
    if not isinstance(config, dict) or config.get("model_type") != "edgelin" or not isinstance(log, dict):
        return frozenset(), "its config.json is not an edgelin checkpoint's"
    files = log.get("files")
    if not (isinstance(files, list) and all(isinstance(n, str) for n in files)):
        files = CHECKPOINT_FILES
    return frozenset(n for n in files if _plain_name(n)) | {"config.json", TRAINING_LOG}, ""


EXPORT = OutputKind("export", "an edgelin export", "partial", True, _owned_export)
CHECKPOINT = OutputKind("training run", "a checkpoint edgelin trained", "tmp", False, _owned_checkpoint)


def read_regular(path: Path) -> str:
    """The text of a regular file; anything else (a FIFO, whose read would block forever, a device) is an
    OSError, which the ownership checks report as unreadable."""
    if not stat.S_ISREG(path.stat().st_mode):  # FileNotFoundError when missing
        raise OSError(errno.EINVAL, "not a regular file", str(path))
    return path.read_text()


def _plain_name(name: str) -> bool:
    return Path(name).name == name and name not in ("", ".", "..")


def files_below(folder: Path) -> set[str]:
    """Every file below `folder` by its '/'-separated path relative to it (what an export's manifest lists, so that
    --force knows the folders it wrote too: triton/, model.mlpackage/)."""
    folder = Path(folder)
    return {(Path(root) / name).relative_to(folder).as_posix()
            for root, _, names in os.walk(folder) for name in names}


def _listed_tree(folder: Path, name: str, listed: frozenset[str]) -> bool:
    """Whether folder/name is a folder an export wrote whole: every file below it listed by its path (name/...),
    no link anywhere below it (nothing that points out of it), and every folder below it on the path of a listed
    file (an empty folder the user made inside it is not ours). Anything unreadable: not ours."""
    parents = {"/".join(path.split("/")[:i]) for path in listed for i in range(1, path.count("/") + 1)}
    unreadable: list[OSError] = []
    for root, dirs, files in os.walk(folder / name, onerror=unreadable.append):
        rel = Path(root).relative_to(folder).as_posix()
        if rel not in parents or any((Path(root) / d).is_symlink() for d in dirs):
            return False
        if any(f"{rel}/{f}" not in listed or (Path(root) / f).is_symlink() for f in files):
            return False
    return not unreadable


# Files a target or a later phase writes into an export after its manifest (a target's sub-folder of
# sources, a built library, engines) are listed in a record beside them, so --force still knows them.
RECORD = ".edgelin-files.json"


def written_record(folder: Path) -> frozenset[str]:
    """The paths (relative to folder, '/'-separated) that edgelin recorded writing into folder."""
    try:
        data = json.loads(read_regular(Path(folder) / RECORD))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return frozenset()
    files = data.get("files") if isinstance(data, dict) else None
    if not (isinstance(files, list) and all(isinstance(n, str) for n in files)):
        return frozenset()
    return frozenset(n for n in files if n and not n.startswith("/") and ".." not in n.split("/"))


def record_written(folder: Path, paths: Collection[str]) -> None:
    """Add `paths` (relative to folder) to its record, atomically."""
    folder = Path(folder)
    names = sorted(written_record(folder) | set(paths))
    staged = folder / f".{RECORD}.tmp-{os.getpid()}"
    try:
        staged.write_text(json.dumps({"format": "edgelin-files", "files": names}, indent=1) + "\n")
        os.replace(staged, folder / RECORD)
    except OSError as exc:
        staged.unlink(missing_ok=True)
        raise os_error(exc, folder) from None


def _all_recorded(folder: Path) -> bool:
    """Every file below folder is in its record (a target's sub-folder of an export)."""
    record = written_record(folder)
    if not record:
        return False
    for root, dirs, files in os.walk(folder):
        if any((Path(root) / d).is_symlink() for d in dirs):
            return False
        for name in files:
            rel = (Path(root) / name).relative_to(folder).as_posix()
            if rel != RECORD and (rel not in record or (Path(root) / name).is_symlink()):
                return False
    return True


# ---- checks ----------------------------------------------------------------------------------------
def resolve_output(out: Path) -> Path:
    """Absolute, symlinks resolved (so `ckpt/../ckpt` or a link to it is seen for what it is)."""
    try:
        target = Path(out).resolve()
    except (OSError, RuntimeError) as exc:  # a symlink loop
        raise EdgelinError(f"cannot use output {out}", str(exc), "pick another --out") from exc
    if target.name in ("", ".", "..") or target.parent == target:
        raise EdgelinError(f"cannot use output {out}", "it is the filesystem root", "pick a folder below it")
    return target


def _relation(target: Path, other: Path) -> str | None:
    if target == other:
        return "is"
    if other in target.parents:
        return "is inside"
    if target in other.parents:
        return "contains"
    return None


def check_output(out: Path, force: bool, kind: OutputKind, protected: Sequence[Path] = (),
                 writes: Collection[str] = ()) -> Path:
    """Refuse an output that would lose data; returns the resolved folder. No side effects.
    `writes`: for checkpoints, the names the run will write into an existing folder."""
    out = Path(out)
    try:
        return _check_output(out, force, kind, protected, writes)
    except OSError as exc:  # e.g. a parent folder we may not even look into
        raise os_error(exc, out) from exc


def _check_output(out: Path, force: bool, kind: OutputKind, protected: Sequence[Path],
                  writes: Collection[str]) -> Path:
    target = resolve_output(out)
    for path in protected:
        source = Path(path).resolve()
        relation = _relation(target, source)
        if relation:
            raise EdgelinError(f"--out {out} {relation} the source {source}",
                               f"writing there could destroy {kind.reads} being read",
                               f"pick an --out outside the folder of {kind.reads}")
    if kind.whole_folder:  # swapping the folder you stand in leaves the shell in a deleted folder
        try:
            relation = _relation(target, Path.cwd().resolve())
        except OSError:  # the current folder was deleted: nothing there to protect
            relation = None
        if relation in ("is", "contains"):
            raise EdgelinError(f"--out {out} {relation} the current folder",
                               "replacing it would delete the folder you are working in",
                               "pick another --out (e.g. a new subfolder)")
    _check_parents(out, target)
    if target.is_symlink() or (target.exists() and not target.is_dir()):
        raise EdgelinError(f"output {out} is a file", f"{kind.noun} is a folder", "pick another --out")
    if not target.exists():
        return target
    if not force:
        raise EdgelinError(f"output folder {out} already exists", "edgelin never overwrites a folder silently",
                           "pick another --out, or pass --force to replace it")
    _check_owned(out, target, kind, writes)
    return target


def _check_parents(out: Path, target: Path) -> None:
    for parent in target.parents:  # the nearest existing ancestor must be a folder
        if parent.exists() or parent.is_symlink():
            if not parent.is_dir():
                raise EdgelinError(f"cannot create {out}", f"{parent} is a file, not a folder",
                                   "pick an --out whose parent folders are folders")
            return


def _check_owned(out: Path, target: Path, kind: OutputKind, writes: Collection[str]) -> None:
    entries = sorted(os.listdir(target))
    # What the replacement would remove: a swapped folder loses everything in it; a checkpoint only
    # the files of the same names.
    at_risk = entries if kind.whole_folder else [n for n in entries if n in set(writes)]
    if not at_risk:
        return  # nothing of the user's is replaced (an empty folder, or only other files kept)
    owned, why_not = kind.owned(target)

    def ours(folder: Path, name: str, listed: frozenset[str]) -> bool:
        path = folder / name
        if path.is_symlink():
            return False
        if path.is_file():
            return name in listed
        # a folder: listed by its name (older exports) or by the paths of the files in it (triton/NAME/...)
        if not (kind.whole_folder and path.is_dir()) or not (name in listed or any(n.startswith(f"{name}/")
                                                                                   for n in listed)):
            return False
        if _listed_tree(folder, name, listed):  # every file in it listed by its path (triton/, model.mlpackage/)
            return True
        if _all_recorded(path):  # a target's sub-folder whose every file edgelin recorded writing (edgelin build)
            return True
        # a folder that is itself wholly an export edgelin wrote (export --baseline kv)
        inner = kind.owned(path)[0]
        return bool(inner) and all(ours(path, n, inner) for n in os.listdir(path))

    foreign = [n for n in at_risk if not ours(target, n, owned)]
    if foreign:
        shown = ", ".join(foreign[:6]) + (f" and {len(foreign) - 6} more" if len(foreign) > 6 else "")
        why = f"edgelin did not write {shown}" + (f" ({why_not})" if why_not else "")
        raise EdgelinError(f"--force will not replace {out}", why,
                           "pick another --out, or move those files away yourself")


# ---- errors ----------------------------------------------------------------------------------------
_FIXES = {
    errno.EROFS: "pick an --out on a writable filesystem",
    errno.EACCES: "pick an --out you may write to, or fix the folder's permissions",
    errno.EPERM: "pick an --out you may write to, or fix the folder's permissions",
    errno.ENOSPC: "free some disk space, or pick an --out on another disk",
    errno.EDQUOT: "free some space within your quota, or pick an --out on another disk",
    errno.ENOTDIR: "pick an --out whose parent folders are folders, not files",
    errno.ENAMETOOLONG: "pick a shorter --out",
}


def os_error(exc: OSError, out: Path) -> EdgelinError:
    """An environment fault while writing `out`, as one line: what, the OS reason, what to do."""
    where = f" ({exc.filename})" if exc.filename else ""
    reason = (exc.strerror or str(exc)) + where
    fix = _FIXES.get(exc.errno or 0, "check the output location (space, permissions) or pick another --out")
    return EdgelinError(f"cannot write {out}", reason, fix)


# ---- lock, leftovers, commit ----------------------------------------------------------------------
@contextlib.contextmanager
def _lock(out: Path, target: Path, kind: OutputKind) -> Iterator[None]:
    path = lock_path(target)
    while True:
        with contextlib.suppress(FileNotFoundError):  # what is there is looked at, not opened (a device node)
            if not stat.S_ISREG(os.lstat(path).st_mode):
                raise _foreign_lock(out, path, "it is not a regular file")
        try:  # O_NOFOLLOW: a symlink planted at the lock's name is refused, never written through
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)
        except OSError as exc:
            if exc.errno not in (errno.ELOOP, errno.EISDIR, errno.ENXIO):
                raise
            raise _foreign_lock(out, path, "it is a symbolic link" if exc.errno == errno.ELOOP
                                else "it is not a regular file") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            pid, _, label = os.read(fd, 64).decode(errors="replace").strip().partition(" ")
            os.close(fd)
            raise EdgelinError(f"another {label or kind.label} (pid {pid or '?'}) is writing {out} right now",
                               "two runs would replace each other's output",
                               "wait for it to finish, or pick another --out") from None
        why_foreign = _not_a_lock(fd)
        if why_foreign:  # a file of the user's that happens to have the lock's name: leave it as it is
            os.close(fd)
            raise _foreign_lock(out, path, why_foreign)
        try:  # the previous holder unlinks the file before unlocking: retry if we locked a dead inode
            same = os.fstat(fd).st_ino == os.stat(path).st_ino
        except FileNotFoundError:
            same = False
        if same:
            break
        os.close(fd)
    try:
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()} {kind.label}\n".encode())  # who holds it, for the refusal's line
        yield
    finally:
        with contextlib.suppress(OSError):
            os.unlink(path)
        os.close(fd)


def lock_path(target: Path) -> Path:
    return target.parent / f".{target.name}.lock"


def _not_a_lock(fd: int) -> str:
    """Why the open file is not a lock edgelin wrote ("" when it is one: empty, or a pid and a newline,
    a plain file with one link), so that it is never emptied or removed."""
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode):
        return "it is not a regular file"
    if info.st_nlink > 1:
        return "it has other hard links"
    if info.st_size > 64 or not re.fullmatch(rb"(\d+( [a-z ]+)?\n)?", os.pread(fd, 64, 0)):
        return "it holds something other than a process id"
    return ""


def _foreign_lock(out: Path, path: Path, why: str) -> EdgelinError:
    return EdgelinError(f"cannot lock {out}: {path} is in the way", f"{why}, so edgelin did not write it",
                        "move that file away, or pick another --out")


def lock_held(target: Path) -> bool:
    """Whether a live run holds target's lock (a file left by a killed run holds none)."""
    try:
        fd = os.open(lock_path(target), os.O_RDONLY | os.O_NOFOLLOW)
    except FileNotFoundError:
        return False
    except OSError as exc:
        if exc.errno == errno.ENAMETOOLONG:
            raise
        return True  # a symlink or an unreadable file at that name: treat the name as taken
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)  # closing drops a lock taken just now
    return False


def pid_alive(pid: int) -> bool:
    if pid <= 0:
        return False
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    except (OverflowError, OSError):
        return False
    return True


def clean_leftovers(target: Path) -> list[Path]:
    """Remove `.NAME.edgelin-{partial,tmp,old}-PID` folders of `target` whose process is gone
    (a killed run); only names of edgelin's own pattern, never anything else. Returns those removed."""
    removed = []
    with contextlib.suppress(OSError):
        for entry in os.scandir(target.parent):
            match = LEFTOVER.fullmatch(entry.name)
            if match and match["name"] == target.name and not pid_alive(int(match["pid"])):
                shutil.rmtree(entry.path, ignore_errors=True) if entry.is_dir(follow_symlinks=False) \
                    else os.unlink(entry.path)
                removed.append(Path(entry.path))
    return removed


def _commit(out: Path, tmp: Path, target: Path, kind: OutputKind) -> None:
    """Move the finished temp folder into place; an existing output is moved aside first and removed
    only once the new one is there (on failure it is put back)."""
    if not target.exists():
        tmp.rename(target)
        return
    if kind.whole_folder and (target.is_symlink() or not target.is_dir()):
        raise EdgelinError(f"output {out} changed while this {kind.label} ran", "it is not a folder any more",
                           "move that file away and run again")
    old = target.parent / f".{target.name}.edgelin-old-{os.getpid()}"
    shutil.rmtree(old, ignore_errors=True)  # ours: the edgelin- tag, this pid, under the lock
    if kind.whole_folder:
        target.rename(old)
        try:  # checked again once moved aside: files added to it while this run wrote are never deleted
            _check_owned(out, old, kind, ())
            tmp.rename(target)
        except EdgelinError as exc:
            old.rename(target)
            raise EdgelinError(f"{exc.what} (it changed while this {kind.label} ran)", exc.why, exc.fix) from None
        except OSError:
            old.rename(target)
            raise
    else:
        old.mkdir()
        names = sorted(p.name for p in tmp.iterdir())
        aside: list[str] = []
        placed: list[str] = []
        try:
            for name in names:
                if (target / name).exists() or (target / name).is_symlink():
                    (target / name).rename(old / name)
                    aside.append(name)
            for name in names:
                (tmp / name).rename(target / name)
                placed.append(name)
        except OSError:  # put the previous checkpoint back as it was
            for name in placed:
                with contextlib.suppress(OSError):
                    (target / name).rename(tmp / name)
            for name in aside:
                with contextlib.suppress(OSError):
                    (old / name).rename(target / name)
            with contextlib.suppress(OSError):
                old.rmdir()  # only when empty: whatever could not be put back stays there
            raise
    shutil.rmtree(old, ignore_errors=True)  # a leftover is cleaned by the next run


@contextlib.contextmanager
def claim_output(out: Path, force: bool, kind: OutputKind, protected: Sequence[Path] = (),
                 writes: Collection[str] = ()) -> Iterator[Path]:
    """Claim `out` for one run: check it (see check_output), lock it, clean leftovers of killed runs,
    yield an empty temp folder to write into, and on success move it into place atomically. On any
    failure the temp folder is removed and `out` is as it was."""
    out = Path(out)
    target = check_output(out, force, kind, protected, writes)
    created = [p for p in reversed(target.parents) if not p.exists() and not p.is_symlink()]
    with contextlib.ExitStack() as stack:
        # runs last: parent folders this run created go again if it failed (not empty: kept)
        stack.callback(_remove_empty, created[::-1])
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
            stack.enter_context(_lock(out, target, kind))
        except OSError as exc:
            raise os_error(exc, out) from exc
        check_output(out, force, kind, protected, writes)  # again, under the lock: it may have appeared
        clean_leftovers(target)
        tmp = target.parent / f".{target.name}.edgelin-{kind.temp_tag}-{os.getpid()}"
        stack.callback(shutil.rmtree, tmp, ignore_errors=True)
        try:
            shutil.rmtree(tmp, ignore_errors=True)  # ours (this pid, under the lock)
            tmp.mkdir()
            yield tmp
            with _signals_deferred():  # the swap is done or undone whole, never left half-way
                if not kind.whole_folder:  # the names are known now: check nothing foreign is replaced
                    check_output(out, force, kind, protected, [p.name for p in tmp.iterdir()])
                _commit(out, tmp, target, kind)
        except OSError as exc:
            raise os_error(exc, out) from exc


_DEFERRED = tuple(getattr(signal, name) for name in ("SIGINT", "SIGTERM", "SIGHUP") if hasattr(signal, name))


@contextlib.contextmanager
def _signals_deferred() -> Iterator[None]:
    """Ctrl-C, SIGTERM and SIGHUP arriving inside the block are delivered when it ends. Python-level
    handlers, not a signal mask: ONNX Runtime's and torch's threads would take a masked signal instead,
    and the main thread would still run its handler mid-block. Outside the main thread: nothing to do."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    caught: list[int] = []
    saved = {sig: signal.getsignal(sig) for sig in _DEFERRED}
    for sig, handler in saved.items():
        if handler not in (signal.SIG_IGN, None):  # an ignored signal stays ignored
            signal.signal(sig, lambda signum, frame: caught.append(signum))
    try:
        yield
    finally:
        for sig, handler in saved.items():
            if handler not in (signal.SIG_IGN, None):
                signal.signal(sig, handler)
        for sig in dict.fromkeys(caught):  # now, in order: the handler raises (KeyboardInterrupt) or kills
            handler = saved[sig]
            if callable(handler):
                handler(sig, None)
            else:
                os.kill(os.getpid(), sig)


def _remove_empty(folders: list[Path]) -> None:
    for folder in folders:  # deepest first
        with contextlib.suppress(OSError):
            folder.rmdir()


def fresh_folder(root: Path, name: str) -> Path:
    """root/name, or root/name-2, -3, ... : the first that neither exists nor is being written."""
    for i in range(1, 10_000):
        candidate = root / (name if i == 1 else f"{name}-{i}")
        if not candidate.exists() and not lock_held(candidate):
            return candidate
    raise EdgelinError(f"no free folder name under {root}", f"{name}, {name}-2 ... are all taken",
                       "pass --out, or clean up old runs")
