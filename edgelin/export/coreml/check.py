"""Linux checks of a Core ML export: the saved package(s) against the manifest and coreml.json.

What is checked (a check of the conversion, not of Apple's runtime, which needs macOS): every
package loads (`MLModel(path, skip_model_load=True)`, `get_spec()`); it holds exactly the functions
coreml.json lists (step, prefill_{L}); each function's inputs, outputs and states have the Core ML
names, shapes (batch 1, padded state dims) and dtypes the contract states, and the logits the
manifest's vocabulary; the specification version is at least the deployment target's; an MLState
function reads and writes every state (read_state / coreml_update_state) and holds no fp16<->fp32
cast of a state; an explicit function casts a state only where the state dtype and the compute
precision differ; the metadata carries edgelin's version and the source's sha256; a fixed-capacity KV
cache (full-attention layers, --context N) has the manifest's capacity (extra["kv_cache"]) in
coreml.json and in every growing state's package dims.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from edgelin.export.coreml.contract import _fail, coremltools_module, feature_name, load_contract, package_view

if TYPE_CHECKING:
    from edgelin.artifact.manifest import Manifest

# coremltools' specification versions of the deployment targets (iOS 16 = 7, 17 = 8, 18 = 9)
SPEC_VERSIONS = {"iOS16": 7, "iOS17": 8, "iOS18": 9, "macOS13": 7, "macOS14": 8, "macOS15": 9}
_ARRAY_DTYPES = {65568: "float32", 65552: "float16", 131104: "int32"}  # ArrayFeatureType.ArrayDataType


@dataclass
class CheckReport:
    """What the Linux check looked at (every item passed: a failure raises)."""

    folder: str
    packages: list[str]
    functions: list[str]
    checks: list[str] = field(default_factory=list)
    note: str = "checked the conversion (package spec and MIL program), not Apple's runtime"

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


def _feature(feature) -> tuple[str, list[int], str]:
    """(name, shape, dtype) of a spec feature (an input, output or state)."""
    kind = feature.type.WhichOneof("Type")
    array = feature.type.stateType.arrayType if kind == "stateType" else feature.type.multiArrayType
    return feature.name, list(array.shape), _ARRAY_DTYPES.get(array.dataType, str(array.dataType))


def check_folder(folder: Path, manifest: "Manifest") -> CheckReport:
    """Every check in the module docstring; EdgelinError naming the first mismatch."""
    ct = coremltools_module()
    contract = load_contract(folder)
    packages = sorted({f["package"] for f in contract["functions"].values()})
    report = CheckReport(str(folder), packages, sorted(contract["functions"]))
    if contract["compute_precision"] != manifest.precision:
        raise _fail(f"{folder}: coreml.json computes in {contract['compute_precision']}",
                    f"the manifest says {manifest.precision}")
    by_input = {t.name: t for t in manifest.state_inputs}
    if [s["input"] for s in contract["states"]] != list(by_input):
        raise _fail(f"{folder}: coreml.json's states differ from the manifest's",
                    f"{[s['input'] for s in contract['states']]} vs {list(by_input)}")
    for entry in contract["states"]:
        t = by_input[entry["input"]]
        if entry["dtype"] != t.dtype or entry["true_dims"] != [1 if d == "batch" else d for d in t.dims]:
            raise _fail(f"{folder}: state {t.name} is {entry['dtype']} {entry['true_dims']} in coreml.json",
                        f"the manifest says {t.dtype} {list(t.dims)}")
    _check_capacity(folder, contract, manifest, report)
    for package in packages:
        path = Path(folder) / package
        try:
            with package_view(path) as view, warnings.catch_warnings():
                warnings.simplefilter("ignore")
                spec = ct.models.MLModel(str(view), skip_model_load=True).get_spec()
        except Exception as exc:  # a missing or corrupt package: one line
            raise _fail(f"Core ML package {path} cannot be read", f"{type(exc).__name__}: {str(exc)[:200]}") from exc
        _check_package(path, spec, contract, manifest, report)
    return report


def _check_capacity(folder: Path, contract: dict, manifest: "Manifest", report: CheckReport) -> None:
    """The KV cache's capacity: coreml.json's, the manifest's, and the growing states' rows in the package."""
    from edgelin.export.fixed_cache import GROWING

    capacity = contract.get("capacity")
    if capacity != manifest.kv_capacity:
        raise _fail(f"{folder}: coreml.json holds a KV cache of capacity {capacity}",
                    f"the manifest says {manifest.kv_capacity} (extra.kv_cache)")
    growing = [(s, s["true_dims"].index(GROWING)) for s in contract["states"] if GROWING in s["true_dims"]]
    if growing and capacity is None:
        raise _fail(f"{folder}: state {growing[0][0]['input']} grows with the context",
                    "a Core ML package holds fixed-size states only: coreml.json must give the KV cache's capacity")
    for entry, axis in growing:
        if entry["dims"][axis] != capacity:
            raise _fail(f"{folder}: state {entry['input']} has {entry['dims'][axis]} rows in coreml.json",
                        f"the KV cache's capacity is {capacity}")
    if capacity is not None:
        report.checks.append(f"KV cache: {len(growing)} state tensors of {capacity} rows (the manifest's capacity)")


def _functions_of(spec) -> dict[str, Any]:
    """{function name: its description} (a single-function package's one function is 'main')."""
    desc = spec.description
    if len(desc.functions):
        return {f.name: f for f in desc.functions}
    return {"main": desc}


def _check_package(path: Path, spec, contract: dict, manifest: "Manifest", report: CheckReport) -> None:
    from edgelin.export.coreml.mil import load_program

    where = path.name
    want_functions = [n for n, f in contract["functions"].items() if f["package"] == path.name]
    functions = _functions_of(spec)
    names = sorted(functions) if contract["multifunction"] else want_functions
    if contract["multifunction"] and names != sorted(want_functions):
        raise _fail(f"{where} holds functions {names}", f"coreml.json lists {sorted(want_functions)}")
    if contract["multifunction"] and spec.description.defaultFunctionName != "step":
        raise _fail(f"{where}: default function {spec.description.defaultFunctionName!r}", "it should be 'step'")
    report.checks.append(f"{where}: functions {', '.join(names)}")
    need = SPEC_VERSIONS[contract["deployment_target"]]
    if spec.specificationVersion < need:
        raise _fail(f"{where} has specification version {spec.specificationVersion}",
                    f"deployment target {contract['deployment_target']} needs {need}")
    report.checks.append(f"{where}: specification version {spec.specificationVersion} "
                         f"(>= {need}, {contract['deployment_target']})")
    meta = dict(spec.description.metadata.userDefined)
    for key, want in (("edgelin_version", manifest.edgelin_version),
                      ("source_sha256", str(manifest.source.get("sha256"))), ("edgelin_style", contract["style"])):
        if meta.get(key) != want:
            raise _fail(f"{where}: metadata {key} is {meta.get(key)!r}", f"expected {want!r}")
    report.checks.append(f"{where}: metadata edgelin_version, source_sha256, edgelin_style")
    program = load_program(path)
    for name in want_functions:
        key = name if contract["multifunction"] else "main"  # a single-function package's function is main
        _check_function(where, name, functions[key], contract, manifest)
        _check_program(where, name, program.functions[key], contract)
        report.checks.append(f"{where}:{name}: I/O names, shapes, dtypes; state ops and casts")


def _check_function(where: str, name: str, fdesc, contract: dict, manifest: "Manifest") -> None:

    entry = contract["functions"][name]
    ids_shape = [1] if entry["kind"] == "step" else [1, entry["length"]]
    want_in = [("input_ids", ids_shape, "int32")] + ([("position_ids", [1], "int32")] if contract["position_ids"] else [])
    want_out = [("logits", [1, manifest.vocab_size], "float32")]
    states = [(s["feature"], s["dims"], s["dtype"]) for s in contract["states"]]
    want_state: list = []
    if contract["style"] == "explicit":
        want_in += states
        want_out += [(feature_name(s["output"]), s["dims"], s["dtype"]) for s in contract["states"]]
    else:
        want_state = states
    got = ([_feature(f) for f in fdesc.input], [_feature(f) for f in fdesc.output], [_feature(f) for f in fdesc.state])
    for label, have, want in zip(("inputs", "outputs", "states"), got, (want_in, want_out, want_state)):
        if [tuple(x) for x in have] != [tuple(x) for x in want]:
            raise _fail(f"{where}:{name} {label} are {have}", f"the contract says {want}")


def _check_program(where: str, name: str, function, contract: dict) -> None:
    """MLState: every state read once and written once. Both styles: a state is cast exactly when its
    dtype differs from the compute precision (fp32 state into an fp16 program, fp16 MLState into an
    fp32 one), never otherwise."""
    ops = list(function.operations)
    features = [s["feature"] for s in contract["states"]]
    compute = "fp16" if contract["compute_precision"] == "fp16" else "fp32"
    state_vars = {f: f for f in features}  # the var a state enters the program as -> its feature
    if contract["style"] == "mlstate":
        read = sorted(op.inputs["input"].name for op in ops if op.op_type == "read_state")
        written = sorted(op.inputs["state"].name for op in ops if op.op_type == "coreml_update_state")
        if read != sorted(features) or written != sorted(features):
            raise _fail(f"{where}:{name} reads states {read} and writes {written}",
                        f"an MLState function reads and writes each of {sorted(features)} once")
        state_vars = {op.outputs[0].name: op.inputs["input"].name for op in ops if op.op_type == "read_state"}
    dtype = {"float16": "fp16", "float32": "fp32"}[contract["state_dtype"]]
    cast = {state_vars[op.inputs["x"].name] for op in ops if op.op_type == "cast" and op.inputs["x"].name in state_vars}
    if dtype == compute and cast:
        raise _fail(f"{where}:{name} casts state {sorted(cast)[0]}",
                    f"the state is {contract['state_dtype']} and the function computes in {compute}: no cast belongs")
    if dtype != compute and set(features) - cast:
        raise _fail(f"{where}:{name} does not cast state {sorted(set(features) - cast)[0]}",
                    f"a {contract['state_dtype']} state enters a {compute} program through a cast")
