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
  in Python) of rank <= 5 tensors per chunk (edgelin.export.static_chunks); step as for ONNX.
- "coreai": delta-rule layers with a scalar or no decay through Apple's GatedDeltaUpdate composite (step and
  prefill), the other layers Core ML's static chunk loop (edgelin.export.coreai.lowering).

Register those with `register_lowering(Lowering(...))`; asking for a target with no lowering is an
error, never a silent fall back to some other form.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from edgelin.errors import EdgelinError
from edgelin.model.mixer import use_engine
from edgelin.reference.engine import Engine
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


LOWERINGS: dict[str, Lowering] = {}  # registered by hand; targets declare theirs


def register_lowering(entry: Lowering) -> Lowering:
    LOWERINGS[entry.target] = entry
    return entry


def get_lowering(target_name: str) -> Lowering:
    """The lowering registered under `target_name`, else the one its target declares (Target.lowering)."""
    if target_name in LOWERINGS:
        return LOWERINGS[target_name]
    from edgelin.export.targets import target_names

    entry = _target_lowering(target_name) if target_name in target_names() else None
    if entry is None:
        raise EdgelinError(f"no lowering for target {target_name!r}",
                           f"lowerings exist for: {', '.join(sorted(all_lowerings()))}",
                           "give the target a lowering() (edgelin.export.base.Target), or register one with "
                           "edgelin.export.lowering.register_lowering")
    return entry


def _target_lowering(target_name: str) -> Lowering | None:
    from edgelin.export.targets import get_target

    return get_target(target_name).lowering()


def all_lowerings() -> dict[str, Lowering]:
    """Every lowering: each registered target's (those that trace graphs) and any registered by hand."""
    from edgelin.export.targets import target_names

    found = {name: entry for name in target_names() if (entry := _target_lowering(name)) is not None}
    return {**found, **LOWERINGS}


@contextlib.contextmanager
def lowering(target_name: str, **engine_options: object) -> Iterator[Lowering]:
    """Install `target_name`'s lowering for the duration of the block (e.g. while tracing); `engine_options`
    replace fields of its engine (the ONNX target's `contrib_ops=False`: --step-ops standard)."""
    entry = get_lowering(target_name)
    if engine_options:
        entry = dataclasses.replace(entry, engine=dataclasses.replace(entry.engine, **engine_options))
    with entry.patch() as installed:
        yield installed
