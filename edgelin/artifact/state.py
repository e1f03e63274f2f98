"""State policy in one place: the names of state inputs and outputs, and each state tensor's dtype.

Names follow optimum / onnxruntime-genai: `past_key_values.{layer}.{name}` in,
`present.{layer}.{name}` out. Only this module spells them; everything that needs an input's
output reads `feeds` from the manifest (`outputs_by_input`) rather than rewriting strings.

Dtype: a device profile names the state dtype (`state_dtype` in devices/*.toml), which export
options carry to `state_tensors`. Today the choice is per device (every state tensor of the model
takes it); per-family refinements (e.g. keeping a delta-rule accumulator in float32 on a float16
device) belong in `state_tensors`, the one place that assigns dtypes. Each target says which
dtypes it can export (ONNX: float32 only for now).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import TYPE_CHECKING

from edgelin.errors import EdgelinError

if TYPE_CHECKING:  # the names below are read by runtimes too, which import no torch: keep this module light
    from edgelin.artifact.tensors import TensorIO
    from edgelin.families.spec import StateTensor
    from edgelin.model.lm import CausalLM

STATE_INPUT_PREFIX = "past_key_values"
STATE_OUTPUT_PREFIX = "present"


def state_input_name(layer: int, name: str) -> str:
    """The graph input a layer's state tensor is fed through: past_key_values.{layer}.{name}."""
    return f"{STATE_INPUT_PREFIX}.{layer}.{name}"


def state_output_name(layer: int, name: str) -> str:
    """The graph output holding a layer's new state tensor: present.{layer}.{name}."""
    return f"{STATE_OUTPUT_PREFIX}.{layer}.{name}"


def parse_state_name(full: str) -> tuple[int, str]:
    """(layer, name) of a state input or output name; EdgelinError for anything else."""
    prefix, _, rest = full.partition(".")
    layer, _, name = rest.partition(".")
    if prefix not in (STATE_INPUT_PREFIX, STATE_OUTPUT_PREFIX) or not layer.isdigit() or not name:
        raise EdgelinError(f"{full!r} is not a state tensor name",
                           f"state names are {STATE_INPUT_PREFIX}.LAYER.NAME or {STATE_OUTPUT_PREFIX}.LAYER.NAME",
                           "use the names the manifest lists")
    return int(layer), name


def output_name_for(input_name: str) -> str:
    """present.{layer}.{name} for past_key_values.{layer}.{name} (by the naming rule; where a
    manifest is at hand, prefer `outputs_by_input`, which reads its `feeds`)."""
    return state_output_name(*parse_state_name(input_name))


def outputs_by_input(outputs: Iterable["TensorIO"]) -> dict[str, str]:
    """{state input name: the output that feeds it}, read from a graph's `feeds` entries."""
    return {t.feeds: t.name for t in outputs if t.feeds is not None}


def state_tensors(model: "CausalLM", state_dtype: str = "float32") -> list[list[StateTensor]]:
    """The model's state tensors per layer with the storage dtype of an export for `state_dtype`
    (a device profile's choice)."""
    from edgelin.artifact.vocabulary import STATE_DTYPES

    if state_dtype not in STATE_DTYPES:
        raise EdgelinError(f"state dtype {state_dtype!r}", f"state tensors are stored as {', '.join(STATE_DTYPES)}",
                           "fix the device profile's state_dtype or the export option")
    return [[dataclasses.replace(t, dtype=state_dtype) for t in layer] for layer in model.state_tensors()]
