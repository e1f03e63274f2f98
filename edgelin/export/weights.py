"""One copy of the weights for the step and prefill graphs: ONNX external data in one shared file.

The exporter writes each graph with its weights inside. `share_weights` moves every initializer of
at least MIN_EXTERNAL bytes out to `weights.bin`, deduplicated by content (the exporter names the same
matrix differently in each graph, e.g. the constant-folded transposes `val_18` / `val_21`, so names
cannot be matched): both graphs then reference the same bytes at the same offset, through onnx's own
external-data fields (`onnx.external_data_helper.set_external_data`). Small tensors (shapes, scalars,
norm vectors) stay inside the graph files.

In memory: one copy, backed by the file, that the OS can drop and reload. The runner maps the file once
and hands each session OrtValues over its slices (where each tensor lives: the manifest's
`tensors_by_graph`, recorded by `describe`); left to itself ONNX Runtime would map it once per session, so each page would count twice
in RSS. The runner turns off ONNX Runtime's weight prepacking (a private copy per session) for float
folders; see edgelin.export.onnx.runner.

Alignment: ONNX Runtime maps a tensor when its offset is a multiple of the allocation granularity
(4 KiB pages; 64 KiB on Windows). Tensors of PAGE_ALIGN_FROM bytes or more start on a 64 KiB boundary,
smaller ones on 64 bytes (SIMD loads), which wastes little of a small model's file.

Export-side module (imports onnx inside its functions); `describe` gives the manifest its account.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from pathlib import Path
from typing import Any

WEIGHTS = "weights.bin"
WEIGHTS_KEY = "weights"  # the key of the weights file in a target's files and in manifest extra
MIN_EXTERNAL = 1024  # bytes: smaller initializers stay in the graph files
PAGE_ALIGN_FROM = 1 << 20  # bytes: tensors this large start on an ALLOCATION_GRANULARITY boundary (as ORT's own saver)
ALLOCATION_GRANULARITY = 64 * 1024  # Windows' mmap granularity; a multiple of every page size
SMALL_ALIGN = 64


def _aligned(offset: int, size: int) -> int:
    step = ALLOCATION_GRANULARITY if size >= PAGE_ALIGN_FROM else SMALL_ALIGN
    return -(-offset // step) * step


def share_weights(folder: Path, graph_files: Sequence[str], name: str = WEIGHTS) -> str:
    """Move the large initializers of `graph_files` (in `folder`, rewritten in place) into one
    deduplicated file `name` next to them; returns `name`. Call it on a folder being written (the
    pipeline's temp folder)."""
    import onnx
    from onnx import external_data_helper

    folder = Path(folder)
    protos = {file: onnx.load(str(folder / file)) for file in graph_files}
    where: dict[str, tuple[int, int]] = {}  # content hash -> (offset, length)
    size = 0
    with open(folder / name, "wb") as out:
        for file, proto in protos.items():
            for tensor in proto.graph.initializer:
                if not tensor.HasField("raw_data") or len(tensor.raw_data) < MIN_EXTERNAL:
                    continue  # typed-field tensors are small constants (the exporter writes raw_data)
                raw = tensor.raw_data
                key = hashlib.sha256(raw).hexdigest()
                if key not in where:
                    start = _aligned(size, len(raw))
                    padding = b"\0" * (start - size)
                    out.write(padding)
                    out.write(raw)
                    where[key] = (start, len(raw))
                    size = start + len(raw)
                external_data_helper.set_external_data(tensor, name, *where[key])
                tensor.data_location = onnx.TensorProto.EXTERNAL
                tensor.ClearField("raw_data")
    for file, proto in protos.items():
        onnx.save(proto, str(folder / file))
    return name


def describe(folder: Path, graph_files: Sequence[str], name: str = WEIGHTS) -> dict[str, Any]:
    """manifest extra["weights"], read off the written files (so it states what is there): the weights
    file, its size and sha256, its distinct tensors, how many of them every graph reads, and the
    bytes per dtype. EdgelinError if the graphs reference any other file."""
    import onnx

    from edgelin.errors import EdgelinError

    folder = Path(folder)
    regions: dict[str, set[tuple[int, int]]] = {}
    tensors: dict[str, list[list]] = {}  # per graph file: [name, offset, length, numpy dtype, dims]
    dtypes: dict[tuple[int, int], str] = {}
    locations: set[str] = set()
    for file in graph_files:
        proto = onnx.load(str(folder / file), load_external_data=False)
        regions[file], tensors[file] = set(), []
        for tensor in proto.graph.initializer:
            if tensor.data_location != onnx.TensorProto.EXTERNAL:
                continue
            info = {entry.key: entry.value for entry in tensor.external_data}
            region = (int(info.get("offset", 0)), int(info["length"]))
            locations.add(info["location"])
            regions[file].add(region)
            dtypes[region] = onnx.helper.tensor_dtype_to_np_dtype(tensor.data_type).name
            tensors[file].append([tensor.name, *region, dtypes[region], list(tensor.dims)])
    if locations - {name}:
        raise EdgelinError(f"the graphs reference {', '.join(sorted(locations - {name}))}",
                           f"an export keeps its weights in one {name}", "report this as an edgelin bug")
    everything = set().union(*regions.values())
    by_dtype: dict[str, int] = {}
    for region in everything:
        by_dtype[dtypes[region]] = by_dtype.get(dtypes[region], 0) + region[1]
    digest = hashlib.sha256((folder / name).read_bytes()).hexdigest()
    return {"file": name, "bytes": (folder / name).stat().st_size, "sha256": digest, "tensors": len(everything),
            "read_by": {file: len(r) for file, r in regions.items()},
            "shared_tensors": len(set.intersection(*regions.values())) if regions else 0,
            "bytes_by_dtype": dict(sorted(by_dtype.items())),
            "tensors_by_graph": tensors}

