"""Reading results files (`edgelin bench --json`, `edgelin validate --json`) for a report: each is checked,
every field the report reads by JSON type and range (one EdgelinError line naming the file and the field
when it is not edgelin's, truncated or malformed; inputs.py reads the bytes within limits), grouped by the
artifact it measured, and labelled by what differs between the results plotted together (threads,
device, target, ...)."""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from edgelin.environment import RESULT_FORMAT, RESULT_VERSION
from edgelin.errors import EdgelinError
from edgelin.report.inputs import read_text

KINDS = ("bench", "validate")
FIX = "pass the JSON files that `edgelin bench --json` or `edgelin validate --json` wrote (this edgelin version)"
# What may tell results apart, in the order a label names them: (environment key, how a label says it).
DIFFERENCES = (("device", "device"), ("gpu", "GPU"), ("cpu", "CPU"), ("machine", "machine"), ("os", "OS"),
               ("python", "Python"), ("runtime", "runtime"), ("runtime_version", "runtime"), ("runner", "runner"),
               ("target", "target"), ("precision", "precision"), ("quantization", "weights"),
               ("threads", "threads"), ("batch", "batch"), ("edgelin_version", "edgelin"))
# The environment's text fields (each text or null); threads and artifact are checked on their own.
TEXTS = ("command", "device", "cpu", "gpu", "os", "machine", "python", "runtime", "runtime_version", "runner",
         "target", "precision", "quantization", "edgelin_version")
MAX_TEXT = 16_384  # characters of one text field (a CPU model; a command line can be long)
MAX_NUMBER = 1e15  # beyond any byte count, position, token rate or millisecond figure a run measures
MAX_INT_DIGITS = 40  # integer literals longer than this are refused (a float holds up to ~1e308)
MAX_ROWS = 100_000  # positions or metrics of one result
MAX_POINTS = 1 << 16  # per-step errors of one output (validate records at most 1,024)
_SURROGATE = re.compile("[\ud800-\udfff]")  # a lone one, from a "\ud800" escape in the JSON


@dataclass(frozen=True)
class Result:
    path: Path
    kind: str  # "bench" or "validate"
    environment: dict[str, Any]
    data: dict[str, Any]
    name: str = ""  # how the report names the file: see file_names (default: the file's name)

    @property
    def shown(self) -> str:
        return self.name or self.path.name

    @property
    def artifact(self) -> str:
        return str(self.environment["artifact"])

    def fact(self, key: str) -> Any:
        """An environment fact; `batch` comes from the result (bench measures at one batch size)."""
        if key == "batch":
            return self.data.get("batch") if self.kind == "bench" else self.data.get("batches")
        return self.environment.get(key)


@dataclass(frozen=True)
class Group:
    """The results of one artifact (export folder content), each with its series label."""

    artifact: str
    results: tuple[Result, ...]
    labels: tuple[str, ...]  # "" when the group holds one result of its kind

    def of(self, kind: str) -> list[tuple[Result, str]]:
        return [(r, label) for r, label in zip(self.results, self.labels) if r.kind == kind]


def load_result(path: Path) -> Result:
    """One results file, checked field by field (inputs.check_files has checked its type and size)."""
    path = Path(path)
    text = read_text(path)
    try:
        data = json.loads(text, parse_int=_parse_int)
    except RecursionError:  # json's parser recurses once per nesting level
        raise EdgelinError(f"{path} is not a readable result", "its JSON is nested too deeply to parse", FIX) from None
    except json.JSONDecodeError as exc:
        looks = text.lstrip()[:1] in ("{", "[")
        why = (f"it is truncated or corrupt JSON ({exc.msg} at line {exc.lineno}, column {exc.colno})" if looks
               else "it is not JSON")
        raise EdgelinError(f"{path} is not a readable result", why, FIX) from None
    env = data.get("environment") if isinstance(data, dict) else None
    if not isinstance(env, dict) or env.get("format") != RESULT_FORMAT:
        raise EdgelinError(f"{path} is not an edgelin result", f"it has no environment block of format "
                           f"{RESULT_FORMAT!r} (bench --json and validate --json write one since format version 1)",
                           FIX)
    version = env.get("format_version")
    if type(version) is int and version > RESULT_VERSION:  # type(): a bool is an int to isinstance
        raise EdgelinError(f"{path} has result format version {version}",
                           f"this edgelin reads versions 1 to {RESULT_VERSION}", "upgrade edgelin, or re-run "
                           "bench/validate with this version")
    if type(version) is not int or version < 1:
        versions = "1" if RESULT_VERSION == 1 else f"a whole number from 1 to {RESULT_VERSION}"
        raise EdgelinError(f"results file {path} is malformed", f"environment.format_version is {_brief(version)}, "
                           f"expected {versions}", FIX)
    try:
        _check(env, data)
    except (KeyError, TypeError, ValueError) as exc:
        why = f"{exc.args[0]} is missing" if isinstance(exc, KeyError) else str(exc)
        raise EdgelinError(f"results file {path} is malformed", why, FIX) from None
    return Result(path, env["kind"], env, data)


class _BigInt:
    """An integer literal beyond MAX_INT_DIGITS digits, kept as its text: no float holds it and Python's
    int-from-text limit (4,300 digits) would stop the parse without saying where; the field check names it."""

    def __init__(self, digits: str):
        self.digits = digits


def _parse_int(text: str) -> int | _BigInt:
    return int(text) if len(text.lstrip("-")) <= MAX_INT_DIGITS else _BigInt(text)


def _brief(value: Any, limit: int = 60) -> str:
    """A value from the file as short JSON: the error line names it, never dumps a whole entry."""
    if isinstance(value, _BigInt):
        return f"an integer of {len(value.digits.lstrip('-')):,} digits"
    text = json.dumps(value, default=lambda v: f"<integer of {len(v.digits):,} digits>")
    return text if len(text) <= limit else text[:limit - 3] + "..."


def _number(value: Any, what: str, least: float = 0.0, most: float = MAX_NUMBER) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not least <= value <= most:
        raise ValueError(f"{what} is {_brief(value)}, expected a finite number from {least:g} to {most:g}")
    return float(value)


def _count(value: Any, what: str, least: int, optional: bool = False) -> None:
    if optional and value is None:
        return
    if type(value) is not int or not least <= value <= MAX_NUMBER:
        raise ValueError(f"{what} is {_brief(value)}, expected {'null or ' if optional else ''}a whole number "
                         f"from {least} to {MAX_NUMBER:g}")


def _real(value: Any, what: str) -> None:
    """Any number: inf is a legitimate (failed) error figure, a perplexity change may be negative."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{what} is {_brief(value)}, expected a number")


def _text(value: Any, what: str, optional: bool = True) -> None:
    if optional and value is None:
        return
    if not isinstance(value, str) or len(value) > MAX_TEXT:
        raise ValueError(f"{what} is {_brief(value)}, expected {'null or ' if optional else ''}text of at most "
                         f"{MAX_TEXT:,} characters")
    if _SURROGATE.search(value):  # "\ud800" in JSON: no UTF-8 file can hold it
        raise ValueError(f"{what} holds an unpaired UTF-16 surrogate ({_brief(value)}), which is not Unicode text")


def _kind(value: Any, kind: type, what: str, wanted: str) -> None:
    if not isinstance(value, kind) or (isinstance(value, bool) and kind is not bool):
        raise ValueError(f"{what} is {_brief(value)}, expected {wanted}")


def _key(name: str) -> str:
    """A name from the file (a series, an output) as the error line shows it: short."""
    return name if len(name) <= 40 else name[:37] + "..."


def _items(value: Any, what: str, most: int) -> None:
    _kind(value, list, what, "a list")
    if len(value) > most:
        raise ValueError(f"{what} holds {len(value):,} entries, more than the {most:,} a result holds")


def _check(env: dict[str, Any], data: dict[str, Any]) -> None:
    """Every field a report reads, by JSON type and range: ValueError naming the field otherwise (KeyError
    for a missing one)."""
    if env.get("kind") not in KINDS:
        raise ValueError(f"environment.kind is {_brief(env.get('kind'))}, expected one of {', '.join(KINDS)}")
    if not isinstance(env.get("artifact"), str) or not re.fullmatch(r"[0-9a-f]{64}", env["artifact"]):
        raise ValueError(f"environment.artifact is {_brief(env.get('artifact'))}, expected a sha256 "
                         "(64 lowercase hex digits)")
    for key in TEXTS:
        _text(env.get(key), f"environment.{key}")
    _count(env.get("threads"), "environment.threads", 1, optional=True)
    if env["kind"] == "bench":
        _check_bench(data)
    else:
        _check_validate(data)


def _check_bench(data: dict[str, Any]) -> None:
    rows = data["positions"]
    _items(rows, "positions", MAX_ROWS)
    if not rows:
        raise ValueError("positions is [], expected a non-empty list")
    _count(data.get("batch"), "batch", 1, optional=True)
    _count(data.get("prefill_tokens"), "prefill_tokens", 0, optional=True)
    for i, row in enumerate(rows):
        _kind(row, dict, f"positions[{i}]", "an object")
        _text(row.get("model"), f"positions[{i}].model", optional=False)
        _count(row["position"], f"positions[{i}].position", 1)
        for key in ("p50_ms", "p90_ms", "p99_ms", "state_bytes", "rss_bytes"):
            _number(row[key], f"positions[{i}].{key}")
    for key in ("prefill_tokens_per_s", "steps_tokens_per_s"):
        _kind(data.get(key, {}), dict, key, "an object (series -> tokens per second)")
        for label, value in data.get(key, {}).items():
            _text(label, f"a series name in {key}", optional=False)
            _number(value, f"{key}.{_key(label)}")
    if data.get("prefill_tokens_per_s") and "steps_tokens_per_s" not in data:  # the report sets them side by side
        raise ValueError("steps_tokens_per_s is missing (prefill_tokens_per_s is there)")


def _check_validate(data: dict[str, Any]) -> None:
    _items(data["metrics"], "metrics", MAX_ROWS)
    for i, metric in enumerate(data["metrics"]):
        _kind(metric, dict, f"metrics[{i}]", "an object")
        _text(metric.get("check"), f"metrics[{i}].check", optional=False)
        _text(metric.get("output"), f"metrics[{i}].output", optional=False)
        _kind(metric.get("passed"), bool, f"metrics[{i}].passed", "true or false")
        _real(metric["max_rel"], f"metrics[{i}].max_rel")
    _kind(data["passed"], bool, "passed", "true or false")
    _text(data.get("against"), "against")
    _count(data.get("steps"), "steps", 0, optional=True)
    if data.get("threshold") is not None:
        _number(data["threshold"], "threshold")
    if data.get("batches") is not None:
        _items(data["batches"], "batches", MAX_ROWS)
        for i, batch in enumerate(data["batches"]):
            _count(batch, f"batches[{i}]", 1)
    quality = data.get("quality")
    if quality is not None:
        _kind(quality, dict, "quality", "an object or null")
        for key in ("top1", "perplexity_change"):
            if quality.get(key) is not None:
                _real(quality[key], f"quality.{key}")
    step_errors = data.get("step_errors") or {}
    _kind(step_errors, dict, "step_errors", "an object")
    for output, series in step_errors.items():
        where = f"step_errors.{_key(output)}"
        _kind(series, dict, where, "an object")
        _count(series["steps_per_point"], f"{where}.steps_per_point", 1)
        _items(series["max_rel"], f"{where}.max_rel", MAX_POINTS)
        for i, value in enumerate(series["max_rel"]):
            _real(value, f"{where}.max_rel[{i}]")


def group(results: list[Result]) -> list[Group]:
    """By artifact hash, in the order the files were given; labels name what differs within a kind."""
    by_hash: dict[str, list[Result]] = {}
    for result in results:
        by_hash.setdefault(result.artifact, []).append(result)
    return [Group(artifact, tuple(members), tuple(labels(members))) for artifact, members in by_hash.items()]


def labels(results: list[Result]) -> list[str]:
    """Each result's label among the results of its kind: the facts that differ ("threads 1"); the file
    name when nothing does or two would read the same."""
    out = [""] * len(results)
    for kind in KINDS:
        index = [i for i, r in enumerate(results) if r.kind == kind]
        if len(index) < 2:
            continue
        differing = [(key, name) for key, name in DIFFERENCES
                     if len({json.dumps(results[i].fact(key), sort_keys=True) for i in index}) > 1]
        for i in index:
            out[i] = ", ".join(f"{name} {_show(results[i].fact(key))}" for key, name in differing)
        seen: dict[str, int] = {}
        for i in index:
            seen[out[i]] = seen.get(out[i], 0) + 1
        for i in index:
            if not out[i] or seen[out[i]] > 1:
                out[i] = (out[i] + ", " if out[i] else "") + results[i].shown
    return out


def file_names(paths: list[Path]) -> list[str]:
    """How the report names each file: its name, with as many parent folders as tell it apart from the
    other files (`a/bench.json`, `b/bench.json`); a file given twice gets ` (2)` the second time."""
    parts = [Path(os.path.abspath(p)).parts for p in paths]
    names = []
    for mine in parts:
        depth = 1
        while depth < len(mine) and any(other != mine and other[-depth:] == mine[-depth:] for other in parts):
            depth += 1
        names.append("/".join(mine[-depth:]))
    seen: dict[tuple[str, ...], int] = {}
    for i, mine in enumerate(parts):
        seen[mine] = seen.get(mine, 0) + 1
        if seen[mine] > 1:
            names[i] += f" ({seen[mine]})"
    return names


def _show(value: Any) -> str:
    if value is None:
        return "default"
    if isinstance(value, list):
        return "+".join(str(v) for v in value)
    return str(value)
