"""The target registry. Each target module is imported only when asked for, so a user who
installed one extra never imports another target's heavy dependencies. A target module imports
nothing heavy at module level (its exporter's torch, its runtime's library are imported inside the
phase that needs them): a runtime-only install asks the registry for the target to run a folder."""

from __future__ import annotations

import difflib
from importlib import import_module

from edgelin.errors import EdgelinError
from edgelin.export.base import Target

_TARGETS = {"onnx": ("edgelin.export.onnx_target", "OnnxTarget"),
            "tensorrt": ("edgelin.export.tensorrt_target", "TensorrtTarget"),
            "coreml": ("edgelin.export.coreml_target", "CoremlTarget"),
            "torch": ("edgelin.export.torch_target", "TorchTarget")}  # the PyTorch reference as a runner


def target_names() -> list[str]:
    return list(_TARGETS)


def get_target(name: str) -> Target:
    if name not in _TARGETS:
        close = difflib.get_close_matches(name, _TARGETS, n=1)
        raise EdgelinError(f"unknown target {name!r}" + (f" (closest: {close[0]!r})" if close else ""),
                           "edgelin has no such target", f"use one of: {', '.join(_TARGETS)}")
    module, cls = _TARGETS[name]
    return getattr(import_module(module), cls)()
