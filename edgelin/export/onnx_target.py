"""ONNX target: torch's dynamo exporter -> checked .onnx files -> ONNX Runtime runner."""

from __future__ import annotations

import contextlib
import io
import logging
import warnings
from pathlib import Path

import numpy as np
import torch

from edgelin.errors import EdgelinError
from edgelin.export.base import ExportOptions, Runner, State, Target
from edgelin.export.graphs import GRAPHS, TensorIO, graph_io
from edgelin.export.manifest import GraphEntry, Manifest
from edgelin.export.state import outputs_by_input
from edgelin.model.lm import CausalLM

# Example sizes for tracing: none is 0 or 1 (the exporter would specialise them) and the sequence
# spans several chunks and attention blocks with a remainder.
EXAMPLE_SIZES = {"batch": 2, "sequence": 67, "past_sequence": 5}


def example_inputs(model: CausalLM, inputs: list[TensorIO], sizes: dict[str, int]) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(0)
    out = []
    for t in inputs:
        shape = [sizes[d] if isinstance(d, str) else d for d in t.dims]
        if t.role == "input_ids":
            out.append(torch.randint(0, model.config.vocab_size, shape, generator=gen))
        elif t.role == "position_ids":
            out.append(torch.arange(3, 3 + shape[0]) * 7)
        else:
            out.append(torch.randn(shape, generator=gen) * 0.1)
    return tuple(out)


def export_onnx_graph(module: torch.nn.Module, model: CausalLM, inputs: list[TensorIO], outputs: list[TensorIO],
                      path: Path, opset: int) -> None:
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
        tail = "\n".join(log.getvalue().strip().splitlines()[-5:])
        raise EdgelinError(f"ONNX export of {path.name} failed", f"{type(exc).__name__}: {str(exc)[:400]} {tail}",
                           "report this model config as an edgelin bug (run with --debug for the trace)") from exc
    name_dynamic_axes(path, inputs, outputs)


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
    onnx.checker.check_model(proto, full_check=True)
    onnx.save(proto, str(path))


class OnnxRunner(Runner):
    def __init__(self, folder: Path, manifest: Manifest, threads: int | None = None):
        super().__init__(manifest)
        import onnxruntime as ort

        options = ort.SessionOptions()
        options.log_severity_level = 3
        if threads:
            options.intra_op_num_threads = threads
        self.sessions = {}
        for kind, entry in manifest.graphs.items():
            path = Path(folder) / entry.file
            if not path.is_file():
                raise EdgelinError(f"{path} is missing", "the manifest lists it", "re-run `edgelin export`")
            try:
                session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
            except _ort_errors() as exc:  # a truncated or corrupt file is the folder's fault, not edgelin's
                reason = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
                raise EdgelinError(f"{path} cannot be loaded by ONNX Runtime", f"{type(exc).__name__}: {reason}",
                                   "re-run `edgelin export` (the file is truncated or corrupt)") from exc
            _check_contract(kind, session, entry)
            self.sessions[kind] = session
        self.state_names = [t.name for t in manifest.state_inputs]
        feeds = outputs_by_input(manifest.graphs["step"].outputs)  # the manifest checked prefill's agree
        self.output_names = ["logits", *[feeds[name] for name in self.state_names]]

    def _run(self, kind: str, ids: np.ndarray, state: State, position: np.ndarray | None):
        feed = {"input_ids": ids.astype(np.int64, copy=False), **state}
        if self.manifest.needs_position:
            feed["position_ids"] = position.astype(np.int64, copy=False)
        outs = self.sessions[kind].run(self.output_names, feed)
        return outs[0], dict(zip(self.state_names, outs[1:]))

    def _step(self, input_ids, state, position):
        return self._run("step", input_ids, state, position)

    def _prefill(self, input_ids, state, start):
        return self._run("prefill", input_ids, state, start)


def _ort_errors() -> tuple[type[BaseException], ...]:
    """ONNX Runtime's exception classes (they share no base class but Exception)."""
    from onnxruntime.capi import onnxruntime_pybind11_state as ort_state

    found = tuple(c for c in vars(ort_state).values() if isinstance(c, type) and issubclass(c, Exception))
    return (*found, RuntimeError)


_ONNX_TYPES = {"float32": "tensor(float)", "float16": "tensor(float16)", "int64": "tensor(int64)",
               "int32": "tensor(int32)"}


def _check_contract(kind: str, session, entry: GraphEntry) -> None:
    """The manifest and the graph file must agree on every input's and output's name, rank, fixed
    sizes and dtype, and the graph must have no input or output the manifest does not list."""
    for direction, actual_list, expected in (("input", session.get_inputs(), entry.inputs),
                                             ("output", session.get_outputs(), entry.outputs)):
        actual = {i.name: i for i in actual_list}
        for t in expected:
            got = actual.get(t.name)
            problem = None
            if got is None:
                problem = f"is not an {direction} of the graph"
            elif len(got.shape) != len(t.dims) or any(
                    isinstance(w, int) and g != w for g, w in zip(got.shape, t.dims)):
                problem = f"has shape {got.shape} in the graph but {list(t.dims)} in the manifest"
            elif got.type != _ONNX_TYPES.get(t.dtype, t.dtype):
                problem = f"has type {got.type} in the graph but {t.dtype} in the manifest"
            if problem:
                raise EdgelinError(f"manifest and {kind} graph disagree: {direction} {t.name} {problem}",
                                   "the folder was edited or mixed with another export", "re-run `edgelin export`")
        unlisted = sorted(set(actual) - {t.name for t in expected})
        if unlisted:
            raise EdgelinError(f"manifest and {kind} graph disagree: the graph has {direction} {unlisted[0]}",
                               "the manifest does not list it", "re-run `edgelin export`")


class OnnxTarget(Target):
    name = "onnx"
    extra = "onnx"
    graph_suffix = ".onnx"

    def unavailable_reason(self) -> str | None:
        try:
            import onnx  # noqa: F401
            import onnxruntime  # noqa: F401
            import onnxscript  # noqa: F401
        except ImportError as exc:
            return f"{exc.name} is not installed (pip install 'edgelin[onnx]')"
        return None

    def export(self, model: CausalLM, folder: Path, options: ExportOptions) -> dict[str, str]:
        if options.precision != "fp32":
            raise EdgelinError(f"ONNX precision {options.precision!r}", "this target exports fp32 graphs",
                               "use --precision fp32")
        if options.state_dtype != "float32":  # float16 state: issue 11
            raise EdgelinError(f"ONNX state dtype {options.state_dtype!r}", "this target stores the state as float32",
                               "export with state dtype float32 (pick a device profile whose state_dtype is float32)")
        from edgelin.export.lowering import lowering

        files = {}
        with lowering(self.name):  # the ONNX forms of the recurrences (chunk loop -> one Scan)
            for kind, graph in GRAPHS.items():
                inputs, outputs = graph_io(model, kind, options.state_dtype)
                files[kind] = f"{kind}.onnx"
                export_onnx_graph(graph(model).eval(), model, inputs, outputs, Path(folder) / files[kind],
                                  options.opset)
        return files

    def runner(self, folder: Path, manifest: Manifest, threads: int | None = None) -> OnnxRunner:
        return OnnxRunner(folder, manifest, threads)


