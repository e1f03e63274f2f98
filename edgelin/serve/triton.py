"""`edgelin export --serve triton|triton-native`: a Triton Inference Server model repository under DIR/triton/.

`--serve triton` (the default flavour) writes a Python-backend model running edgelin's runner, holding each
sequence's state itself, with prefill and hybrids: edgelin.serve.triton_python. This module writes that
repository's shared parts (the client) and the *native* flavour, `--serve triton-native`, below.

Triton's sequence batcher with *implicit state* keeps, per sequence, exactly what edgelin's step graph takes
and returns: every `past_key_values.*` input is a `state` whose next value is its `present.*` output, zero at
the sequence's start. The repository:

    DIR/triton/<name>/config.pbtxt   backend onnxruntime (tensorrt export: platform tensorrt_plan)
    DIR/triton/<name>/1/model.onnx   the step graph with the sequence batcher's inputs (below); ~100 KiB
    DIR/triton/<name>/1/weights.bin  a hard link to DIR/weights.bin: the same bytes, not a second copy
    DIR/triton/client.py             streams the tokens of one sequence through tritonclient (gRPC)

Why model.onnx is not step.onnx: Triton's ONNX Runtime backend counts the model's inputs and wants one per
config input, control input and state, each control shaped [batch, 1]. So model.onnx is step.onnx's nodes and
weights (the same external-data references) with inputs added: START, READY ([batch, 1] int32) and CORRID
([batch, 1] uint64), and, for models that take a position (softmax layers: RoPE, the sliding window), the
position as implicit state too: `past_position` [batch, 1] int64 (zero at START) feeds `position_ids`, and
`present.position = position + READY` is its next value. A client never counts positions.

Why a hard link: the ONNX backend opens `1/model.onnx`, and ONNX Runtime reads external data relative to that
folder, refusing locations outside it. A relative symlink (../../../weights.bin) breaks when only DIR/triton
is mounted into the container; a hard link is a plain file wherever the repository is mounted or copied
(a copy elsewhere then holds the bytes once). Where the file system refuses hard links, the file is copied.

What cannot be implicit state is refused before the export writes anything: a state that grows with the
context (a full-attention KV cache: the batcher joins sequences of different lengths into one batch, whose
states would differ in shape), and a Core ML export (Triton has no Core ML backend)."""

from __future__ import annotations

import os
import re
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from edgelin.errors import EdgelinError
from edgelin.serve.repository import CLIENT, FOLDER, client_text, parse_config  # noqa: F401 (shared)

if TYPE_CHECKING:
    from edgelin.devices import DeviceProfile, ServingLimits
    from edgelin.artifact.manifest import Manifest
    from edgelin.artifact.tensors import TensorIO

PYTHON_FLAVOUR, NATIVE_FLAVOUR = "triton", "triton-native"
SERVERS = (PYTHON_FLAVOUR, NATIVE_FLAVOUR)
# Triton's names for what serves a graph (a target says which: Target.triton_backend): the ONNX Runtime backend,
# or the TensorRT platform that loads a plan
ONNXRUNTIME, TENSORRT_PLAN = "onnxruntime", "tensorrt_plan"
MODEL_FILE = {ONNXRUNTIME: "model.onnx", TENSORRT_PLAN: "model.plan"}
POSITION_IN, POSITION_OUT = "past_position", "present.position"
START, READY, CORRID = "START", "READY", "CORRID"
TRITON_DTYPES = {"float32": "TYPE_FP32", "float16": "TYPE_FP16", "int64": "TYPE_INT64", "int32": "TYPE_INT32"}
MANIFEST_KEY = "serve"


def check_server(serve: str | None) -> None:
    if serve is not None and serve not in SERVERS:
        raise EdgelinError(f"--serve {serve}", f"edgelin writes a serving repository for: {', '.join(SERVERS)}",
                           "pass --serve triton, or leave --serve out")


def unservable(state: Sequence["TensorIO"], target: str, serve: str) -> str | None:
    """Why this export cannot be served by Triton in flavour `serve`, or None (the Python flavour serves any
    export: its model runs the target's own runner)."""
    if serve == PYTHON_FLAVOUR:
        return None
    if _backend(target) is None:
        from edgelin.export.targets import get_target, target_names

        served = [n for n in target_names() if get_target(n).triton_backend is not None]
        return (f"Triton Inference Server has no backend for the {target} target (it serves {' and '.join(served)} "
                "exports)")
    for t in state:
        grown = [d for d in t.dims[1:] if not isinstance(d, int)]
        if grown:
            return (f"state {t.name} has dims {list(t.dims)}: it grows with the context (a full-attention KV "
                    "cache), and Triton's sequence batcher joins sequences of different lengths into one batch, "
                    "whose states would differ in shape, so it cannot be implicit state")
    return None


def _backend(target: str) -> str | None:
    """The Triton backend that serves `target`'s step graph (Target.triton_backend), None if none does."""
    from edgelin.export.targets import get_target

    return get_target(target).triton_backend


def check_servable(state: Sequence["TensorIO"], target: str, serve: str) -> None:
    why = unservable(state, target, serve)
    if why:
        raise EdgelinError(f"--serve {serve}", why, "pass --serve triton (the Python backend serves every export, "
                           "hybrids included), or export without --serve")


def model_name(source: dict[str, Any]) -> str:
    """The repository's model name: the checkpoint folder's name, in the characters Triton takes."""
    name = re.sub(r"[^A-Za-z0-9_.-]+", "-", Path(str(source.get("path") or "model")).name).strip("-.")
    return name or "model"


# ---- config.pbtxt -----------------------------------------------------------------------------------
def _dims(dims: Sequence[Any]) -> str:
    return "[ " + ", ".join(str(d) for d in dims) + " ]"


def controls(backend: str, needs_position: bool) -> list[tuple[str, str, str]]:
    """(name, kind, data type) of the sequence batcher's control inputs the graph takes. TensorRT drops graph
    inputs no node reads, so its engines get only the controls the position arithmetic reads."""
    if backend == TENSORRT_PLAN:
        return [(START, "CONTROL_SEQUENCE_START", "TYPE_INT32"), (READY, "CONTROL_SEQUENCE_READY", "TYPE_INT32")] \
            if needs_position else []
    return [(START, "CONTROL_SEQUENCE_START", "TYPE_INT32"), (READY, "CONTROL_SEQUENCE_READY", "TYPE_INT32"),
            (CORRID, "CONTROL_SEQUENCE_CORRID", "TYPE_UINT64")]


def state_pairs(manifest: "Manifest") -> list[tuple[str, str, str, list[int]]]:
    """(input, output, Triton data type, dims without the batch) of every implicit state."""
    from edgelin.artifact.state import state_output_name

    pairs = [(t.name, state_output_name(t.layer, t.state_name), TRITON_DTYPES[t.dtype], list(t.dims[1:]))
             for t in manifest.state_inputs]
    if manifest.needs_position:
        pairs.append((POSITION_IN, POSITION_OUT, "TYPE_INT64", [1]))
    return pairs


def config_text(manifest: "Manifest", name: str, limits: "ServingLimits", backend: str, gpu: bool | None) -> str:
    """config.pbtxt in protobuf text format (Triton's ModelConfig; tests parse it with tritonclient's schema).
    `gpu`: instance kind (None: Triton's default, a GPU when there is one)."""
    lines = [f'name: "{name}"',
             f'backend: "{ONNXRUNTIME}"' if backend == ONNXRUNTIME else f'platform: "{TENSORRT_PLAN}"',
             f'default_model_filename: "{MODEL_FILE[backend]}"',
             f"max_batch_size: {limits.max_batch_size}",
             "input [",
             '  { name: "input_ids" data_type: TYPE_INT64 dims: [ 1 ] reshape: { shape: [ ] } }',
             "]",
             "output [",
             f'  {{ name: "logits" data_type: TYPE_FP32 dims: [ {manifest.vocab_size} ] }}',
             "]",
             "sequence_batching {",
             f"  max_sequence_idle_microseconds: {limits.max_sequence_idle_us}"]
    ctrl = controls(backend, manifest.needs_position)
    if ctrl:
        lines.append("  control_input [")
        for i, (cname, kind, dtype) in enumerate(ctrl):
            value = "int32_false_true: [ 0, 1 ]" if dtype == "TYPE_INT32" else f"data_type: {dtype}"
            lines.append(f'    {{ name: "{cname}" control [ {{ kind: {kind} {value} }} ] }}'
                         + ("," if i < len(ctrl) - 1 else ""))
        lines.append("  ]")
    pairs = state_pairs(manifest)
    lines.append("  state [")
    for i, (inp, out, dtype, dims) in enumerate(pairs):
        lines += [f'    {{ input_name: "{inp}" output_name: "{out}" data_type: {dtype} dims: {_dims(dims)}',
                  f'      initial_state: {{ name: "zeros" data_type: {dtype} dims: {_dims(dims)} zero_data: true }} }}'
                  + ("," if i < len(pairs) - 1 else "")]
    lines += ["  ]",
              "  oldest {",
              f"    max_candidate_sequences: {limits.max_candidate_sequences}",
              f"    preferred_batch_size: {_dims(limits.preferred_batch_sizes)}",
              f"    max_queue_delay_microseconds: {limits.max_queue_delay_us}",
              "  }",
              "}"]
    if gpu is not None:
        lines += [f"instance_group [ {{ kind: {'KIND_GPU' if gpu else 'KIND_CPU'} count: {limits.instances} }} ]"]
    return "\n".join(lines) + "\n"


def _choices(manifest: "Manifest", device: "DeviceProfile | None") -> tuple[str, str, "ServingLimits", bool | None]:
    """(model name, backend, batching limits, GPU instances) of the repository for this export and device."""
    from edgelin.devices import ServingLimits

    backend = _backend(manifest.target)
    limits = device.serving if device is not None else ServingLimits()
    return model_name(manifest.source), backend, limits, None if device is None else device.compute == "cuda"


def check_config(manifest: "Manifest", device: "DeviceProfile | None", serve: str) -> str | None:
    """Before anything is written (the graphs' I/O is known from the model): the config.pbtxt this export would
    write, parsed with Triton's schema (parse_config). Returns a warning line when tritonclient is not installed."""
    name, backend, limits, gpu = _choices(manifest, device)
    where = f"{FOLDER}/{name}/config.pbtxt"
    if serve == PYTHON_FLAVOUR:
        from edgelin.serve import triton_python

        text = triton_python.config_text(manifest, name, limits, device)
    else:
        text = config_text(manifest, name, limits, backend, gpu)
    if parse_config(text, where):
        return None
    return (f"tritonclient is not installed, so {where} was not parsed with Triton's schema (pip install "
            "'edgelin[serve]' to have export check it)")


# ---- model.onnx -------------------------------------------------------------------------------------
def serving_graph(step: Path, out: Path, backend: str, needs_position: bool) -> list[str]:
    """Writes out = step.onnx with the control inputs (and the position as state); the weights stay external,
    at the same locations. Returns those locations (the files that must sit next to `out`)."""
    import onnx
    from onnx import TensorProto, helper

    model = onnx.load(str(step), load_external_data=False)
    graph = model.graph
    batch_1 = ["batch", 1]
    added = [helper.make_tensor_value_info(c, TensorProto.UINT64 if c == CORRID else TensorProto.INT32, batch_1)
             for c, _, _ in controls(backend, needs_position)]
    if needs_position:
        kept = [i for i in graph.input if i.name != "position_ids"]
        del graph.input[:]
        graph.input.extend(kept)
        added.append(helper.make_tensor_value_info(POSITION_IN, TensorProto.INT64, batch_1))
        one = helper.make_tensor("serve_one", TensorProto.INT64, [], [1])
        flat = helper.make_tensor("serve_flat", TensorProto.INT64, [1], [-1])
        graph.initializer.extend([one, flat])
        graph.node.extend([  # position = past_position * (1 - START); the next one advances for READY rows
            helper.make_node("Cast", [START], ["serve_start"], to=TensorProto.INT64),
            helper.make_node("Cast", [READY], ["serve_ready"], to=TensorProto.INT64),
            helper.make_node("Sub", ["serve_one", "serve_start"], ["serve_keep"]),
            helper.make_node("Mul", [POSITION_IN, "serve_keep"], ["serve_position"]),
            helper.make_node("Reshape", ["serve_position", "serve_flat"], ["position_ids"]),
            helper.make_node("Add", ["serve_position", "serve_ready"], [POSITION_OUT]),
        ])
        graph.output.append(helper.make_tensor_value_info(POSITION_OUT, TensorProto.INT64, batch_1))
    graph.input.extend(added)
    onnx.save(model, str(out))
    return sorted({e.value for t in graph.initializer for e in t.external_data if e.key == "location"})


def trtexec_line(manifest: "Manifest", name: str, limits: "ServingLimits", plugin: str) -> str:
    """The engine build for a tensorrt export's repository (run where TensorRT and the serving GPU are): every
    input's shape from batch 1 to max_batch_size, optimised for the largest preferred batch."""
    opt = limits.preferred_batch_sizes[-1] if limits.preferred_batch_sizes else limits.max_batch_size
    shapes: list[tuple[str, list[int]]] = [("input_ids", [])]
    shapes += [(t.name, [int(d) for d in t.dims[1:]]) for t in manifest.state_inputs]
    shapes += [(c, [1]) for c, _, _ in controls(TENSORRT_PLAN, manifest.needs_position)]
    shapes += [(POSITION_IN, [1])] if manifest.needs_position else []
    flag = lambda kind, b: f"--{kind}Shapes=" + ",".join(  # noqa: E731
        f"{n}:" + "x".join(str(d) for d in [b, *dims]) for n, dims in shapes)
    version = f"triton/{name}/1"
    return (f"trtexec --onnx={version}/model.onnx --saveEngine={version}/model.plan --dynamicPlugins={plugin} "
            f"{flag('min', 1)} {flag('opt', opt)} {flag('max', limits.max_batch_size)}"
            + (" --stronglyTyped" if manifest.precision == "fp16" else ""))


def _link(source: Path, target: Path) -> None:
    try:
        os.link(source, target)
    except OSError:  # a file system without hard links: a copy (the bytes twice, but a working repository)
        shutil.copyfile(source, target)


# ---- the repository ---------------------------------------------------------------------------------
def write_repository(folder: Path, manifest: "Manifest", device: "DeviceProfile | None", serve: str) -> dict[str, Any]:
    """DIR/triton/ for the export in `folder` (its graphs and weights written, `manifest` describing them).
    Returns the manifest's extra["serve"] entry."""
    check_servable(manifest.state_inputs, manifest.target, serve)
    name, backend, limits, gpu = _choices(manifest, device)
    if serve == PYTHON_FLAVOUR:
        from edgelin.serve import triton_python

        return {"triton": triton_python.write_repository(folder, manifest, name, limits, device)}
    root = Path(folder) / FOLDER
    version = root / name / "1"
    version.mkdir(parents=True)
    config = root / name / "config.pbtxt"
    config.write_text(config_text(manifest, name, limits, backend, gpu))
    parse_config(config.read_text(), f"{FOLDER}/{name}/config.pbtxt")  # the file as written (check_config: up front)
    locations = serving_graph(Path(folder) / manifest.graphs["step"].file, version / "model.onnx", backend,
                              manifest.needs_position)
    for location in locations:
        if Path(location).name != location:
            raise EdgelinError(f"step graph weights at {location!r}", "a Triton repository needs them next to "
                               "model.onnx", "re-export (edgelin writes weights.bin beside the graphs)")
        _link(Path(folder) / location, version / location)
    from edgelin.export.targets import get_target

    get_target(manifest.target).write_serving_notes(root, manifest, name, limits)  # e.g. how to build the plan
    (root / CLIENT).write_text(client_text(name, prefill=False))
    return {"triton": {"repository": FOLDER, "model": name, "backend": backend, "graph": f"{name}/1/model.onnx",
                       "weights": [f"{name}/1/{loc}" for loc in locations], "client": f"{FOLDER}/{CLIENT}",
                       "position": (f"implicit state {POSITION_IN} -> {POSITION_OUT}" if manifest.needs_position
                                    else None),
                       "controls": [c for c, _, _ in controls(backend, manifest.needs_position)],
                       "states": len(state_pairs(manifest)),
                       "limits": {"max_batch_size": limits.max_batch_size,
                                  "max_candidate_sequences": limits.max_candidate_sequences,
                                  "preferred_batch_sizes": list(limits.preferred_batch_sizes),
                                  "max_queue_delay_us": limits.max_queue_delay_us,
                                  "max_sequence_idle_us": limits.max_sequence_idle_us}}}
