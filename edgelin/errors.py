"""One error type for everything a user can get wrong: what happened, why, how to fix it."""

from __future__ import annotations


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
