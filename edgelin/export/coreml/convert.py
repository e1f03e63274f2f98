"""Core ML conversion: the step graph and one prefill graph per enumerated prompt length, traced
under lowering("coreml") and converted by coremltools into ML programs, then merged into one
multifunction .mlpackage whose functions share one copy of the weights.

Layout of the converted functions (what coreml.json records and edgelin.export.coreml.check checks):
- batch 1, static (the Neural Engine runs static shapes); a runner splits a batch into rows.
- input_ids int32 ([1] for step, [1, L] for prefill_L; Core ML has no int64 inputs), position_ids
  int32 [1] where the model needs positions.
- Core ML feature names must be identifiers: the manifest's `past_key_values.0.recurrent_state`
  is `past_key_values_0_recurrent_state` (`feature_name`).
- state tensors padded with zeros to the profile's `state_dim_multiple` in their innermost dim
  (the Neural Engine tiles it: coremltools#2631); the graphs read the unpadded part and write
  zeros into the padding, so the padded state equals the manifest's state plus zero columns.
- explicit style: states are inputs (past_*) and outputs (present_*) in the state dtype;
  mlstate style: states are `ct.StateType` (fp16), read with read_state and written with
  coreml_update_state inside the function; the function returns the logits only.
- full-attention layers (a KV cache that grows with the context): traced under
  fixed_capacity(model, capacity), so their key/value states are [1, Hkv, capacity, d_h] in both
  styles, written at the position (gather + select) and read up to it; the MLState style is then
  Apple's stateful-Llama layout (the KV cache in fp16 model state).

coremltools and torch are imported inside the functions (the registry imports the target module on
a runtime-only install).
"""

from __future__ import annotations

import contextlib
import io
import logging
import shutil
import tempfile
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from edgelin.errors import EdgelinError
from edgelin.export.coreml.contract import feature_name

if TYPE_CHECKING:
    import torch

    from edgelin.artifact.tensors import TensorIO
    from edgelin.model.lm import CausalLM

BUG = "report this model config as an edgelin bug (run with --debug for the trace)"


def padded_dims(dims: tuple, multiple: int) -> tuple:
    """A state tensor's dims in the package: batch 1, innermost dim rounded up to `multiple`."""
    fixed = [1 if d == "batch" else d for d in dims]
    if multiple > 1 and isinstance(fixed[-1], int):
        fixed[-1] = -(-fixed[-1] // multiple) * multiple
    return tuple(fixed)


@dataclass(frozen=True)
class FunctionPlan:
    """One function of the package: its name, the graph kind and prompt length it was traced at."""

    name: str
    kind: str  # step | prefill
    length: int  # tokens per call (1 for step)


_OPS_REGISTERED = False


@contextlib.contextmanager
def quiet() -> Iterator[io.StringIO]:
    """coremltools' progress bars and warnings (e.g. "Torch version ... has not been tested") into a
    buffer: edgelin prints its own progress. The buffer names the op a failed conversion stopped at."""
    log = io.StringIO()
    logging.getLogger("coremltools").setLevel(logging.ERROR)
    with contextlib.redirect_stdout(log), contextlib.redirect_stderr(log), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield log


def register_ops() -> None:
    """Converters coremltools 9.0 lacks or gets wrong for the ops edgelin's graphs use:
    log_sigmoid (none: -softplus(-x)), cumsum (refuses a negative axis other than -1)."""
    global _OPS_REGISTERED
    if _OPS_REGISTERED:
        return
    from coremltools.converters.mil import Builder as mb
    from coremltools.converters.mil.frontend.torch.ops import _get_inputs
    from coremltools.converters.mil.frontend.torch.torch_op_registry import register_torch_op

    @register_torch_op(override=True)
    def log_sigmoid(context, node):  # noqa: ANN001 (coremltools' converter signature)
        x = _get_inputs(context, node, expected=1)[0]
        context.add(mb.mul(x=mb.softplus(x=mb.mul(x=x, y=-1.0)), y=-1.0, name=node.name))

    @register_torch_op(override=True)
    def cumsum(context, node):  # noqa: ANN001
        inputs = _get_inputs(context, node, min_expected=2)
        x, axis = inputs[0], int(inputs[1].val)
        context.add(mb.cumsum(x=x, axis=axis + x.rank if axis < 0 else axis, name=node.name))

    _OPS_REGISTERED = True


def state_dims(t: "TensorIO", multiple: int, capacity: int | None) -> tuple[int, ...]:
    """A state tensor's dims in the package: a KV cache at the capacity, batch 1, padded (padded_dims)."""
    from edgelin.export.fixed_cache import capacity_dims

    return padded_dims(capacity_dims(t.dims, capacity), multiple)


def _wrapped(model: "CausalLM", kind: str, states: list["TensorIO"], style: str, multiple: int,
             capacity: int | None) -> "torch.nn.Module":
    """The graph module with padded states: explicit (states in and out) or mlstate (fp16 buffers)."""
    import torch
    from torch import nn

    from edgelin.export.graphs import GRAPHS

    graph = GRAPHS[kind](model).eval()
    dims = [state_dims(t, multiple, capacity) for t in states]
    pads = [padded[-1] - t.dims[-1] for t, padded in zip(states, dims)]  # the innermost dim is a fixed size
    needs_position = model.needs_position

    def unpad(x: torch.Tensor, pad: int) -> torch.Tensor:
        return x[..., :x.shape[-1] - pad] if pad else x

    def repad(x: torch.Tensor, pad: int) -> torch.Tensor:
        return torch.cat([x, x.new_zeros(*x.shape[:-1], pad)], -1) if pad else x

    class Explicit(nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = graph

        def forward(self, input_ids, *args):
            lead, flat = (args[:1], args[1:]) if needs_position else ((), args)
            out = self.inner(input_ids.long(), *(a.long() for a in lead),
                             *(unpad(x.float(), p) for x, p in zip(flat, pads)))
            return (out[0], *(repad(x, p) for x, p in zip(out[1:], pads)))

    class Stateful(nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = graph
            for t, shape in zip(states, dims):  # Core ML states are fp16 ("State only support fp16 dtype")
                self.register_buffer(feature_name(t.name), torch.zeros(shape, dtype=torch.float16))

        def forward(self, input_ids, *lead):
            buffers = [getattr(self, feature_name(t.name)) for t in states]
            out = self.inner(input_ids.long(), *(a.long() for a in lead),
                             *(unpad(b.float(), p) for b, p in zip(buffers, pads)))
            for buffer, new, pad in zip(buffers, out[1:], pads):
                buffer[:] = repad(new, pad).half()  # a slice assignment: coremltools' state-update pattern
            return out[0]

    return (Explicit() if style == "explicit" else Stateful()).eval()


def convert_function(model: "CausalLM", plan: FunctionPlan, style: str, compute: str, state_dtype: str,
                     multiple: int, deployment: str, capacity: int | None = None) -> Any:
    """Trace one function under lowering("coreml") (and, with a `capacity`, the full-attention layers' KV cache
    at that many rows: fixed_capacity) and convert it: a coremltools MLModel."""
    import numpy as np
    import torch

    import coremltools as ct
    from edgelin.export.graphs import graph_io
    from edgelin.export.lowering import lowering
    from edgelin.model.attention import fixed_capacity

    register_ops()
    inputs, outputs = graph_io(model, plan.kind, state_dtype)
    states = [t for t in inputs if t.role == "state"]
    lead = [t for t in inputs if t.role != "state"]
    module = _wrapped(model, plan.kind, states, style, multiple, capacity).requires_grad_(False)
    gen = torch.Generator().manual_seed(0)
    shape_of = {"input_ids": [1] if plan.kind == "step" else [1, plan.length], "position_ids": [1]}
    examples = [torch.randint(0, model.config.vocab_size, shape_of["input_ids"], generator=gen, dtype=torch.int32)]
    if model.needs_position:
        examples.append(torch.tensor([3], dtype=torch.int32))
    state_np = np.float16 if state_dtype == "float16" else np.float32
    ct_inputs = [ct.TensorType(name=t.name, shape=shape_of[t.role], dtype=np.int32) for t in lead]
    ct_states, ct_outputs = [], [ct.TensorType(name="logits", dtype=np.float32)]
    if style == "explicit":
        for t in states:
            examples.append(torch.randn(state_dims(t, multiple, capacity), generator=gen) * 0.1)
            ct_inputs.append(ct.TensorType(name=feature_name(t.name), shape=state_dims(t, multiple, capacity),
                                           dtype=state_np))
        ct_outputs += [ct.TensorType(name=feature_name(t.name), dtype=state_np) for t in outputs if t.role == "state"]
    else:
        ct_states = [ct.StateType(wrapped_type=ct.TensorType(shape=state_dims(t, multiple, capacity),
                                                             dtype=np.float16), name=feature_name(t.name))
                     for t in states]
    log = None
    held = fixed_capacity(model, capacity) if capacity is not None else contextlib.nullcontext()
    try:
        with quiet() as log, lowering("coreml"), held, torch.no_grad():
            traced = torch.jit.trace(module, tuple(examples), check_trace=False)
            return ct.convert(
                traced, inputs=ct_inputs, outputs=ct_outputs, states=ct_states or None, convert_to="mlprogram",
                minimum_deployment_target=getattr(ct.target, deployment),
                compute_precision=ct.precision.FLOAT16 if compute == "fp16" else ct.precision.FLOAT32,
                compute_units=ct.ComputeUnit.ALL, skip_model_load=True)
    except EdgelinError:
        raise
    except Exception as exc:
        where = _where(exc, log.getvalue() if log is not None else "")
        raise EdgelinError(f"Core ML conversion of the {plan.name} function failed" + where,
                           f"{type(exc).__name__}: {str(exc)[:300]}", BUG) from exc


def _where(exc: Exception, log: str) -> str:
    """Which op and layer the converter stopped at, from its own 'ERROR - converting' line."""
    for line in reversed(log.splitlines()):
        if "converting '" in line:  # ERROR - converting 'log_sigmoid' op (located at: 'model/2/mixer/448'):
            op = line.split("converting '", 1)[1].split("'", 1)[0]
            at = line.split("located at: '", 1)[1].split("'", 1)[0] if "located at: '" in line else ""
            layer = at.split("/")[1] if at.startswith("model/") and at.count("/") >= 2 else None
            return f" at op {op!r}" + (f" in layer {layer}" if layer is not None else "")
    return ""


def save_package(models: dict[str, Any], folder: Path, package: str, multifunction: bool) -> list[str]:
    """Save the functions: one multifunction package (shared weights; iOS 18 / macOS 15), or one
    package per function where the deployment target predates multifunction models. Returns the
    package names written into `folder` (the export's temp folder)."""
    import coremltools as ct

    with tempfile.TemporaryDirectory(prefix=".coreml-", dir=folder) as scratch:
        paths = {}
        for name, model in models.items():
            paths[name] = Path(scratch) / f"{name}.mlpackage"
            model.save(str(paths[name]))
        if not multifunction:
            for name, path in paths.items():
                shutil.move(str(path), str(Path(folder) / f"{package}-{name}.mlpackage"))
            return [f"{package}-{name}.mlpackage" for name in paths]
        desc = ct.utils.MultiFunctionDescriptor()
        for name, path in paths.items():
            desc.add_function(str(path), src_function_name="main", target_function_name=name)
        desc.default_function_name = "step"
        with quiet():
            ct.utils.save_multifunction(desc, str(Path(folder) / f"{package}.mlpackage"))
    return [f"{package}.mlpackage"]


def stamp_metadata(path: Path, metadata: dict[str, str]) -> None:
    """Write edgelin's metadata (version, source hash, style) into a saved package, in place (the
    export's temp folder): saved to a sibling, then renamed over it."""
    import coremltools as ct

    model = ct.models.MLModel(str(path), skip_model_load=True)
    model.user_defined_metadata.update(metadata)
    model.short_description = "edgelin export: step and prefill functions of a linear-attention language model"
    fresh = path.with_name(f".stamped-{path.name}")  # coremltools wants the .mlpackage suffix
    with quiet():
        model.save(str(fresh))
    shutil.rmtree(path)
    fresh.rename(path)
