"""Registry of families. Adding a family = one small file with a `SPEC` + its name here."""

from __future__ import annotations

import difflib
from importlib import import_module

from edgelin.errors import EdgelinError
from edgelin.families.spec import Decay, FamilySpec, Gate, LayerDims, OutputGate, StateTensor

_MODULES = ("linear_attn", "performer", "retnet", "gla", "deltanet", "gated_deltanet", "gated_deltanet2", "kda",
            "mamba2")
FAMILIES: dict[str, FamilySpec] = {
    spec.name: spec for spec in (import_module(f"edgelin.families.{m}").SPEC for m in _MODULES)
}
SOFTMAX = "softmax"  # the one non-linear layer type, for hybrids and the KV-cache baseline
LAYER_TYPES = (*FAMILIES, SOFTMAX)


def get_family(name: str) -> FamilySpec:
    if name in FAMILIES:
        return FAMILIES[name]
    close = difflib.get_close_matches(name, LAYER_TYPES, n=1)
    hint = f" (closest: {close[0]!r})" if close else ""
    raise EdgelinError(
        f"unknown layer family {name!r}{hint}",
        "edgelin has no spec for it",
        f"use one of: {', '.join(LAYER_TYPES)}",
    )


__all__ = [
    "FAMILIES", "LAYER_TYPES", "SOFTMAX", "Decay", "FamilySpec", "Gate", "LayerDims",
    "OutputGate", "StateTensor", "get_family",
]
