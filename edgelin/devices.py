"""Device profiles: data files in devices/*.toml, read here; no device policy is coded in Python."""

from __future__ import annotations

import difflib
import os
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

from edgelin.errors import EdgelinError

DEVICES_DIR = Path(os.environ.get("EDGELIN_DEVICES", Path(__file__).resolve().parents[1] / "devices"))


@dataclass(frozen=True)
class DeviceProfile:
    name: str
    title: str
    kind: str  # desktop | jetson | phone
    targets: tuple[str, ...]  # in order of preference
    compute: str  # cpu | cuda | ane
    precision: str  # default compute precision for exports aimed at it
    state_dtype: str
    memory_gib: float
    threads: int = 0  # CPU threads for runtimes; 0 = runtime default
    sm: int | None = None  # CUDA compute capability (e.g. 87 for Orin)
    state_dim_multiple: int = 1  # state dims should be multiples of this (Neural Engine: 32)
    notes: tuple[str, ...] = field(default_factory=tuple)

    @classmethod
    def from_file(cls, path: Path) -> "DeviceProfile":
        try:
            data = tomllib.loads(path.read_text())
            data["targets"] = tuple(data["targets"])
            data["notes"] = tuple(data.get("notes", ()))
            return cls(name=path.stem, **data)
        except (tomllib.TOMLDecodeError, KeyError, TypeError) as exc:
            raise EdgelinError(f"device profile {path} is invalid", f"{type(exc).__name__}: {exc}",
                               "fix the TOML file (see devices/README.md)") from exc


def load_devices(folder: Path = DEVICES_DIR) -> dict[str, DeviceProfile]:
    return {p.stem: DeviceProfile.from_file(p) for p in sorted(Path(folder).glob("*.toml"))}


def get_device(name: str, folder: Path = DEVICES_DIR) -> DeviceProfile:
    devices = load_devices(folder)
    if name not in devices:
        close = difflib.get_close_matches(name, devices, n=1)
        raise EdgelinError(f"unknown device {name!r}" + (f" (closest: {close[0]!r})" if close else ""),
                           f"no devices/{name}.toml", f"use one of: {', '.join(devices) or '(none found)'}")
    return devices[name]
