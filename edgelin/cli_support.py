"""The command line's machinery: the typer app, one-line usage errors, option checks, and the `command`
decorator that turns EdgelinErrors and environment faults into one line and an exit code. The commands
themselves are in edgelin.cli."""

from __future__ import annotations

import contextlib
import errno
import functools
import math
import os
import signal
import sys
from typing import Any, Callable, Iterator, Optional

import typer
from typer.core import TyperCommand, TyperGroup

from edgelin.errors import EdgelinError, Terminated
from edgelin.integrity import checking
from edgelin.output import Output

try:  # typer >= 0.20 vendors click
    from typer._click.exceptions import NoArgsIsHelpError, UsageError
except ImportError:  # pragma: no cover - older typer on the real click
    from click.exceptions import NoArgsIsHelpError, UsageError

_debug = {"on": bool(os.environ.get("EDGELIN_DEBUG"))}


class _Clean:
    """Help and usage errors for people: flags render as flags, and a usage error is one line."""

    def get_params(self, ctx: Any) -> list:
        params = super().get_params(ctx)  # type: ignore[misc]
        for param in params:  # typer 0.29's rich help prints every flag (--force, --help) as "<bool>"
            if getattr(param, "is_flag", False) and param.metavar is None:
                param.metavar = ""
        return params

    def make_context(self, info_name: Optional[str], args: list[str], *rest: Any, **kwargs: Any) -> Any:
        with _one_line_usage_errors(list(args)):  # a copy: parsing consumes the list
            return super().make_context(info_name, args, *rest, **kwargs)  # type: ignore[misc]


class EdgelinCommand(_Clean, TyperCommand):
    pass


class EdgelinGroup(_Clean, TyperGroup):
    def invoke(self, ctx: Any) -> Any:  # "Missing command", "No such command", a command's own parse errors
        with _one_line_usage_errors([*getattr(ctx, "_protected_args", ()), *ctx.args]):
            return super().invoke(ctx)


def _wants_json(args: list[str]) -> bool:
    """Whether the command line asks for --json (before a `--`, after which everything is an argument)."""
    return "--json" in args[:args.index("--")] if "--" in args else "--json" in args


@contextlib.contextmanager
def _one_line_usage_errors(args: list[str]) -> Iterator[None]:
    """typer's usage error is a multi-line box; edgelin's errors are one line: `error: WHAT: WHY. Fix: FIX`,
    or with --json among `args` (the arguments being parsed) the `{"error": ...}` object a command prints."""
    try:
        yield
    except NoArgsIsHelpError:  # bare `edgelin` prints the help, as intended
        raise
    except UsageError as exc:
        where = exc.ctx.command_path if exc.ctx is not None else "edgelin"
        message = exc.format_message().strip().rstrip(".").replace("Value error, ", "")  # typer 0.29's wording
        Output(as_json=_wants_json(args)).error(f"{message}. Fix: see `{where} --help`")
        raise typer.Exit(exc.exit_code) from None


app = typer.Typer(cls=EdgelinGroup, no_args_is_help=True, add_completion=False, pretty_exceptions_enable=False,
                  help="Ship trained linear-attention models to edge devices.")
JSON = typer.Option(False, "--json", help="Print machine-readable JSON instead of tables.")
NO_VERIFY = typer.Option(False, "--no-verify", help="Skip checking the export's files against the sha256 digests its "
                                                    "manifest records (checked by default; verdicts are cached).")


# ---- parse-time range checks: a bad number is a one-line usage error (exit 2) before any work ----
def _finite(above: float, at_most: float | None = None) -> Callable[[Optional[float]], Optional[float]]:
    """A callback accepting finite values in (above, at_most]: typer's min= is a closed bound and lets inf through."""
    bound = f"> {above:g}" + (f" and <= {at_most:g}" if at_most is not None else "")

    def check(value: Optional[float]) -> Optional[float]:
        if value is not None and not (math.isfinite(value) and value > above
                                      and (at_most is None or value <= at_most)):
            raise typer.BadParameter(f"{value:g} is out of range: it must be finite and {bound}")
        return value

    return check


POSITIVE = _finite(0.0)


# ---- environment faults: the user's machine, not a bug in edgelin ----------------------------------
_OS_FAULTS: dict[int, tuple[str, str]] = {
    errno.EACCES: ("permission denied", "check the path's permissions, or use a location you own"),
    errno.EPERM: ("operation not permitted", "check the path's permissions, or use a location you own"),
    errno.EROFS: ("the file system is read-only", "write to a folder on a writable file system"),
    errno.ENOSPC: ("no space left on the device", "free disk space, or write to another disk"),
    errno.EDQUOT: ("the disk quota is exhausted", "free disk space, or write to another disk"),
    errno.ENOTDIR: ("a part of the path is a file, not a folder", "pick a path whose parents are folders"),
    errno.EISDIR: ("it is a folder where a file was expected", "pass a file, or pick another path"),
    errno.ENOENT: ("no such file or folder", "check the path"),
    errno.EEXIST: ("it already exists", "pick another path"),
    errno.EMFILE: ("too many open files", "raise the open-file limit (ulimit -n) and re-run"),
    errno.ENFILE: ("too many open files in the system", "close other programs and re-run"),
    errno.ENAMETOOLONG: ("the path is too long", "use a shorter path"),
    errno.EIO: ("input/output error", "check the disk (it may be failing or disconnected)"),
}


def _address_space_limit() -> str | None:
    """The process's address-space limit as `ulimit -v` shows it (KiB), or None when unlimited."""
    try:
        import resource  # POSIX only
    except ImportError:  # pragma: no cover - Windows
        return None
    soft, _ = resource.getrlimit(resource.RLIMIT_AS)
    return None if soft == resource.RLIM_INFINITY else f"{soft // 1024}"


def _lack_of_memory(what: str) -> tuple[str, str]:
    """Why and fix for memory `what` could not get: the address-space limit if one is set, else the machine."""
    limit = _address_space_limit()
    if limit is not None:
        return (f"{what} needs more memory than the address-space limit allows (`ulimit -v` is {limit} KiB)",
                "raise the limit (`ulimit -v unlimited`, or a larger value) and re-run")
    return f"the machine has not enough free memory for {what}", "close other programs and re-run"


# The dynamic loader's words when mapping a library fails for lack of memory (glibc's dl-load.c, dl-map-segments.h).
# "cannot allocate memory in static TLS block" is the loader's TLS space, not the machine's memory: not one of them.
_MAP_FAILURES = ("failed to map segment", "cannot map zero-fill pages", "cannot allocate memory",
                 "cannot create shared object descriptor", "out of memory")


def library_load_fault(exc: BaseException) -> EdgelinError | None:
    """One line for a library that could not be loaded for lack of memory (torch or ONNX Runtime under a low
    `ulimit -v`): an ImportError, or ctypes' errno-less OSError, with the loader's words for it, itself or in
    `exc`'s cause/context chain. None for any other failure."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        loader = isinstance(current, ImportError) or (isinstance(current, OSError) and current.errno is None)
        message = str(current.args[0]) if current.args else ""
        lowered = message.lower()
        if loader and "static tls" not in lowered and any(words in lowered for words in _MAP_FAILURES):
            # The loader names the file it failed on first: "/path/libtorch_cpu.so: failed to map segment ..."
            named = message.split(": ")[0]
            library = os.path.basename(named) if ".so" in named or named.endswith((".dylib", ".dll")) \
                else getattr(current, "name", None) or "a shared library"
            return EdgelinError(f"cannot load {library}", *_lack_of_memory("mapping it"))
        current = current.__cause__ or current.__context__
    return None


def environment_error(exc: BaseException) -> EdgelinError:
    """An OSError or MemoryError as one actionable line (exit 2): the machine, not edgelin, failed."""
    if isinstance(exc, MemoryError):
        if _address_space_limit() is not None:  # the limit, not the machine, is what to change
            return EdgelinError("out of memory", *_lack_of_memory("this command"))
        return EdgelinError("out of memory", "the machine could not allocate what this command needs",
                            "close other programs, or use smaller sizes (--batch, --positions, --steps, -n)")
    assert isinstance(exc, OSError)
    loading = library_load_fault(exc)  # ctypes' OSError for a library it could not map
    if loading is not None:
        return loading
    paths = " -> ".join(str(p) for p in (exc.filename, exc.filename2) if p is not None)
    if exc.errno == errno.ENOMEM:  # mmap, fork: the fix is memory or its limit, not the path
        return EdgelinError(f"cannot use {paths}" if paths else "out of memory", *_lack_of_memory("this command"))
    why, fix = _OS_FAULTS.get(exc.errno or -1, (exc.strerror or str(exc) or type(exc).__name__,
                                                "check the path and the file system, then re-run"))
    return EdgelinError(f"cannot use {paths}" if paths else "a file operation failed", why, fix)


# ---- signals: `kill`, `timeout`, a closed terminal end a run the way Ctrl-C does ---------------------
_TERMINATING = tuple(getattr(signal, name) for name in ("SIGTERM", "SIGHUP") if hasattr(signal, name))


_terminating: list[int] = []


def _terminate(signum: int, frame: Any) -> None:
    # Once: a second signal must not cut short the cleanup (partial folder, lock) the first one started.
    # A flag, not SIG_IGN: switching to SIG_IGN while the other signal is pending makes Python print
    # "Signal 15 ignored due to race condition" with a traceback (SIGHUP then SIGTERM: a closed terminal).
    if _terminating:
        return
    _terminating.append(signum)
    raise Terminated(signum)


def handle_termination() -> None:
    """SIGTERM and SIGHUP raise Terminated (a KeyboardInterrupt) like Ctrl-C's SIGINT, so that output
    claims are rolled back and the command exits with 128 + the signal's number. Call from the main
    thread (the entry point). A signal already ignored (`nohup` ignores SIGHUP) stays ignored."""
    _terminating.clear()
    for sig in _TERMINATING:
        if signal.getsignal(sig) is signal.SIG_DFL:
            signal.signal(sig, _terminate)


def _lenient_streams() -> None:
    """stdout and stderr print what they cannot encode as escapes (`\\xe9`, `\\u2603`): on an ASCII or Latin-1
    stream (PYTHONIOENCODING=ascii, a C locale without UTF-8) generated text and paths must not end a command."""
    for stream in (sys.stdout, sys.stderr):
        reconfigure = getattr(stream, "reconfigure", None)  # a TextIOWrapper; None when detached or replaced
        if reconfigure is not None:
            reconfigure(errors="backslashreplace")


def _check_working_folder() -> None:
    """A working folder deleted under the shell leaves every relative path meaningless, and torch's oneMKL
    aborts loading without a word of why: refused here, before a command imports torch."""
    try:
        os.getcwd()
    except FileNotFoundError:
        Output(as_json=_wants_json(sys.argv[1:])).error(
            "the current folder no longer exists: it was deleted after this shell entered it. "
            "Fix: cd to an existing folder and re-run")
        raise SystemExit(2) from None


def prepare_process() -> None:
    """What the entry point sets up before the command runs: an existing working folder, streams that
    print any text, and SIGTERM/SIGHUP handled like Ctrl-C."""
    _lenient_streams()
    _check_working_folder()
    handle_termination()


def argv_text(value: str, option: str) -> str:
    """Text from the command line as the UTF-8 the user typed. Python decodes argv with the locale's encoding,
    holding undecodable bytes as surrogates: such bytes are re-read as UTF-8 (an ASCII locale, a UTF-8
    terminal), and text that is not UTF-8 at all (a Latin-1 terminal, `$'\\xff'`) is refused by name."""
    if not any("\ud800" <= char <= "\udfff" for char in value):
        return value
    fix = "pass UTF-8 text (convert it with `iconv -t UTF-8`, or set the terminal to UTF-8)"
    try:
        raw = os.fsencode(value)
    except UnicodeEncodeError:  # a surrogate no decoding made: not bytes from a command line
        raise EdgelinError(f"{option} is not valid text", "it holds a lone UTF-16 surrogate", fix) from None
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise EdgelinError(f"{option} is not valid UTF-8", f"byte 0x{raw[exc.start]:02x} (byte {exc.start + 1} of "
                           f"{len(raw)}) is not part of a UTF-8 character (the terminal or the script sent another "
                           "encoding)", fix) from None


# Libraries an install may lack by design (`edgelin[runtime]` has none of them), each with how to get it: the
# core's own, and those each target declares (Target.libraries).
CORE_OPTIONAL_MODULES = {
    "transformers": "pip install 'edgelin[onnx]'",
    "triton": "pip install 'edgelin[onnx]' on a machine with an NVIDIA GPU",
    "matplotlib": "pip install matplotlib",
}


def optional_modules() -> dict[str, str]:
    from edgelin.export.targets import get_target, target_names

    declared = {module: how for name in target_names() for module, how in get_target(name).libraries}
    return {**declared, **CORE_OPTIONAL_MODULES}


def missing_library(module: str, command_name: str) -> EdgelinError:
    top = module.split(".")[0]
    return EdgelinError(f"`edgelin {command_name.replace('_', '-')}` needs {top} here",
                        "this install does not have it (a runtime-only install, edgelin[runtime], runs validate, "
                        "bench, generate and build on export folders)", optional_modules()[top])


def command(fn: Callable | None = None, *, cls: type = EdgelinCommand) -> Callable:
    """Register a command whose EdgelinErrors become one line on stderr and a non-zero exit (`cls`: its click
    command class)."""
    if fn is None:
        return functools.partial(command, cls=cls)

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        out = Output(kwargs.get("as_json", False))
        try:
            # an export folder opened by the command is verified (edgelin.integrity) unless it passed --no-verify
            with checking(verify=not kwargs.get("no_verify", False), warn=out.warning):
                return fn(out, *args, **kwargs)
        except EdgelinError as exc:
            if _debug["on"]:
                raise
            out.error(exc.line())
            raise typer.Exit(exc.exit_code)
        except Terminated as exc:  # SIGTERM/SIGHUP: the `with` blocks above cleaned up on the way here
            out.error(f"terminated ({signal.Signals(exc.signum).name})")
            raise typer.Exit(128 + exc.signum)
        except KeyboardInterrupt:
            out.error("interrupted")
            raise typer.Exit(130)
        except BrokenPipeError:  # `edgelin ... | head`: the reader left; nothing to report
            raise typer.Exit(0)
        except (typer.Exit, typer.Abort):
            raise
        except ModuleNotFoundError as exc:  # an optional library this install lacks (a runtime-only one)
            if _debug["on"] or (exc.name or "").split(".")[0] not in optional_modules():
                raise
            error = missing_library(exc.name or "", fn.__name__)
            out.error(error.line())
            raise typer.Exit(error.exit_code)
        except (OSError, MemoryError) as exc:  # the safety net: the library names the common ones itself
            if _debug["on"]:
                raise
            error = environment_error(exc)
            out.error(error.line())
            raise typer.Exit(error.exit_code)
        except Exception as exc:  # a bug in edgelin: still one line unless --debug
            if _debug["on"]:
                raise
            loading = library_load_fault(exc)  # torch/ONNX Runtime could not map their libraries: the machine's limit
            if loading is not None:
                out.error(loading.line())
                raise typer.Exit(loading.exit_code)
            out.error(f"internal error: {type(exc).__name__}: {exc}. Fix: re-run with --debug and report it")
            raise typer.Exit(3)

    import inspect

    sig = inspect.signature(fn)
    wrapper.__signature__ = sig.replace(parameters=list(sig.parameters.values())[1:])
    return app.command(cls=cls)(wrapper)
