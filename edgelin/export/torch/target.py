"""The torch target: edgelin's PyTorch reference as a runner, so `edgelin bench` and `validate` measure it in
the same tables as ONNX Runtime (and TensorRT). On an NVIDIA GPU it is what a GPU user without TensorRT
runs: decode steps replayed as CUDA graphs (the fused Gated DeltaNet decode where it takes the model),
prefill through the chunked form on the Triton kernels; on a CPU, eager torch.

The folder holds what every export holds (manifest.json with the I/O and state contract, reference.npz,
tokenizer.json, the quality figures) plus the model as `config.json` + `model.safetensors` (edgelin's own
checkpoint format: no pickles, and the runner loads it with edgelin's checkpoint code, never code from the
folder) and `torch.json`, the target's contract (the weights file's size and sha256, the storage dtypes).
Both graphs of the manifest name `model.safetensors`: one model runs the step (recurrent form) and the
prefill (chunked form). Precision: fp32, or fp16 (weights fp16 except the decay parameters, kept float32 as
in every fp16 export; the recurrent state float32, conv caches fp16 inside, float32 at the state I/O).

Run phase: needs torch (and safetensors). Where it runs (edgelin.export.torch.runner.choose_device):
`EDGELIN_TORCH_DEVICE` (cpu, cuda, cuda:N) when set; else a `--device` profile's compute (cuda: the GPU,
cpu: the CPU; a phone's ane/gpu is refused); else the GPU when torch sees one, the CPU otherwise. Device
profiles do not list this target (it is the reference, not a deployment): any profile with compute cuda
or cpu runs it. Export takes no `--device` for the same reason.

No torch at module level (the registry imports this module on a runtime-only install).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from edgelin.errors import EdgelinError
from edgelin.export.base import Artifact, Phase, Target, missing_module
from edgelin.export.torch import IN_DEVICE_PROFILES
from edgelin.export.torch.contract import CONFIG, CONTRACT, CONTRACT_FORMAT, CONTRACT_VERSION, PRECISIONS, WEIGHTS

if TYPE_CHECKING:
    from edgelin.devices import DeviceProfile, ExportSettings
    from edgelin.export.torch.runner import TorchRunner
    from edgelin.families import FamilySpec
    from edgelin.model.lm import CausalLM

RUN_COMPUTES = ("cuda", "cpu")  # device profiles whose compute this target runs on
_NEEDS = ("torch", "safetensors")
_WHERE = "a machine with edgelin[onnx] installed (it brings torch; an NVIDIA GPU for the CUDA-graph decode)"


@dataclass(frozen=True)
class TorchOptions:
    """The torch target has no options of its own (precision is the export's --precision)."""




class TorchTarget(Target):
    name = "torch"
    extra = "onnx"  # the extra that brings torch
    options_type = TorchOptions
    saturates_float16 = True  # fp16 weights beyond float16's range: ±65504 (with_compute_dtype, to_float16)
    precisions = PRECISIONS  # fp32 or fp16 weights; the recurrent state float32
    in_device_profiles = IN_DEVICE_PROFILES  # declared in the package (data): the reference is not a deployment
    runtime = "torch"
    libraries = (("torch", "pip install 'edgelin[onnx]' (it brings torch)"),
                 ("safetensors", "pip install 'edgelin[onnx]'"))

    def can_export(self) -> Phase:
        missing = missing_module(_NEEDS)
        if missing:
            return Phase(False, f"{missing} is not installed (pip install 'edgelin[onnx]')", _WHERE)
        return Phase(True)

    def device_refusal(self, device: "DeviceProfile | None") -> Phase | None:
        """The reference runs on any CUDA or CPU profile (profiles list deployment targets, not it)."""
        if device is None or device.compute in RUN_COMPUTES:
            return None
        return Phase(False, f"device {device.name} computes on {device.compute}; the torch reference runs on "
                            f"{' or '.join(RUN_COMPUTES)}", "an NVIDIA GPU or a CPU (--device desktop-gpu or "
                            "desktop-cpu, or no --device)")

    def can_run(self, device: "DeviceProfile | None" = None) -> Phase:
        refused = self.device_refusal(device)
        if refused is not None:
            return refused
        missing = missing_module(_NEEDS)
        if missing:
            return Phase(False, f"{missing} is not installed: the torch target runs the PyTorch reference "
                                "(a runtime-only install has no torch)", _WHERE)
        return Phase(True)

    def family_support(self, spec: "FamilySpec") -> str | None:
        return None  # the reference itself: every family, every option (erase gate included)

    def export(self, model: "CausalLM", device: "DeviceProfile | None", settings: "ExportSettings",
               options: TorchOptions, folder: Path) -> dict[str, str]:
        if settings.precision not in PRECISIONS:
            raise EdgelinError(f"torch precision {settings.precision!r}",
                               f"this target writes {'/'.join(PRECISIONS)} weights", "use --precision fp32 or fp16")
        if settings.quantize is not None:
            raise EdgelinError(f"--quantize {settings.quantize} for the torch target",
                               "the torch target keeps float weights", "drop --quantize, or use --target onnx")
        if settings.state_dtype != "float32":
            raise EdgelinError(f"torch state dtype {settings.state_dtype!r}",
                               "the torch target keeps its recurrent state in float32",
                               "export with state dtype float32 (no --device, or a profile whose state_dtype "
                               "is float32)")
        write_model(model, settings.precision, Path(folder))
        return {"step": WEIGHTS, "prefill": WEIGHTS}

    def runner(self, artifact: Artifact, device: "DeviceProfile | None" = None,
               threads: int | None = None) -> "TorchRunner":
        from edgelin.export.torch.runner import TorchRunner

        return TorchRunner(artifact.folder, artifact.manifest, device=device, threads=threads)


def write_model(model: "CausalLM", precision: str, folder: Path) -> dict:
    """config.json + model.safetensors (+ torch.json, returned) for `precision`: the fp16 copy is
    edgelin.model.lm.with_compute_dtype's (decay parameters float32), saved as it is."""
    import torch

    from edgelin.checkpoint import save_safetensors
    from edgelin.integrity import sha256_of
    from edgelin.model.lm import with_compute_dtype

    dtype = {"fp32": torch.float32, "fp16": torch.float16}[precision]
    low = with_compute_dtype(model, dtype)
    config = {**model.config.to_dict(), "torch_dtype": str(dtype).removeprefix("torch.")}
    (folder / CONFIG).write_text(json.dumps(config, indent=2) + "\n")
    tensors = {k: v.detach().contiguous() for k, v in low.state_dict().items()}
    if model.config.tie_word_embeddings:
        tensors.pop("lm_head.weight", None)  # safetensors refuses shared storage; the loader re-ties it
    save_safetensors(tensors, folder / WEIGHTS, {"format": "pt", "edgelin_precision": precision})
    by_dtype: dict[str, int] = {}
    for value in tensors.values():
        key = str(value.dtype).removeprefix("torch.")
        by_dtype[key] = by_dtype.get(key, 0) + value.numel() * value.element_size()
    contract = {"format": CONTRACT_FORMAT, "version": CONTRACT_VERSION, "precision": precision, "config": CONFIG,
                "weights": WEIGHTS, "bytes": (folder / WEIGHTS).stat().st_size, "sha256": sha256_of(folder / WEIGHTS),
                "config_sha256": sha256_of(folder / CONFIG), "tensor_bytes": dict(sorted(by_dtype.items()))}
    (folder / CONTRACT).write_text(json.dumps(contract, indent=2) + "\n")
    return contract
