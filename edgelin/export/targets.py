"""The target registry: which targets exist, found, never listed.

- Built in: every subpackage of edgelin.export whose `__init__.py` declares `TARGET = "module:Class"`
  (edgelin/export/onnx/, tensorrt/, coreml/, torch/). The declaration is read from the file's syntax tree,
  not imported, so asking which targets exist imports no target and none of their libraries; the package's
  folder name is the target's name. This works from a source checkout (PYTHONPATH), where installed entry
  points may be stale.
- Third party: the entry-point group `edgelin.targets` (`name = "module:Class"` under
  `[project.entry-points."edgelin.targets"]` of the plug-in's pyproject.toml). A built-in name wins over an
  entry point of the same name.

A target module is imported only when asked for (`get_target`), so a user who installed one extra never
imports another target's heavy dependencies; the module itself imports nothing heavy at module level.
"""

from __future__ import annotations

import ast
import difflib
import functools
import pkgutil
from importlib import import_module
from importlib.metadata import entry_points
from pathlib import Path

from typing import TYPE_CHECKING, NamedTuple

from edgelin.errors import EdgelinError

if TYPE_CHECKING:
    from collections.abc import Callable

    from edgelin.artifact.manifest import Manifest
    from edgelin.export.base import Target

ENTRY_POINT_GROUP = "edgelin.targets"
DECLARATION = "TARGET"  # the module-level name a built-in target package's __init__.py assigns "module:Class"
DEFAULT = "DEFAULT"  # `DEFAULT = True` there: the target `edgelin export CKPT` exports to when none is named


@functools.cache
def _builtin_declarations() -> dict[str, dict[str, object]]:
    """{package name: its __init__.py's module-level constants} for edgelin.export's subpackages that
    declare a target."""
    import edgelin.export as package

    found: dict[str, dict[str, object]] = {}
    for info in sorted(pkgutil.iter_modules(package.__path__), key=lambda i: i.name):
        init = Path(info.module_finder.path) / info.name / "__init__.py" if info.ispkg else None
        if init is not None and init.is_file():
            constants = _constants(init)
            if isinstance(constants.get(DECLARATION), str):
                found[info.name] = constants
    return found


def _constants(init: Path) -> dict[str, object]:
    """The constants a module assigns at its top level (name = literal), read without running it."""
    found: dict[str, object] = {}
    for node in ast.parse(init.read_text(encoding="utf-8"), str(init)).body:
        if isinstance(node, ast.Assign):
            try:
                value = ast.literal_eval(node.value)
            except ValueError:  # not a literal: not a declaration
                continue
            found.update({t.id: value for t in node.targets if isinstance(t, ast.Name)})
    return found


class ProfileRules(NamedTuple):
    """What a device profile may say about a target: whether it may list it, on which computes (None: any)."""

    listed: bool
    computes: tuple[str, ...] | None
    reason: str


def profile_rules(name: str) -> ProfileRules:
    """A target's device-profile rules: a built-in target's from its package declarations (IN_DEVICE_PROFILES,
    PROFILE_COMPUTES, COMPUTE_REASON), without importing it (profiles load where no target's libraries are, e.g.
    numpy); a plug-in's from its Target class."""
    declared = _builtin_declarations().get(name)
    if declared is not None:
        computes = declared.get("PROFILE_COMPUTES")
        return ProfileRules(bool(declared.get("IN_DEVICE_PROFILES", True)),
                            None if computes is None else tuple(computes), str(declared.get("COMPUTE_REASON", "")))
    target = get_target(name)
    return ProfileRules(target.in_device_profiles, target.profile_computes, target.compute_reason)


def builtin_targets() -> dict[str, str]:
    """{target name: "module:Class"} for edgelin.export's subpackages that declare a target."""
    return {name: str(constants[DECLARATION]) for name, constants in _builtin_declarations().items()}


def default_target() -> str:
    """The built-in target that declares itself the default (the one whose files run everywhere)."""
    chosen = [name for name, constants in _builtin_declarations().items() if constants.get(DEFAULT) is True]
    if len(chosen) != 1:
        raise EdgelinError(f"{len(chosen)} built-in targets declare DEFAULT = True", "exactly one is the default",
                           "report this as an edgelin bug")
    return chosen[0]


def registered_targets() -> dict[str, str]:
    """{target name: "module:Class"}: the built-in targets, then those plug-ins declare as entry points (read
    each call: a plug-in installed while this process runs is seen)."""
    found = dict(builtin_targets())
    for entry in entry_points(group=ENTRY_POINT_GROUP):
        found.setdefault(entry.name, entry.value)
    return found


def target_names() -> list[str]:
    return list(registered_targets())


def get_target(name: str) -> "Target":
    """An instance of the target registered as `name`; unknown names are refused with the closest match."""
    known = registered_targets()
    if name not in known:
        close = difflib.get_close_matches(name, known, n=1)
        raise EdgelinError(f"unknown target {name!r}" + (f" (closest: {close[0]!r})" if close else ""),
                           "edgelin has no such target", f"use one of: {', '.join(known)}")
    module, _, attribute = known[name].partition(":")
    if name in builtin_targets():
        cls = getattr(import_module(module), attribute)
    else:  # a plug-in's: one line when its package is broken or gone (a stale entry point)
        try:
            cls = getattr(import_module(module), attribute)
        except (ImportError, AttributeError) as exc:
            raise EdgelinError(f"target {name!r} ({known[name]}) cannot be loaded", f"{type(exc).__name__}: {exc}",
                               "reinstall the package that provides it") from exc
    from edgelin.export.base import Target

    if not (isinstance(cls, type) and issubclass(cls, Target)):
        raise EdgelinError(f"target {name!r} ({known[name]}) is not a Target", "a target's declaration names a "
                           "subclass of edgelin.export.base.Target", "fix the declaration in its package")
    return cls()


def weights_reader(manifest: "Manifest") -> "Callable | None":
    """How the export's target reads its weights back where it keeps them its own way (Target.dequantized_weights,
    optional: the parity reference of a weight-quantised export carries them); None: read off the ONNX graphs."""
    return getattr(get_target(manifest.target), "dequantized_weights", None)
