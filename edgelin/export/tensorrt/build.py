"""The tensorrt target's engine path: what export writes into `tensorrt/` (plugin sources + CMake,
a standalone `build_engine.py`, `COMMANDS.md` with the trtexec and polygraphy lines) and what
`edgelin build` does with it (the plugin library here; the engines where TensorRT and a GPU are).

Layout of `tensorrt/` (the plugin's CMakeLists.txt finds the launcher at ../../kernels/cuda):
  plugins/tensorrt/CMakeLists.txt, plugins/tensorrt/src/*.cpp, kernels/cuda/*  the plugin sources
  build_engine.py   tensorrt only: a copy of edgelin.plugins.tensorrt.build_engine with engines.json's spec
                    filled in, for building by hand; `edgelin build` never runs it (an export folder is
                    data): it runs its own module on engines.json, checked (read_engine_spec)
  engines.json      per graph: its file, its engine, its profiles (narrowest first: a batch-1 step, short
                    prompts; the last is the full range), and with --trt-inplace the state pairs the
                    step engine aliases (what the TensorRT runner binds to one buffer)
  COMMANDS.md       the equivalent trtexec lines and a polygraphy TensorRT-vs-ONNX-Runtime line
  build.json        written by `edgelin build` (the manifest is never rewritten: the folder still validates)

No torch and no TensorRT import at module level (runtime-only installs, machines without TensorRT).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from edgelin.errors import EdgelinError

if TYPE_CHECKING:
    from edgelin.devices import DeviceProfile
    from edgelin.artifact.manifest import Manifest

TRT_DIR = "tensorrt"
BUILD_RECORD = "build.json"
ENGINE_SPEC = "engines.json"
GRAPHS = ("step", "prefill")
BATCH = (1, 1, 8)  # min / opt / max batch of the optimisation profiles
PROMPT = (1, 128, 2048)  # min / opt / max prompt length (prefill's `sequence`)
PAST = (0, 128, 2048)  # a growing cache's past length (an empty cache is allowed)
DEFAULT_ARCHS = ("80", "86", "87", "89", "90")
HEADER_CANDIDATES = ("/usr/include/aarch64-linux-gnu", "/usr/include/x86_64-linux-gnu", "/usr/local/tensorrt/include",
                     "/usr/include")
WHERE_ENGINE = "a machine with TensorRT 10.3+ (pip install tensorrt, or JetPack 6) and an NVIDIA GPU"

Shapes = dict[str, tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]]  # input -> (min, opt, max)


@dataclass(frozen=True)
class Ranges:
    """min / opt / max per symbolic dimension."""

    batch: tuple[int, int, int] = BATCH
    prompt: tuple[int, int, int] = PROMPT

    @classmethod
    def for_device(cls, device: "DeviceProfile | None") -> "Ranges":
        # A profile may one day carry its own ranges (min_batch/opt_batch/max_batch, ...); none does yet.
        def pick(prefix: str, default: tuple[int, int, int]) -> tuple[int, int, int]:
            values = tuple(getattr(device, f"{w}_{prefix}", None) for w in ("min", "opt", "max"))
            return values if all(isinstance(v, int) for v in values) else default  # type: ignore[return-value]

        return cls(pick("batch", BATCH), pick("prompt", PROMPT)) if device is not None else cls()

    def dim(self, name: str | int, which: int) -> int:
        if isinstance(name, int):
            return name
        if name == "batch":
            return self.batch[which]
        if name.startswith("past"):
            return PAST[which]
        return self.prompt[which]  # sequence (prompt length)


def graph_inputs(path: Path) -> list[tuple[str, tuple[str | int, ...]]]:
    """(name, dims) of each input of an ONNX graph: an int for a fixed dim, its name for a symbolic one."""
    import onnx

    model = onnx.load(str(path), load_external_data=False)
    return [(i.name, tuple(d.dim_param if d.dim_param else d.dim_value for d in i.type.tensor_type.shape.dim))
            for i in model.graph.input]


def profile_shapes(inputs: list[tuple[str, tuple[str | int, ...]]], ranges: Ranges) -> Shapes:
    return {name: tuple(tuple(ranges.dim(d, w) for d in dims) for w in range(3))  # type: ignore[misc]
            for name, dims in inputs}


def graph_profiles(graph: str, inputs: list[tuple[str, tuple[str | int, ...]]], ranges: Ranges) -> list[Shapes]:
    """The optimisation profiles of one graph, narrowest first; the last is the full range (the one the
    trtexec line builds). The runner picks the first that holds a call's shapes: a batch-1 decode step
    gets an engine tuned for exactly batch 1 (and a fixed shape for its CUDA graph), a short prompt one
    tuned for short prompts."""
    full = profile_shapes(inputs, ranges)
    b_lo, _, b_hi = ranges.batch
    p_lo, p_opt, p_hi = ranges.prompt
    if graph == "step":
        narrow = Ranges((b_lo, b_lo, b_lo), ranges.prompt) if b_hi > b_lo else None
    else:
        narrow = Ranges(ranges.batch, (p_lo, max(p_lo, min(16, p_opt)), p_opt)) if p_opt < p_hi else None
    return ([profile_shapes(inputs, narrow)] if narrow is not None else []) + [full]


def shape_arg(shapes: Shapes, which: int) -> str:
    """trtexec / polygraphy form: name:1x2x8x8,name2:1 (a scalar input is name:)."""
    return ",".join(f"{name}:{'x'.join(str(d) for d in dims[which])}" for name, dims in shapes.items())


def trtexec_line(graph: str, shapes: Shapes, plugin: str, fp16: bool = False, inplace: bool = False,
                 strongly_typed: bool = False) -> str:
    return (f"trtexec --onnx={graph}.onnx --dynamicPlugins={plugin} --minShapes={shape_arg(shapes, 0)} "
            f"--optShapes={shape_arg(shapes, 1)} --maxShapes={shape_arg(shapes, 2)} "
            f"--saveEngine={graph}.engine" + (" --stronglyTyped" if strongly_typed else " --fp16" if fp16 else "")
            + (" --preview=+aliasedPluginIO1003" if inplace and graph == "step" else ""))


def polygraphy_line(graph: str, shapes: Shapes, plugin: str) -> str:
    """The opt shapes (polygraphy feeds one shape per input: name:[1,2,8,8])."""
    inputs = " ".join(f"{n}:[{','.join(str(d) for d in dims[1])}]" for n, dims in shapes.items())
    return f"polygraphy run {graph}.onnx --trt --onnxrt --plugins {plugin} --input-shapes {inputs}"


def plugin_file(trt_major: int | str) -> str:
    return f"libedgelin_trt_plugin_trt{trt_major}.so"


def write_folder(folder: Path, files: dict[str, str], device: "DeviceProfile | None", inplace: bool = False,
                 aliased: dict[str, str] | None = None, strongly_typed: bool = False) -> None:
    """Write `tensorrt/` into the export's temp folder (the pipeline renames the whole folder).
    `inplace`/`aliased`: --trt-inplace and the step's {state input: state output} pairs its plugin
    nodes alias (edgelin.export.tensorrt.target.add_step_functions). `strongly_typed`: an fp16 export,
    built as a strongly typed network (the graph's fp16/fp32 types are the engine's)."""
    from edgelin.kernels.abi import CUDA_DIR
    from edgelin.plugins.tensorrt import PLUGIN_DIR

    root = Path(folder) / TRT_DIR
    ranges = Ranges.for_device(device)
    inputs = {g: graph_inputs(Path(folder) / files[g]) for g in GRAPHS if g in files}
    shapes = {g: profile_shapes(inputs[g], ranges) for g in inputs}
    plugins = root / "plugins" / "tensorrt"
    (plugins / "src").mkdir(parents=True)
    shutil.copy2(PLUGIN_DIR / "CMakeLists.txt", plugins / "CMakeLists.txt")
    for src in sorted((PLUGIN_DIR / "src").glob("*.cpp")):
        shutil.copy2(src, plugins / "src" / src.name)
    (root / "kernels" / "cuda").mkdir(parents=True)
    for src in sorted(CUDA_DIR.iterdir()):
        if src.suffix in (".h", ".cuh", ".cu"):  # the launcher; torch_ext.cpp is the torch extension's
            shutil.copy2(src, root / "kernels" / "cuda" / src.name)
    profiles = {g: [{n: [list(s) for s in v] for n, v in p.items()} for p in graph_profiles(g, inputs[g], ranges)]
                for g in inputs}
    weights = {"weights": files["weights"]} if "weights" in files else {}  # external data both graphs read
    spec = {g: {"file": files[g], "engine": f"{g}.engine", "profiles": profiles[g], **weights,
                "aliased": dict(aliased or {}) if g == "step" else {}} for g in inputs}
    (root / ENGINE_SPEC).write_text(json.dumps({"inplace": inplace, "strongly_typed": strongly_typed, "graphs": spec},
                                               indent=2) + "\n")
    # the template, for building by hand (edgelin build runs its own module): GRAPHS, INPLACE and
    # STRONGLY_TYPED filled in
    script = (PLUGIN_DIR / "build_engine.py").read_text()
    for name, value in (("GRAPHS", json.dumps(spec)), ("INPLACE", inplace), ("STRONGLY_TYPED", strongly_typed)):
        placeholder = f"{name} = {'{}' if name == 'GRAPHS' else False}  # filled in by edgelin export"
        script = script.replace(placeholder, f"{name} = {value}")
    (root / "build_engine.py").write_text(script)
    (root / "COMMANDS.md").write_text(commands_text(shapes, inplace, files.get("weights"), strongly_typed))
    from edgelin.outputs import record_written

    # every file of tensorrt/ is edgelin's: a later `export --force` may replace the folder
    record_written(root, [p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file()])


def commands_text(shapes: dict[str, Shapes], inplace: bool = False, weights: str | None = None,
                  strongly_typed: bool = False) -> str:
    lib = "tensorrt/" + plugin_file("10")
    lines = ["# Building and checking the TensorRT engines by hand", "",
             "Run from the export folder. `edgelin build .` builds the plugin library (`" + lib + "`; `trt11` for "
             "TensorRT 11) and, where TensorRT and a GPU are present, builds the engines as `tensorrt/build_engine.py` "
             "does (with edgelin's own copy of it)."
             + (f" Both graphs read their weights from `{weights}` beside them (ONNX external data, which TensorRT's "
                "parser, trtexec and polygraphy resolve relative to the .onnx file): keep the files together."
                if weights else ""), "",
             "## Plugin library", "", "```sh",
             "cmake -S tensorrt/plugins/tensorrt -B tensorrt/build -DTENSORRT_INCLUDE_DIR=/usr/include/aarch64-linux-gnu "
             "-DEDGELIN_TRT_MAJOR=10 -DCMAKE_CUDA_ARCHITECTURES=87 && cmake --build tensorrt/build", "```", "",
             "## Engines (the same as build_engine.py)", "", "```sh"]
    lines += [trtexec_line(g, s, lib, inplace=inplace, strongly_typed=strongly_typed) for g, s in shapes.items()]
    precision = ("`--stronglyTyped`: this is an fp16 export, whose graphs say which tensors are fp16 (matmuls, the "
                 "plugin's q/k/v) and which stay fp32 (state, gates, logits). " if strongly_typed else
                 "Add `--fp16` (build_engine.py: `--fp16`) to allow half precision. ")
    lines += ["```", "", precision + "The trtexec lines build "
              "one optimisation profile, the full range; build_engine.py also builds the narrower ones of "
              "engines.json (a batch-1 step, short prompts) that the TensorRT runner prefers."
              + (" `--preview=+aliasedPluginIO1003`: the step's plugin nodes update the state in place "
                 "(exported with --trt-inplace)." if inplace else ""), "",
              "## Compare TensorRT with ONNX Runtime", "", "```sh"]
    lines += [polygraphy_line(g, s, lib) for g, s in shapes.items()]
    lines += ["```", ""]
    return "\n".join(lines)


# ---- the build phase ---------------------------------------------------------------------------
@dataclass(frozen=True)
class BuildResult:
    files: dict[str, str]  # kind -> path relative to the export folder
    missing: str | None  # what was not built and why (None: everything)


def find_headers(trt_include: Path | None) -> Path:
    from edgelin.plugins.tensorrt import HEADERS_FIX

    if trt_include is not None:
        return Path(trt_include)
    env = os.environ.get("TENSORRT_INCLUDE_DIR")
    for candidate in ([env] if env else []) + list(HEADER_CANDIDATES):
        if (Path(candidate) / "NvInferRuntime.h").is_file():
            return Path(candidate)
    raise EdgelinError("no TensorRT headers found", "the plugin library is compiled against NvInferRuntime.h",
                       HEADERS_FIX.replace("pass the folder", "pass --trt-include with the folder"))


def gpu_visible() -> bool:
    """An NVIDIA GPU's device node (desktop: /dev/nvidia0; Jetson: /dev/nvhost-*)."""
    return Path("/dev/nvidia0").exists() or any(Path("/dev").glob("nvhost-*"))


def engine_possible() -> str | None:
    """None when `tensorrt` imports and a GPU is visible; otherwise why not (one line)."""
    try:
        import tensorrt  # noqa: F401
    except ImportError:
        return "the tensorrt Python package is not installed here"
    if not gpu_visible():
        return "no NVIDIA GPU is visible here"
    return None


def build_folder(folder: Path, device: "DeviceProfile | None" = None, trt_include: Path | None = None,
                 archs: list[str] | None = None) -> BuildResult:
    """Build the plugin library into folder/tensorrt/, then the engines when TensorRT and a GPU are here."""
    from edgelin.artifact.manifest import Manifest
    from edgelin.plugins.tensorrt import build_plugin, header_version

    folder = Path(folder)
    root = folder / TRT_DIR
    spec = read_engine_spec(folder, Manifest.load(folder))  # checked before anything is built
    headers = find_headers(trt_include)
    major, _ = header_version(headers)
    if not archs:
        archs = [str(device.sm)] if device is not None and device.sm else list(DEFAULT_ARCHS)
    library = build_plugin(root, headers, archs, major)
    missing = engine_possible()
    engines: dict[str, str] = {}
    if missing is None:
        run_engine_build(folder, spec, library)
        engines = {g: f"{g}.engine" for g in GRAPHS if (folder / f"{g}.engine").is_file()}
    aliased = dict(spec["graphs"].get("step", {}).get("aliased", {})) if spec["inplace"] and engines else {}
    record_build(folder, library.name, major, [str(a) for a in archs], engines, missing, aliased)
    return BuildResult({"plugin": f"{TRT_DIR}/{library.name}", **engines},
                       None if missing is None else f"the engines need TensorRT: {missing}; build them on "
                       f"{WHERE_ENGINE} (edgelin build again, or tensorrt/build_engine.py)")


def run_engine_build(folder: Path, spec: dict, library: Path) -> None:
    """Build the engines with edgelin's own build_engine module, never the folder's copy of it (an export
    folder is data). A child process: TensorRT's log stays off edgelin's stderr and a crash in its builder
    is a failed build, not a dead edgelin. `-P` and edgelin's own folder first on PYTHONPATH: nothing is
    imported from the export folder (the child's working folder) and the child runs this very edgelin."""
    import edgelin

    here = str(Path(edgelin.__file__).resolve().parent.parent)
    path = os.pathsep.join([here] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])
    command = [sys.executable, "-P", "-m", "edgelin.plugins.tensorrt.build_engine", "--folder",
               str(Path(folder).resolve()), "--plugin", str(Path(library).resolve()), "--spec", "-"]
    try:
        done = subprocess.run(command, cwd=folder, input=json.dumps(spec), capture_output=True, text=True,
                              env={**os.environ, "PYTHONPATH": path})
    except OSError as exc:
        raise EdgelinError("cannot start the TensorRT engine build", exc.strerror or str(exc),
                           "free some memory and run edgelin build again") from None
    if done.returncode != 0:
        tail = " | ".join(ln.strip() for ln in (done.stdout + done.stderr).splitlines()[-3:])
        raise EdgelinError("building the TensorRT engines failed", tail or "no output",
                           "run `python -m edgelin.plugins.tensorrt.build_engine --spec tensorrt/engines.json "
                           f"--plugin {TRT_DIR}/{Path(library).name}` in the export folder for the full log")


def read_engine_spec(folder: Path, manifest: "Manifest") -> dict:
    """tensorrt/engines.json, checked: only step/prefill, each naming its graph and weights as the manifest
    does and its engine `<graph>.engine` (nothing outside the folder, nothing but an engine is written),
    profiles of whole numbers min <= opt <= max over exactly the graph's inputs, aliased state names.
    What `edgelin build` hands its engine builder; strongly typed from the manifest's precision (fp16)."""
    path = Path(folder) / TRT_DIR / ENGINE_SPEC
    fix = "export the folder again with --target tensorrt (--force replaces it)"
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise EdgelinError(f"{folder} has no {TRT_DIR}/{ENGINE_SPEC}", "it was exported by an older edgelin or "
                           "the file was removed", fix) from None
    except OSError as exc:
        raise EdgelinError(f"cannot read {path}", exc.strerror or str(exc), "make the folder readable") from None
    except (ValueError, RecursionError) as exc:
        raise EdgelinError(f"{path} is malformed", f"it is not JSON ({type(exc).__name__})", fix) from None
    try:
        return {"inplace": _checked_inplace(data), "strongly_typed": manifest.precision == "fp16",
                "graphs": {g: _checked_graph(g, entry, manifest) for g, entry in _checked_graphs(data).items()}}
    except ValueError as exc:
        raise EdgelinError(f"{path} is malformed", str(exc), fix) from None


def _checked_inplace(data: object) -> bool:
    if not isinstance(data, dict) or not isinstance(data.get("inplace", False), bool):
        raise ValueError("it is not an object with a true/false `inplace`")
    return bool(data.get("inplace", False))


def _checked_graphs(data: dict) -> dict:
    graphs = data.get("graphs")
    if not isinstance(graphs, dict) or not graphs or any(g not in GRAPHS for g in graphs):
        raise ValueError(f"`graphs` must name some of {', '.join(GRAPHS)}")
    return graphs


def _checked_graph(graph: str, entry: object, manifest: "Manifest") -> dict:
    if not isinstance(entry, dict) or graph not in manifest.graphs:
        raise ValueError(f"graph {graph} is not an object of a graph the manifest lists")
    weights = (manifest.extra.get("weights") or {}).get("file")
    wanted = {"file": manifest.graphs[graph].file, "engine": f"{graph}.engine", "weights": weights}
    for key, value in wanted.items():
        if entry.get(key) != value:
            raise ValueError(f"{graph}'s {key} is {str(entry.get(key))[:60]!r}, the manifest says {value!r}")
    dims = {t.name: len(t.dims) for t in manifest.graphs[graph].inputs}
    profiles = entry.get("profiles")
    if not isinstance(profiles, list) or not profiles or not all(_is_profile(p, dims) for p in profiles):
        raise ValueError(f"{graph}'s profiles must each give every input of {manifest.graphs[graph].file} "
                         "[min, opt, max] shapes of whole numbers, min <= opt <= max")
    aliased = entry.get("aliased", {})
    if not isinstance(aliased, dict) or (aliased and graph != "step") or not all(
            isinstance(k, str) and k in dims and isinstance(v, str) for k, v in aliased.items()):
        raise ValueError(f"{graph}'s aliased must map the step's state inputs to its outputs")
    return {**{k: v for k, v in wanted.items() if v is not None}, "profiles": profiles, "aliased": aliased}


def _is_profile(profile: object, dims: dict[str, int]) -> bool:
    def shape(value: object, rank: int) -> bool:
        return isinstance(value, list) and len(value) == rank and all(
            type(d) is int and 0 <= d < 2 ** 31 for d in value)

    if not isinstance(profile, dict) or set(profile) != set(dims):
        return False
    for name, shapes in profile.items():
        if not isinstance(shapes, list) or len(shapes) != 3 or not all(shape(s, dims[name]) for s in shapes):
            return False
        if not all(lo <= opt <= hi for lo, opt, hi in zip(*shapes)):
            return False
    return True


def record_build(folder: Path, plugin: str, trt_major: int, archs: list[str], engines: dict[str, str],
                 missing: str | None, aliased: dict[str, str] | None = None) -> dict:
    """Write tensorrt/build.json: what the build phase made (the TensorRT runner reads it: which engines,
    which plugin library, which state pairs the step engine was built to alias). Files are recorded as
    edgelin's before they are written (--force)."""
    from edgelin.outputs import record_written

    folder = Path(folder)
    root = folder / TRT_DIR
    record_written(root, [plugin, BUILD_RECORD])  # before writing them: never an unrecorded file of ours
    if engines:
        record_written(folder, list(engines.values()))
    from edgelin.integrity import sha256_of

    # The plugin library and the engines are code the runner loads: their digests, taken as written here, are what
    # the runner checks them against before loading (edgelin.export.tensorrt.runner.verified_build_file).
    digests = {f"{TRT_DIR}/{plugin}": sha256_of(root / plugin),
               **{name: sha256_of(folder / name) for name in engines.values()}}
    record = {"plugin": plugin, "trt_major": trt_major, "archs": archs, "engines": dict(engines),
              "engine_missing": missing, "aliased": dict(aliased or {}), "sha256": digests}
    try:
        staged = root / f".{BUILD_RECORD}.tmp"
        staged.write_text(json.dumps(record, indent=2) + "\n")
        os.replace(staged, root / BUILD_RECORD)
    except OSError as exc:
        raise EdgelinError(f"cannot write {root / BUILD_RECORD}", exc.strerror or str(exc),
                           "free some space or make the folder writable") from None
    return record
