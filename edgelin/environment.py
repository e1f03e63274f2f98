"""What a result ran on: the `environment` block every `bench --json` and `validate --json` result carries,
so results from a Jetson, a phone, a Mac and this machine can be put side by side (`edgelin report`).

One function builds it (`environment`); bench.py and validate.py call it. The artifact hash identifies the
export folder measured: sha256 over manifest.json, which records the sha256 of every file the export wrote
(edgelin.integrity checks them when the folder is opened); for an older export's manifest, which records only the
weights file's and the reference vectors', also over the graph files it names (small: the weights live in
weights.bin). Cheap and stable across copies of the folder.
"""

from __future__ import annotations

import contextlib
import datetime
import glob
import hashlib
import json
import os
import platform
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

from edgelin import __version__

RESULT_FORMAT = "edgelin-result"
RESULT_VERSION = 1
HASH_METHOD = "sha256(manifest.json, which records every file's sha256; older exports: + graph files without a digest)"


def environment(kind: str, folder: Path, runner_label: str, threads: int | None, device: str | None,
                command: str | None = None) -> dict[str, Any]:
    """The block: result format and kind, the command, the machine (device profile, CPU, GPU when one is
    used, OS, Python), the runtime (name and version as the runner says), edgelin's version, threads
    (as asked; None: the runtime's default), and the artifact (target, precision, quantisation, hash)."""
    from edgelin.artifact.manifest import Manifest
    from edgelin.artifact.quality import quantized_weights

    manifest = Manifest.load(Path(folder))
    from edgelin.export.targets import get_target

    target = get_target(manifest.target)
    runtime = target.runtime_of(runner_label)
    quant = manifest.extra.get("quantization")
    quantization = quantized_weights(quant) if isinstance(quant, dict) and quant.get("bits") else None
    uses_gpu = runtime in target.gpu_runtimes or "cuda" in runner_label.lower() or "gpu" in runner_label.lower()
    return {
        "format": RESULT_FORMAT,
        "format_version": RESULT_VERSION,
        "kind": kind,
        "command": command if command is not None else invocation(),
        "created": datetime.datetime.now(datetime.timezone.utc).replace(microsecond=0).isoformat(),
        "edgelin_version": __version__,
        "device": device,
        "cpu": cpu_model(),
        "cpu_count": os.cpu_count(),
        "gpu": gpu_model() if uses_gpu else None,
        "os": platform.platform(),
        "machine": platform.machine(),
        "python": platform.python_version(),
        "runtime": runtime,
        "runtime_version": module_version(runtime, dict(target.runtime_distributions).get(runtime, ())),
        "runner": runner_label,
        "threads": threads,
        "target": manifest.target,
        "precision": manifest.precision,
        "quantization": quantization,
        "artifact": artifact_hash(Path(folder)),
        "artifact_hash": HASH_METHOD,
    }


def module_version(name: str, distributions: tuple[str, ...] = ()) -> str | None:
    """The installed version of a runtime module, without importing it when its metadata says (`distributions`:
    the pip distributions that carry it, when not one of its own name)."""
    from importlib import metadata

    for dist in distributions or (name,):
        with contextlib.suppress(metadata.PackageNotFoundError):
            return metadata.version(dist)
    with contextlib.suppress(Exception):  # e.g. JetPack's tensorrt, installed without pip metadata
        return str(__import__(name).__version__)
    return None


def artifact_hash(folder: Path) -> str:
    """sha256 of manifest.json; for an older export without the digests of every file (its `sha256`), then of each
    graph file (path order) the manifest records no digest for."""
    manifest_path = folder / "manifest.json"
    raw = manifest_path.read_bytes()
    digest = hashlib.sha256(raw)
    data = json.loads(raw)
    if isinstance(data.get("sha256"), dict):  # the manifest pins every file already
        return digest.hexdigest()
    recorded = {entry.get("file") for entry in (data.get("extra") or {}).values()
                if isinstance(entry, dict) and isinstance(entry.get("sha256"), str)}
    graphs = sorted({g["file"] for g in data.get("graphs", {}).values()} - recorded)
    for name in graphs:
        path = folder / name
        files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
        for file in files:  # a Core ML .mlpackage is a folder
            digest.update(file.relative_to(folder).as_posix().encode() + b"\0")
            with open(file, "rb") as fh:
                for block in iter(lambda: fh.read(1 << 20), b""):
                    digest.update(block)
    return digest.hexdigest()


def cpu_model() -> str:
    """The CPU's model name: /proc/cpuinfo (x86 "model name", Arm "Hardware"/"Model"), macOS sysctl, else
    platform.processor()."""
    with contextlib.suppress(OSError):
        fields: dict[str, str] = {}
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                key, _, value = line.partition(":")
                fields.setdefault(key.strip().lower(), value.strip())
        for key in ("model name", "hardware", "model", "cpu model"):
            if fields.get(key):
                return fields[key]
    if sys.platform == "darwin":
        with contextlib.suppress(OSError, subprocess.SubprocessError):
            return subprocess.run(["sysctl", "-n", "machdep.cpu.brand_string"], capture_output=True, text=True,
                                  timeout=5).stdout.strip()
    return platform.processor() or platform.machine() or "unknown"


def gpu_model() -> str | None:
    """The NVIDIA GPU's name (the driver's /proc entries; a Jetson's device-tree model), else None."""
    for info in sorted(glob.glob("/proc/driver/nvidia/gpus/*/information")):
        with contextlib.suppress(OSError), open(info) as fh:
            for line in fh:
                if line.startswith("Model:"):
                    return line.split(":", 1)[1].strip()
    with contextlib.suppress(OSError):
        model = Path("/proc/device-tree/model").read_text().strip("\0 \n")
        if "nvidia" in model.lower() or "jetson" in model.lower():
            return model
    return None


def invocation() -> str | None:
    """The command as typed, rebuilt from the running click context (options at their defaults left
    out); the process's argv when no command is running."""
    try:  # typer >= 0.20 vendors click
        from typer._click.globals import get_current_context
    except ImportError:  # pragma: no cover - older typer on the real click
        from click import get_current_context
    ctx = get_current_context(silent=True)
    if ctx is None:
        return shlex.join(["edgelin" if Path(sys.argv[0]).stem in ("edgelin", "cli") else sys.argv[0],
                           *sys.argv[1:]])
    names, node = [], ctx
    while node.parent is not None:  # the root's name is the program ("python -m edgelin.cli" too)
        names.insert(0, node.info_name)
        node = node.parent
    words = ["edgelin", *names]
    for param in ctx.command.params:
        value = ctx.params.get(param.name)
        if getattr(param, "param_type_name", "") == "argument":
            words += [] if value is None else [str(value)]
        elif value is None or value == param.default:
            continue
        elif value is True:
            words.append(max(param.opts, key=len))
        elif value is False:
            words.append(next((o for o in getattr(param, "secondary_opts", []) if o.startswith("--no-")),
                              max(param.opts, key=len)))
        else:
            words += [max(param.opts, key=len), str(value)]
    return shlex.join(words)


def available_memory() -> int | None:
    """Bytes the kernel could give us now (MemAvailable), else free physical pages; None if unknown."""
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, AttributeError):
        return None
