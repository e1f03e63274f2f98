"""Reading results files (`edgelin bench --json`, `edgelin validate --json`) for a report: each is checked
(one EdgelinError line naming the file when it is not edgelin's, truncated or malformed), grouped by the
artifact it measured, and labelled by what differs between the results plotted together (threads,
device, target, ...)."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from edgelin.environment import RESULT_FORMAT, RESULT_VERSION
from edgelin.errors import EdgelinError

KINDS = ("bench", "validate")
FIX = "pass the JSON files that `edgelin bench --json` or `edgelin validate --json` wrote (this edgelin version)"
# What may tell results apart, in the order a label names them: (environment key, how a label says it).
DIFFERENCES = (("device", "device"), ("gpu", "GPU"), ("cpu", "CPU"), ("machine", "machine"), ("os", "OS"),
               ("python", "Python"), ("runtime", "runtime"), ("runtime_version", "runtime"), ("runner", "runner"),
               ("target", "target"), ("precision", "precision"), ("quantization", "weights"),
               ("threads", "threads"), ("batch", "batch"), ("edgelin_version", "edgelin"))


@dataclass(frozen=True)
class Result:
    path: Path
    kind: str  # "bench" or "validate"
    environment: dict[str, Any]
    data: dict[str, Any]

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
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise EdgelinError(f"results file {path} does not exist", "edgelin report reads the files it is given",
                           "check the path") from None
    except IsADirectoryError:
        raise EdgelinError(f"results file {path} is a folder", "a result is one JSON file", FIX) from None
    except UnicodeDecodeError:
        raise EdgelinError(f"{path} is not an edgelin result", "it is not UTF-8 text (a binary file?)", FIX) from None
    try:
        data = json.loads(text)
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
    if not isinstance(version, int) or version > RESULT_VERSION:
        raise EdgelinError(f"{path} has result format version {version!r}",
                           f"this edgelin reads versions up to {RESULT_VERSION}", "upgrade edgelin, or re-run "
                           "bench/validate with this version")
    try:
        _check(env, data)
    except (KeyError, TypeError, ValueError) as exc:
        raise EdgelinError(f"results file {path} is malformed", f"{type(exc).__name__}: {exc}", FIX) from None
    return Result(path, env["kind"], env, data)


def _number(value: Any, what: str, least: float = 0.0) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < least:
        raise ValueError(f"{what} is {_brief(value)}, expected a finite number >= {least:g}")
    return float(value)


def _real(value: Any, what: str) -> None:
    """Any number: inf is a legitimate (failed) error figure, a perplexity change may be negative."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{what} is {_brief(value)}, expected a number")


def _kind(value: Any, kind: type, what: str, wanted: str) -> None:
    if not isinstance(value, kind) or (isinstance(value, bool) and kind is not bool):
        raise ValueError(f"{what} is {_brief(value)}, expected {wanted}")


def _brief(value: Any, limit: int = 60) -> str:
    """A value from the file as short JSON: the error line names it, never dumps a whole entry."""
    text = json.dumps(value)
    return text if len(text) <= limit else text[:limit - 3] + "..."


def _check(env: dict[str, Any], data: dict[str, Any]) -> None:
    """Every field a report reads, with its JSON type: ValueError naming the field otherwise (KeyError for
    a missing one)."""
    if env.get("kind") not in KINDS:
        raise ValueError(f"kind {_brief(env.get('kind'))} is not one of {', '.join(KINDS)}")
    if not isinstance(env.get("artifact"), str) or not env["artifact"]:
        raise ValueError("environment.artifact is missing")
    if env["kind"] == "bench":
        _check_bench(data)
    else:
        _check_validate(data)


def _check_bench(data: dict[str, Any]) -> None:
    rows = data["positions"]
    if not isinstance(rows, list) or not rows:
        raise ValueError(f"positions is {_brief(rows)}, expected a non-empty list")
    for i, row in enumerate(rows):
        _kind(row, dict, f"positions[{i}]", "an object")
        _kind(row.get("model"), str, f"positions[{i}].model", "a string")
        _number(row["position"], f"positions[{i}].position", 1)
        for key in ("p50_ms", "p90_ms", "p99_ms", "state_bytes", "rss_bytes"):
            _number(row[key], f"positions[{i}].{key}")
    for key in ("prefill_tokens_per_s", "steps_tokens_per_s"):
        _kind(data.get(key, {}), dict, key, "an object (series -> tokens per second)")
        for label, value in data.get(key, {}).items():
            _number(value, f"{key}.{label}")
    if data.get("prefill_tokens_per_s") and "steps_tokens_per_s" not in data:  # the report sets them side by side
        raise ValueError("steps_tokens_per_s is missing (prefill_tokens_per_s is there)")


def _check_validate(data: dict[str, Any]) -> None:
    _kind(data["metrics"], list, "metrics", "a list")
    for i, metric in enumerate(data["metrics"]):
        _kind(metric, dict, f"metrics[{i}]", "an object")
        if not isinstance(metric.get("check"), str) or not isinstance(metric.get("passed"), bool):
            raise ValueError(f"metrics[{i}] has no check name or verdict")
        _real(metric["max_rel"], f"metrics[{i}].max_rel")
    quality = data.get("quality")
    if quality is not None:
        _kind(quality, dict, "quality", "an object or null")
        for key in ("top1", "perplexity_change"):
            if quality.get(key) is not None:
                _real(quality[key], f"quality.{key}")
    step_errors = data.get("step_errors") or {}
    _kind(step_errors, dict, "step_errors", "an object")
    for output, series in step_errors.items():
        _kind(series, dict, f"step_errors.{output}", "an object")
        _number(series["steps_per_point"], f"step_errors.{output}.steps_per_point", 1)
        _kind(series["max_rel"], list, f"step_errors.{output}.max_rel", "a list of numbers")
        if not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in series["max_rel"]):
            raise ValueError(f"step_errors.{output}.max_rel holds a non-number")


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
                out[i] = (out[i] + ", " if out[i] else "") + results[i].path.name
    return out


def _show(value: Any) -> str:
    if value is None:
        return "default"
    if isinstance(value, list):
        return "+".join(str(v) for v in value)
    return str(value)
