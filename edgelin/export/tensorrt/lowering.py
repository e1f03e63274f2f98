"""The TensorRT target's lowering: the ONNX forms, except that each linear layer's one-token step
exports as one edgelin::EdgelinStep node, the IPluginV3 step plugin (S's update and readout; the
normaliser stays in standard ops); prefill's chunk loop as torch's scan, as for ONNX."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from edgelin.export.lowering import Lowering, scan_loop
from edgelin.export.tensorrt.step_node import plugin_step
from edgelin.reference.engine import TorchEngine

Tensor = torch.Tensor

@dataclass(frozen=True)
class PluginStepEngine(TorchEngine):
    """The ONNX forms, except that `step` exports as one edgelin::EdgelinStep node (the TensorRT
    step plugin; edgelin.export.tensorrt.target gives it an ONNX function with the same math).

    Its step takes q, k, v in the model's compute dtype (`step_takes_compute_dtype`: the mixer skips
    its fp32 cast for a T = 1 step), so an fp16 graph's plugin nodes read half-precision q/k/v
    (dtype=1) and the kernel accumulates in fp32; g, beta and the state still enter in fp32. Prefill
    (standard ops) keeps the fp32 recurrence inputs."""

    step_takes_compute_dtype: ClassVar[bool] = True

    def step(self, state: Tensor, q: Tensor, k: Tensor, v: Tensor, g: Tensor | None = None,
             beta: Tensor | None = None, erase: Tensor | None = None) -> tuple[Tensor, Tensor]:
        return plugin_step(state, q, k, v, g, beta, erase)


LOWERING = Lowering("tensorrt", PluginStepEngine(name="tensorrt-plugin", loop=scan_loop),
                    "step: one edgelin::EdgelinStep plugin node per linear layer; "
                    "prefill: the chunk loop as torch's scan")
