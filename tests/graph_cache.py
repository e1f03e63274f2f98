"""Test-suite plumbing (never product code): an ONNX graph traced once per test run.

Tracing dominates the suite's time (torch.onnx.export: ~10 s a graph on the 2-core CI machine), and
many test files export the very same tiny checkpoint (`make_checkpoint(..., "hybrid")`, seed 0) with
the very same settings. `install()` wraps `edgelin.export.onnx.target.export_onnx_graph` so that
the second request for an identical graph copies the file the first one wrote, across pytest-xdist
workers (a file lock per graph: a worker asking for a graph being traced waits for it).

"Identical" is decided by a key over everything the traced file depends on: the model config, the
traced module's classes, plain attributes and every parameter and buffer byte, the I/O contract (names,
dims, dtypes), the opset and file name, the engine the lowering installed (its plain fields too), and a fingerprint of the code of every
edgelin function and method and of torch.onnx.export (so a test that monkeypatches any of them
traces afresh). A test that replaces export_onnx_graph itself bypasses the cache. Set
EDGELIN_TEST_GRAPH_CACHE=0 to trace every graph.
"""

from __future__ import annotations

import hashlib
import inspect
import os
import shutil
import time
from pathlib import Path

ENV = "EDGELIN_TEST_GRAPH_CACHE"
DIR_ENV = "EDGELIN_TEST_GRAPH_DIR"  # the cache folder, for a CLI subprocess (tests/cached_cli.py)
_DIR: list[Path] = []  # set by conftest's session fixture: one folder per test run, shared by its workers


def set_cache_dir(folder: Path) -> None:
    _DIR[:] = [Path(folder)]


def cache_dir() -> Path | None:
    return _DIR[0] if _DIR else None


def _code_digest(fn) -> bytes:
    code = getattr(getattr(fn, "__func__", fn), "__code__", None)
    return repr(fn).encode() if code is None else _digest_code(code)


def _digest_code(code) -> bytes:
    """Bytecode, constants (nested code objects by their own digest: their repr holds an address
    that differs between processes) and names."""
    consts = [_digest_code(c) if inspect.iscode(c) else repr(c).encode() for c in code.co_consts]
    return hashlib.sha256(code.co_code + b"|".join(consts) + repr(code.co_names).encode()
                          + code.co_qualname.encode()).digest()


# The modules whose code and constants decide what a traced graph holds (a fixed list, so that a key
# does not depend on which other modules a worker happened to import first).
TRACED_MODULES = (
    "edgelin.model.lm", "edgelin.model.layers", "edgelin.model.mixer", "edgelin.model.attention",
    "edgelin.model.config", "edgelin.reference.engine", "edgelin.reference.recurrence",
    "edgelin.families.spec", "edgelin.families.feature_maps", "edgelin.kernels.dispatch",
    "edgelin.export.onnx.target", "edgelin.export.onnx.deferred", "edgelin.export.lowering", "edgelin.export.graphs",
    "edgelin.export.fuse_matmuls",
    "edgelin.artifact.tensors", "edgelin.artifact.state", "edgelin.export.tensorrt.target",
    "edgelin.export.onnx.lowering", "edgelin.export.tensorrt.lowering", "edgelin.export.tensorrt.step_node",
)


def _code_fingerprint() -> bytes:
    """The functions, methods and plain constants of TRACED_MODULES as they are now (monkeypatches
    included), and torch.onnx.export."""
    import importlib

    import torch

    from edgelin.families import FAMILIES

    h = hashlib.sha256(_code_digest(torch.onnx.export) + repr(sorted(FAMILIES.items())).encode())
    for name in TRACED_MODULES:
        module = importlib.import_module(name)
        for attr, value in sorted(vars(module).items()):
            if inspect.isfunction(value):
                h.update(f"{name}.{attr}".encode() + _code_digest(value))
            elif inspect.isclass(value) and value.__module__ == name:
                for meth, fn in sorted(vars(value).items()):
                    if inspect.isfunction(fn) or isinstance(fn, (staticmethod, classmethod)):
                        h.update(f"{name}.{attr}.{meth}".encode() + _code_digest(fn))
            elif attr.isupper() and _plain(value):
                h.update(f"{name}.{attr}={sorted(value.items()) if isinstance(value, dict) else value!r}".encode())
    return h.digest()


def _plain(value) -> bool:
    if isinstance(value, (tuple, list)):
        return all(_plain(v) for v in value)
    if isinstance(value, dict):
        return all(_plain(k) and _plain(v) for k, v in value.items())
    return isinstance(value, (int, float, str, bool, type(None)))


def graph_key(module, model, inputs, outputs, path: Path, opset: int) -> str:
    import torch

    from edgelin.model import mixer

    h = hashlib.sha256(_code_fingerprint())
    engine = mixer._ENGINE.get()
    loop = getattr(engine, "loop", None)
    options = sorted((k, v) for k, v in vars(engine).items() if _plain(v))  # e.g. OnnxEngine.contrib_ops
    h.update(repr((type(engine).__qualname__, options, getattr(loop, "__qualname__", None),
                   repr(model.config), [(t.name, t.dims, t.dtype) for t in [*inputs, *outputs]], opset, path.name)).encode())
    for name, sub in module.named_modules():
        attrs = sorted((k, v) for k, v in vars(sub).items() if not k.startswith("_") and _plain(v))
        h.update(repr((name, type(sub).__module__, type(sub).__qualname__, attrs)).encode())
    for name, tensor in sorted(module.state_dict(keep_vars=False).items()):
        h.update(repr((name, tensor.dtype, tuple(tensor.shape))).encode())
        if tensor.numel():
            h.update(tensor.detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def install() -> None:
    if os.environ.get(ENV, "1") == "0":
        return
    from filelock import FileLock

    from edgelin.export.onnx import target as onnx_target

    traced = onnx_target.export_onnx_graph

    def export_onnx_graph(module, model, inputs, outputs, path, opset):
        path, root = Path(path), cache_dir()
        if root is None:  # outside a test session's fixtures
            return traced(module, model, inputs, outputs, path, opset)
        key = graph_key(module, model, inputs, outputs, path, opset)
        root.mkdir(parents=True, exist_ok=True)
        cached = root / key  # the graph file and its data file (its weights: edgelin.export.weights.save_ir_graph)
        with FileLock(str(root / f"{key}.lock")):
            if cached.is_dir():
                for file in cached.iterdir():
                    shutil.copyfile(file, path.parent / file.name)
                return None
            began = time.perf_counter()
            result = traced(module, model, inputs, outputs, path, opset)
            if os.environ.get("EDGELIN_TEST_GRAPH_LOG"):  # which test traced what, and how long it took
                with open(os.environ["EDGELIN_TEST_GRAPH_LOG"], "a") as log:
                    log.write(f"{time.perf_counter() - began:6.1f}s {path.name} {key[:10]} "
                              f"{os.environ.get('PYTEST_CURRENT_TEST', '?')}\n")
            partial = root / f"{key}.{os.getpid()}.partial"
            partial.mkdir()
            for file in [path, *path.parent.glob(f"{path.name}*.data")]:
                shutil.copyfile(file, partial / file.name)
            os.replace(partial, cached)
            return result

    export_onnx_graph.__wrapped__ = traced
    onnx_target.export_onnx_graph = export_onnx_graph
