"""Core AI target (Apple's new stack, coreai-core / coreai-torch / coreai-opt): one .aimodel whose `step` and
`prefill_{L}` entry points share one copy of the weights and hold the recurrent state as model state.

Phases: export converts wherever torch and coreai-torch install (Linux x86_64, macOS), saves the asset (Apple's
portable form; saved assets target OS 27) and, where Apple's Linux runtime runs, compiles it into the folder
(model.aimodelx: the runtime loads it in milliseconds instead of compiling the asset on every open). Run: Apple's
Core AI runtime (edgelin.export.coreai.runner), on Linux through the CPU runtime the coreai-core wheel carries
(CPU only: compute units cannot be chosen there, and its speed is no device figure), on macOS through the OS's.
So `edgelin validate`, `bench` and `generate` run a Core AI export here, on Apple's runtime.

The folder holds, besides the manifest, reference vectors and tokenizer every export has: model.aimodel,
model.aimodelx (where compiled) and coreai.json (edgelin.export.coreai.contract).

Options (CoreaiOptions): batch 1 (a batch runs row by row) or --dynamic-batch; the enumerated prefill lengths (one entry point each; other lengths are fed in those
pieces, the tail by step) and, for a model with full-attention layers, the KV cache's capacity (--context N,
default 4096: edgelin.export.fixed_cache). Precision fp32; the state float32 (default) or float16. Weights
float32, or with --quantize int8/int4 (coreai-opt, --block-size) or fp16 stored compressed in the program,
checked on Apple's runtime before the folder is published (edgelin.export.coreai.weights); compute stays fp32.

No torch or coreai at module level (the registry imports this module on any install).
"""

from __future__ import annotations

import dataclasses
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from edgelin.environment import module_version
from edgelin.errors import EdgelinError
from edgelin.export.base import Artifact, Phase, Target, TargetFlag, missing_module
from edgelin.export.coreai.contract import (ASSET, COMPILED, CONTRACT, CONTRACT_FORMAT, CONTRACT_VERSION,
                                            feature_name, load_contract, this_platform)
from edgelin.export.fixed_cache import capacity_dims, kv_cache_entry
from edgelin.export.prefill_lengths import DEFAULT_LENGTHS, checked_lengths, parse_lengths

if TYPE_CHECKING:
    from edgelin.artifact.manifest import Manifest
    from edgelin.devices import DeviceProfile, ExportSettings
    from edgelin.export.base import Runner
    from edgelin.export.lowering import Lowering
    from edgelin.model.lm import CausalLM

# The beta packages this target is tested with (pip install 'edgelin[coreai]' pins them): another version is
# refused in one line, since the betas change their API between releases.
PACKAGES = {"coreai-core": "==1.0.0b3", "coreai-torch": ">=0.4.3,<0.5", "coreai-opt": "==0.4.0"}
EXPORT_NEEDS = ("coreai-core", "coreai-torch")
RUN_NEEDS = ("coreai-core",)
INSTALL = "pip install 'edgelin[coreai]'"
# Where Apple's runtime runs from the wheel: Linux x86_64 (the CPU runtime) and macOS (the OS's Core AI).
_RUNS_ON = ("linux-x86_64", "darwin-arm64")
DEPLOYMENT_TARGETS = ("iOS27", "macOS27")
_WHERE = "Linux x86_64 (glibc 2.34+) or a Mac with macOS 27, with edgelin[coreai] installed"


@dataclass(frozen=True)
class CoreaiOptions:
    """The Core AI target's own export options."""

    prefill_lengths: tuple[int, ...] = DEFAULT_LENGTHS  # one prefill entry point per prompt length
    context: int | None = None  # the full-attention KV cache's capacity (None: 4096 where there is such a layer)
    dynamic_batch: bool = False  # entry points of any batch (one call per batch) instead of batch 1 (row by row)
    deployment_target: str | None = None  # iOS27 | macOS27 (None: both; a saved asset targets OS 27 only)
    composite_ops: bool = True  # matching delta-rule layers as Apple's GatedDeltaUpdate (False: edgelin's forms)

    def checked(self) -> "CoreaiOptions":
        if self.deployment_target is not None and self.deployment_target not in DEPLOYMENT_TARGETS:
            raise EdgelinError(f"Core AI deployment target {self.deployment_target}",
                               "Core AI assets target OS 27 only (coreai-core 1.0.0b3 saves no earlier format)",
                               "pass --deployment-target iOS27 or macOS27, or export with --target coreml for "
                               "iOS 16-26 / macOS 13-26")
        return dataclasses.replace(self, prefill_lengths=checked_lengths(self.prefill_lengths))


def package_refusal(needs: tuple[str, ...]) -> str | None:
    """Why the installed beta packages cannot serve (missing, or a version this target is not tested with)."""
    from packaging.specifiers import SpecifierSet

    for name in needs:
        found = module_version(name)
        if found is None:
            return f"{name} is not installed ({INSTALL})"
        if found not in SpecifierSet(PACKAGES[name], prereleases=True):
            return f"{name} {found} is installed; this target is tested with {name}{PACKAGES[name]} ({INSTALL})"
    return None


class CoreaiTarget(Target):
    name = "coreai"
    extra = "coreai"
    options_type = CoreaiOptions
    precisions = ("fp32", "bf16")  # fp16 arithmetic is emulated on Apple's Linux runtime: its parity is not checked
    quantize_modes = ("fp16", "int8", "int4")  # weights only (edgelin.export.coreai.weights); compute fp32
    state_dtypes = ("float32", "float16")  # Core AI takes fp32 model state (Core ML's MLState: fp16 only)
    erase_gate = True  # the static chunk loop's two-row WY form (edgelin.export.static_chunks)
    runtime = "coreai"
    runtime_distributions = (("coreai", ("coreai-core",)),)
    libraries = (("coreai", INSTALL),)
    flags = (
        TargetFlag("--prefill-lengths", "prefill_lengths", "Prompt lengths with a prefill entry point each, "
                   "comma-separated (default: 16,64); other lengths are fed in those pieces, the tail by step."),
        TargetFlag("--context", "context", "The full-attention layers' KV cache capacity in tokens, one buffer "
                   "of that many rows (a longer sequence is refused); onnx: with --kv-cache static; coreai, coreml: "
                   "held as model state (default 4096 for a model with such layers).", int),
        TargetFlag("--deployment-target", "deployment_target", "The OS the model is built for. coreml: iOS18 (default; one package, shared weights), "
                   "iOS16/iOS17/macOS13/macOS14 (explicit style; one package per function), macOS15; coreai: "
                   "iOS27 or macOS27 (its assets target OS 27 only)."),
        TargetFlag("--composite-ops/--no-composite-ops", "composite_ops", "Delta-rule layers with a scalar or no "
                   "decay through Apple's GatedDeltaUpdate composite, which Apple's runtime may fuse (default: on); off: "
                   "edgelin's own forms (on Apple's Linux CPU runtime ~3x faster: the composite runs as a token loop "
                   "there).", bool),
        TargetFlag("--dynamic-batch", "dynamic_batch", "Entry points that take any batch in one call (default: "
                   "batch 1, a batch runs row by row; a symbolic batch makes the conversion ~4x slower).", bool),
    )

    def options_from_flags(self, given: dict, settings: "ExportSettings",
                           precision_flag: str | None = None) -> tuple[CoreaiOptions, "ExportSettings"]:
        lengths = parse_lengths(given.get("prefill_lengths"))
        options = CoreaiOptions(lengths, given.get("context"), bool(given.get("dynamic_batch")),
                                given.get("deployment_target"), given.get("composite_ops") is not False)
        return options.checked(), settings

    def lowering(self) -> "Lowering":
        from edgelin.export.coreai.lowering import CoreaiEngine
        from edgelin.export.lowering import Lowering

        return Lowering("coreai", CoreaiEngine(), "delta-rule layers with a scalar or no decay through Apple's "
                        "GatedDeltaUpdate composite; the others a static chunk loop per enumerated prompt length "
                        "(coreai-torch cannot convert torch's scan)")

    def can_export(self) -> Phase:
        missing = missing_module(("torch",))
        if missing:
            return Phase(False, "torch is not installed (pip install 'edgelin[onnx,coreai]')", _WHERE)
        refused = package_refusal(EXPORT_NEEDS)
        return Phase(False, refused, _WHERE) if refused else Phase(True)

    def can_run(self, device: "DeviceProfile | None" = None) -> Phase:
        refused = self.device_refusal(device)
        if refused is not None:
            return refused
        if this_platform() not in _RUNS_ON:
            return Phase(False, f"Apple's Core AI runtime runs on Linux x86_64 and macOS (this is {this_platform()})",
                         _WHERE)
        refused = package_refusal(RUN_NEEDS)
        return Phase(False, refused, _WHERE) if refused else Phase(True)

    def check_export(self, model: "CausalLM", settings: "ExportSettings", options: CoreaiOptions) -> None:
        from edgelin.export.fixed_cache import resolve_context

        options.checked()
        if settings.precision not in self.precisions:
            raise EdgelinError(f"Core AI precision {settings.precision!r}", "this target computes in fp32 or bf16 "
                               "(fp16 arithmetic is emulated on Apple's Linux runtime, so an fp16 export's parity could "
                               "not be checked here)", "pass --precision fp32 or --precision bf16")
        if settings.quantize is not None and settings.precision != "fp32":
            raise EdgelinError(f"--quantize {settings.quantize} with --precision {settings.precision}",
                               "the coreai target compresses the weights of a float32 program (compute stays fp32)",
                               "pass --precision bf16 or --quantize, not both")
        resolve_context(model, options.context)
        if settings.quantize in ("int8", "int4"):
            _check_block_size(model, settings.block_size)

    def export(self, model: "CausalLM", device: "DeviceProfile | None", settings: "ExportSettings",
               options: CoreaiOptions, folder: Path) -> dict[str, str]:
        from edgelin import __version__
        from edgelin.export.coreai.convert import ConvertRequest, EntryPoint, compile_asset, convert_program, save_asset
        from edgelin.export.fixed_cache import resolve_context

        options = options.checked()
        capacity = resolve_context(model, options.context)
        entries = (EntryPoint("step", "step", 1),) + tuple(EntryPoint(f"prefill_{n}", "prefill", n)
                                                           for n in options.prefill_lengths)
        program = convert_program(model, ConvertRequest(entries, settings.state_dtype, capacity, options.dynamic_batch,
                                                         settings.precision, options.composite_ops))
        tensors = []
        if settings.quantize is not None:
            from edgelin.export.coreai.weights import compress, read_compressed

            program = compress(program, settings.quantize, settings.block_size)
            tensors = read_compressed(program)
        save_asset(program, folder, ASSET, {"edgelin_version": __version__, "edgelin_state_dtype": settings.state_dtype})
        compiled = None
        if sys.platform.startswith("linux"):  # macOS' runtime specialises the asset itself when it loads it
            compile_asset(folder, ASSET, COMPILED)
            compiled = {"file": COMPILED, "platform": this_platform(), "coreai_core": module_version("coreai-core")}
        contract = contract_for(model, settings, entries, capacity, compiled)
        contract["batch"] = "dynamic" if options.dynamic_batch else 1
        contract["deployment_target"] = options.deployment_target
        from edgelin.export.pipeline import precision_entry

        contract["weights"] = {"precision": precision_entry(settings)}  # the weights' account, into the manifest
        if settings.quantize is not None:  # by finish_export
            from edgelin.export.coreai.weights import describe

            contract["weights"]["quantization"] = describe(model, tensors, settings.quantize, settings.block_size)
        (Path(folder) / CONTRACT).write_text(json.dumps(contract, indent=2) + "\n")
        if settings.quantize is not None:  # before the folder is published: the runtime reads what was written
            self._verify(model, settings, options, folder, tensors)
        return {"step": ASSET, "prefill": ASSET}

    def _verify(self, model: "CausalLM", settings: "ExportSettings", options: CoreaiOptions, folder: Path,
                tensors: list) -> None:
        from edgelin.export.coreai.weights import verify
        from edgelin.export.pipeline import build_manifest

        files = {"step": ASSET, "prefill": ASSET}
        manifest = build_manifest(model, self.name, settings.precision, files, {}, None, settings.state_dtype)
        manifest = self.finish_export(folder, manifest, options) or manifest
        verify(model, folder, manifest, tensors, min(options.prefill_lengths))

    def finish_export(self, folder: Path, manifest: "Manifest", options: Any = None) -> "Manifest | None":
        """A full-attention KV cache's capacity goes into the manifest's state contract (extra["kv_cache"]), and
        compressed weights' account (extra["precision"], ["quantization"]: what replay's thresholds, the quality
        gate and inspect read) into its extra, before the reference vectors are recorded through the runner."""
        contract = json.loads((Path(folder) / CONTRACT).read_text())
        extra = {**manifest.extra, **contract.get("weights", {})}  # compressed weights: precision, quantization
        if contract["kv_capacity"] is not None:
            extra["kv_cache"] = kv_cache_entry(contract["kv_capacity"], contract["state_dtype"])
        return dataclasses.replace(manifest, extra=extra) if extra != manifest.extra else None

    def dequantized_weights(self, folder: Path, manifest: "Manifest") -> list:
        """The export's compressed weights read back from its asset (edgelin.reference.parity's reference)."""
        from edgelin.export.coreai.weights import read_asset

        return read_asset(folder, load_contract(folder)["asset"])

    def runner(self, artifact: Artifact, device: "DeviceProfile | None" = None,
               threads: int | None = None) -> "Runner":
        from edgelin.export.coreai.runner import CoreaiRunner

        return CoreaiRunner(artifact.folder, artifact.manifest)


def _check_block_size(model: "CausalLM", block_size: int) -> None:
    """coreai-opt quantises a weight only where its input dimension is a whole number of blocks (the others stay
    float32): a block size that fits no weight would quantise nothing."""
    inputs = {p.shape[1] for p in model.parameters() if p.ndim == 2}
    if not any(n % block_size == 0 for n in inputs):
        raise EdgelinError(f"--block-size {block_size} for this model", "coreai-opt quantises a weight only where "
                           f"its input dimension is a multiple of the block, and none is ({sorted(inputs)})",
                           "pass a smaller --block-size (e.g. 32)")


def contract_for(model: "CausalLM", settings: "ExportSettings", entries: tuple, capacity: int | None,
                 compiled: dict | None) -> dict:
    """coreai.json (edgelin.export.coreai.contract's docstring)."""
    from edgelin.export.graphs import graph_io

    inputs, _ = graph_io(model, "step", settings.state_dtype)
    states = [{"input": t.name, "feature": feature_name(t.name), "dims": list(capacity_dims(t.dims, capacity)),
               "dtype": settings.state_dtype} for t in inputs if t.role == "state"]
    return {
        "format": CONTRACT_FORMAT, "version": CONTRACT_VERSION, "asset": ASSET, "compiled": compiled,
        "minimum_os": "27", "compute_precision": settings.precision, "state_dtype": settings.state_dtype,
        "functions": {e.name: {"kind": e.kind, "length": e.length} for e in entries},
        "prefill_lengths": [e.length for e in entries if e.kind == "prefill"], "states": states,
        "ids_dtype": "int32", "position_ids": model.needs_position, "kv_capacity": capacity,
        "packages": {name: module_version(name) for name in EXPORT_NEEDS},
    }
