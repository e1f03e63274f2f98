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
from edgelin.export.manifest import Manifest
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
            session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
            _check_contract(kind, session, entry.inputs)
            self.sessions[kind] = session
        self.state_names = [t.name for t in manifest.state_inputs]
        self.output_names = ["logits", *[t.name.replace("past_key_values.", "present.", 1) for t in manifest.state_inputs]]

    def _run(self, kind: str, ids: np.ndarray, state: State, position: np.ndarray):
        feed = {"input_ids": ids.astype(np.int64, copy=False), **state}
        if self.manifest.needs_position:
            feed["position_ids"] = position.astype(np.int64, copy=False)
        outs = self.sessions[kind].run(self.output_names, feed)
        return outs[0], dict(zip(self.state_names, outs[1:]))

    def step(self, input_ids, state, position):
        return self._run("step", input_ids, state, position)

    def prefill(self, input_ids, state, start):
        return self._run("prefill", input_ids, state, start)


def _check_contract(kind: str, session, expected: tuple[TensorIO, ...]) -> None:
    """The manifest and the graph must agree on every input's name, rank, fixed sizes and dtype."""
    actual = {i.name: i for i in session.get_inputs()}
    for t in expected:
        got = actual.get(t.name)
        onnx_type = f"tensor({'float' if t.dtype == 'float32' else 'float16' if t.dtype == 'float16' else t.dtype})"
        problem = None
        if got is None:
            problem = "is not an input of the graph"
        elif len(got.shape) != len(t.dims) or any(
                isinstance(w, int) and g != w for g, w in zip(got.shape, t.dims)):
            problem = f"has shape {got.shape} in the graph but {list(t.dims)} in the manifest"
        elif got.type != onnx_type:
            problem = f"has type {got.type} in the graph but {t.dtype} in the manifest"
        if problem:
            raise EdgelinError(f"manifest and {kind} graph disagree: {t.name} {problem}",
                               "the folder was edited or mixed with another export", "re-run `edgelin export`")


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
        files = {}
        for kind, graph in GRAPHS.items():
            inputs, outputs = graph_io(model, kind)
            files[kind] = f"{kind}.onnx"
            export_onnx_graph(graph(model).eval(), model, inputs, outputs, Path(folder) / files[kind], options.opset)
        return files

    def runner(self, folder: Path, manifest: Manifest, threads: int | None = None) -> OnnxRunner:
        return OnnxRunner(folder, manifest, threads)


