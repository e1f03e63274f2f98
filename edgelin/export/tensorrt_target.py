"""TensorRT target, export phase: the step graph with each linear layer's recurrence step as one
`edgelin::EdgelinStep` plugin node, and an ONNX function for that node in the same file.

What TensorRT's ONNX parser does with the node: an op it does not know becomes a plugin lookup by
op_type (`EdgelinStep`), version from the `plugin_version` attribute ("1"), namespace from
`plugin_namespace` (""); it passes the attributes the plugin creator lists (gate, delta, heads, d_k,
d_v, dtype, aux_dtype, inplace: edgelin/plugins/tensorrt/src/edgelin_trt_plugin.cpp), narrowing INT
attributes to int32. The node's inputs are q, k, v, [g when gate != 0], [beta when delta], state;
its outputs o and state_out, in the plugin's order.

What ONNX Runtime does with it: a node in a custom domain runs when the model carries an ONNX
function of that (domain, op_type). Each distinct layer kind (gate, delta) gets its own function
*overload* (the node's `overload` field names it; TensorRT's parser ignores that field), whose body
is `edgelin.reference.recurrence.recurrent_step` in standard ops. So the very file TensorRT parses
also runs, with the same math, on ONNX Runtime.

Decision (run phase): this target's `runner` is the ONNX Runtime runner on that file (CPU, through
the functions). It is the *validation* runner: `edgelin validate`/replay check the exported math on
any machine. It does not run TensorRT (no TensorRT runner yet): the plugin library comes from the
build phase (nvcc, cmake, TensorRT headers), the engines from tensorrt/build_engine.py, which
`edgelin build` runs where TensorRT 10.3+ and an NVIDIA GPU are (edgelin/export/tensorrt_build.py). The prefill graph stays in
standard ops (the plugin is a decode-step plugin).

No torch at module level (the registry imports this module on a runtime-only install).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from edgelin.errors import EdgelinError
from edgelin.export.base import Artifact, Phase
from edgelin.export.onnx_target import OnnxOptions, OnnxTarget

if TYPE_CHECKING:
    import torch

    from edgelin.devices import DeviceProfile, ExportSettings
    from edgelin.export.onnx_runtime import OnnxRunner
    from edgelin.model.lm import CausalLM

PLUGIN_DOMAIN = "edgelin"
PLUGIN_NAME = "EdgelinStep"
PLUGIN_VERSION = "1"
PLUGIN_NAMESPACE = ""
# The creator's fields, all INT (the parser narrows them to int32), in the plugin's order.
PLUGIN_FIELDS = ("gate", "delta", "heads", "d_k", "d_v", "dtype", "aux_dtype", "inplace")
GATE_NONE, GATE_SCALAR, GATE_PER_KEY = 0, 1, 2  # EdgelinGate (edgelin_step.h)
DTYPE_F32 = 0  # EdgelinDtype
_WHERE_TRT = "a machine with TensorRT 10.3+ and an NVIDIA GPU (Jetson Orin: JetPack 6)"


def overload_name(gate: int, delta: int) -> str:
    """The ONNX function overload for one layer kind (one function body per kind)."""
    return f"gate{gate}_delta{delta}"


def plugin_step(state: "torch.Tensor", q: "torch.Tensor", k: "torch.Tensor", v: "torch.Tensor",
                g: "torch.Tensor | None", beta: "torch.Tensor | None") -> tuple["torch.Tensor", "torch.Tensor"]:
    """While exporting: one EdgelinStep node (o, state_out); otherwise the reference step."""
    import torch

    from edgelin.reference.recurrence import recurrent_step

    if not torch.onnx.is_in_onnx_export():
        return recurrent_step(state, q, k, v, g, beta)
    if q.dtype != torch.float32 or state.dtype != torch.float32:  # fp16 plugin graphs: edge-precision work
        raise EdgelinError(f"TensorRT step in {q.dtype} with a {state.dtype} state", "this export writes float32 "
                           "plugin nodes today", "export with --precision fp32")
    _, heads, d_k = q.shape
    gate = GATE_NONE if g is None else (GATE_SCALAR if g.shape[-1] == 1 else GATE_PER_KEY)
    delta = int(beta is not None)
    fields = dict(gate=gate, delta=delta, heads=int(heads), d_k=int(d_k), d_v=int(v.shape[-1]),
                  dtype=DTYPE_F32, aux_dtype=DTYPE_F32, inplace=0)
    attrs = {**fields, "plugin_version": PLUGIN_VERSION, "plugin_namespace": PLUGIN_NAMESPACE}
    inputs = [q, k, v, *(t for t in (g, beta) if t is not None), state]
    o, new_state = torch.onnx.ops.symbolic_multi_out(
        f"{PLUGIN_DOMAIN}::{PLUGIN_NAME}", inputs, attrs, dtypes=(v.dtype, state.dtype),
        shapes=(v.shape, state.shape), version=1)
    return o, new_state


def step_function(gate: int, delta: int, opset: int):
    """The ONNX function (an onnx_ir.Function) of one EdgelinStep overload: recurrent_step's math."""
    import numpy as np
    import onnx_ir as ir

    def value(name: str) -> ir.Value:
        return ir.Value(name=name)

    nodes: list[ir.Node] = []

    def op(op_type: str, *args: ir.Value, **attrs) -> ir.Value:
        node = ir.node(op_type, list(args), attrs or None)
        nodes.append(node)
        return node.outputs[0]

    def const(name: str, values: list[int]) -> ir.Value:
        out = op("Constant", value=ir.tensor(np.array(values, np.int64), name=name))
        out.name = name
        return out

    q, k, v, state = value("q"), value("k"), value("v"), value("state")
    g = value("g") if gate != GATE_NONE else None
    beta = value("beta") if delta else None
    last, before_last = const("axis_last", [-1]), const("axis_before_last", [-2])
    s = state
    if g is not None:  # S *= exp(g) over the value axis
        s = op("Mul", s, op("Unsqueeze", op("Exp", g), last))
    v_in = v
    if beta is not None:  # v <- beta (v - k^T S)
        k_s = op("Squeeze", op("MatMul", op("Unsqueeze", k, before_last), s), before_last)
        v_in = op("Mul", op("Unsqueeze", beta, last), op("Sub", v, k_s))
    s = op("Add", s, op("Mul", op("Unsqueeze", k, last), op("Unsqueeze", v_in, before_last)))
    o = op("Squeeze", op("MatMul", op("Unsqueeze", q, before_last), s), before_last)
    o_out = op("Identity", o)
    s_out = op("Identity", s)
    o_out.name, s_out.name = "o", "state_out"
    inputs = [q, k, v, *(t for t in (g, beta) if t is not None), state]
    graph = ir.Graph(inputs, [o_out, s_out], nodes=nodes, opset_imports={"": opset}, name=PLUGIN_NAME)
    attributes = [ir.Attr(name, ir.AttributeType.INT, 0) for name in PLUGIN_FIELDS]
    attributes += [ir.Attr("plugin_version", ir.AttributeType.STRING, PLUGIN_VERSION),
                   ir.Attr("plugin_namespace", ir.AttributeType.STRING, PLUGIN_NAMESPACE)]
    return ir.Function(PLUGIN_DOMAIN, PLUGIN_NAME, overload_name(gate, delta), graph=graph, attributes=attributes)


def add_step_functions(path: Path, opset: int) -> int:
    """Give every EdgelinStep node of the graph at `path` its overload and the model that overload's
    function; returns the number of plugin nodes. Checked and saved in place (the pipeline's temp folder)."""
    import onnx
    import onnx_ir as ir

    model = ir.load(str(path))
    count = 0
    for node in ir.traversal.RecursiveGraphIterator(model.graph):
        if node.domain != PLUGIN_DOMAIN or node.op_type != PLUGIN_NAME:
            continue
        gate, delta = node.attributes["gate"].as_int(), node.attributes["delta"].as_int()
        node.overload = overload_name(gate, delta)
        if node.op_identifier() not in model.functions:
            function = step_function(gate, delta, opset)
            model.functions[function.identifier()] = function
        count += 1
    model.opset_imports[PLUGIN_DOMAIN] = 1
    proto = ir.serde.serialize_model(model)
    onnx.checker.check_model(proto)
    onnx.save(proto, str(path))
    return count


@dataclass(frozen=True)
class TensorrtOptions(OnnxOptions):
    """The TensorRT target's export options (its ONNX opset, as for the ONNX target)."""


class TensorrtTarget(OnnxTarget):
    """The ONNX target's export under lowering("tensorrt"), plus the plugin functions (module docstring)."""

    name = "tensorrt"
    extra = "onnx"
    options_type = TensorrtOptions

    def can_build(self, device: "DeviceProfile | None" = None) -> Phase | None:
        # The plugin library needs only nvcc, cmake and TensorRT's headers; the engines need TensorRT
        # and a GPU as well (build_folder builds what it can and says what is missing).
        import shutil

        if shutil.which("cmake") is None:
            return Phase(False, "the plugin library is built with cmake, which is not installed here", _WHERE_TRT)
        try:
            from edgelin.plugins.tensorrt import find_nvcc

            find_nvcc()
        except EdgelinError:
            return Phase(False, "the plugin library is compiled with nvcc (the CUDA toolkit), not found here",
                         _WHERE_TRT)
        return Phase(True)

    def build(self, artifact: Artifact, device: "DeviceProfile | None" = None) -> Artifact:
        """The plugin library into tensorrt/, then the engines where TensorRT and a GPU are (tensorrt_build)."""
        from edgelin.export.tensorrt_build import build_folder

        result = build_folder(artifact.folder, device)
        return Artifact(artifact.folder, artifact.manifest, result.files)

    def can_run(self, device: "DeviceProfile | None" = None) -> Phase:
        # The validation runner: step.onnx through its ONNX functions on ONNX Runtime (module docstring).
        if device is not None and self.name not in device.targets:
            return Phase(False, f"device {device.name} does not list target {self.name} (it lists: "
                                f"{', '.join(device.targets)})", "a device whose profile lists tensorrt")
        return super().can_run(None)

    def export(self, model: "CausalLM", device: "DeviceProfile | None", settings: "ExportSettings",
               options: OnnxOptions, folder: Path) -> dict[str, str]:
        # options, precision and state dtype are checked by the ONNX target's export (fp32 plugin graphs)
        files = super().export(model, device, settings, options, folder)  # under lowering(self.name)
        from edgelin.families import SOFTMAX

        linear = sum(1 for layer in model.config.layer_types if layer != SOFTMAX)
        found = add_step_functions(Path(folder) / files["step"], options.opset)
        if found != linear:
            raise EdgelinError(f"step.onnx has {found} {PLUGIN_NAME} nodes for {linear} linear layers",
                               "every linear layer's step must be one plugin node", "report this as an edgelin bug")
        from edgelin.export.tensorrt_build import write_folder

        write_folder(Path(folder), files, device)  # tensorrt/: plugin sources, build_engine.py, COMMANDS.md
        return files

    def runner(self, artifact: Artifact, device: "DeviceProfile | None" = None,
               threads: int | None = None) -> "OnnxRunner":
        """ONNX Runtime on the exported files (the plugin nodes run through their functions)."""
        return super().runner(artifact, device, threads)
