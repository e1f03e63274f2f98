"""One error type for everything a user can get wrong: what happened, why, how to fix it."""

from __future__ import annotations

import errno
import signal


class EdgelinError(Exception):
    """A user-facing failure. The CLI prints it as one line and exits non-zero."""

    def __init__(self, what: str, why: str, fix: str, exit_code: int = 2):
        self.what, self.why, self.fix, self.exit_code = what, why, fix, exit_code
        super().__init__(self.line())

    def line(self) -> str:
        return f"{self.what}: {self.why}. Fix: {self.fix}"


class ValidationFailed(EdgelinError):
    """An exported artifact disagreed with the reference (exit code 1, like a failed test)."""

    def __init__(self, what: str, why: str, fix: str):
        super().__init__(what, why, fix, exit_code=1)


class Terminated(KeyboardInterrupt):
    """SIGTERM or SIGHUP, raised where Ctrl-C's KeyboardInterrupt would be: the same `with` blocks clean
    up (partial output folders, locks) on the way out, and the CLI exits with 128 + the signal number."""

    def __init__(self, signum: int):
        self.signum = signum
        super().__init__(signal.Signals(signum).name)


# errnos that mean the machine (disk, quota, permissions, limits) failed, never the code
ENVIRONMENT_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS, errno.EACCES, errno.EPERM,
                                errno.EIO, errno.EMFILE, errno.ENFILE, errno.ENAMETOOLONG})


def environment_fault(exc: BaseException) -> OSError | MemoryError | None:
    """The environment fault behind `exc` (itself or an exception in its cause/context chain): an OSError
    with one of ENVIRONMENT_ERRNOS, or a MemoryError; None when the failure is the code's own. Third-party
    tools (torch.onnx, ONNX Runtime's quantizer) may wrap the OSError of a full disk in their own error."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, MemoryError) or (isinstance(current, OSError)
                                                and current.errno in ENVIRONMENT_ERRNOS):
            return current
        current = current.__cause__ or current.__context__
    return None


def one_line(text: str, limit: int = 400) -> str:
    """`text` with its whitespace runs (newlines too) as single spaces, cut to `limit` characters: for
    a third-party message quoted in an EdgelinError, which is one line."""
    flat = " ".join(text.split())
    return flat if len(flat) <= limit else flat[:limit - 3] + "..."
