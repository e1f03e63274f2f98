"""Core AI conversion: the step graph and one prefill graph per enumerated prompt length, each exported with
torch.export under lowering("coreai") and converted by coreai-torch into entry points of one
program, so the entry points share one copy of the weights; then saved as an .aimodel and, where Apple's runtime
runs it from a compiled folder (Linux), compiled into model.aimodelx.

Batch: 1 by default (a runner runs a batch row by row, each row its own state), or symbolic with
--dynamic-batch (one call per batch): measured on the shipped model, the symbolic batch makes torch.export's
decomposition ~4x slower (20 -> 80 s), for a phone or Mac that decodes one sequence at a time.

State: each manifest state tensor is an input the graph mutates in place (`copy_`), which coreai-torch turns into
model state (state_names): the runtime updates the caller's arrays in place across calls, so a runner's state
handle is its arrays. The recurrent state is float32 by default (Core AI takes fp32 state, unlike Core ML's fp16
MLState) or float16. A full-attention KV cache is state at the export's capacity (edgelin.model.attention's
fixed_capacity).

Prefill: coreai-torch crashes on torch's scan, so each prompt length is its own entry point; a prompt is fed in
pieces of those lengths, its tail by step.

Layers: under lowering("coreai") (edgelin.export.coreai.lowering) the delta-rule layers with a scalar or no decay
call Apple's GatedDeltaUpdate module, which each entry point's module holds and which is marked for
externalization before torch.export, so coreai-torch emits each call as the composite op "gated_delta_update"
(Apple's runtime may put its fused kernel there); the other layers trace the static chunk loop
(edgelin.export.static_chunks). ConvertRequest.composite_ops=False traces every layer the static way.

coreai and torch are imported inside the functions (the registry imports the target on a runtime-only install).
"""

from __future__ import annotations

import contextlib
import io
import shutil
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from edgelin.environment import module_version
from edgelin.errors import EdgelinError
from edgelin.export.coreai.contract import feature_name
from edgelin.export.fixed_cache import capacity_dims

if TYPE_CHECKING:
    import torch

    from edgelin.artifact.tensors import TensorIO
    from edgelin.model.lm import CausalLM

BUG = "report this model config as an edgelin bug (run with --debug for the trace)"
MAX_BATCH = 1024  # the entry points' batch dimension is dynamic, 1..MAX_BATCH
_TORCH_DTYPES = {"float32": "float32", "float16": "float16"}


@dataclass(frozen=True)
class EntryPoint:
    """One entry point of the program: its name, the graph kind and the prompt length it was traced at."""

    name: str
    kind: str  # step | prefill
    length: int  # tokens per call (1 for step)


@dataclass(frozen=True)
class ConvertRequest:
    """What one conversion needs besides the model."""

    entry_points: tuple[EntryPoint, ...]
    state_dtype: str  # float32 | float16
    capacity: int | None  # the full-attention KV cache's rows (None: no such layer)
    dynamic_batch: bool = False  # batch symbolic (1..MAX_BATCH) instead of 1: a conversion ~4x slower
    precision: str = "fp32"  # fp32 | bf16: the weights and matmuls (the recurrence stays float32)
    composite_ops: bool = True  # matching delta-rule layers as Apple's composite (edgelin.export.coreai.lowering)


@contextlib.contextmanager
def quiet() -> Iterator[io.StringIO]:
    """coreai-torch's progress lines and warnings (e.g. "only validated with torch<=2.13.0") into a buffer:
    edgelin prints its own progress."""
    log = io.StringIO()
    with contextlib.redirect_stdout(log), contextlib.redirect_stderr(log), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield log


def decompositions() -> dict:
    """coreai-torch's decomposition table, plus what its converter lacks for edgelin's graphs:
    aten.remainder.Scalar (the sliding-window ring's slot index) as remainder.Tensor, which it lowers; and a
    bfloat16 aten.full (new_zeros, masks in a bf16 graph), which coreai-torch 0.4.3 emits as float32 and then
    refuses ("dtype f32 vs bf16"), as a float32 full cast to bfloat16; aten.elu (linear attention's elu + 1
    feature map), which it has no lowering for, as where(x > 0, x, alpha (e^x - 1))."""
    import coreai_torch
    import torch

    table = coreai_torch.get_decomp_table()
    table[torch.ops.aten.remainder.Scalar] = lambda x, y: torch.ops.aten.remainder.Tensor(
        x, torch.scalar_tensor(y, dtype=x.dtype))

    def full(size, fill_value, *, dtype=None, layout=None, device=None, pin_memory=None):  # noqa: ANN001, ANN202
        if dtype != torch.bfloat16:
            return NotImplemented
        return torch.ops.aten.full.default(size, fill_value, dtype=torch.float32, layout=layout, device=device,
                                           pin_memory=pin_memory).to(torch.bfloat16)

    table[torch.ops.aten.full.default] = full
    table[torch.ops.aten.elu.default] = lambda x, alpha=1.0, scale=1.0, input_scale=1.0: scale * torch.where(
        x > 0, x, alpha * torch.expm1(x * input_scale))
    return table


def _entry_module(model: "CausalLM", kind: str, states: list["TensorIO"], precision: str) -> "torch.nn.Module":
    """The graph with its state as inputs it updates in place (coreai-torch's model state), holding the one
    GatedDeltaUpdate every matching layer calls while it is traced (`gated_delta_update`: each call site becomes
    its own composite graph; unused where no layer matches). bf16: the graph of a bfloat16 copy of the model
    (edgelin.model.lm.with_compute_dtype: weights and matmuls bf16; the recurrence, its state, decay and gates
    float32, cast inside LinearMixer), each state fed in the dtype the model keeps it in (accumulators float32, conv
    and KV caches bf16) and written back in the state's dtype; logits float32."""
    import torch
    from torch import nn

    from edgelin.export.coreai.lowering import composite_module
    from edgelin.export.graphs import GRAPHS
    from edgelin.model.lm import with_compute_dtype

    low = torch.bfloat16 if precision == "bf16" else torch.float32
    graph = GRAPHS[kind](with_compute_dtype(model, low)).eval()
    kept = [torch.float32 if t.accumulates or low == torch.float32 else low
            for layer in model.state_tensors() for t in layer]
    needs_position = model.needs_position

    class Entry(nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = graph
            self.gated_delta_update = composite_module()

        def forward(self, input_ids, *args):
            lead, held = (args[:1], args[1:]) if needs_position else ((), args)
            out = self.inner(input_ids.long(), *(a.long() for a in lead), *(s.to(d) for s, d in zip(held, kept)))
            for state, new in zip(held, out[1:]):
                state.copy_(new.to(state.dtype))
            return out[0].float()

    return Entry().eval().requires_grad_(False)


def _examples(model: "CausalLM", entry: EntryPoint, states: list["TensorIO"], request: ConvertRequest) -> tuple:
    import torch

    batch = 2 if request.dynamic_batch else 1  # an example batch > 1 keeps the dimension symbolic
    shape = (batch,) if entry.kind == "step" else (batch, entry.length)
    examples = [torch.zeros(shape, dtype=torch.int32)]
    if model.needs_position:
        examples.append(torch.zeros(batch, dtype=torch.int32))
    dtype = getattr(torch, _TORCH_DTYPES[request.state_dtype])
    for t in states:
        dims = capacity_dims(t.dims, request.capacity)
        examples.append(torch.zeros([batch if d == "batch" else d for d in dims], dtype=dtype))
    return tuple(examples)


def convert_program(model: "CausalLM", request: ConvertRequest) -> Any:
    """Export every entry point and convert them into one Core AI program (coreai.authoring.AIProgram)."""
    import torch

    from edgelin.export.graphs import graph_io
    from edgelin.export.lowering import lowering
    from edgelin.model.attention import fixed_capacity

    with quiet():  # its import warns that it was validated up to torch 2.13.0 (edgelin's conversions pass on it)
        import coreai_torch

    inputs, _ = graph_io(model, "step", request.state_dtype)
    states = [t for t in inputs if t.role == "state"]
    lead = ["input_ids"] + (["position_ids"] if model.needs_position else [])
    batch = torch.export.Dim("batch", min=1, max=MAX_BATCH)
    table = decompositions()
    try:
        with quiet():
            converter = coreai_torch.TorchConverter(mode=coreai_torch.TorchConverter.Mode.RELEASE)
            for entry in request.entry_points:
                module = _entry_module(model, entry.kind, states, request.precision)
                examples = _examples(model, entry, states, request)
                dynamic = tuple({0: batch} for _ in examples) if request.dynamic_batch else None
                if request.composite_ops:
                    _mark_composites(module)
                with torch.no_grad(), fixed_capacity(module, request.capacity or 1), lowering(
                        "coreai", composite=module.gated_delta_update, composite_ops=request.composite_ops):
                    program = torch.export.export(module, examples, dynamic_shapes=dynamic and (dynamic[0], dynamic[1:]))
                    program = program.run_decompositions(table)
                # one composite graph per call site (None: no layer took it); the module's forward restored
                composites = (coreai_torch._subexport_and_restore(module, program) or None) if request.composite_ops \
                    else None
                try:
                    converter.add_exported_program(program, input_names=lead, output_names=["logits"],
                                                   state_names=[feature_name(t.name) for t in states],
                                                   entrypoint_name=entry.name, _externalized_exported_programs=composites)
                except ValueError as exc:
                    raise _unsupported(exc, program, entry, model) from exc
            return converter.to_coreai()
    except EdgelinError:
        raise
    except Exception as exc:
        raise EdgelinError("Core AI conversion failed" + _where(exc), f"{type(exc).__name__}: {str(exc)[:300]}",
                           BUG) from exc


def _unsupported(exc: ValueError, program: Any, entry: EntryPoint, model: "CausalLM") -> Exception:
    """An op coreai-torch has no lowering for, as one line naming the layer(s) that use it (from the exported
    nodes' module stacks), raised before anything is saved; any other refusal of the converter as it is."""
    text = str(exc)
    if "unsupported ATen ops:" not in text:
        return exc
    ops = [op.strip() for op in text.split("unsupported ATen ops:", 1)[1].split(". Use", 1)[0].split(",")]
    layers = sorted({int(part.split(".")[1]) for node in program.graph.nodes if str(node.target) in ops
                     for path, _ in (node.meta.get("nn_module_stack") or {}).values()
                     for part in [path[path.find("layers."):]] if path.find("layers.") >= 0
                     and part.split(".")[1].isdigit()})
    where = ", ".join(f"layer {i} ({model.config.layer_types[i]})" for i in layers) or "outside the layers"
    return EdgelinError(f"Core AI cannot convert {where}: {', '.join(ops)} in the {entry.name} entry point",
                        f"coreai-torch {module_version('coreai-torch')} has no lowering for it",
                        "export this model with another target (onnx, coreml), or report it as an edgelin bug")


def _mark_composites(module: "torch.nn.Module") -> None:
    """Mark the module's GatedDeltaUpdate for externalization before it is exported (its forward becomes a custom
    op the exported program keeps opaque): coreai-torch's pre-marked-program path, the one Apple's coreai-models
    takes. add_pytorch_module(externalize_modules=...) does the same but exports every entry point twice."""
    import coreai_torch

    from edgelin.export.coreai.lowering import externalize_specs

    coreai_torch._patch_model_for_externalization(module, externalize_specs())


def _where(exc: Exception) -> str:
    """The op the converter stopped at, when its message names unsupported ATen ops."""
    text = str(exc)
    if "unsupported ATen ops:" in text:
        return " at " + text.split("unsupported ATen ops:", 1)[1].split(".", 1)[0].strip() + " (an op coreai-torch lacks)"
    return ""


def save_asset(program: Any, folder: Path, name: str, metadata: dict[str, str]) -> None:
    """The program as an .aimodel asset (Apple's portable form) in `folder`, edgelin's metadata inside."""
    from coreai.authoring.asset import AIModelAssetMetadata

    meta = AIModelAssetMetadata()
    meta.author = "edgelin"
    meta.model_description = "edgelin export: step and prefill entry points of a linear-attention language model"
    for key, value in metadata.items():
        meta.set_custom(key, value)
    program.save_asset(Path(folder) / name, metadata=meta)


def compile_asset(folder: Path, asset: str, compiled: str) -> None:
    """Compile the asset into the runtime form Apple's Linux runtime loads (what `asset.executable()` does into a
    temporary folder on every open: seconds to minutes), without the debug info it writes beside it."""
    from coreai.authoring import AIModelAsset

    target = Path(folder) / compiled
    target.mkdir()
    AIModelAsset.load(Path(folder) / asset)._write_odix(target, enable_debug_info=False)  # executable()'s own step
    for extra in target.glob("*.dbginfo"):
        extra.unlink()
    if not any(target.iterdir()):
        shutil.rmtree(target)
        raise EdgelinError("Core AI compiled nothing", f"{asset} compiled into an empty folder", BUG)
