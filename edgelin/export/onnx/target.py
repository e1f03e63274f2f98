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
from pathlib import Path
from typing import TYPE_CHECKING

from edgelin.errors import EdgelinError, environment_fault, one_line
from edgelin.ortops import DOMAIN as ORT_OPS_DOMAIN
from edgelin.artifact.vocabulary import QUANTIZE
from edgelin.export.base import Artifact, Phase, Target, TargetFlag, missing_module
from edgelin.export.onnx.options import (KV_DTYPES, ORT_OPS_KEY, OnnxOptions,
                                         check_cache_capacity, check_static_cache, kv_cache_entry, kv_retyped, mark_in_place_states,
                                         mark_static_cache, ort_op_counts, static_capacity)
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

    from edgelin.export.fuse_matmuls import fuse_graph
    from edgelin.export.onnx.deferred import optimize_traced
    from edgelin.export.phases import step
    from edgelin.export.weights import save_ir_graph

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
            program = torch.onnx.export(
                module, args, None, dynamo=True, opset_version=opset, dynamic_shapes=dynamic,
                input_names=[t.name for t in inputs], output_names=[t.name for t in outputs],
                optimize=False, verify=False,
            )
        step(f"optimising {path.name}")
        optimize_traced(program.model)  # the exporter's optimisation, weights transposed only when written
        # Sibling projections fused, then one write of the weights (to a data file: no 2 GiB limit); the initializers
        # are still the model's own tensors, transposed and concatenated as each is written.
        step(f"fusing the projections of {path.name}")
        fuse_graph(program.model.graph)
        step(f"writing {path.name}")
        save_ir_graph(program.model, path)
        held = sum(getattr(v.const_value, "nbytes", 0) for v in program.model.graph.initializers.values())
        del program
        release_rewriter_graphs(collect=held > COLLECT_BYTES)
    except Exception as exc:
        fault = environment_fault(exc)
        if fault is not None:  # a full disk, a quota, permissions: the caller's output claim names the fix
            raise fault from None
        raise EdgelinError(f"ONNX export of {path.name} failed", exporter_reason(exc, log.getvalue()),
                           "report this model config as an edgelin bug (run with --debug for the trace)") from exc
    name_dynamic_axes(path, inputs, outputs)


# What onnxscript's pattern matchers keep of the last graph they matched (onnxscript 0.7: a module-level rule set's
# matcher holds it in these attributes until its next match).
_MATCHER_STATE = ("_graph", "_current_node", "_tracer", "_match")
COLLECT_BYTES = 256 << 20  # a traced graph's weights past which its release runs the cycle collector at once


def release_rewriter_graphs(collect: bool = True) -> None:
    """Let the traced graph go: the exporter's rewrite rules live at module level, and each pattern matcher keeps
    the last graph it matched, with every initializer the tracer folded or we fused (Qwen3.5-0.8B's step graph:
    1.5 GB held through the prefill's tracing and the rest of the export). The matchers are the default rules'
    (or, in an onnxscript without that tuple, found by class); one of another layout is left as it is. `collect`:
    run the cycle collector now (the graph is a web of cycles: nodes, values, their graph), worth it for a large
    graph only (a full collection of a test session's heap takes a while)."""
    import gc

    from onnxscript import rewriter
    from onnxscript.rewriter import _matcher

    matchers = tuple(getattr(_matcher, name) for name in ("SimplePatternMatcher", "PatternMatcher")
                     if isinstance(getattr(_matcher, name, None), type))
    rules = getattr(rewriter, "_DEFAULT_REWRITE_RULES", None)
    held = ([vars(rule).get("_matcher") for rule in rules] if isinstance(rules, (tuple, list))
            else gc.get_objects() if matchers else [])
    for found in held:
        if matchers and issubclass(type(found), matchers):  # (not isinstance: a dead weak proxy raises on it)
            for attr in _MATCHER_STATE:
                if attr in vars(found):
                    setattr(found, attr, None)
    if collect:
        gc.collect()


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

    proto = onnx.load(str(path), load_external_data=False)  # the graph only: its weights stay where they are
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
    onnx.save(proto, str(path))
    onnx.checker.check_model(str(path), full_check=True)  # by path: a graph of more than 2 GiB is checked too


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
    """After tracing (which fused the sibling MatMuls: edgelin.export.fuse_matmuls), --quantize (both graphs alike, so
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
    from edgelin.export.phases import step
    from edgelin.export.weights import WEIGHTS, WEIGHTS_KEY, share_weights

    graphs = [files[kind] for kind in ("step", "prefill")]
    if settings.quantize is not None:
        from edgelin.export.quantize import quantize_graph

        for file in graphs:
            step(f"quantising {file} ({settings.quantize})")
            quantize_graph(folder / file, settings.quantize, settings.block_size, embeddings, embedding_bits)
    if edgelin_ops:  # the float32 products left (all of a float export's) on packed panels, in both graphs
        from edgelin.export.panels import pack_float_products

        for file in graphs:
            step(f"packing the float products of {file}")
            pack_float_products(folder / file)
    if share:
        step(f"writing {WEIGHTS}")
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


# The modules each phase imports (import names; the distributions are the extras in pyproject.toml).
_EXPORT_NEEDS = ("torch", "onnx", "onnxscript", "onnxruntime")
_RUN_NEEDS = ("onnxruntime",)




class OnnxTarget(Target):
    name = "onnx"
    extra = "onnx"
    options_type = OnnxOptions
    saturates_float16 = True  # fp16 weights beyond float16's range: ±65504 (with_compute_dtype, to_float16)
    precisions = ("fp32", "fp16")
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

    def export_memory_factor(self, settings: "ExportSettings") -> float:
        """The loaded float32 model and what the export's steps hold beside it (docs/benchmarks.md#export-cost), the
        weight passes writing each new weight as they make it (edgelin.export.weights.DataSpill): int8 / int4 at
        most one dequantised table while the parity reference takes the float weights' place (Qwen3.5-0.8B's
        shapes at int4 measured 1.03, int8 1.42 before the spill); fp16 1.45 (0.8B, its parity reference's
        unpacked head, since read a slice at a time: HalfRows; 0.96 after) and 1.46 (2B, before HalfRows); fp32 1.13
        (0.8B) and 1.19 (2B). Whatever the precision the float32 model is loaded: the factors differ little."""
        if settings.quantize in ("int8", "int4"):
            return 1.45
        return 1.5 if settings.quantize == "fp16" else 1.3

    def export_disk_factor(self, settings: "ExportSettings") -> float:
        """Both graphs' data files at float32 and weights.bin being written from them (a quantised weights.bin is
        smaller)."""
        return 3.0 if settings.quantize is None else 2.5

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
        if settings.precision not in self.precisions:
            raise EdgelinError(f"ONNX precision {settings.precision!r}",
                               f"this target exports {'/'.join(self.precisions)} graphs", "use --precision fp32 or fp16")
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
        from edgelin.export.phases import step

        with forms, attention as layers:  # the ONNX forms of the recurrences (chunk loop -> one Scan)
            for kind, module in modules.items():
                step(f"tracing {kind}.onnx")
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
                    kind: dataclasses.replace(entry, inputs=kv_retyped(entry.inputs, KV_DTYPES[options.kv_dtype]),
                                              outputs=kv_retyped(entry.outputs, KV_DTYPES[options.kv_dtype]))
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
