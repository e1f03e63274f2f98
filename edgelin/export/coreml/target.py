"""Core ML target: one .mlpackage per model whose `step` and `prefill_{L}` functions share one copy
of the weights (a multifunction ML program); explicit state or iOS 18 MLState.

Phases: export converts anywhere coremltools and torch install (Linux included) and then checks the
saved package against the manifest (edgelin.export.coreml.check); Core ML predictions need macOS, so
the run phase refuses elsewhere in one line. The folder holds, besides the manifest, reference
vectors and tokenizer every export has, the package(s) and `coreml.json`: the package's own
contract (style, deployment target, function per prompt length, Core ML feature names, padded
state dims), which the Linux check and the macOS runner read.

Two state styles (CoremlOptions.style):
- "explicit": state tensors are inputs (past_key_values_*) and outputs (present_*) of every
  function, in the state dtype (float32 by default; float16 from a profile that asks for it).
- "mlstate": `ct.StateType` states (MLState, iOS 18 / macOS 15), updated inside the functions; fp16
  only (Core ML refuses fp32 states), so the export first asks the state-precision verdict
  (edgelin.precision.check_state_dtype; --force overrides a failing one).
Deployment target: iOS 18 by default for both styles, because multifunction packages (shared
weights) need iOS 18 / macOS 15. The explicit style also exports for iOS 16/17 or macOS 13/14
(deployment_target="iOS16"...): then each function is its own package and carries its own weights.

Prefill: Core ML cannot convert torch's scan, so each enumerated prompt length L is its own
function `prefill_{L}`, traced with a static chunk loop (lowering("coreml")); a prompt is fed as
pieces of those lengths and its tail by step. Batch is static 1 (the Neural Engine); a runner runs
a batch row by row.

Hybrids with full-attention layers (Qwen3.5's full_attention): their KV cache is a fixed-capacity
state of `--context N` rows (edgelin.model.attention.fixed_capacity; edgelin.export.fixed_cache), in
either style: an MLState KV cache as Apple's stateful Llama example keeps it (fp16, iOS 18), or
explicit state at the capacity. The manifest records it (extra["kv_cache"], layout static), and the
runners refuse a call past the capacity in one line.

No torch or coremltools at module level (the registry imports this module on any install).
"""

from __future__ import annotations

import json
import platform
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from edgelin.errors import EdgelinError
from edgelin.export.base import Artifact, Phase, Target, TargetFlag, missing_module
from edgelin.export.coreml.contract import CONTRACT, CONTRACT_FORMAT, CONTRACT_VERSION

if TYPE_CHECKING:
    from edgelin.export.lowering import Lowering
    from edgelin.devices import DeviceProfile, ExportSettings
    from edgelin.export.base import Runner
    from edgelin.artifact.manifest import Manifest
    from edgelin.model.lm import CausalLM

STYLES = ("explicit", "mlstate")
PACKAGE = "model"
DEFAULT_PREFILL_LENGTHS = (16, 64)
MAX_PREFILL_LENGTH = 2048
# Deployment targets this exporter writes, with (platform, major version); multifunction models and
# MLState need iOS 18 / macOS 15.
DEPLOYMENT_TARGETS = {"iOS16": ("iOS", 16), "iOS17": ("iOS", 17), "iOS18": ("iOS", 18),
                      "macOS13": ("macOS", 13), "macOS14": ("macOS", 14), "macOS15": ("macOS", 15)}
_IOS18_LEVEL = {"iOS": 18, "macOS": 15}
# The device profile's compute -> the Core ML compute units an app should load the package with.
COMPUTE_UNITS = {"ane": "cpuAndNeuralEngine", "gpu": "cpuAndGPU", "cpu": "cpuOnly"}
RUN_REFUSAL = "Core ML predictions need macOS 13+ (15+ for MLState)"
_WHERE_RUN = "a Mac with macOS 13+ (15+ for MLState) and edgelin[coreml]"


def multifunction_ok(deployment: str) -> bool:
    os_name, major = DEPLOYMENT_TARGETS[deployment]
    return major >= _IOS18_LEVEL[os_name]


@dataclass(frozen=True)
class CoremlOptions:
    """The Core ML target's own export options (compute precision is the export's --precision)."""

    style: str = "explicit"  # explicit | mlstate
    prefill_lengths: tuple[int, ...] = DEFAULT_PREFILL_LENGTHS  # one prefill function per length
    deployment_target: str | None = None  # None: iOS18 (one multifunction package)
    context: int | None = None  # --context: the full-attention layers' KV cache capacity (None: the default)

    def checked(self) -> "CoremlOptions":
        """These options, normalised (sorted unique lengths), or one line saying what is wrong."""
        if self.style not in STYLES:
            raise EdgelinError(f"Core ML style {self.style!r}", f"the styles are: {', '.join(STYLES)}",
                               "pass --coreml-style explicit or --coreml-style mlstate")
        lengths = self.prefill_lengths
        if (not isinstance(lengths, (tuple, list)) or not lengths
                or not all(isinstance(n, int) and not isinstance(n, bool) and 1 <= n <= MAX_PREFILL_LENGTH
                           for n in lengths)):
            raise EdgelinError(f"prefill lengths {list(lengths) if isinstance(lengths, (tuple, list)) else lengths!r}",
                               f"each is a prompt length in 1..{MAX_PREFILL_LENGTH} (one prefill function per length)",
                               "pass e.g. --prefill-lengths 16,64")
        deployment = self.deployment_target or "iOS18"
        if deployment not in DEPLOYMENT_TARGETS:
            raise EdgelinError(f"Core ML deployment target {deployment!r}",
                               f"this exporter writes: {', '.join(DEPLOYMENT_TARGETS)}", "pass one of those")
        if self.style == "mlstate" and not multifunction_ok(deployment):
            raise EdgelinError(f"MLState with deployment target {deployment}",
                               "Core ML states (MLState) need iOS 18 / macOS 15 or later",
                               "use deployment target iOS18 or macOS15, or --coreml-style explicit")
        return CoremlOptions(self.style, tuple(sorted(set(lengths))), deployment, self.context)




def macos_major() -> int | None:
    """The macOS major version on a Mac, else None."""
    if platform.system() != "Darwin":
        return None
    release = platform.mac_ver()[0]
    return int(release.split(".")[0]) if release.split(".")[0].isdigit() else None


class CoremlTarget(Target):
    name = "coreml"
    extra = "coreml"
    options_type = CoremlOptions
    pads_state_dims = True  # the pipeline leaves state_dim_multiple to this target (zero padding)
    # fp16 or fp32 compute; float32 state (explicit style) or float16 (explicit, or MLState: fp16 only)
    precisions = ("fp16", "fp32")
    erase_gate = True  # the static chunk loop's two-row WY form (edgelin.export.static_chunks)
    state_dtypes = ("float32", "float16")
    # the compute units (ane, gpu, cpu) the package asks for; whether the device keeps the state in the model
    # (MLState: the default style then)
    profile_options = ("compute", "model_state")
    runtime = "coremltools"
    libraries = (("coremltools", "pip install coremltools (Core ML predictions also need macOS 13+)"),)
    flags = (
        TargetFlag("--coreml-style", "style", "Explicit state inputs/outputs, or iOS 18 MLState (fp16 state) "
                   "(default: mlstate where the device profile keeps the state in the model, e.g. --device "
                   "iphone; else explicit).", str, STYLES),
        TargetFlag("--prefill-lengths", "prefill_lengths", "Prompt lengths with a prefill function each, "
                   "comma-separated (default: 16,64); other lengths are fed in those pieces, the tail by step."),
        TargetFlag("--deployment-target", "deployment_target", "The OS the model is built for. coreml: iOS18 (default; one package, shared weights), "
                   "iOS16/iOS17/macOS13/macOS14 (explicit style; one package per function), macOS15; coreai: "
                   "iOS27 or macOS27 (its assets target OS 27 only)."),
        # one option with the onnx target's --context (the CLI shows the first target's help): worded for both
        TargetFlag("--context", "context", "The full-attention layers' KV cache capacity in tokens, one buffer "
                   "of that many rows (a longer sequence is refused); onnx: with --kv-cache static; coreai, coreml: "
                   "held as model state (default 4096 for a model with such layers).", int),
    )

    def options_from_flags(self, given: dict, settings: "ExportSettings",
                           precision_flag: str | None = None) -> tuple[CoremlOptions, "ExportSettings"]:
        return cli_options(settings, precision_flag, given.get("style"), given.get("prefill_lengths"),
                           given.get("deployment_target"), given.get("context"))

    def runtime_of(self, runner_label: str) -> str:
        """Apple's Core ML through coremltools, or (off macOS) the MIL program in numpy."""
        first = runner_label.strip().lower()
        return "numpy" if first.startswith("coreml") and "apple" not in first else "coremltools"

    def lowering(self) -> "Lowering":
        from edgelin.export.coreml.lowering import LOWERING

        return LOWERING

    def can_export(self) -> Phase:
        missing = missing_module(("torch", "coremltools"))
        if missing:
            return Phase(False, f"{missing} is not installed (pip install 'edgelin[onnx,coreml]')",
                         "a machine with edgelin[onnx,coreml] installed (Linux or macOS)")
        return Phase(True)

    def can_run(self, device: "DeviceProfile | None" = None) -> Phase:
        refused = self.device_refusal(device)
        if refused is not None:
            return refused
        major = macos_major()
        if major is None or major < 13:
            return Phase(False, RUN_REFUSAL + (f" (this is {platform.system()})" if major is None
                                               else f" (this is macOS {major})"), _WHERE_RUN)
        if missing_module(("coremltools",)):
            return Phase(False, "coremltools is not installed (pip install 'edgelin[coreml]')", _WHERE_RUN)
        return Phase(True)

    def check_export(self, model: "CausalLM", settings: "ExportSettings", options: object) -> None:
        """Full-attention layers: the KV cache's capacity (--context) resolved, or refused, before tracing."""
        from edgelin.export.fixed_cache import resolve_context

        if isinstance(options, CoremlOptions):
            resolve_context(model, options.context)

    def export(self, model: "CausalLM", device: "DeviceProfile | None", settings: "ExportSettings",
               options: CoremlOptions, folder: Path) -> dict[str, str]:
        from edgelin.export.coreml.convert import FunctionPlan, convert_function, save_package
        from edgelin.export.fixed_cache import resolve_context

        if not isinstance(options, CoremlOptions):
            raise EdgelinError(f"Core ML export options of type {type(options).__name__}",
                               "the coreml target takes CoremlOptions", "pass CoremlOptions(...) or nothing")
        options = options.checked()
        check_settings(model, settings, options)
        capacity = resolve_context(model, options.context)  # None: no full-attention layers
        plans = [FunctionPlan("step", "step", 1)] + [FunctionPlan(f"prefill_{n}", "prefill", n)
                                                     for n in options.prefill_lengths]
        models = {p.name: convert_function(model, p, options.style, settings.precision, settings.state_dtype,
                                           settings.state_dim_multiple, options.deployment_target, capacity)
                  for p in plans}
        multi = multifunction_ok(options.deployment_target)
        contract = contract_for(model, settings, options, device, plans, multi, capacity)
        packages = save_package(models, Path(folder), PACKAGE, multi)
        (Path(folder) / CONTRACT).write_text(json.dumps(contract, indent=2) + "\n")
        by_function = {p.name: contract["functions"][p.name]["package"] for p in plans}
        assert set(by_function.values()) == set(packages), (by_function, packages)
        return {"step": by_function["step"], "prefill": by_function[plans[-1].name]}

    def finish_export(self, folder: Path, manifest: "Manifest", options: object = None) -> "Manifest | None":
        """Once the manifest exists (the pipeline calls this): the source hash and edgelin's version
        into every package's metadata, then the Linux contract check of what was written. A package
        holding a fixed-capacity KV cache returns the manifest with it recorded (extra["kv_cache"]), which
        the runners that record the reference vectors next read."""
        import dataclasses

        from edgelin.export.coreml.check import check_folder
        from edgelin.export.coreml.convert import stamp_metadata
        from edgelin.export.fixed_cache import kv_cache_entry

        contract = json.loads((Path(folder) / CONTRACT).read_text())
        finished = None
        if contract.get("capacity") is not None:
            finished = manifest = dataclasses.replace(manifest, extra={
                **manifest.extra, "kv_cache": kv_cache_entry(contract["capacity"], contract["state_dtype"])})
        metadata = {"edgelin_version": manifest.edgelin_version, "source_sha256": str(manifest.source.get("sha256")),
                    "edgelin_style": contract["style"], "edgelin_state_dtype": contract["state_dtype"]}
        for package in sorted({f["package"] for f in contract["functions"].values()}):
            stamp_metadata(Path(folder) / package, metadata)
        check_folder(Path(folder), manifest)
        return finished

    def conversion_runner(self, artifact: Artifact) -> "Runner":
        """Where Core ML cannot run (off macOS): the Linux contract check, then a runner that evaluates
        the package's MIL program in numpy; `edgelin validate DIR` replays the reference through it.
        A check of the conversion, not of Apple's runtime."""
        from edgelin.export.coreml.check import check_folder
        from edgelin.export.coreml.runner import MilRunner

        check_folder(artifact.folder, artifact.manifest)
        return MilRunner(artifact.folder, artifact.manifest)

    def runner(self, artifact: Artifact, device: "DeviceProfile | None" = None,
               threads: int | None = None) -> "Runner":
        from edgelin.export.coreml.runner import CoremlRunner

        return CoremlRunner(artifact.folder, artifact.manifest, device)


def check_settings(model: "CausalLM", settings: "ExportSettings", options: CoremlOptions) -> None:
    """Refuse, in one line each, what this target cannot write (before any conversion)."""
    if settings.precision not in ("fp16", "fp32"):
        raise EdgelinError(f"Core ML precision {settings.precision!r}", "Core ML computes in fp16 or fp32",
                           "pass --precision fp16 or --precision fp32")
    if options.style == "mlstate":
        if settings.state_dtype != "float16":
            raise EdgelinError(f"MLState with a {settings.state_dtype} state",
                               "Core ML states (MLState) are fp16 only (fp32 states are refused by Core ML)",
                               "use --coreml-style explicit for a float32 state, or a device profile with "
                               "state_dtype = \"float16\" (e.g. --device iphone)")
        from edgelin.precision import check_state_dtype  # stream S: the measured fp16-state verdict

        check_state_dtype(model.config.layer_types, "float16", settings.force, "Core ML MLState")


def contract_for(model: "CausalLM", settings: "ExportSettings", options: CoremlOptions,
                 device: "DeviceProfile | None", plans: list, multifunction: bool, capacity: int | None) -> dict:
    """coreml.json: what the package holds, in Core ML's names (module docstring). `dims` are the package's
    (a KV cache at the capacity, padded), `true_dims` the manifest's (past_sequence: the tokens held)."""
    from edgelin.export.coreml.contract import feature_name
    from edgelin.export.coreml.convert import state_dims
    from edgelin.export.graphs import graph_io

    inputs, outputs = graph_io(model, "step", settings.state_dtype)
    feeds = {t.feeds: t.name for t in outputs if t.feeds}
    states = [{"input": t.name, "output": feeds[t.name], "feature": feature_name(t.name),
               "dims": list(state_dims(t, settings.state_dim_multiple, capacity)),
               "true_dims": [1 if d == "batch" else d for d in t.dims],
               "dtype": settings.state_dtype}  # float16 for MLState (check_settings refuses anything else)
              for t in inputs if t.role == "state"]
    functions = {p.name: {"kind": p.kind, "length": p.length,
                          "package": f"{PACKAGE}.mlpackage" if multifunction else f"{PACKAGE}-{p.name}.mlpackage"}
                 for p in plans}
    return {
        "format": CONTRACT_FORMAT, "version": CONTRACT_VERSION, "style": options.style,
        "deployment_target": options.deployment_target, "multifunction": multifunction,
        "compute_precision": settings.precision, "state_dtype": settings.state_dtype,
        "compute_units": COMPUTE_UNITS.get(device.compute, "all") if device is not None else "all",
        "batch": 1, "state_dim_multiple": settings.state_dim_multiple,
        "prefill_lengths": list(options.prefill_lengths), "functions": functions,
        "ids_dtype": "int32", "position_ids": model.needs_position, "states": states,
        "capacity": capacity,  # the full-attention layers' KV cache (--context), None without such layers
    }


def cli_options(settings: "ExportSettings", precision_flag: str | None, style: str | None, lengths: str | None,
                deployment: str | None, context: int | None = None) -> tuple[CoremlOptions, "ExportSettings"]:
    """`edgelin export --target coreml`'s options, and its defaults where no device profile chose:
    fp16 compute (the Neural Engine's), and for MLState a float16 state (the only one Core ML takes;
    a profile that asks for float32 is refused by the export, never overridden). The style: --coreml-style,
    else MLState where the device profile keeps the state in the model (`model_state = true`: iphone), else
    explicit."""
    import dataclasses

    parsed = DEFAULT_PREFILL_LENGTHS
    if lengths is not None:
        try:
            parsed = tuple(int(part) for part in lengths.split(","))
        except ValueError:
            raise EdgelinError(f"--prefill-lengths {lengths}", "it takes comma-separated prompt lengths",
                               "pass e.g. --prefill-lengths 16,64") from None
    if style is None:
        style = "mlstate" if settings.target_options.get("model_state") else "explicit"
    options = CoremlOptions(style, parsed, deployment, context).checked()
    if settings.device is None:
        settings = dataclasses.replace(settings, precision=precision_flag or "fp16",
                                       state_dtype="float16" if options.style == "mlstate" else settings.state_dtype)
    return options, settings
