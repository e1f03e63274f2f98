"""Type and range rules for configuration fields: one small table per config, one error line per fault.

A `Rule` states what a field may hold ("an integer >= 1", "null or a number > 0"); `check` refuses
anything else with an `EdgelinError` naming the field, the value and the allowed range. JSON has no
int/float distinction worth trusting, so: bool is never a number, an int field takes ints only, a
float field takes ints and floats (finite unless the rule says otherwise), strings only where strings
belong.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping

from edgelin.errors import EdgelinError

_KINDS = {"int": "an integer", "float": "a number", "bool": "true or false", "str": "a string"}


@dataclass(frozen=True)
class Rule:
    kind: str  # int | float | bool | str
    low: float | None = None  # inclusive lower bound
    above: float | None = None  # exclusive lower bound
    high: float | None = None  # inclusive upper bound
    optional: bool = False  # null (None) allowed
    choices: tuple[str, ...] = ()  # str: the allowed values
    finite: bool = True  # float: refuse inf and nan

    def describe(self) -> str:
        if self.choices:
            text = "one of " + ", ".join(repr(c) for c in self.choices)
        else:
            text = "a finite number" if self.kind == "float" and self.finite else _KINDS[self.kind]
            bounds = [f">= {_num(self.low)}" if self.low is not None else "",
                      f"> {_num(self.above)}" if self.above is not None else "",
                      f"<= {_num(self.high)}" if self.high is not None else ""]
            bounds = [b for b in bounds if b]
            if bounds:
                text += " " + " and ".join(bounds)
        return f"null or {text}" if self.optional else text

    def accepts(self, value: Any) -> bool:
        if value is None:
            return self.optional
        if self.kind == "bool":
            return isinstance(value, bool)
        if self.kind == "str":
            return isinstance(value, str) and (not self.choices or value in self.choices)
        if isinstance(value, bool) or not isinstance(value, (int, float) if self.kind == "float" else int):
            return False
        if isinstance(value, float) and math.isnan(value):
            return False
        if self.finite and not math.isfinite(value):
            return False
        return ((self.low is None or value >= self.low) and (self.above is None or value > self.above)
                and (self.high is None or value <= self.high))

    def check(self, name: str, value: Any, where: str, fix: str = "") -> Any:
        if not self.accepts(value):
            raise invalid(name, value, self.describe(), where, fix)
        return value


def invalid(name: str, value: Any, allowed: str, where: str, fix: str = "") -> EdgelinError:
    """The one-line error for a field outside its allowed range."""
    return EdgelinError(f"{where}: {name}={value!r} is invalid", f"{name} must be {allowed}",
                        fix or f"set {name} to {allowed}")


def check_fields(rules: Mapping[str, Rule], values: Mapping[str, Any], where: str, prefix: str = "") -> None:
    for name, rule in rules.items():
        if name in values:
            rule.check(prefix + name, values[name], where)


def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else repr(x)


# Shorthands for the tables.
SIZE = Rule("int", low=1)  # a dimension or count: >= 1
COUNT = Rule("int", low=0)
OPT_SIZE = Rule("int", low=1, optional=True)
POSITIVE = Rule("float", above=0)  # eps, theta, scales: finite and > 0
OPT_POSITIVE = Rule("float", above=0, optional=True)
FLAG = Rule("bool")
