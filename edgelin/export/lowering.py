"""Target lowering as patches: how each target's graphs express the recurrences.

The reference (`edgelin.reference`) is pure torch and knows no target. While a target traces its
graphs it enters `with lowering(target_name):`, which installs that target's engine for every
linear mixer (`edgelin.model.mixer.use_engine`), in the spirit of optimum's model patchers:

- "onnx": the torch forms, with the chunked form's loop over chunks as torch's scan operator,
  which the exporter turns into one ONNX `Scan` with a dynamic trip count (a Python loop would be
  unrolled for the example's chunk count and pin the sequence length).
- "tensorrt": an engine whose `step` emits one `edgelin::EdgelinStep` node the IPluginV3 step
  plugin implements (S's update and readout; the normaliser stays in standard ops), prefill as for ONNX.
- "coreml": coremltools cannot convert torch's scan and Core ML takes tensors of rank <= 5, so
  its prefill functions are traced per enumerated prompt length with a static chunk loop (unrolled
  in Python) of rank <= 5 tensors per chunk (edgelin.export.coreml_lowering); step as for ONNX.

Register those with `register_lowering(Lowering(...))`; asking for a target with no lowering is an
error, never a silent fall back to some other form.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import ClassVar

import torch

from edgelin.errors import EdgelinError
from edgelin.model.mixer import use_engine
from edgelin.reference.engine import Engine, TorchEngine
from edgelin.reference.recurrence import ChunkBody

Tensor = torch.Tensor


def scan_loop(body: ChunkBody, init: Tensor, xs: tuple[Tensor, ...]) -> tuple[Tensor, Tensor]:
    """The chunk loop as torch's scan operator (exported as one ONNX Scan over chunks)."""
    from torch._higher_order_ops.scan import scan

    return scan(body, init, xs)


@dataclass(frozen=True)
class Lowering:
    """What a target needs while its graphs are traced: the engine every linear mixer runs."""

    target: str
    engine: Engine
    summary: str

    @contextlib.contextmanager
    def patch(self) -> Iterator["Lowering"]:
        with use_engine(self.engine):
            yield self


LOWERINGS: dict[str, Lowering] = {}


def register_lowering(entry: Lowering) -> Lowering:
    LOWERINGS[entry.target] = entry
    return entry


register_lowering(Lowering("onnx", TorchEngine(name="onnx-scan", loop=scan_loop),
                           "torch forms; the chunk loop is torch's scan (one ONNX Scan, dynamic count)"))


@dataclass(frozen=True)
class PluginStepEngine(TorchEngine):
    """The ONNX forms, except that `step` exports as one edgelin::EdgelinStep node (the TensorRT
    step plugin; edgelin.export.tensorrt_target gives it an ONNX function with the same math).

    Its step takes q, k, v in the model's compute dtype (`step_takes_compute_dtype`: the mixer skips
    its fp32 cast for a T = 1 step), so an fp16 graph's plugin nodes read half-precision q/k/v
    (dtype=1) and the kernel accumulates in fp32; g, beta and the state still enter in fp32. Prefill
    (standard ops) keeps the fp32 recurrence inputs."""

    step_takes_compute_dtype: ClassVar[bool] = True

    def step(self, state: Tensor, q: Tensor, k: Tensor, v: Tensor, g: Tensor | None = None,
             beta: Tensor | None = None, erase: Tensor | None = None) -> tuple[Tensor, Tensor]:
        from edgelin.export.tensorrt_target import plugin_step

        return plugin_step(state, q, k, v, g, beta, erase)


register_lowering(Lowering("tensorrt", PluginStepEngine(name="tensorrt-plugin", loop=scan_loop),
                           "step: one edgelin::EdgelinStep plugin node per linear layer; prefill as for ONNX"))


def _coreml_lowering() -> Lowering:
    from edgelin.export.coreml_lowering import StaticChunkEngine

    return Lowering("coreml", StaticChunkEngine(), "static chunk loop per enumerated prompt length, rank <= 5 "
                    "tensors per chunk (coremltools cannot convert torch's scan)")


register_lowering(_coreml_lowering())


def get_lowering(target_name: str) -> Lowering:
    if target_name not in LOWERINGS:
        raise EdgelinError(f"no lowering for target {target_name!r}",
                           f"lowerings exist for: {', '.join(sorted(LOWERINGS))}",
                           "register one with edgelin.export.lowering.register_lowering")
    return LOWERINGS[target_name]


@contextlib.contextmanager
def lowering(target_name: str) -> Iterator[Lowering]:
    """Install `target_name`'s lowering for the duration of the block (e.g. while tracing)."""
    with get_lowering(target_name).patch() as entry:
        yield entry
