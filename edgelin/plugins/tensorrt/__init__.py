"""edgelin's TensorRT plugin library: build it (CMake + nvcc against a TensorRT's headers) and check
a built one (exports, no libnvinfer link, TensorRT major and launcher ABI) before anything loads it.

No torch and no TensorRT import here: `edgelin build` runs on a Jetson with the runtime install.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

from edgelin.errors import EdgelinError
from edgelin.kernels.abi import header_abi_version as step_abi_version  # the launcher ABI this edgelin speaks

PLUGIN_DIR = Path(__file__).parent
# TensorRT 10.3 (JetPack 6: IPluginV3OneBuildV2 and aliasing) through 11.x
SUPPORTED_MAJORS = (10, 11)
# Ampere (80, 86), Orin (87), Ada (89), Hopper (90), Blackwell and Thor (100, 103, 110, 120, 121):
# bf16 loads need sm_80 or newer
SUPPORTED_ARCHS = ("80", "86", "87", "89", "90", "100", "103", "110", "120", "121")
EXPORTS = ("getCreators", "setLoggerFinder")
MARKER_SYMBOL = "edgelin_trt_plugin_marker"  # read by check_library; src/exports.map exports these three only
LINKER_SYMBOLS = ("_init", "_fini", "_edata", "_end", "__bss_start")  # some linkers export them in every library
MARKER = re.compile(rb"edgelin-trt-plugin:trt_major=(\d+);abi=(\d+);")
HEADERS_FIX = ("pass the folder holding NvInferRuntime.h (JetPack: /usr/include/aarch64-linux-gnu; "
               "apt: libnvinfer-dev, /usr/include/x86_64-linux-gnu; a TensorRT tarball: its include/)")


@dataclass(frozen=True)
class LibraryInfo:
    path: Path
    trt_major: int
    abi_version: int
    exports: tuple[str, ...]


def library_name(trt_major: int) -> str:
    return f"libedgelin_trt_plugin_trt{trt_major}.so"


def header_version(trt_include: Path) -> tuple[int, int]:
    """(major, minor) of the TensorRT headers in `trt_include` (NvInferVersion.h; 11 defines them
    through TRT_*_ENTERPRISE)."""
    version_h = Path(trt_include) / "NvInferVersion.h"
    if not (Path(trt_include) / "NvInferRuntime.h").is_file() or not version_h.is_file():
        raise EdgelinError(f"no TensorRT headers in {trt_include}", "NvInferRuntime.h or NvInferVersion.h is missing",
                           HEADERS_FIX)
    text = version_h.read_text(errors="replace")

    def number(name: str) -> int:
        match = re.search(rf"#define NV_TENSORRT_{name}\s+(\w+)", text)
        value = match.group(1) if match else ""
        if value and not value.isdigit():  # one level of indirection (TRT_MAJOR_ENTERPRISE)
            alias = re.search(rf"#define {re.escape(value)}\s+(\d+)", text)
            value = alias.group(1) if alias else ""
        if not value.isdigit():
            raise EdgelinError(f"cannot read the TensorRT version in {version_h}", f"no NV_TENSORRT_{name} number",
                               HEADERS_FIX)
        return int(value)

    return number("MAJOR"), number("MINOR")


def find_nvcc() -> str:
    for candidate in (os.environ.get("CUDACXX"), shutil.which("nvcc"), "/usr/local/cuda/bin/nvcc"):
        if candidate and os.access(candidate, os.X_OK):
            return candidate
    raise EdgelinError("nvcc not found", "the plugin's CUDA step kernel is compiled with nvcc",
                       "install the CUDA toolkit (JetPack 6 ships it in /usr/local/cuda/bin: add that to PATH) "
                       "or set CUDACXX to nvcc's path")


def check_archs(archs: list[str] | tuple[str, ...]) -> list[str]:
    clean = [str(a).strip().removeprefix("sm_") for a in archs]
    bad = [a for a in clean if a not in SUPPORTED_ARCHS]
    if not clean or bad:
        raise EdgelinError(f"unsupported compute capability {', '.join(bad) or '(none given)'}",
                           f"the plugin is built for {', '.join(SUPPORTED_ARCHS)} (87: Jetson Orin)",
                           "pass one or more of those, e.g. 87 for Orin or 86;89;90 for desktops")
    return clean


def _one_line(text: str, limit: int = 400) -> str:
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    errors = [ln for ln in lines if "error" in ln.lower()] or lines[-3:]
    return " | ".join(errors[:3])[:limit] or "no output"


def build_plugin(out_dir: Path, trt_include: Path, archs: list[str] | tuple[str, ...], trt_major: int,
                 *, jobs: int = 2) -> Path:
    """Build the plugin library into `out_dir` (libedgelin_trt_plugin_trt<major>.so) and check it.

    Compiled in a temporary folder and renamed into place, so a failure leaves no partial library;
    an existing file of that name is replaced only when it is an edgelin plugin library."""
    if trt_major not in SUPPORTED_MAJORS:
        raise EdgelinError(f"TensorRT {trt_major} is not supported", "the plugin targets TensorRT 10.3 through 11.x",
                           "use TensorRT 10.3 or newer (JetPack 6) or 11")
    archs = check_archs(archs)
    cmake = shutil.which("cmake")
    if cmake is None:
        raise EdgelinError("cmake not found", "the plugin library is built with CMake 3.18 or newer",
                           "install it: pip install cmake, or apt install cmake")
    nvcc = find_nvcc()
    major, minor = header_version(Path(trt_include))
    if major != trt_major:
        raise EdgelinError(f"the headers in {trt_include} are TensorRT {major}.{minor}, not {trt_major}",
                           "one plugin build per TensorRT major (11 changed the logger layout)",
                           f"pass TensorRT {trt_major}'s include folder, or build for {major}")
    if (major, minor) < (10, 3):
        raise EdgelinError(f"TensorRT {major}.{minor} is too old", "the plugin needs IPluginV3OneBuildV2 (10.3)",
                           "use TensorRT 10.3 or newer (JetPack 6)")
    out_dir = Path(out_dir)
    target = out_dir / library_name(trt_major)
    if target.exists() and (not target.is_file() or MARKER.search(target.read_bytes()) is None):
        raise EdgelinError(f"{target} exists and is not an edgelin plugin library", "edgelin replaces only its own",
                           "move it away or choose another output folder")
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        work = Path(tempfile.mkdtemp(prefix=".edgelin-trt-build-", dir=out_dir))
    except OSError as exc:
        raise EdgelinError(f"cannot write to {out_dir}", exc.strerror or str(exc),
                           "choose a writable folder with free space") from None
    try:
        configure = [cmake, "-S", str(PLUGIN_DIR), "-B", str(work / "build"), "-DCMAKE_BUILD_TYPE=Release",
                     f"-DTENSORRT_INCLUDE_DIR={Path(trt_include).resolve()}", f"-DEDGELIN_TRT_MAJOR={trt_major}",
                     f"-DCMAKE_CUDA_ARCHITECTURES={';'.join(archs)}", f"-DCMAKE_CUDA_COMPILER={nvcc}"]
        for cmd in (configure, [cmake, "--build", str(work / "build"), "-j", str(jobs)]):
            done = subprocess.run(cmd, capture_output=True, text=True)
            if done.returncode != 0:
                raise EdgelinError("building the TensorRT plugin failed", _one_line(done.stdout + done.stderr),
                                   "check the CUDA toolkit and TensorRT headers named above; rerun with them fixed")
        built = work / "build" / library_name(trt_major)
        check_library(built, trt_major)
        staged = out_dir / f".{target.name}.tmp"
        shutil.copy2(built, staged)
        os.replace(staged, target)  # atomic: the old library or the new one, never half of one
    except OSError as exc:
        raise EdgelinError(f"cannot write the plugin library to {out_dir}", exc.strerror or str(exc),
                           "free some space or choose a writable folder") from None
    finally:
        shutil.rmtree(work, ignore_errors=True)  # the temporary folder this call created
    return target


def _tool(name: str, args: list[str]) -> str:
    exe = shutil.which(name)
    if exe is None:
        raise EdgelinError(f"{name} not found", "checking the plugin library reads its dynamic symbols",
                           "install binutils (apt install binutils)")
    done = subprocess.run([exe, *args], capture_output=True, text=True)
    if done.returncode != 0:
        raise EdgelinError(f"{name} could not read {args[-1]}", _one_line(done.stderr), "rebuild it with edgelin build")
    return done.stdout


def check_library(path: Path, expected_major: int) -> LibraryInfo:
    """Refuse, before anything loads it, a library that is not edgelin's plugin, was built for another
    TensorRT major or launcher ABI, misses an export or exports more than the loader interface, or links or
    references libnvinfer."""
    path = Path(path)
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise EdgelinError(f"cannot read the plugin library {path}", exc.strerror or str(exc),
                           "build it with edgelin build") from None
    found = MARKER.search(data)
    if found is None:
        raise EdgelinError(f"{path} is not an edgelin TensorRT plugin library", "it has no edgelin plugin marker",
                           "build it with edgelin build")
    major, abi = int(found.group(1)), int(found.group(2))
    if major != expected_major:
        raise EdgelinError(f"{path.name} was built for TensorRT {major}, not {expected_major}",
                           "a plugin library loads only into the TensorRT major its headers came from",
                           f"rebuild it against TensorRT {expected_major}'s headers (edgelin build)")
    if abi != step_abi_version():
        raise EdgelinError(f"{path.name} has step-launcher ABI {abi}, this edgelin has {step_abi_version()}",
                           "it was built by another edgelin version", "rebuild it with edgelin build")
    defined = _tool("nm", ["-D", "--defined-only", str(path)])
    exports = tuple(name for name in EXPORTS if re.search(rf"\sT {name}$", defined, re.MULTILINE))
    missing = [name for name in EXPORTS if name not in exports]
    if missing:
        raise EdgelinError(f"{path.name} does not export {', '.join(missing)}",
                           "TensorRT's loadLibrary and trtexec --dynamicPlugins call them",
                           "rebuild it with edgelin build")
    others = sorted({line.split()[-1] for line in defined.splitlines() if line.strip()}
                    - {*EXPORTS, MARKER_SYMBOL, *LINKER_SYMBOLS})
    if others:
        raise EdgelinError(f"{path.name} exports {len(others)} symbols beyond TensorRT's loader interface "
                           f"(first: {others[0]})", "in TensorRT's process they would take the place of its own "
                           "(libstdc++'s, where the library was built without src/exports.map)",
                           "rebuild it with edgelin build")
    undefined = [ln for ln in _tool("nm", ["-DC", "--undefined-only", str(path)]).splitlines() if "nvinfer1::" in ln]
    if undefined:
        raise EdgelinError(f"{path.name} references TensorRT symbols", undefined[0].split()[-1],
                           "rebuild it with edgelin build (it must not link libnvinfer)")
    needed = re.findall(r"\(NEEDED\).*\[(.+)\]", _tool("readelf", ["-d", str(path)]))
    if any(lib.startswith("libnvinfer") for lib in needed):
        raise EdgelinError(f"{path.name} links libnvinfer", "it would load only into that one TensorRT build",
                           "rebuild it with edgelin build")
    return LibraryInfo(path=path, trt_major=major, abi_version=abi, exports=exports)
