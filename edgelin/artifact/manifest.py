"""manifest.json: the contract between an exported folder and whoever runs it."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from edgelin import __version__
from edgelin.errors import EdgelinError
from edgelin.integrity import safe_relative
from edgelin.outputs import inside_path
from edgelin.artifact.tensors import TensorIO
from edgelin.artifact.state import state_output_name

MANIFEST = "manifest.json"
FORMAT = "edgelin-export"
MANIFEST_VERSION = 1
NUMPY_DTYPES = {"float32": np.float32, "float16": np.float16, "int64": np.int64, "int32": np.int32}


@dataclass(frozen=True)
class GraphEntry:
    file: str
    inputs: tuple[TensorIO, ...]
    outputs: tuple[TensorIO, ...]

    def to_dict(self) -> dict:
        return {"file": self.file, "inputs": [t.to_dict() for t in self.inputs],
                "outputs": [t.to_dict() for t in self.outputs]}

    @classmethod
    def from_dict(cls, data: dict) -> "GraphEntry":
        return cls(data["file"], tuple(TensorIO.from_dict(t) for t in data["inputs"]),
                   tuple(TensorIO.from_dict(t) for t in data["outputs"]))


@dataclass(frozen=True)
class Manifest:
    target: str
    precision: str
    graphs: dict[str, GraphEntry]
    layers: tuple[dict[str, Any], ...]  # per layer: index, type, state tensor names
    vocab_size: int
    needs_position: bool
    source: dict[str, Any]  # path, sha256, format, model_type
    tokenizer: str | None = None
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    num_parameters: int = 0
    extra: dict[str, Any] = field(default_factory=dict)
    edgelin_version: str = __version__
    files: tuple[str, ...] | None = None  # every file the export wrote (lets --force know the folder is ours)
    # {path relative to the folder: sha256} of every file under it but manifest.json (edgelin.integrity checks them
    # when the folder is opened); None: an older export, which recorded none
    sha256: dict[str, str] | None = None

    # ---- derived -------------------------------------------------------------------------------
    @property
    def state_inputs(self) -> list[TensorIO]:
        return [t for t in self.graphs["step"].inputs if t.role == "state"]

    def state_bytes(self, batch: int = 1, past: int = 0) -> int:
        return sum(int(np.prod(_shape(t.dims, batch, past))) * np.dtype(NUMPY_DTYPES[t.dtype]).itemsize
                   for t in self.state_inputs)

    def initial_state(self, batch: int, past: int = 0) -> dict[str, np.ndarray]:
        return {t.name: np.zeros(_shape(t.dims, batch, past), NUMPY_DTYPES[t.dtype]) for t in self.state_inputs}

    @property
    def constant_memory(self) -> bool:
        return not any(isinstance(d, str) and d != "batch" for t in self.state_inputs for d in t.dims)

    @property
    def kv_capacity(self) -> int | None:
        """A static KV cache's capacity in tokens (`export --kv-cache static --context N`: the runner keeps
        each growing state tensor in one buffer of this many positions); None: a growing cache, or none."""
        entry = self.extra.get("kv_cache")
        return entry["capacity"] if entry else None

    def kv_flag(self, tokens: int | str) -> str:
        """The export flags that give a fixed-capacity KV cache `tokens` rows, as the export that wrote this folder
        takes them: `--context N` where the cache is held as state (Apple's targets: extra.kv_cache.flag), else ONNX
        Runtime's `--kv-cache static --context N`."""
        entry = self.extra.get("kv_cache") or {}
        return f"--context {tokens}" if str(entry.get("flag", "")).startswith("--context") else \
            f"--kv-cache static --context {tokens}"

    @property
    def kv_dtype(self) -> str | None:
        """A static KV cache's element type ("float32", or "float16" with `--kv-dtype fp16`; entries written
        before the option say none: float32); None without a static cache."""
        entry = self.extra.get("kv_cache")
        return entry.get("dtype", "float32") if entry else None

    # ---- file ----------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return {
            "format": FORMAT,
            "manifest_version": MANIFEST_VERSION,
            "edgelin_version": self.edgelin_version,
            "target": self.target,
            "precision": self.precision,
            "source": self.source,
            "model": {
                "vocab_size": self.vocab_size,
                "num_parameters": self.num_parameters,
                "needs_position": self.needs_position,
                "layers": list(self.layers),
                "state_bytes_per_sequence": self.state_bytes(1),
                "constant_memory": self.constant_memory,
            },
            "tokenizer": self.tokenizer,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_id,
            "graphs": {kind: g.to_dict() for kind, g in self.graphs.items()},
            "state": [
                {"input": t.name, "output": state_output_name(t.layer, t.state_name), "layer": t.layer,
                 "name": t.state_name, "dims": list(t.dims), "dtype": t.dtype, "init": "zeros",
                 **({"capacity": self.kv_capacity} if self.kv_capacity and _STATE_DIMS[1] in t.dims else {})}
                for t in self.state_inputs
            ],
            "extra": self.extra,
            **({"files": list(self.files)} if self.files is not None else {}),
            **({"sha256": dict(self.sha256)} if self.sha256 is not None else {}),
        }

    def save(self, folder: Path) -> None:
        (Path(folder) / MANIFEST).write_text(json.dumps(self.to_dict(), indent=2) + "\n")

    @classmethod
    def load(cls, folder: Path) -> "Manifest":
        path = Path(folder) / MANIFEST
        if not path.is_file():
            raise EdgelinError(f"no {MANIFEST} in {folder}", "this is not an edgelin export folder",
                               "pass a folder written by `edgelin export`")
        try:
            data = json.loads(path.read_text())
            check_shapes(data)
            model, files = data["model"], data.get("files")
            for name in [g["file"] for g in data["graphs"].values()] + [data.get("tokenizer")]:
                if name is not None and not _plain_name(name):
                    raise ValueError(f"file name {_brief(name)} escapes the export folder")
            for name in files or []:  # also the files inside the folders an export writes (triton/...), by path
                if not inside_path(name):
                    raise ValueError(f"file name {_brief(name)} escapes the export folder")
            check_consistency(data)
            return cls(
                target=data["target"], precision=data["precision"],
                graphs={k: GraphEntry.from_dict(v) for k, v in data["graphs"].items()},
                layers=tuple(model["layers"]), vocab_size=model["vocab_size"],
                needs_position=model["needs_position"], source=data["source"], tokenizer=data.get("tokenizer"),
                bos_token_id=data.get("bos_token_id"), eos_token_id=data.get("eos_token_id"),
                num_parameters=model.get("num_parameters", 0), extra=data.get("extra", {}),
                edgelin_version=data.get("edgelin_version", "?"),
                files=tuple(files) if files is not None else None,
                sha256=dict(data["sha256"]) if data.get("sha256") is not None else None,
            )
        except (KeyError, TypeError, ValueError, json.JSONDecodeError) as exc:
            raise EdgelinError(f"{path} is malformed", f"{type(exc).__name__}: {exc}",
                               "re-run `edgelin export` to regenerate the folder") from exc
        except RecursionError as exc:  # json's parser recurses once per nesting level
            raise EdgelinError(f"{path} is malformed", "its JSON is nested too deeply to parse",
                               "re-run `edgelin export` to regenerate the folder") from exc


def _brief(value: Any, limit: int = 60) -> str:
    """A value from the file as short JSON: an error line names it, never dumps a whole entry."""
    try:
        text = json.dumps(value)
    except (TypeError, ValueError):
        text = repr(value)
    return text if len(text) <= limit else text[:limit - 3] + "..."


def _plain_name(name: Any) -> bool:
    """A file name directly inside the export folder (no folder part, not '.' or '..')."""
    return isinstance(name, str) and Path(name).name == name and name not in ("", ".", "..")


def _expect(where: str, value: Any, kind: type | tuple[type, ...], wanted: str) -> None:
    """ValueError (the caller: "malformed") naming the field and its value unless `value` is a `kind`."""
    if not isinstance(value, kind) or (isinstance(value, bool) and bool not in (kind if isinstance(kind, tuple)
                                                                                 else (kind,))):
        raise ValueError(f"{where} is {_brief(value)}, expected {wanted}")


def check_shapes(data: Any) -> None:
    """The JSON types of every manifest field the readers index into (the top level, model, graphs,
    state, extra and its weights/precision/quantization entries), so that an edited or foreign file is
    one "malformed" line naming the field instead of a crash where it is first used. check_consistency
    then checks the values against each other."""
    _expect("the manifest", data, dict, "a JSON object")
    if data.get("format") != FORMAT:
        raise ValueError(f"format is {_brief(data.get('format'))}, expected {FORMAT!r}")
    if data.get("manifest_version") != MANIFEST_VERSION:
        raise ValueError(f"manifest_version {_brief(data.get('manifest_version'))} is not {MANIFEST_VERSION}")
    for key in ("target", "precision"):
        _expect(key, data.get(key), str, "a string")
    _expect("source", data.get("source"), dict, "an object")
    _expect("model", data.get("model"), dict, "an object")
    _expect("model.layers", data["model"].get("layers"), list, "a list")
    for i, layer in enumerate(data["model"]["layers"]):
        _expect(f"model.layers[{i}]", layer, dict, "an object")
    if "num_parameters" in data["model"]:
        _expect("model.num_parameters", data["model"]["num_parameters"], int, "an integer")
    _expect("graphs", data.get("graphs"), dict, "an object (graph kind -> its file and I/O)")
    for kind, graph in data["graphs"].items():
        _expect(f"graphs.{kind}", graph, dict, "an object")
        _expect(f"graphs.{kind}.file", graph.get("file"), str, "a file name")
        for side in ("inputs", "outputs"):
            _expect(f"graphs.{kind}.{side}", graph.get(side), list, "a list")
            for i, tensor in enumerate(graph[side]):
                _expect(f"graphs.{kind}.{side}[{i}]", tensor, dict, "an object")
                _expect(f"graphs.{kind}.{side}[{i}].dims", tensor.get("dims"), list, "a list")
    _expect("state", data.get("state"), list, "a list")
    for i, entry in enumerate(data["state"]):
        _expect(f"state[{i}]", entry, dict, "an object")
    _expect("tokenizer", data.get("tokenizer"), (str, type(None)), "a file name or null")
    for key in ("bos_token_id", "eos_token_id"):
        _expect(key, data.get(key), (int, type(None)), "an integer or null")
    files = data.get("files")
    if files is not None and not (isinstance(files, list) and all(isinstance(n, str) for n in files)):
        raise ValueError("files is not a list of file names")
    digests = data.get("sha256")
    if digests is not None:
        _expect("sha256", digests, dict, "an object (file path -> its sha256)")
        for name, digest in digests.items():
            if not safe_relative(name):
                raise ValueError(f"sha256 names {_brief(name)}, a path that escapes the export folder")
            if not (isinstance(digest, str) and len(digest) == 64 and all(c in "0123456789abcdef" for c in digest)):
                raise ValueError(f"sha256[{_brief(name)}] is {_brief(digest)}, expected 64 lowercase hex digits")
    extra = data.get("extra", {})
    _expect("extra", extra, dict, "an object")
    for key in ("precision", "quantization", "reference_vectors", "baselines", "quality", "serve"):
        if extra.get(key) is not None:
            _expect(f"extra.{key}", extra[key], dict, "an object")
    if extra.get("weights") is not None:
        _check_weights_entry(extra["weights"])


def _check_weights_entry(weights: Any) -> None:
    """extra.weights (edgelin.export.weights.describe): the one weights file both graphs read."""
    _expect("extra.weights", weights, dict, "an object")
    if not _plain_name(weights.get("file")):
        raise ValueError(f"extra.weights.file {_brief(weights.get('file'))} is not a file name in the export "
                         "folder (it escapes the folder)")
    for key in ("bytes", "shared_tensors"):
        if not isinstance(weights.get(key), int) or isinstance(weights[key], bool) or weights[key] < 0:
            raise ValueError(f"extra.weights.{key} is {_brief(weights.get(key))}, expected an integer >= 0")
    for key in ("read_by", "bytes_by_dtype"):
        if key in weights:
            _expect(f"extra.weights.{key}", weights[key], dict, "an object")
    by_graph = weights.get("tensors_by_graph", {})
    _expect("extra.weights.tensors_by_graph", by_graph, dict, "an object (graph file -> its tensors)")
    for file, tensors in by_graph.items():
        where = f"extra.weights.tensors_by_graph[{_brief(file)}]"
        _expect(where, tensors, list, "a list of [name, offset, length, dtype, dims]")
        for i, tensor in enumerate(tensors):
            if not (isinstance(tensor, list) and len(tensor) == 5 and isinstance(tensor[0], str)
                    and all(isinstance(n, int) and not isinstance(n, bool) for n in tensor[1:3])
                    and isinstance(tensor[3], str) and isinstance(tensor[4], list)
                    and all(isinstance(d, int) and not isinstance(d, bool) for d in tensor[4])):
                raise ValueError(f"{where}[{i}] is {_brief(tensor)}, expected [name, offset, length, dtype, dims]")


_EDITED = "the folder was edited or mixed with another export"
_REEXPORT = "re-run `edgelin export`"
_STATE_DIMS = ("batch", "past_sequence")  # the symbolic sizes a state tensor may have


def _agree(where: str, fact: str, a_label: str, a: Any, b_label: str, b: Any) -> None:
    if a != b:
        raise EdgelinError(f"{where}: {fact} is {_show(a)} in {a_label} but {_show(b)} in {b_label}", _EDITED,
                           _REEXPORT)


def _show(value: Any) -> str:
    return str(list(value)) if isinstance(value, tuple) else json.dumps(value)


def check_consistency(data: dict[str, Any]) -> None:
    """Every fact the manifest states twice must agree: the top-level `state` list, `model.layers`,
    `state_bytes_per_sequence`, `constant_memory`, `needs_position` and `vocab_size` against the
    graphs' I/O, and the step and prefill graphs against each other. (The runner then checks the
    graph files against `graphs`.) A mismatch raises EdgelinError naming the fact and both values;
    a missing key or a wrong type raises KeyError/TypeError/ValueError (the caller: "malformed")."""
    from edgelin.artifact.tensors import grown_dims as _grown
    from edgelin.artifact.state import state_input_name, state_output_name

    model = data["model"]
    vocab, needs_position = model["vocab_size"], model["needs_position"]
    if not isinstance(vocab, int) or isinstance(vocab, bool) or vocab < 1 or not isinstance(needs_position, bool):
        raise ValueError("model.vocab_size must be a positive integer and model.needs_position a boolean")
    _agree("manifest is inconsistent", "the set of graphs", "graphs", sorted(data["graphs"]),
           "the format", ["prefill", "step"])
    graphs = {kind: GraphEntry.from_dict(g) for kind, g in data["graphs"].items()}
    states: dict[str, list[TensorIO]] = {}
    for kind, graph in graphs.items():
        where = f"manifest and {kind} graph disagree"
        inputs = {t.name: t for t in graph.inputs}
        outputs = {t.name: t for t in graph.outputs}
        if len(inputs) != len(graph.inputs) or len(outputs) != len(graph.outputs):
            raise ValueError(f"graphs.{kind} lists a tensor name twice")
        ids = inputs.get("input_ids")
        _agree(where, "input_ids", f"graphs.{kind}.inputs", ids and [list(ids.dims), ids.dtype, ids.role],
               "the format", [["batch"] if kind == "step" else ["batch", "sequence"], "int64", "input_ids"])
        _agree(where, "whether the graph takes position_ids", f"graphs.{kind}.inputs", "position_ids" in inputs,
               "model.needs_position", needs_position)
        if needs_position:
            pos = inputs["position_ids"]
            _agree(where, "position_ids", f"graphs.{kind}.inputs", [list(pos.dims), pos.dtype], "the format",
                   [["batch"], "int64"])
        logits = outputs.get("logits")
        _agree(where, "the logits dims", f"graphs.{kind}.outputs", logits and list(logits.dims),
               "model.vocab_size", ["batch", vocab])
        states[kind] = [t for t in graph.inputs if t.role == "state"]
        grown = "1" if kind == "step" else "sequence"
        for t in states[kind]:
            name = state_input_name(t.layer, t.state_name)
            _agree(where, f"the name of state input {t.name}", f"graphs.{kind}.inputs", t.name,
                   "its layer and name", name)
            if not t.dims or t.dims[0] != "batch" or any(
                    not (d in _STATE_DIMS if isinstance(d, str) else isinstance(d, int) and d > 0) for d in t.dims):
                raise ValueError(f"graphs.{kind}: {t.name} has dims {list(t.dims)} (batch first, then sizes > 0 "
                                 f"or {_STATE_DIMS[1]})")
            if t.dtype not in NUMPY_DTYPES:
                raise ValueError(f"graphs.{kind}: {t.name} has dtype {t.dtype!r}")
            out_name = state_output_name(t.layer, t.state_name)
            out = outputs.get(out_name)
            _agree(where, f"{out_name} [dims, dtype, feeds]", f"graphs.{kind}.outputs",
                   out and [list(out.dims), out.dtype, out.feeds], f"what input {t.name} implies",
                   [list(_grown(t.dims, grown)), t.dtype, t.name])
        other = set(outputs) - {"logits"} - {state_output_name(t.layer, t.state_name) for t in states[kind]}
        if other:
            raise EdgelinError(f"{where}: graphs.{kind}.outputs lists {sorted(other)[0]}",
                               "no state input feeds it", _REEXPORT)

    step = states["step"]
    describe = lambda ts: [[t.name, list(t.dims), t.dtype, t.state_role] for t in ts]  # noqa: E731
    _agree("step and prefill graphs disagree", "the state inputs", "graphs.step", [t.name for t in step],
           "graphs.prefill", [t.name for t in states["prefill"]])
    for a, b in zip(describe(step), describe(states["prefill"])):
        _agree("step and prefill graphs disagree", f"state input {a[0]}", "graphs.step", a, "graphs.prefill", b)

    listed = data["state"]
    _agree("manifest and step graph disagree", "the state tensors", "state[]", [s["input"] for s in listed],
           "graphs.step.inputs", [t.name for t in step])
    for entry, t in zip(listed, step):
        for key, want in (("dims", list(t.dims)), ("dtype", t.dtype), ("layer", t.layer), ("name", t.state_name),
                          ("output", state_output_name(t.layer, t.state_name)), ("init", "zeros")):
            _agree("manifest and step graph disagree", f"{t.name} {key}", "state[]", entry[key],
                   "graphs.step.inputs", want)

    layers = model["layers"]
    _agree("manifest is inconsistent", "the layer indices", "model.layers", [layer["index"] for layer in layers],
           "their order", list(range(len(layers))))
    by_layer = [[t.state_name for t in step if t.layer == i] for i in range(len(layers))]
    _agree("manifest and step graph disagree", "the state names per layer", "model.layers",
           [layer["state"] for layer in layers], "graphs.step.inputs", by_layer)
    _agree("manifest and step graph disagree", "the number of state inputs", "model.layers",
           sum(map(len, by_layer)), "graphs.step.inputs", len(step))

    extra = data.get("extra", {})
    kv_cache = extra.get("kv_cache") if isinstance(extra, dict) else None
    growing = [entry for entry in listed if _STATE_DIMS[1] in entry["dims"]]
    if kv_cache is not None:
        capacity = kv_cache.get("capacity") if isinstance(kv_cache, dict) else None
        if not isinstance(kv_cache, dict) or kv_cache.get("layout") != "static" or isinstance(capacity, bool) \
                or not isinstance(capacity, int) or capacity < 1 or not growing:
            raise ValueError(f"extra.kv_cache {kv_cache!r} (a static cache: layout \"static\", a capacity >= 1, "
                             "and state tensors that grow)")
    for entry in growing:
        _agree("manifest is inconsistent", f"the capacity of {entry['input']}", "state[]", entry.get("capacity"),
               "extra.kv_cache", kv_cache and kv_cache["capacity"])

    probe = Manifest("", "", graphs, (), vocab, needs_position, {})
    _agree("manifest is inconsistent", "state_bytes_per_sequence", "model", model["state_bytes_per_sequence"],
           "the state tensors' dims and dtypes", probe.state_bytes(1))
    _agree("manifest is inconsistent", "constant_memory", "model", model["constant_memory"],
           "the state tensors' dims", probe.constant_memory)


def _shape(dims: tuple, batch: int, past: int) -> list[int]:
    sizes = {"batch": batch, "past_sequence": past}
    return [sizes[d] if isinstance(d, str) else d for d in dims]
