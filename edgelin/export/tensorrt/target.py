"""TensorRT target, export phase: the step graph with each linear layer's recurrence step as one
`edgelin::EdgelinStep` plugin node, and an ONNX function for that node in the same file.

What TensorRT's ONNX parser does with the node: an op it does not know becomes a plugin lookup by
op_type (`EdgelinStep`), version from the `plugin_version` attribute ("1"), namespace from
`plugin_namespace` (""); it passes the attributes the plugin creator lists (gate, delta, heads, d_k,
d_v, dtype, aux_dtype, inplace, erase: edgelin/plugins/tensorrt/src/edgelin_trt_plugin.cpp), narrowing
INT attributes to int32. The node's inputs are q, k, v, [g when gate != 0], [beta when delta], [e when
erase], state; its outputs o and state_out, in the plugin's order. `erase` (Gated DeltaNet-2's erase
gate e [B, H, d_k], float32 like g and beta) defaults to 0 and then adds no input, so a node written
before it existed keeps its layout and plugin_version "1" reads both.

What ONNX Runtime does with it: a node in a custom domain runs when the model carries an ONNX
function of that (domain, op_type). Each distinct layer kind (gate, delta) gets its own function
*overload* (the node's `overload` field names it; TensorRT's parser ignores that field), whose body
is `edgelin.reference.recurrence.recurrent_step` in standard ops (the erase-gated rule included). So
the very file TensorRT parses also runs, with the same math, on ONNX Runtime.

Precision and weights: in an fp16 export the step's plugin nodes take q/k/v in fp16 (`dtype` 1: the
lowering's engine declares `step_takes_compute_dtype`, so the model's fp32 cast is skipped for them;
the function casts inside, as the kernel does), g, beta and the state in fp32; prefill keeps the ONNX
target's fp32 recurrence. Both graphs read one weights.bin (edgelin.export.onnx.target.SHARED_WEIGHTS); step.onnx is
rewritten with onnx-ir, which keeps the external-data references, and checked by path.

Run phase: where `edgelin build` built the engines (tensorrt/build.json) and tensorrt, cuda-python
and an NVIDIA GPU are present, `runner` is the TensorRT runner (edgelin/export/tensorrt/runner.py:
device buffers, state on the GPU, CUDA graph steps). Everywhere else it is the ONNX Runtime runner on
the same file (CPU, through the functions): the *validation* runner, labelled with why the engines
were not used, so `edgelin validate`/replay check the exported math on any machine. The plugin
library comes from the build phase (nvcc, cmake, TensorRT headers), the engines from edgelin's own
edgelin.plugins.tensorrt.build_engine on tensorrt/engines.json (edgelin/export/tensorrt/build.py; the
folder's copy, tensorrt/build_engine.py, is for building by hand). The prefill graph stays in standard ops
(the plugin is a decode-step plugin).

No torch at module level (the registry imports this module on a runtime-only install).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from edgelin.errors import EdgelinError
from edgelin.export.base import Artifact, Built, Phase, TargetFlag
from edgelin.export.onnx.options import OnnxOptions
from edgelin.export.onnx.target import OnnxTarget
from edgelin.export.tensorrt import COMPUTE_REASON, PROFILE_COMPUTES
from edgelin.export.tensorrt.step_node import (
    DTYPE_F32, GATE_NONE, PLUGIN_DOMAIN, PLUGIN_FIELDS, PLUGIN_NAME, PLUGIN_NAMESPACE, PLUGIN_VERSION, _ONNX_TYPES,
    overload_name)

if TYPE_CHECKING:
    from edgelin.export.lowering import Lowering

    from edgelin.artifact.manifest import Manifest
    from edgelin.devices import DeviceProfile, ExportSettings, ServingLimits
    from edgelin.export.base import Runner
    from edgelin.model.lm import CausalLM

_WHERE_TRT = "a machine with TensorRT 10.3+ and an NVIDIA GPU (Jetson Orin: JetPack 6)"


def step_function(gate: int, delta: int, opset: int, dtype: int = DTYPE_F32, erase: int = 0):
    """The ONNX function (an onnx_ir.Function) of one EdgelinStep overload: recurrent_step's math. With
    half-precision q/k/v (`dtype`) the body casts them to fp32, computes in fp32 (g, beta, e and the state
    are fp32 already: aux_dtype 0) and casts o back, as the plugin's kernel does. With `erase` the delta
    rule erases along e * k: S' = S - beta (e * k)(k^T S) + k (beta v)^T."""
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

    q_arg, k_arg, v_arg, state = value("q"), value("k"), value("v"), value("state")
    g = value("g") if gate != GATE_NONE else None
    beta = value("beta") if delta else None
    e = value("erase") if erase else None
    last, before_last = const("axis_last", [-1]), const("axis_before_last", [-2])
    q, k, v = ((op("Cast", t, to=_ONNX_TYPES[DTYPE_F32]) for t in (q_arg, k_arg, v_arg)) if dtype != DTYPE_F32
               else (q_arg, k_arg, v_arg))
    s = state
    if g is not None:  # S *= exp(g) over the value axis
        s = op("Mul", s, op("Unsqueeze", op("Exp", g), last))
    v_in = v
    if beta is not None and e is not None:  # S -= (beta e * k)(k^T S); then v <- beta v
        k_s = op("Squeeze", op("MatMul", op("Unsqueeze", k, before_last), s), before_last)
        b = op("Unsqueeze", beta, last)
        f = op("Mul", b, op("Mul", e, k))
        s = op("Sub", s, op("Mul", op("Unsqueeze", f, last), op("Unsqueeze", k_s, before_last)))
        v_in = op("Mul", b, v)
    elif beta is not None:  # v <- beta (v - k^T S)
        k_s = op("Squeeze", op("MatMul", op("Unsqueeze", k, before_last), s), before_last)
        v_in = op("Mul", op("Unsqueeze", beta, last), op("Sub", v, k_s))
    s = op("Add", s, op("Mul", op("Unsqueeze", k, last), op("Unsqueeze", v_in, before_last)))
    o = op("Squeeze", op("MatMul", op("Unsqueeze", q, before_last), s), before_last)
    o_out = op("Identity", o) if dtype == DTYPE_F32 else op("Cast", o, to=_ONNX_TYPES[dtype])
    s_out = op("Identity", s)
    o_out.name, s_out.name = "o", "state_out"
    inputs = [q_arg, k_arg, v_arg, *(t for t in (g, beta, e) if t is not None), state]
    graph = ir.Graph(inputs, [o_out, s_out], nodes=nodes, opset_imports={"": opset}, name=PLUGIN_NAME)
    attributes = [ir.Attr(name, ir.AttributeType.INT, 0) for name in PLUGIN_FIELDS]
    attributes += [ir.Attr("plugin_version", ir.AttributeType.STRING, PLUGIN_VERSION),
                   ir.Attr("plugin_namespace", ir.AttributeType.STRING, PLUGIN_NAMESPACE)]
    return ir.Function(PLUGIN_DOMAIN, PLUGIN_NAME, overload_name(gate, delta, dtype, erase), graph=graph,
                       attributes=attributes)


def add_step_functions(path: Path, opset: int, inplace: bool = False) -> dict[str, str]:
    """Give every EdgelinStep node of the graph at `path` its overload and the model that overload's
    function; with `inplace`, set each node's `inplace` attribute (state_out aliases the state input in
    the engine; the function still computes out of place, as ONNX Runtime needs). Checked and saved in
    place (the pipeline's temp folder). Returns {state input: state output} per plugin node, graph
    input and output names where the node reads and writes them directly (else the node's own names):
    the pairs a TensorRT runner binds to one buffer when the engine aliases them."""
    import onnx
    import onnx_ir as ir

    model = ir.load(str(path))
    graph_inputs = {v.name for v in model.graph.inputs}
    graph_outputs = {v.name for v in model.graph.outputs}
    pairs: dict[str, str] = {}
    for node in ir.traversal.RecursiveGraphIterator(model.graph):
        if node.domain != PLUGIN_DOMAIN or node.op_type != PLUGIN_NAME:
            continue
        gate, delta = node.attributes["gate"].as_int(), node.attributes["delta"].as_int()
        dtype = node.attributes["dtype"].as_int()
        erase = node.attributes["erase"].as_int() if "erase" in node.attributes else 0
        node.overload = overload_name(gate, delta, dtype, erase)
        if node.op_identifier() not in model.functions:
            function = step_function(gate, delta, opset, dtype, erase)
            model.functions[function.identifier()] = function
        if inplace:
            node.attributes["inplace"] = ir.Attr("inplace", ir.AttributeType.INT, 1)
        state_in, state_out = node.inputs[-1].name, node.outputs[1].name
        if state_in in graph_inputs and state_out in graph_outputs:
            pairs[state_in] = state_out
        else:  # the engine still aliases them (TensorRT inserts a copy); no buffer of the runner's is shared
            pairs[f"{node.name}:state"] = f"{node.name}:state_out"
    model.opset_imports[PLUGIN_DOMAIN] = 1
    proto = ir.serde.serialize_model(model)  # large weights stay references into the shared weights file
    onnx.save(proto, str(path))
    onnx.checker.check_model(str(path))  # by path: external data resolves next to the file
    return pairs


@dataclass(frozen=True)
class TensorrtOptions(OnnxOptions):
    """The TensorRT target's export options: its ONNX opset (as for the ONNX target) and `inplace`
    (--trt-inplace): each plugin node's state_out aliases its state input in the engine
    (IPluginV3OneBuildV2::getAliasedInput, TensorRT's preview feature ALIASED_PLUGIN_IO_10_03, which
    build_engine.py then enables), so a step updates the recurrent state in one buffer."""

    inplace: bool = False


class TensorrtTarget(OnnxTarget):
    """The ONNX target's export under lowering("tensorrt"), plus the plugin functions (module docstring)."""

    name = "tensorrt"
    extra = "onnx"
    options_type = TensorrtOptions
    quantize_modes = ()  # weight quantisation is the ONNX target's (ONNX Runtime's kernels)
    profile_options = ("sm",)  # the engine's CUDA compute capability
    profile_computes, compute_reason = PROFILE_COMPUTES, COMPUTE_REASON  # declared in the package (data)
    triton_backend = "tensorrt_plan"  # edgelin.serve.triton.TENSORRT_PLAN: the user builds model.plan
    runtime = "tensorrt"
    runtime_distributions = (("tensorrt", ("tensorrt", "tensorrt-cu12", "tensorrt-cu13")),
                             ("onnxruntime", ("onnxruntime", "onnxruntime-gpu")))
    gpu_runtimes = ("tensorrt",)
    libraries = (("tensorrt", "use a machine with TensorRT (a Jetson, an NGC container)"),)
    flags = (TargetFlag("--trt-inplace", "inplace", "The step plugin updates the recurrent state in place "
                        "(TensorRT's aliased plugin I/O, a preview feature since 10.3).", bool),)
    build_flags = (
        TargetFlag("--trt-include", "trt_include", "The folder holding NvInferRuntime.h (default: "
                   "$TENSORRT_INCLUDE_DIR, system folders).", Path),
        TargetFlag("--archs", "archs", "CUDA compute capabilities, e.g. 87 or 86,89,90 (default: the device's sm, "
                   "else 80-90)."),
    )

    def options_from_flags(self, given: dict, settings: "ExportSettings",
                           precision_flag: str | None = None) -> tuple["TensorrtOptions | None", "ExportSettings"]:
        return (TensorrtOptions(inplace=True) if given.get("inplace") else None), settings

    def runtime_of(self, runner_label: str) -> str:
        """TensorRT's engines, or ONNX Runtime where it runs the plugin's ONNX functions (no engine built here)."""
        return "onnxruntime" if runner_label.strip().lower().startswith("onnxruntime") else "tensorrt"

    def write_serving_notes(self, root: Path, manifest: "Manifest", model: str, limits: "ServingLimits") -> None:
        """BUILD.md: the plan is built on the serving GPU, with the plugin library edgelin build makes."""
        from edgelin.export.tensorrt.build import plugin_file
        from edgelin.serve.triton import trtexec_line

        plugin = f"tensorrt/{plugin_file('10')}"
        (root / "BUILD.md").write_text(
            f"# Building {model}/1/model.plan\n\nThe config names platform tensorrt_plan: build the engine where "
            "TensorRT and the serving GPU are, from the export folder (the repository's model.onnx is the step "
            "graph with Triton's control inputs and the position state):\n\n```sh\nedgelin build .   # the "
            f"plugin library, {plugin}\n{trtexec_line(manifest, model, limits, plugin)}\n```\n\nThen load the "
            f"plugin into the server: `LD_PRELOAD=$PWD/{plugin} tritonserver --model-repository=$PWD/triton` "
            "(docs/serving.md).\n")

    def lowering(self) -> "Lowering":
        from edgelin.export.tensorrt.lowering import LOWERING

        return LOWERING

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

    def build(self, artifact: Artifact, device: "DeviceProfile | None" = None,
              options: dict | None = None) -> Built:
        """The plugin library into tensorrt/, then the engines where TensorRT and a GPU are (tensorrt.build);
        a partial build (the library, no engine) says what is missing."""
        import re

        from edgelin.export.tensorrt.build import build_folder

        options = options or {}
        archs = [a for a in re.split(r"[,; ]+", options.get("archs") or "") if a] or None
        result = build_folder(artifact.folder, device, options.get("trt_include"), archs)
        return Built(artifact.folder, artifact.manifest, result.files, result.missing)

    def can_run(self, device: "DeviceProfile | None" = None) -> Phase:
        # Every folder runs on ONNX Runtime through its plugin functions (the validation runner); a folder
        # whose engines are built runs on TensorRT where tensorrt, cuda-python and a GPU are (runner()).
        refused = self.device_refusal(device)
        if refused is not None:
            return refused
        return super().can_run(None)

    def export(self, model: "CausalLM", device: "DeviceProfile | None", settings: "ExportSettings",
               options: OnnxOptions, folder: Path) -> dict[str, str]:
        # options, precision and state dtype are checked by the ONNX target's export
        files = super().export(model, device, settings, options, folder)  # under lowering(self.name)
        from edgelin.families import SOFTMAX

        linear = sum(1 for layer in model.config.layer_types if layer != SOFTMAX)
        inplace = bool(getattr(options, "inplace", False))
        aliased = add_step_functions(Path(folder) / files["step"], options.opset, inplace)
        if len(aliased) != linear:
            raise EdgelinError(f"step.onnx has {len(aliased)} {PLUGIN_NAME} nodes for {linear} linear layers",
                               "every linear layer's step must be one plugin node", "report this as an edgelin bug")
        from edgelin.export.tensorrt.build import write_folder

        # tensorrt/: plugin sources, build_engine.py, engines.json, COMMANDS.md
        write_folder(Path(folder), files, device, inplace=inplace, aliased=aliased if inplace else {},
                     strongly_typed=settings.precision == "fp16")
        return files

    def runner(self, artifact: Artifact, device: "DeviceProfile | None" = None,
               threads: int | None = None) -> "Runner":
        """The TensorRT runner when the folder's engines are built and tensorrt, cuda-python and a GPU are
        here; otherwise ONNX Runtime on the exported files (the plugin nodes through their functions),
        labelled with why the engines were not used."""
        from edgelin.export.tensorrt.runner import ORT_LABEL, TensorrtRunner, engines_unavailable

        why = engines_unavailable(artifact.folder)
        if why is None:
            return TensorrtRunner(artifact.folder, artifact.manifest)
        runner = super().runner(artifact, device, threads)
        runner.label = f"{ORT_LABEL}; TensorRT engines not used: {why}"  # type: ignore[attr-defined]
        return runner
