"""ONNX target: torch's dynamo exporter -> checked .onnx files; runs on ONNX Runtime.

This module is the target and its export half. It imports no torch at module level: the registry
imports it on a runtime-only install too (can_run, runner). The exporter's modules (torch, onnx)
are imported inside the export functions; the run half is edgelin.export.onnx.runner.
"""

from __future__ import annotations

import contextlib
import io
import logging
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from edgelin.errors import EdgelinError, environment_fault, one_line
from edgelin.export.onnx.metadata import KV_CAPACITY_KEY
from edgelin.ortops import DOMAIN as ORT_OPS_DOMAIN
from edgelin.artifact.vocabulary import PRECISIONS, QUANTIZE
from edgelin.export.base import Artifact, Phase, Target, TargetFlag, missing_module
from edgelin.artifact.tensors import TensorIO

if TYPE_CHECKING:
    from edgelin.export.lowering import Lowering
    import torch

    from edgelin.devices import DeviceProfile, ExportSettings
    from edgelin.artifact.manifest import Manifest
    from edgelin.export.onnx.runner import OnnxRunner
    from edgelin.model.lm import CausalLM


# Example sizes for tracing: none is 0 or 1 (the exporter would specialise them) and the sequence
# spans several chunks and attention blocks with a remainder.
EXAMPLE_SIZES = {"batch": 2, "sequence": 67, "past_sequence": 5}


def example_inputs(model: "CausalLM", inputs: list[TensorIO], sizes: dict[str, int]) -> tuple["torch.Tensor", ...]:
    import torch

    gen = torch.Generator().manual_seed(0)
    out = []
    for t in inputs:
        shape = [sizes[d] if isinstance(d, str) else d for d in t.dims]
        if t.role == "input_ids":
            out.append(torch.randint(0, model.config.vocab_size, shape, generator=gen))
        elif t.role == "position_ids":
            out.append(torch.arange(3, 3 + shape[0]) * 7)
        else:
            dtype = torch.float16 if t.dtype == "float16" else torch.float32
            out.append((torch.randn(shape, generator=gen) * 0.1).to(dtype))
    return tuple(out)


def export_onnx_graph(module: "torch.nn.Module", model: "CausalLM", inputs: list[TensorIO], outputs: list[TensorIO],
                      path: Path, opset: int) -> None:
    import torch

    args = example_inputs(model, inputs, EXAMPLE_SIZES)
    # Parameters must not require grad: otherwise the exporter's type-promotion pass re-traces the
    # chunk scan through its autograd path, which fails on symbolic shapes (torch 2.13).
    module.requires_grad_(False)
    per_input = [{axis: torch.export.Dim.DYNAMIC for axis, d in enumerate(t.dims) if isinstance(d, str)}
                 for t in inputs]
    dynamic = (per_input[0], tuple(per_input[1:]))  # forward(input_ids, *args)
    log = io.StringIO()
    logging.getLogger("torch.onnx").setLevel(logging.ERROR)  # "torchvision is not installed" noise
    try:
        with contextlib.redirect_stdout(log), contextlib.redirect_stderr(log), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            torch.onnx.export(
                module, args, str(path), dynamo=True, opset_version=opset, dynamic_shapes=dynamic,
                input_names=[t.name for t in inputs], output_names=[t.name for t in outputs],
                external_data=False, optimize=True, verify=False,
            )
    except Exception as exc:
        fault = environment_fault(exc)
        if fault is not None:  # a full disk, a quota, permissions: the caller's output claim names the fix
            raise fault from None
        raise EdgelinError(f"ONNX export of {path.name} failed", exporter_reason(exc, log.getvalue()),
                           "report this model config as an edgelin bug (run with --debug for the trace)") from exc
    name_dynamic_axes(path, inputs, outputs)


def exporter_reason(exc: BaseException, log: str, limit: int = 400) -> str:
    """Why torch.onnx.export failed, on one line: the exception, and the last line the exporter printed
    that is not one of its "[torch.onnx] <step>... ✅/❌" progress lines (often the actual complaint)."""
    said = [line for line in log.splitlines() if line.strip() and not line.lstrip().startswith("[torch.onnx]")
            and not any(mark in line for mark in ("✅", "❌"))]
    reason = f"{type(exc).__name__}: {one_line(str(exc), limit)}"
    return reason + (f" (exporter: {one_line(said[-1], 160)})" if said else "")


def name_dynamic_axes(path: Path, inputs: list[TensorIO], outputs: list[TensorIO]) -> None:
    """Give every dynamic axis its contract name and fail if the exporter fixed any of them."""
    import onnx

    proto = onnx.load(str(path))
    graph_values = {v.name: v for v in [*proto.graph.input, *proto.graph.output]}
    renames: dict[str, str] = {}
    for t in [*inputs, *outputs]:
        value = graph_values.get(t.name)
        if value is None:
            raise EdgelinError(f"{path.name} has no {t.name!r}", "the exporter dropped or renamed it",
                               "report this as an edgelin bug")
        dims = value.type.tensor_type.shape.dim
        if len(dims) != len(t.dims):
            raise EdgelinError(f"{path.name}: {t.name} has rank {len(dims)}, expected {len(t.dims)}",
                               "the graph does not match the I/O contract", "report this as an edgelin bug")
        for axis, (dim, want) in enumerate(zip(dims, t.dims)):
            if isinstance(want, int):
                if dim.dim_value != want:
                    raise EdgelinError(f"{path.name}: {t.name} axis {axis} is {dim.dim_value or dim.dim_param}",
                                       f"expected the fixed size {want}", "report this as an edgelin bug")
                continue
            if not dim.dim_param:
                raise EdgelinError(
                    f"{path.name}: dynamic axis {want!r} of {t.name} was fixed to {dim.dim_value} by the exporter",
                    "the graph would only run at the example's size", "report this model config as an edgelin bug")
            renames.setdefault(dim.dim_param, want)
            dim.dim_param = renames[dim.dim_param]
    for value in proto.graph.value_info:
        for dim in value.type.tensor_type.shape.dim:
            if dim.dim_param in renames:
                dim.dim_param = renames[dim.dim_param]
    strip_trace_metadata(proto.graph)
    onnx.checker.check_model(proto, full_check=True)
    onnx.save(proto, str(path))


# Node metadata the exporter writes that only debugs the trace: the Python stack, FX node and class
# path of every node (~0.6 MB per graph for the shipped model, and this machine's source paths). The
# module path (`pkg.torch.onnx.name_scopes`) stays: it names the matrix behind each MatMul.
TRACE_METADATA = ("pkg.torch.onnx.stack_trace", "pkg.torch.onnx.fx_node", "pkg.torch.onnx.class_hierarchy",
                  "namespace")


def strip_trace_metadata(graph) -> None:
    import onnx

    for node in graph.node:
        kept = [p for p in node.metadata_props if p.key not in TRACE_METADATA]
        del node.metadata_props[:]
        node.metadata_props.extend(kept)
        for attribute in node.attribute:
            if attribute.type == onnx.AttributeProto.GRAPH:
                strip_trace_metadata(attribute.g)
            for sub in attribute.graphs:
                strip_trace_metadata(sub)


def graph_modules(model: "CausalLM", precision: str, static: bool = False,
                  kv_dtype: str | None = None) -> dict[str, "torch.nn.Module"]:
    """The modules traced for each graph at `precision`. fp32: the graphs as they are. fp16: the graphs
    of a float16 copy of the model (edgelin.model.lm.with_compute_dtype: weights and matmuls fp16; the
    recurrence, its state, decay and gates float32, cast inside LinearMixer) behind a float32 I/O
    boundary: state inputs are cast to the dtype the model keeps them in (accumulators float32, conv
    and KV caches fp16, which hold fp16 projections anyway, so the cast loses nothing) and every
    output back to float32, so the state I/O and logits stay float32 whatever the precision. With `static`
    (--kv-cache static) the growing KV caches stay float32 inside too: GroupQueryAttention updates the bound
    buffer in place, which a cast of the cache (a copy of all of it per call) would defeat; with `kv_dtype`
    float16 (--kv-dtype fp16) that cache is float16 at the I/O and inside."""
    import torch

    from edgelin.export.graphs import GRAPHS
    from edgelin.model.lm import with_compute_dtype

    if precision == "fp32":
        return {kind: graph(model).eval() for kind, graph in GRAPHS.items()}
    dtype = {"fp16": torch.float16}[precision]
    low = with_compute_dtype(model, dtype).eval()
    half_kv = kv_dtype == "float16"
    kept = [torch.float32 if t.accumulates or (static and not half_kv and "past_sequence" in t.dims) else dtype
            for layer in model.state_tensors() for t in layer]
    # the I/O dtype of each state output: float32, but a float16 static cache stays float16
    io = [torch.float16 if static and half_kv and "past_sequence" in t.dims else torch.float32
          for layer in model.state_tensors() for t in layer]

    class Float32IO(torch.nn.Module):
        def __init__(self, graph: torch.nn.Module):
            super().__init__()
            self.inner = graph  # not "graph": an fx GraphModule has that attribute

        def forward(self, input_ids: torch.Tensor, *args: torch.Tensor):
            lead = 1 if model.needs_position else 0  # position_ids come before the state
            states = [s.to(d) for s, d in zip(args[lead:], kept)]
            logits, *presents = self.inner(input_ids, *args[:lead], *states)
            return (logits.float(), *[t.to(d) for t, d in zip(presents, io)])

    return {kind: Float32IO(graph(low)).eval() for kind, graph in GRAPHS.items()}


# Targets built on this export whose graphs share one weights file. The tensorrt target rewrites step.onnx
# afterwards with onnx-ir, keeping the external-data references, and checks it by path (add_step_functions).
SHARED_WEIGHTS = ("onnx", "tensorrt")


def finish_graphs(folder: Path, files: dict[str, str], settings: "ExportSettings", share: bool = True,
                  embeddings: bool = True, embedding_bits: int | None = None,
                  step_outputs: list[TensorIO] | None = None,
                  edgelin_ops: bool = False, contrib_ops: bool = False,
                  rotary_positions: int | None = None) -> dict[str, str]:
    """After tracing: sibling MatMuls fused (edgelin.export.fuse_matmuls), --quantize (both graphs alike, so
    their quantised weights still match; with `embeddings`, the embedding table and LM head too, at
    `embedding_bits` when given), then (with
    `share`) one copy of the weights, a weights.bin both graphs reference (ONNX external data), given the step
    graph's outputs, which states that graph updates in place (edgelin.export.onnx.in_place, on the graph as
    written), with `contrib_ops` (--step-ops contrib or edgelin) the step's residual Adds + RMSNorms and, given
    `rotary_positions` (a static KV cache's capacity), its rotary as ONNX Runtime's contrib ops
    (edgelin.export.onnx.kernels.fuse_contrib_steps), and with `edgelin_ops` (--step-ops edgelin) the float32
    weight products of both graphs on packed panels (edgelin.export.panels) and the step's nodes for edgelin's
    kernels (edgelin.export.onnx.kernels). Returns the files it adds ({"weights": "weights.bin"} or
    nothing)."""
    from edgelin.export.fuse_matmuls import fuse_matmuls
    from edgelin.export.weights import WEIGHTS_KEY, share_weights

    graphs = [files[kind] for kind in ("step", "prefill")]
    for file in graphs:  # sibling projections as one MatMul + Split (before quantising: one wider MatMulNBits)
        fuse_matmuls(folder / file)
    if settings.quantize is not None:
        from edgelin.export.quantize import quantize_graph

        for file in graphs:
            quantize_graph(folder / file, settings.quantize, settings.block_size, embeddings, embedding_bits)
    if edgelin_ops:  # the float32 products left (all of a float export's) on packed panels, in both graphs
        from edgelin.export.panels import pack_float_products

        for file in graphs:
            pack_float_products(folder / file)
    added = {WEIGHTS_KEY: share_weights(folder, graphs)} if share else {}
    if step_outputs is not None:
        mark_in_place_states(folder / files["step"], step_outputs)
    if contrib_ops:
        from edgelin.export.onnx.kernels import fuse_contrib_steps

        fuse_contrib_steps(folder / files["step"], rotary_positions)
    if edgelin_ops:
        from edgelin.export.onnx.kernels import route_to_edgelin_kernels

        route_to_edgelin_kernels(folder / files["step"])
        route_to_edgelin_kernels(folder / files["prefill"], products_only=True)
    return added


@dataclass(frozen=True)
class OnnxOptions:
    """The ONNX target's own export options."""

    opset: int = 18
    # --quantize: also quantise the embedding table and LM head (GatherBlockQuantized / MatMulNBits);
    # False: --keep-embeddings-float. No effect without --quantize.
    quantize_embeddings: bool = True
    # --embeddings-bits: the embedding table and LM head at these bits (8 with --quantize int4: llama.cpp's Q4_0
    # keeps its token table at Q8_0 too); None: the --quantize bits.
    embedding_bits: int | None = None
    # --kv-cache static --context N: full-context attention layers export as GroupQueryAttention and the
    # runner keeps their KV cache in one buffer of N positions per tensor, updated in place (KV_CACHES).
    kv_cache: str = "growing"
    context: int | None = None  # the static cache's capacity in tokens (required with kv_cache="static")
    # --kv-dtype: the static cache's dtype; fp16 halves the bytes its attention reads per token (edgelin's kernel
    # reads float16 rows with F16C; the node's q/k/v are cast to fp16 and its output back)
    kv_dtype: str = "fp32"
    # --step-ops: the step graph's recurrence and short conv as ONNX Runtime's com.microsoft LinearAttention and
    # CausalConvWithState (one node each per linear layer; ONNX Runtime >= 1.32), or standard ONNX ops (any
    # ONNX runtime; slower). edgelin.export.lowering.OnnxEngine.contrib_ops. "edgelin" (the default): contrib, and
    # the step's convs, recurrences, 4-/8-bit products and static-cache attention as ai.edgelin ops for edgelin's
    # operator library, ONNX Runtime's own op as each one's function body, so the file runs without the library too
    # (edgelin.export.onnx.kernels; edgelin.ortops).
    step_ops: str = "edgelin"

    def __post_init__(self) -> None:
        if self.step_ops not in STEP_OPS:
            raise EdgelinError(f"--step-ops {self.step_ops}", f"the ONNX step's ops are one of {', '.join(STEP_OPS)}",
                               "pass --step-ops contrib (ONNX Runtime >= 1.32), edgelin (contrib and edgelin's own "
                               "CPU kernels) or standard")
        if self.embedding_bits not in (None, 4, 8):
            raise EdgelinError(f"--embeddings-bits {self.embedding_bits}", "the embedding table and LM head quantise "
                               "to 4 or 8 bits", "pass --embeddings-bits 8 (or 4)")
        if self.embedding_bits is not None and not self.quantize_embeddings:
            raise EdgelinError("--embeddings-bits with --keep-embeddings-float", "the embedding table and LM head "
                               "stay float with --keep-embeddings-float", "drop one of the two")
        if self.kv_cache not in KV_CACHES:
            raise EdgelinError(f"--kv-cache {self.kv_cache}", f"the ONNX target's KV caches are {', '.join(KV_CACHES)}",
                               "pass --kv-cache growing or --kv-cache static --context N")
        if self.kv_cache == "static" and (isinstance(self.context, bool) or not isinstance(self.context, int)
                                          or not 1 <= self.context <= MAX_CONTEXT):
            given = "without --context" if self.context is None else f"with --context {self.context}"
            raise EdgelinError(f"--kv-cache static {given}",
                               f"a fixed-capacity cache needs its capacity in tokens, 1..{MAX_CONTEXT}",
                               "pass --context N (the longest sequence the export will hold, e.g. 32768)")
        if self.kv_dtype not in KV_DTYPES:
            raise EdgelinError(f"--kv-dtype {self.kv_dtype}", f"the static KV cache is one of {', '.join(KV_DTYPES)}",
                               "pass --kv-dtype fp32 or fp16")
        if self.kv_dtype != "fp32" and self.kv_cache != "static":
            raise EdgelinError(f"--kv-dtype {self.kv_dtype} without --kv-cache static", "the dtype is the "
                               "fixed-capacity cache's (the growing cache follows the graphs' precision)",
                               "add --kv-cache static --context N, or drop --kv-dtype")
        if self.kv_cache == "growing" and self.context is not None:
            raise EdgelinError(f"--context {self.context} without --kv-cache static",
                               "a growing KV cache has no capacity", "add --kv-cache static, or drop --context")


# growing: past/present are graph inputs/outputs, concatenated each call (the default); static: an in-place
# fixed-capacity cache (GroupQueryAttention, one bound buffer; README "Fixed-capacity KV cache").
KV_CACHES = ("growing", "static")
KV_DTYPES = {"fp32": "float32", "fp16": "float16"}  # --kv-dtype: the static cache's I/O dtype
STEP_OPS = ("contrib", "standard", "edgelin")  # OnnxOptions.step_ops: OnnxEngine.contrib_ops on or off (edgelin: on)
ORT_OPS_KEY = "ort_ops"  # the manifest's entry for a step graph that names edgelin.ortops' ops
MAX_CONTEXT = (1 << 31) - 1  # GroupQueryAttention's sequence lengths are int32


# The modules each phase imports (import names; the distributions are the extras in pyproject.toml).
_EXPORT_NEEDS = ("torch", "onnx", "onnxscript", "onnxruntime")
_RUN_NEEDS = ("onnxruntime",)




def check_static_cache(model: "CausalLM", target: str, settings: "ExportSettings") -> None:
    """--kv-cache static is for ONNX Runtime and a model with a growing KV cache (fp16 graphs keep that cache
    float32: graph_modules)."""
    from edgelin.model.attention import SoftmaxAttention

    if target != "onnx":
        raise EdgelinError(f"--kv-cache static with --target {target}", "the fixed-capacity cache is ONNX Runtime's "
                           "GroupQueryAttention contrib op", "export with --target onnx, or drop --kv-cache")
    if not any(isinstance(m, SoftmaxAttention) and m.cfg.window is None for m in model.modules()):
        raise EdgelinError("--kv-cache static on a model without a growing KV cache", "its state is constant-size "
                           "already (linear layers, sliding-window attention)", "drop --kv-cache static")


def check_cache_capacity(model: "CausalLM", target: str, settings: "ExportSettings", options: "OnnxOptions") -> None:
    """A fixed-capacity KV cache (`--kv-cache static --context N`) must hold the longest sequence the export's
    own checks feed it: `edgelin validate DIR` replays the recorded reference vectors and measures the quality
    figures (reference_vectors.positions_needed: 527 tokens), and an fp16/quantised export runs the same figures
    as its quality gate. A shorter cache would write an export that cannot validate itself, and a larger one than
    this machine's memory or ONNX's protobuf limit holds (edgelin.export.static_cache) would fail minutes into the
    export: both refused before anything is traced, naming the --context that works."""
    from edgelin.artifact.reference_vectors import positions_needed
    from edgelin.export.static_cache import check_static_cache_size

    capacity = getattr(options, "context", None) if getattr(options, "kv_cache", None) == "static" else None
    if capacity is None:
        return
    check_static_cache(model, target, settings)  # its own refusals first (wrong target, no growing cache)
    need = positions_needed()
    if capacity < need:
        raise EdgelinError(f"--kv-cache static --context {capacity}",
                           f"the export's own checks (the reference vectors and quality figures that `edgelin "
                           f"validate DIR` replays, and the fp16/quantised quality gate) feed one sequence up to "
                           f"{need} tokens, more than a {capacity}-token cache holds",
                           f"pass --context {need} or more (the longest sequence the export will hold)")
    check_static_cache_size(model.config, capacity, KV_DTYPES[options.kv_dtype],
                            rotary_tables=options.step_ops != "standard", least=need)


def mark_static_cache(path: Path, outputs: list[TensorIO], layers: int, capacity: int) -> None:
    """Check that each GroupQueryAttention node reads its past KV from a graph input and writes its present
    straight to the graph output that feeds that input (what lets the runner bind one buffer to both: in
    place, nothing between them to copy), then record the capacity in the graph's metadata."""
    import onnx

    proto = onnx.load(str(path), load_external_data=False)  # weights stay where they are (weights.bin)
    graph_inputs = {v.name for v in proto.graph.input}
    feeds = {t.name: t.feeds for t in outputs if t.feeds is not None}
    nodes = [n for n in proto.graph.node if n.domain in ("com.microsoft", ORT_OPS_DOMAIN)
             and n.op_type == "GroupQueryAttention"]
    in_place = [n for n in nodes if all(n.input[3 + i] in graph_inputs and feeds.get(n.output[1 + i]) == n.input[3 + i]
                                        for i in (0, 1))]
    if len(nodes) != layers or len(in_place) != layers:
        raise EdgelinError(f"{path.name}: {len(in_place)} of {layers} attention layers export as an in-place "
                           "GroupQueryAttention", "the exporter put other nodes between the KV state and the op",
                           "report this model config as an edgelin bug; export without --kv-cache static meanwhile")
    set_metadata(proto, KV_CAPACITY_KEY, str(capacity))
    onnx.save(proto, str(path))


def mark_in_place_states(path: Path, outputs: list[TensorIO]) -> list[str]:
    """Record in the step graph's metadata which of its states the runner may update in place
    (edgelin.export.onnx.in_place); returns their past input names."""
    import onnx

    from edgelin.export.onnx.in_place import in_place_states
    from edgelin.export.onnx.metadata import IN_PLACE_KEY

    proto = onnx.load(str(path), load_external_data=False)  # weights stay where they are (weights.bin)
    safe = in_place_states(proto.graph, {t.name: t.feeds for t in outputs if t.feeds is not None})
    set_metadata(proto, IN_PLACE_KEY, ",".join(safe))
    onnx.save(proto, str(path))
    return safe


def set_metadata(proto, key: str, value: str) -> None:
    """The graph's metadata_props entry `key` set to `value` (replacing any)."""
    kept = [p for p in proto.metadata_props if p.key != key]
    del proto.metadata_props[:]
    proto.metadata_props.extend(kept)
    proto.metadata_props.add(key=key, value=value)


def ort_op_counts(path: Path) -> tuple[int, int]:
    """For the graph at `path`: how many nodes are edgelin.ortops' (--step-ops edgelin), and how many weight
    products ONNX Runtime would prepack (its own MatMulNBits, those the library does not take; the runner turns
    prepacking off when no graph has any). One parse; none for a graph without either name in its bytes."""
    import onnx

    data = path.read_bytes()
    if ORT_OPS_DOMAIN.encode() not in data and b"MatMulNBits" not in data:
        return 0, 0
    nodes = onnx.load(str(path), load_external_data=False).graph.node
    return (sum(node.domain == ORT_OPS_DOMAIN for node in nodes),
            sum(node.op_type == "MatMulNBits" and node.domain == "com.microsoft" for node in nodes))


def static_capacity(path: Path) -> int | None:
    """The static KV cache capacity a graph file records (None: a growing cache)."""
    import onnx

    proto = onnx.load(str(path), load_external_data=False)
    value = {p.key: p.value for p in proto.metadata_props}.get(KV_CAPACITY_KEY)
    return int(value) if value is not None else None


def _kv_retyped(tensors: tuple[TensorIO, ...], dtype: str) -> tuple[TensorIO, ...]:
    """The growing KV caches' state tensors (dims with past_sequence) as `dtype`."""
    import dataclasses

    return tuple(dataclasses.replace(t, dtype=dtype) if t.role == "state" and any("past_sequence" in str(d)
                                                                                    for d in t.dims) else t
                 for t in tensors)


def kv_cache_entry(capacity: int, dtype: str = "float32") -> dict:
    """manifest extra["kv_cache"] of a static-cache export (edgelin.artifact.manifest reads it)."""
    return {"layout": "static", "capacity": capacity, "op": "com.microsoft.GroupQueryAttention", "dtype": dtype}


class OnnxTarget(Target):
    name = "onnx"
    extra = "onnx"
    options_type = OnnxOptions
    saturates_float16 = True  # fp16 weights beyond float16's range: ±65504 (with_compute_dtype, to_float16)
    precisions = PRECISIONS
    erase_gate = True  # the ONNX forms and (TensorRT, a subclass) the EdgelinStep plugin's erase input
    triton_backend = "onnxruntime"  # edgelin.serve.triton.ONNXRUNTIME
    runtime = "onnxruntime"
    runtime_distributions = (("onnxruntime", ("onnxruntime", "onnxruntime-gpu")),)
    libraries = (("onnx", "pip install 'edgelin[onnx]'"),)
    flags = (
        TargetFlag("--keep-embeddings-float", "keep_embeddings_float", "With --quantize: leave the embedding table "
                   "and LM head float (quantise the other matmuls only).", bool),
        TargetFlag("--embeddings-bits", "embedding_bits", "With --quantize int4 / int8: the embedding table and LM "
                   "head at 8 or 4 bits (default: as --quantize; 8 with int4 is what llama.cpp's Q4_0 does).", int),
        TargetFlag("--kv-cache", "kv_cache", "The attention layers' KV cache: growing (default; concatenated each "
                   "call) or static (one buffer of --context tokens updated in place: GroupQueryAttention)."),
        TargetFlag("--context", "context", "With --kv-cache static: the cache's capacity in tokens (a longer "
                   "sequence is refused).", int),
        TargetFlag("--kv-dtype", "kv_dtype", "With --kv-cache static: the cache's dtype, fp32 (default) or fp16 "
                   "(half the bytes read per token)."),
        TargetFlag("--step-ops", "step_ops", "edgelin (default): the step's short convs, recurrences, 4-/8-bit "
                   "products and static-KV-cache attention through edgelin's CPU kernel library where the runner "
                   "loads it, ONNX Runtime's own ops elsewhere (same file); contrib: ONNX Runtime's contrib ops "
                   "LinearAttention and CausalConvWithState (ONNX Runtime >= 1.32); standard: standard ONNX ops "
                   "only (any ONNX runtime, slower)."),
    )

    run_flags = (TargetFlag("--prepack/--no-prepack", "prepack", "Let ONNX Runtime prepack the weights (a private "
                            "copy per session; default: off for float exports and for int4 / int8 ones whose 4-/8-bit "
                            "products are all edgelin's kernel, on for other quantised ones).", bool),)

    def apply_run_options(self, options: dict) -> None:
        if options.get("prepack") is not None:
            import os

            from edgelin.export.onnx.runner import PREPACK_ENV

            os.environ[PREPACK_ENV] = "1" if options["prepack"] else "0"  # read by the runner this process opens

    def options_from_flags(self, given: dict, settings: "ExportSettings",
                           precision_flag: str | None = None) -> tuple["OnnxOptions | None", "ExportSettings"]:
        quantize = settings.quantize
        fields: dict = {}
        if given.get("keep_embeddings_float"):
            if quantize is None:
                raise EdgelinError("--keep-embeddings-float without --quantize", "unquantised exports keep every "
                                   "weight float already", "add --quantize int4 (or int8), or drop "
                                   "--keep-embeddings-float")
            fields["quantize_embeddings"] = False
        bits = given.get("embedding_bits")
        if bits is not None:
            if quantize not in ("int4", "int8"):
                raise EdgelinError(f"--embeddings-bits {bits} without --quantize int4 or int8", "only "
                                   "block-quantised exports store the embedding table and LM head in bits",
                                   "add --quantize int4, or drop --embeddings-bits")
            fields["embedding_bits"] = bits
        kv = {k: given.get(k) for k in ("kv_cache", "context", "kv_dtype")}
        if any(v is not None for v in kv.values()):
            fields.update(kv_cache=kv["kv_cache"] or "growing", context=kv["context"], kv_dtype=kv["kv_dtype"] or "fp32")
        if given.get("step_ops") is not None:
            fields["step_ops"] = given["step_ops"]
        return (self.options_type(**fields) if fields else None), settings
    quantize_modes = QUANTIZE  # int8/int4 block-wise (MatMulNBits, GatherBlockQuantized), fp16 weights

    def lowering(self) -> "Lowering":
        from edgelin.export.onnx.lowering import LOWERING

        return LOWERING

    def check_export(self, model: "CausalLM", settings: "ExportSettings", options: OnnxOptions) -> None:
        check_cache_capacity(model, self.name, settings, options)

    def can_export(self) -> Phase:
        missing = missing_module(_EXPORT_NEEDS)
        if missing:
            return Phase(False, f"{missing} is not installed (pip install 'edgelin[onnx]')",
                         "a machine with edgelin[onnx] installed (any OS)")
        return Phase(True)

    def can_run(self, device: "DeviceProfile | None" = None) -> Phase:
        refused = self.device_refusal(device)
        if refused is not None:
            return refused
        missing = missing_module(_RUN_NEEDS)
        if missing:
            return Phase(False, f"{missing} is not installed (pip install 'edgelin[runtime]')",
                         "any machine with edgelin[runtime] installed (CPU; Linux, macOS, Windows, Android)")
        return Phase(True)

    def export(self, model: "CausalLM", device: "DeviceProfile | None", settings: "ExportSettings",
               options: OnnxOptions, folder: Path) -> dict[str, str]:
        if not isinstance(options, OnnxOptions):
            raise EdgelinError(f"ONNX export options of type {type(options).__name__}",
                               "the onnx target takes OnnxOptions", "pass OnnxOptions(opset=...) or nothing")
        if settings.precision not in PRECISIONS:
            raise EdgelinError(f"ONNX precision {settings.precision!r}",
                               f"this target exports {'/'.join(PRECISIONS)} graphs", "use --precision fp32 or fp16")
        if settings.state_dtype != "float32":  # float16 state: issue 11
            raise EdgelinError(f"ONNX state dtype {settings.state_dtype!r}", "this target stores the state as float32",
                               "export with state dtype float32 (pick a device profile whose state_dtype is float32)")
        import torch

        from edgelin.export.graphs import graph_io
        from edgelin.export.lowering import lowering
        from edgelin.model.attention import grouped_query_attention

        static = options.kv_cache == "static"
        if static:
            check_static_cache(model, self.name, settings)
        files, written = {}, {}
        kv_dtype = KV_DTYPES[options.kv_dtype] if static else None
        modules = graph_modules(model, settings.precision, static, kv_dtype)
        # the traced modules' layers (an fp16 graph traces a float16 copy of the model)
        traced = torch.nn.ModuleList(modules.values())
        attention = grouped_query_attention(traced) if static else contextlib.nullcontext(0)
        # --step-ops standard: the ONNX engine without its contrib ops (other targets tracing here keep their own)
        forms = lowering(self.name, **({"contrib_ops": False} if options.step_ops == "standard" else {}))
        with forms, attention as layers:  # the ONNX forms of the recurrences (chunk loop -> one Scan)
            for kind, module in modules.items():
                inputs, outputs = graph_io(model, kind, settings.state_dtype, kv_dtype)
                files[kind], written[kind] = f"{kind}.onnx", outputs
                export_onnx_graph(module, model, inputs, outputs, Path(folder) / files[kind], options.opset)
        shared = finish_graphs(Path(folder), files, settings, share=self.name in SHARED_WEIGHTS,
                               embeddings=options.quantize_embeddings, embedding_bits=options.embedding_bits,
                               step_outputs=written["step"],
                               contrib_ops=options.step_ops != "standard" and self.name == "onnx",
                               rotary_positions=options.context if static else None,
                               edgelin_ops=options.step_ops == "edgelin" and self.name == "onnx")  # (not TensorRT's)
        if static:  # on the graphs as written (quantised, weights shared)
            for kind, outputs in written.items():
                mark_static_cache(Path(folder) / files[kind], outputs, layers, options.context)
        return {**files, **shared}

    def finish_export(self, folder: Path, manifest: "Manifest", options: OnnxOptions | None = None) -> "Manifest | None":
        """Once the manifest exists (the pipeline calls this): a static-cache export's capacity, read from
        its graphs' metadata, goes into the manifest's state contract (extra["kv_cache"]), before the
        reference vectors are recorded through the runner that reads it. Other exports: nothing to add."""
        import dataclasses

        if not isinstance(options, OnnxOptions):
            return None
        extra = dict(manifest.extra)
        if options.kv_cache == "static":
            capacity = static_capacity(Path(folder) / manifest.graphs["step"].file)
            if capacity is not None:
                extra["kv_cache"] = kv_cache_entry(capacity, KV_DTYPES[options.kv_dtype])
            if options.kv_dtype != "fp32":  # the graphs' KV inputs and outputs are float16 (graph_io's kv_dtype)
                manifest = dataclasses.replace(manifest, graphs={
                    kind: dataclasses.replace(entry, inputs=_kv_retyped(entry.inputs, KV_DTYPES[options.kv_dtype]),
                                              outputs=_kv_retyped(entry.outputs, KV_DTYPES[options.kv_dtype]))
                    for kind, entry in manifest.graphs.items()})
        if options.step_ops == "edgelin":
            counts = {kind: ort_op_counts(Path(folder) / entry.file) for kind, entry in manifest.graphs.items()}
            if counts["step"][0]:  # the runner loads edgelin's operator library for this step graph (and the prefill's)
                extra[ORT_OPS_KEY] = {"library": "edgelin.ortops", "domain": ORT_OPS_DOMAIN,
                                      "step_nodes": counts["step"][0], "prefill_nodes": counts["prefill"][0],
                                      "packed_products": sum(packed for _, packed in counts.values())}
        retyped = options.kv_cache == "static" and options.kv_dtype != "fp32"
        return dataclasses.replace(manifest, extra=extra) if extra != manifest.extra or retyped else None

    def runner(self, artifact: Artifact, device: "DeviceProfile | None" = None,
               threads: int | None = None) -> "OnnxRunner":
        from edgelin.export.onnx.runner import OnnxRunner

        return OnnxRunner(artifact.folder, artifact.manifest, threads)
