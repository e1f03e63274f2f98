"""State-precision verdicts: may a family's recurrent state be stored in float16 (or bfloat16)?

Measured, not assumed: `bench/state_precision.py` rolls a model of every family out 4,096 steps with
its state rounded to the lower dtype after every step, next to a float32 state fed the same tokens
(edgelin.precision.drift), and writes the figures to `state_precision.toml` beside this file (package
data). An exporter asked for a state below float32 calls `check_state_dtype`, which refuses a family
whose measured drift exceeds the bound below, or that was never measured, unless --force.

Torch-free (it only reads a TOML file): the Core ML exporter and `edgelin families` import it.
The bound and why it is where it is: docs/performance.md#state-precision, and docs/precision.md#state-precision.
"""

from __future__ import annotations

import math
import tomllib
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cache
from importlib.resources import files
from typing import Any

from edgelin.errors import EdgelinError

TABLE = "state_precision.toml"
DOCS = "docs/performance.md#state-precision"
# The bound a family's lower-precision state must meet (docs/performance.md#state-precision says why):
# max over 4,096 steps of max|logits - fp32 logits| / RMS(fp32 logits), and top-1 agreement.
MAX_REL_ERROR_BOUND = 1e-2
TOP1_BOUND = 0.99
LOWER_DTYPES = ("float16", "bfloat16")
SHORT = {"float32": "fp32", "float16": "fp16", "bfloat16": "bf16"}
SOFTMAX = "softmax"  # softmax layers hold a KV cache, not an accumulated state: not part of the study
ROW_FIELDS: dict[str, tuple[type, ...]] = {
    "max_rel_error": (float, int), "final_rel_error": (float, int), "top1_agreement": (float, int),
    "steps": (int,), "weights": (str,),
}


@dataclass(frozen=True)
class StateVerdict:
    """A family's measured drift with its state in `state_dtype`, and whether it meets the bound."""

    family: str
    state_dtype: str
    max_rel_error: float  # nan when not measured
    top1_agreement: float  # fraction of steps, nan when not measured
    steps: int  # 0 when not measured
    weights: str  # "trained" | "random" | "none" (not measured)
    bound: float  # MAX_REL_ERROR_BOUND
    ok: bool
    top1_bound: float = TOP1_BOUND

    @property
    def measured(self) -> bool:
        return self.steps > 0

    def to_dict(self) -> dict[str, Any]:
        """For manifest.json (strict JSON: no NaN)."""
        def num(x: float) -> float | None:
            return x if math.isfinite(x) else None
        return {"family": self.family, "state_dtype": self.state_dtype, "max_rel_error": num(self.max_rel_error),
                "top1_agreement": num(self.top1_agreement), "steps": self.steps, "weights": self.weights,
                "bound": self.bound, "top1_bound": self.top1_bound, "ok": self.ok}

    def figure(self) -> str:
        """The measured figure in words, for messages and `edgelin families`."""
        if not self.measured:
            return "not measured"
        return (f"drift {self.max_rel_error:.2g} over {self.steps} steps, top-1 {self.top1_agreement:.2%} "
                f"({self.weights} weights)")


def _bad_table(why: str) -> EdgelinError:
    return EdgelinError(f"the state-precision table edgelin/precision/{TABLE} cannot be used", why,
                        "reinstall edgelin, or regenerate the table with python bench/state_precision.py")


@cache
def load_table() -> dict[str, Any]:
    """The table as parsed TOML ({"meta": ..., "families": {family: {dtype: row}}, "models": ...}),
    every family row checked. Read once per process."""
    try:
        data = tomllib.loads(files(__name__).joinpath(TABLE).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError) as exc:
        raise _bad_table(f"{type(exc).__name__}: {exc}") from exc
    except tomllib.TOMLDecodeError as exc:
        raise _bad_table(f"it is not valid TOML ({exc})") from exc
    families = data.get("families")
    if not isinstance(families, dict):
        raise _bad_table("it has no [families] table")
    for family, dtypes in families.items():
        for dtype, row in (dtypes.items() if isinstance(dtypes, dict) else [("?", None)]):
            if not isinstance(row, dict):
                raise _bad_table(f"families.{family}.{dtype} is not a table")
            for key, types in ROW_FIELDS.items():
                if not isinstance(row.get(key), types) or isinstance(row.get(key), bool):
                    raise _bad_table(f"families.{family}.{dtype}.{key} is missing or not a {types[0].__name__}")
    return data


def _verdict(family: str, state_dtype: str, row: dict[str, Any]) -> StateVerdict:
    err, top1 = float(row["max_rel_error"]), float(row["top1_agreement"])
    ok = err <= MAX_REL_ERROR_BOUND and top1 >= TOP1_BOUND  # nan/inf drift fails both ways
    return StateVerdict(family, state_dtype, err, top1, int(row["steps"]), str(row["weights"]),
                        MAX_REL_ERROR_BOUND, ok)


def state_verdict(family: str, state_dtype: str) -> StateVerdict | None:
    """The measured verdict for `family` with a `state_dtype` state; None when not measured."""
    row = load_table()["families"].get(family, {}).get(state_dtype)
    return None if row is None else _verdict(family, state_dtype, row)


def _unmeasured(family: str, state_dtype: str) -> StateVerdict:
    return StateVerdict(family, state_dtype, math.nan, math.nan, 0, "none", MAX_REL_ERROR_BOUND, False)


def _shortfall(v: StateVerdict) -> float:
    """How far a verdict misses the bound (larger is worse; unmeasured is worst)."""
    if not v.measured:
        return math.inf
    err = v.max_rel_error / v.bound if not math.isnan(v.max_rel_error) else math.inf
    return max(err, (1 - v.top1_agreement) / (1 - v.top1_bound))


def check_state_dtype(layer_types: Sequence[str], state_dtype: str, force: bool, context: str) -> list[StateVerdict]:
    """Refuse a `state_dtype` state for a model with these layers unless every linear family among
    them was measured within the bound, or `force`. A no-op (returns []) for float32; otherwise the
    verdicts of the linear families, in layer order (for the manifest), unmeasured ones included
    (steps 0) when forced. `context` says which export asked, e.g. "Core ML MLState"."""
    if state_dtype == "float32":
        return []
    if state_dtype not in LOWER_DTYPES:
        raise EdgelinError(f"state dtype {state_dtype!r} ({context})",
                           f"edgelin stores a recurrent state as float32, {', '.join(LOWER_DTYPES)}",
                           "use float32, or a device profile whose state_dtype is float16")
    linear = list(dict.fromkeys(t for t in layer_types if t != SOFTMAX))
    verdicts = [state_verdict(f, state_dtype) or _unmeasured(f, state_dtype) for f in linear]
    failing = [v for v in verdicts if not v.ok]
    if failing and not force:
        worst = max(failing, key=_shortfall)
        short = SHORT[state_dtype]
        if not worst.measured:
            why = (f"its {short}-state drift was never measured (no {worst.family}.{state_dtype} row in "
                   f"edgelin/precision/{TABLE}; bound {worst.bound:g}, {DOCS})")
        elif worst.max_rel_error > worst.bound or math.isnan(worst.max_rel_error):
            why = (f"measured drift {worst.max_rel_error:.2g} over {worst.steps} steps > bound {worst.bound:g} "
                   f"(max relative logit error vs a float32 state, {worst.weights} weights; {DOCS})")
        else:
            why = (f"measured top-1 agreement {worst.top1_agreement:.1%} over {worst.steps} steps < "
                   f"{worst.top1_bound:.0%} (vs a float32 state, {worst.weights} weights; {DOCS})")
        measure = "" if worst.measured else f", measure it (python bench/state_precision.py --families {worst.family})"
        raise EdgelinError(f"{short} state for {worst.family} layers ({context})", why,
                           f"keep a float32 state (e.g. Core ML's explicit-state style){measure} or pass --force")
    return verdicts
