"""The target plug-in interface. A target says whether it is available here, whether it supports a
model on a device (and why not), exports the graphs into a folder, and gives a runner for them."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from edgelin.devices import DeviceProfile
    from edgelin.export.manifest import Manifest
    from edgelin.families import FamilySpec
    from edgelin.model.lm import CausalLM

State = dict[str, np.ndarray]


@dataclass(frozen=True)
class ExportOptions:
    precision: str = "fp32"
    opset: int = 18


class Runner(ABC):
    """Runs an exported folder. State is a dict keyed by the graphs' past_key_values.* names."""

    def __init__(self, manifest: "Manifest"):
        self.manifest = manifest

    def initial_state(self, batch: int) -> State:
        return self.manifest.initial_state(batch)

    @abstractmethod
    def step(self, input_ids: np.ndarray, state: State, position: np.ndarray) -> tuple[np.ndarray, State]:
        """input_ids [B] int64, position [B] int64 -> (logits [B, V], new state)."""

    @abstractmethod
    def prefill(self, input_ids: np.ndarray, state: State, start: np.ndarray) -> tuple[np.ndarray, State]:
        """input_ids [B, T] int64, start [B] int64 -> (logits of the last position [B, V], new state)."""


class Target(ABC):
    name: str
    extra: str  # the pip extra that brings this target's dependencies
    graph_suffix: str

    @abstractmethod
    def unavailable_reason(self) -> str | None:
        """None when this machine can export and run this target; otherwise why not."""

    def supports(self, model: "CausalLM", device: "DeviceProfile | None" = None) -> str | None:
        """None when the target can take this model on this device; otherwise the reason."""
        if device is not None and self.name not in device.targets:
            return f"device {device.name} does not list target {self.name} (it lists: {', '.join(device.targets)})"
        return None

    def family_support(self, spec: "FamilySpec") -> str | None:
        """None when every layer of this family can be exported; otherwise why not."""
        return None

    @abstractmethod
    def export(self, model: "CausalLM", folder: Path, options: ExportOptions) -> dict[str, str]:
        """Write the step and prefill graphs into folder; return {graph kind: file name}."""

    @abstractmethod
    def runner(self, folder: Path, manifest: "Manifest") -> Runner: ...
