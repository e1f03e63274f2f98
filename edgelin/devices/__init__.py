"""Device profiles: TOML data in the repository's top-level `devices/` (`devices/*.toml`; README.md next to
them describes every field), checked field by field when read, and turned into export choices by
`export_settings`, the one place where a profile's values reach the exporter.

`EDGELIN_DEVICES=DIR` adds the profiles in `DIR/*.toml`; a file there replaces the built-in profile of
the same name. No device policy is coded here: the profiles are data, this module only checks them."""

from __future__ import annotations

import dataclasses
import difflib
import math
import os
import tomllib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from importlib.resources import files
from importlib.resources.abc import Traversable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from edgelin.artifact.vocabulary import PRECISIONS, QUANTIZE, STATE_DTYPES
from edgelin.errors import EdgelinError
from edgelin.export.targets import get_target, profile_rules, target_names

if TYPE_CHECKING:
    from edgelin.families.spec import StateTensor

def _builtin_devices_dir() -> Traversable:
    """Where the built-in profiles live. One copy in git, the repository's top-level devices/: a wheel (and an
    editable install) carries it as edgelin/devices/profiles/ (CMakeLists.txt's install rule); a source checkout
    without an install reads the repository's folder itself."""
    packaged = files(__name__) / "profiles"
    if packaged.is_dir():
        return packaged
    return Path(__file__).resolve().parents[2] / "devices"


# `edgelin devices` prints it.
DEVICES_DIR: Traversable = _builtin_devices_dir()
USER_DEVICES_ENV = "EDGELIN_DEVICES"
README = "devices/README.md"

KINDS = ("desktop", "jetson", "phone", "server")
COMPUTES = ("cpu", "cuda", "ane", "gpu")
# --block-size with --quantize int8/int4: ONNX Runtime's quantiser packs every weight with MLAS's
# MlasQuantizeBlockwise, which takes blocks of 16 to 256 weights (512 and up: "unsupported block size", after the
# whole trace), and MatMulNBits and GatherBlockQuantized take powers of two >= 16. edgelin's own 4- and 8-bit
# kernels (edgelin.ortops) take block 32; the other sizes run on ONNX Runtime's MatMulNBits.
BLOCK_SIZES = (16, 32, 64, 128, 256)
SM_RANGE = (53, 120)  # CUDA compute capability x10: Jetson Nano (5.3) .. Blackwell (12.0)


def profile_targets() -> list[str]:
    """The registered targets a device profile may list (edgelin.export.targets; Target.in_device_profiles)."""
    return [name for name in target_names() if profile_rules(name).listed]


# ---- the schema -----------------------------------------------------------------------------------
def _closest(value: Any, known: Sequence[str]) -> str:
    close = difflib.get_close_matches(value, known, n=1) if isinstance(value, str) else []
    return f" (closest: {close[0]!r})" if close else ""


def _choice(allowed: tuple[str, ...]) -> Callable[[Any], str | None]:
    def check(value: Any) -> str | None:
        if isinstance(value, str) and value in allowed:
            return None
        return f"must be one of: {', '.join(allowed)}{_closest(value, allowed)}"
    return check


# More runtime threads than any machine has cores is a typo (ONNX Runtime would try to start them all).
MAX_THREADS = 1024


def _integer(low: int, high: int | None = None) -> Callable[[Any], str | None]:
    def check(value: Any) -> str | None:
        is_int = isinstance(value, int) and not isinstance(value, bool)  # TOML's true is not a count
        if is_int and value >= low and (high is None or value <= high):
            return None
        return f"must be an integer in {low}..{high}" if high is not None else f"must be an integer >= {low}"
    return check


def _targets(value: Any) -> str | None:
    if not isinstance(value, list) or not value:
        return f"must be a non-empty list of targets from: {', '.join(profile_targets())}"
    for name in value:
        if not isinstance(name, str) or name not in target_names() or not profile_rules(name).listed:
            known = profile_targets()
            return f"{name!r} is not a target; targets are: {', '.join(known)}{_closest(name, known)}"
    if len(set(value)) != len(value):
        return "names a target twice (the list is an order of preference)"
    return None


def _memory(value: Any) -> str | None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value > 0
    return None if ok else "must be a number of GiB > 0"


def _text(value: Any) -> str | None:
    return None if isinstance(value, str) and value.strip() else "must be a non-empty string"


def _boolean(value: Any) -> str | None:
    return None if isinstance(value, bool) else "must be true or false"


def _notes(value: Any) -> str | None:
    ok = isinstance(value, list) and all(isinstance(n, str) for n in value)
    return None if ok else "must be a list of strings"


@dataclass(frozen=True)
class ServingLimits:
    """The `[serving]` table: Triton Inference Server's batching limits for this device (`export --serve
    triton`). Absent keys (or no table) take these defaults, sized for one mid-range GPU or a many-core CPU."""

    max_batch_size: int = 8  # sequences batched into one step (Triton's max_batch_size)
    max_candidate_sequences: int = 64  # live sequences the oldest-first sequence batcher juggles
    preferred_batch_sizes: tuple[int, ...] = (4, 8)
    max_queue_delay_us: int = 500  # how long a step waits to fill a batch (a decode step is ~1 ms)
    max_sequence_idle_us: int = 60_000_000  # a sequence idle this long is dropped with its state
    instances: int = 1  # model instances per GPU (or on the CPU)


SERVING_KEYS = tuple(f.name for f in dataclasses.fields(ServingLimits))
INT32_MAX = 2**31 - 1
# Each [serving] key's range: the Triton ModelConfig field it becomes (config.pbtxt) and what Triton does with it.
# Counts are int32 fields; the microseconds are uint64 fields that Triton counts in int64 nanoseconds (so at most
# about 292 years); more model instances than MAX_THREADS is a typo (each is a whole copy of the model).
SERVING_RANGES: dict[str, tuple[int, int, str]] = {
    "max_batch_size": (1, INT32_MAX, "Triton's max_batch_size is an int32"),
    "max_candidate_sequences": (1, INT32_MAX, "Triton's max_candidate_sequences is an int32"),
    "preferred_batch_sizes": (1, INT32_MAX, "Triton's preferred_batch_size is an int32"),
    "max_queue_delay_us": (1, (2**63 - 1) // 1000, "Triton keeps the delay in int64 nanoseconds"),
    "max_sequence_idle_us": (1, (2**63 - 1) // 1000, "Triton keeps the idle time in int64 nanoseconds"),
    "instances": (1, MAX_THREADS, "each model instance is a whole copy of the model"),
}


def _serving(value: Any) -> str | None:
    if not isinstance(value, dict):
        return "must be a table of " + ", ".join(SERVING_KEYS)
    unknown = [k for k in value if k not in SERVING_KEYS]
    if unknown:
        return f"has unknown key {unknown[0]!r}{_closest(unknown[0], SERVING_KEYS)} (keys: {', '.join(SERVING_KEYS)})"
    for key, item in value.items():
        items = item if key == "preferred_batch_sizes" else [item]
        low, high, why = SERVING_RANGES[key]
        if key == "preferred_batch_sizes" and not isinstance(item, list):
            return f"preferred_batch_sizes must be a list of integers in {low}..{high}"
        if any(_integer(low, high)(v) for v in items):
            return f"{key} must be {'integers' if key == 'preferred_batch_sizes' else 'an integer'} in {low}..{high} " \
                   f"({why})"
    limits = ServingLimits(**{k: tuple(v) if isinstance(v, list) else v for k, v in value.items()})
    sizes = limits.preferred_batch_sizes
    if list(sizes) != sorted(set(sizes)) or (sizes and sizes[-1] > limits.max_batch_size):
        return f"preferred_batch_sizes {list(sizes)} must ascend, without repeats, up to max_batch_size"
    if limits.max_candidate_sequences < limits.max_batch_size:
        return "max_candidate_sequences must be >= max_batch_size (a batch holds one step of each of several sequences)"
    return None


@dataclass(frozen=True)
class FieldRule:
    check: Callable[[Any], str | None]  # None when the value is valid; otherwise why not
    required: bool = True


FIELDS: dict[str, FieldRule] = {
    "title": FieldRule(_text),
    "kind": FieldRule(_choice(KINDS)),
    "targets": FieldRule(_targets),
    "compute": FieldRule(_choice(COMPUTES)),
    "precision": FieldRule(_choice(PRECISIONS)),
    "state_dtype": FieldRule(_choice(STATE_DTYPES)),
    "memory_gib": FieldRule(_memory),
    "threads": FieldRule(_integer(0, MAX_THREADS), required=False),
    "sm": FieldRule(_integer(*SM_RANGE), required=False),
    "state_dim_multiple": FieldRule(_integer(1), required=False),
    "model_state": FieldRule(_boolean, required=False),
    "notes": FieldRule(_notes, required=False),
    "serving": FieldRule(_serving, required=False),
}


@dataclass(frozen=True)
class DeviceProfile:
    name: str
    title: str
    kind: str  # desktop | jetson | phone | server
    targets: tuple[str, ...]  # in order of preference
    compute: str  # cpu | cuda | ane | gpu
    precision: str  # compute precision of the graphs exported for it
    state_dtype: str
    memory_gib: float
    threads: int = 0  # CPU threads for runtimes; 0 = runtime default
    sm: int | None = None  # CUDA compute capability x10 (87 for Orin)
    state_dim_multiple: int = 1  # the innermost state dim must be a multiple of this (Neural Engine: 32)
    # true: the device's runtime keeps the state inside the model between calls (iOS 18 MLState), the default a
    # target that can hold it either way exports; None: not stated (explicit state inputs and outputs)
    model_state: bool | None = None
    notes: tuple[str, ...] = field(default_factory=tuple)
    serving: ServingLimits = field(default_factory=ServingLimits)  # Triton batching limits (export --serve)
    source: str = ""  # the file it was read from

    @classmethod
    def from_dict(cls, name: str, data: dict[str, Any], source: str) -> "DeviceProfile":
        """Every field checked; an unknown field is refused by name (never silently ignored)."""
        def refuse(what: str, why: str, fix: str) -> EdgelinError:
            return EdgelinError(f"device profile {source}: {what}", why, f"{fix} (see {README})")

        for key in data:
            if key not in FIELDS:
                close = difflib.get_close_matches(key, FIELDS, n=1)
                raise refuse(f"unknown field {key!r}" + (f" (closest: {close[0]!r})" if close else ""),
                             "edgelin would ignore it silently",
                             (f"rename it to {close[0]!r}" if close else "remove it")
                             + f"; the fields are: {', '.join(FIELDS)}")
        for key, rule in FIELDS.items():
            if key not in data:
                if rule.required:
                    raise refuse(f"missing field {key!r}", "every profile states it", f"add {key} = ...")
                continue
            why = rule.check(data[key])
            if why:
                raise refuse(f"{key} = {data[key]!r}", f"{key} {why}", f"set a valid {key}")
        if "sm" in data and data["compute"] != "cuda":
            raise refuse(f"sm = {data['sm']!r} with compute = {data['compute']!r}",
                         "sm is a CUDA compute capability", "remove sm, or set compute = \"cuda\"")
        for listed in data["targets"]:  # a target that runs on some computes only says which (profile_rules)
            rules = profile_rules(listed)
            if rules.computes is not None and data["compute"] not in rules.computes:
                raise refuse(f"targets lists {listed!r} with compute = {data['compute']!r}",
                             rules.reason or f"the {listed} target runs on {'/'.join(rules.computes)}",
                             f"set compute = \"{rules.computes[0]}\", or remove {listed}")
        return cls(name=name, source=source, **{
            **data, "targets": tuple(data["targets"]), "notes": tuple(data.get("notes", ())),
            "memory_gib": float(data["memory_gib"]),
            "serving": ServingLimits(**{k: tuple(v) if isinstance(v, list) else v
                                        for k, v in data.get("serving", {}).items()})})


# ---- loading --------------------------------------------------------------------------------------
def _read_profile(entry: Traversable, name: str) -> DeviceProfile:
    source = str(entry)
    try:
        text = entry.read_text(encoding="utf-8-sig")  # the BOM Windows editors write is not TOML: dropped
    except (OSError, UnicodeDecodeError) as exc:
        raise EdgelinError(f"device profile {source} cannot be read", f"{type(exc).__name__}: {exc}",
                           "fix the file's permissions or encoding (UTF-8), or remove it") from exc
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise EdgelinError(f"device profile {source} is not valid TOML", str(exc),
                           f"fix the syntax (see {README})") from exc
    return DeviceProfile.from_dict(name, data, source)


def _profiles_in(folder: Traversable) -> dict[str, DeviceProfile]:
    entries = [e for e in folder.iterdir() if e.name.endswith(".toml") and not e.name.startswith(".")
               and e.is_file()]
    return {e.name[:-len(".toml")]: _read_profile(e, e.name[:-len(".toml")])
            for e in sorted(entries, key=lambda e: e.name)}


def user_devices_dir() -> Path | None:
    """The folder named by EDGELIN_DEVICES (read at each call, not at import), or None."""
    value = os.environ.get(USER_DEVICES_ENV, "")
    if not value:
        return None
    folder = Path(value).expanduser()
    if not folder.is_dir():
        raise EdgelinError(f"{USER_DEVICES_ENV}={value} is not a folder",
                           "it names a folder of device profiles (*.toml) that add to or replace the built-in ones",
                           f"point it at an existing folder, or unset {USER_DEVICES_ENV}")
    return folder


def load_devices(folder: Path | Traversable | None = None) -> dict[str, DeviceProfile]:
    """The profiles in `folder`; by default the built-in ones, then EDGELIN_DEVICES's (which win)."""
    if folder is not None:
        return _profiles_in(folder if isinstance(folder, Traversable) else Path(folder))
    user = user_devices_dir()
    return {**_profiles_in(DEVICES_DIR), **(_profiles_in(user) if user else {})}


def get_device(name: str, folder: Path | Traversable | None = None) -> DeviceProfile:
    devices = load_devices(folder)
    if not name.strip():  # `--device ''` (an unset shell variable): refused, never read as no device
        raise EdgelinError(f"--device {name!r}", "the device name is empty",
                           f"use one of: {', '.join(devices) or '(none found)'}, or leave --device out (no device)")
    if name not in devices:
        close = difflib.get_close_matches(name, devices, n=1)
        raise EdgelinError(f"unknown device {name!r}" + (f" (closest: {close[0]!r})" if close else ""),
                           f"no {name}.toml among the device profiles",
                           f"use one of: {', '.join(devices) or '(none found)'}, or add {name}.toml to a folder "
                           f"named by {USER_DEVICES_ENV}")
    return devices[name]


# ---- profile -> export choices --------------------------------------------------------------------
@dataclass(frozen=True)
class ExportSettings:
    """What an export does for a device. With no profile: fp32 graphs and float32 state (as before)."""

    precision: str = "fp32"
    state_dtype: str = "float32"
    state_dim_multiple: int = 1
    target_options: dict[str, Any] = field(default_factory=dict)  # the profile fields the target reads, e.g. {"sm": 87}
    threads: int = 0
    device: str | None = None  # the profile's name
    quantize: str | None = None  # weight-only quantisation: None, "int8" or "int4" (--quantize)
    block_size: int = 32  # weights per quantisation block (--block-size)
    force: bool = False  # the user's --force: export past a failed quality or state-precision check

    def manifest_entry(self) -> dict[str, Any]:
        """manifest.json's extra["device"]: the profile and the choices it led to."""
        return {"name": self.device, "precision": self.precision, "state_dtype": self.state_dtype,
                "state_dim_multiple": self.state_dim_multiple, "threads": self.threads,
                "target_options": dict(self.target_options), "quantize": self.quantize,
                "block_size": self.block_size}


def export_settings(profile: DeviceProfile | None, target_name: str, precision_flag: str | None = None,
                    quantize: str | None = None, block_size: int | None = None, force: bool = False) -> ExportSettings:
    """The export choices for `target_name` on `profile`: an explicit flag wins over the profile, the
    profile over the defaults. A choice the target cannot write is refused, never silently replaced.
    `quantize`/`block_size`: --quantize/--block-size; `force`: the user's --force (recorded, read by the
    quality and state-precision checks that it overrides)."""
    target = get_target(target_name)
    if quantize is not None and quantize not in QUANTIZE:
        raise EdgelinError(f"--quantize {quantize}", f"weight quantisation must be one of: {', '.join(QUANTIZE)}"
                           + _closest(quantize, QUANTIZE), "pass --quantize int8, int4 or fp16")
    if block_size is not None and (isinstance(block_size, bool) or not isinstance(block_size, int)
                                   or block_size not in BLOCK_SIZES):
        raise EdgelinError(f"--block-size {block_size}", "ONNX Runtime's block quantiser takes blocks of "
                           f"{', '.join(map(str, BLOCK_SIZES))} weights (32: edgelin's own 4- and 8-bit kernels)",
                           f"pass --block-size 32 (or {', '.join(str(b) for b in BLOCK_SIZES if b != 32)})")
    if precision_flag is not None and precision_flag not in PRECISIONS:
        raise EdgelinError(f"--precision {precision_flag}", f"precision must be one of: {', '.join(PRECISIONS)}"
                           + _closest(precision_flag, PRECISIONS), "pass --precision fp32 or --precision fp16")
    if profile is None:
        settings = ExportSettings(precision=precision_flag or "fp32")
    else:
        if target_name not in profile.targets:
            raise EdgelinError(f"device {profile.name} does not list target {target_name}",
                               f"its profile lists: {', '.join(profile.targets)}",
                               "pick one of those --target values, or another --device (edgelin devices lists them)")
        options = {k: getattr(profile, k) for k in target.profile_options if getattr(profile, k) is not None}
        settings = ExportSettings(precision_flag or profile.precision, profile.state_dtype,
                                  profile.state_dim_multiple, options, profile.threads, profile.name)
    limits = {"precision": target.precisions, "state_dtype": target.state_dtypes, "quantize": target.quantize_modes}
    if settings.precision not in limits["precision"]:
        asked = (f"--precision {settings.precision}" if precision_flag else
                 f"device {settings.device} asks for precision {settings.precision} (its profile's default)")
        raise EdgelinError(f"{asked}, which the {target_name} target cannot export",
                           f"the {target_name} target writes {'/'.join(limits['precision'])} graphs today; "
                           f"{settings.precision} {target_name} export lands with the edge-precision work",
                           f"pass --precision {limits['precision'][0]} to export {limits['precision'][0]} graphs"
                           + (f" for {settings.device}" if settings.device else ""))
    if quantize is not None and quantize not in limits["quantize"]:
        takes = "/".join(limits["quantize"]) or "no weight quantisation"
        others = [n for n in target_names() if n != target_name and quantize in get_target(n).quantize_modes]
        raise EdgelinError(f"--quantize {quantize} for the {target_name} target",
                           f"the {target_name} target takes {takes}",
                           "drop --quantize" + (f", or use --target {others[0]} (it writes {quantize} weights)"
                                                if others else ""))
    if quantize == "fp16" and settings.precision != "fp32":
        raise EdgelinError(f"--quantize fp16 with {settings.precision} graphs",
                           "--quantize fp16 stores a float32 graph's matmul weights as float16; an fp16 graph's "
                           "weights are float16 already", "drop --quantize, or export with --precision fp32")
    settings = dataclasses.replace(settings, quantize=quantize, force=force,
                                   **({"block_size": block_size} if block_size is not None else {}))
    if settings.state_dtype not in limits["state_dtype"]:
        raise EdgelinError(f"device {settings.device} asks for state_dtype {settings.state_dtype}, which the "
                           f"{target_name} target cannot export",
                           f"the {target_name} target keeps its state in {'/'.join(limits['state_dtype'])} today",
                           f"use a profile with state_dtype = \"{limits['state_dtype'][0]}\" "
                           f"({USER_DEVICES_ENV}=DIR adds one), or another --target")
    return settings


def check_state_dims(layers: Sequence[Sequence["StateTensor"]], settings: ExportSettings) -> None:
    """A profile's state_dim_multiple is met (the innermost dim of every state tensor, the width the
    Neural Engine tiles: coremltools#2631) or the export is refused with the dims that miss it.
    Targets that pad the state up to the multiple instead (Core ML: `pads_state_dims`) skip this check."""
    m = settings.state_dim_multiple
    if m <= 1:
        return
    misses = [f"layer {i} {t.name} {t.dims[-1]}" for i, layer in enumerate(layers) for t in layer
              if isinstance(t.dims[-1], int) and t.dims[-1] % m]
    if misses:
        shown = ", ".join(misses[:6]) + (f" and {len(misses) - 6} more" if len(misses) > 6 else "")
        padders = [name for name in target_names() if get_target(name).pads_state_dims]
        raise EdgelinError(f"device {settings.device} needs state widths that are multiples of {m}",
                           f"these are not: {shown} (the innermost dim of each state tensor)",
                           f"export a model whose head and conv widths are multiples of {m}, or pick another "
                           "--device" + "".join(f", or --target {n} (which pads the state with zeros)" for n in padders))
