"""Reading the results files a report is made of, without trusting them: each must be a regular file
(a FIFO would block forever, /dev/urandom never ends) no larger than MAX_FILE_BYTES, the files together
no larger than MAX_TOTAL_BYTES; all are checked by stat before any is read. The text is UTF-8 (a UTF-8
byte-order mark is allowed) or UTF-16/UTF-32 with a byte-order mark, decoded by that mark."""

from __future__ import annotations

import codecs
import os
import stat
from pathlib import Path

from edgelin.errors import EdgelinError

MAX_FILE_BYTES = 64 << 20  # results are a few KiB (bench) to a few MiB (validate's per-step errors)
MAX_TOTAL_BYTES = 256 << 20
_CHUNK = 1 << 20  # read in chunks: a signal (Ctrl-C, SIGTERM) is handled between two
_FIX = "pass the JSON files that `edgelin bench --json` or `edgelin validate --json` wrote"
# Longest first: UTF-32-LE's mark starts with UTF-16-LE's.
_BOMS = ((codecs.BOM_UTF32_LE, "utf-32", "UTF-32"), (codecs.BOM_UTF32_BE, "utf-32", "UTF-32"),
         (codecs.BOM_UTF8, "utf-8-sig", "UTF-8"), (codecs.BOM_UTF16_LE, "utf-16", "UTF-16"),
         (codecs.BOM_UTF16_BE, "utf-16", "UTF-16"))
_TYPES = ((stat.S_ISFIFO, "a FIFO (named pipe)"), (stat.S_ISCHR, "a character device"),
          (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"))


def _size(n: int) -> str:
    return f"{n:,} bytes" + (f" ({n / (1 << 20):,.1f} MiB)" if n >= 1 << 20 else "")


def _limit(n: int) -> str:
    return f"{n >> 20} MiB"


def _checked(path: Path, info: os.stat_result) -> int:
    """The size of a regular file within the limit; an EdgelinError for anything else."""
    if stat.S_ISDIR(info.st_mode):
        raise EdgelinError(f"results file {path} is a folder", "a result is one JSON file", _FIX)
    if not stat.S_ISREG(info.st_mode):
        kind = next((name for test, name in _TYPES if test(info.st_mode)), "not a regular file")
        raise EdgelinError(f"results file {path} is {kind}", "edgelin report reads regular files only (a pipe or "
                           "a device may block or never end)",
                           "save the result to a file first (`edgelin bench ... --json > result.json`)")
    if info.st_size > MAX_FILE_BYTES:
        raise EdgelinError(f"results file {path} is too large", f"it holds {_size(info.st_size)}, more than the "
                           f"{_limit(MAX_FILE_BYTES)} a result may hold", _FIX)
    return info.st_size


def check_files(paths: list[Path]) -> None:
    """Every path a regular file within the limits (stat only, nothing read)."""
    total = 0
    for path in paths:
        try:
            info = os.stat(path)
        except (FileNotFoundError, NotADirectoryError):
            raise EdgelinError(f"results file {path} does not exist", "edgelin report reads the files it is given",
                               "check the path") from None
        total += _checked(path, info)
    if total > MAX_TOTAL_BYTES:
        raise EdgelinError(f"the {len(paths)} results files are too large together", f"they hold {_size(total)}, "
                           f"more than the {_limit(MAX_TOTAL_BYTES)} one report reads", "pass fewer files")


def read_text(path: Path) -> str:
    """The file's text, read within MAX_FILE_BYTES whatever it turned into since check_files (O_NONBLOCK:
    a FIFO swapped in opens without waiting for a writer, and fstat then refuses it)."""
    flags = os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOCTTY", 0) | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(path, flags)
    except (FileNotFoundError, NotADirectoryError):
        raise EdgelinError(f"results file {path} does not exist", "edgelin report reads the files it is given",
                           "check the path") from None
    try:
        _checked(path, os.fstat(fd))
        chunks: list[bytes] = []
        total = 0
        while chunk := os.read(fd, _CHUNK):  # /proc files say size 0: the limit holds on what is read
            total += len(chunk)
            if total > MAX_FILE_BYTES:
                raise EdgelinError(f"results file {path} is too large", f"it holds more than the "
                                   f"{_limit(MAX_FILE_BYTES)} a result may hold (it grew while read)", _FIX)
            chunks.append(chunk)
    finally:
        os.close(fd)
    return decode(b"".join(chunks), path)


def decode(raw: bytes, path: Path) -> str:
    """UTF-8, or the encoding its byte-order mark names; one line refusing anything else."""
    encoding, name = next(((enc, name) for bom, enc, name in _BOMS if raw.startswith(bom)), ("utf-8", ""))
    try:
        text = raw.decode(encoding)
    except UnicodeDecodeError:
        why = (f"it starts with a {name} byte-order mark but is not valid {name} text" if name else
               "it is not UTF-8 text (UTF-16 and UTF-32 are read with a byte-order mark only): a binary file?")
        raise EdgelinError(f"{path} is not an edgelin result", why, _FIX) from None
    if "\0" in text:  # never in JSON text; typical of UTF-16/32 without a mark
        raise EdgelinError(f"{path} is not an edgelin result", "it holds NUL characters (UTF-16 or UTF-32 without "
                           "a byte-order mark, or a binary file?)", "save it as UTF-8 and " + _FIX)
    return text
