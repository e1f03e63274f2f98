"""One copy of the weights for the step and prefill graphs: ONNX external data in one shared file.

The exporter writes each graph with its weights inside. `share_weights` moves every initializer of
at least MIN_EXTERNAL bytes out to `weights.bin`, deduplicated by content (the exporter names the same
matrix differently in each graph, e.g. the constant-folded transposes `val_18` / `val_21`, so names
cannot be matched): both graphs then reference the same bytes at the same offset, through onnx's own
external-data fields (`onnx.external_data_helper.set_external_data`). Small tensors (shapes, scalars,
norm vectors) stay inside the graph files.

In memory: one copy, backed by the file, that the OS can drop and reload. The runner maps the file once
and hands each session OrtValues over its slices (`external_tensors` reads where each tensor lives,
without onnx); left to itself ONNX Runtime would map it once per session, so each page would count twice
in RSS. The runner turns off ONNX Runtime's weight prepacking (a private copy per session) for float
folders; see edgelin.export.onnx_runtime.

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
    dtypes: dict[tuple[int, int], str] = {}
    locations: set[str] = set()
    for file in graph_files:
        proto = onnx.load(str(folder / file), load_external_data=False)
        regions[file] = set()
        for tensor in proto.graph.initializer:
            if tensor.data_location != onnx.TensorProto.EXTERNAL:
                continue
            info = {entry.key: entry.value for entry in tensor.external_data}
            region = (int(info.get("offset", 0)), int(info["length"]))
            locations.add(info["location"])
            regions[file].add(region)
            dtypes[region] = onnx.helper.tensor_dtype_to_np_dtype(tensor.data_type).name
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
            "bytes_by_dtype": dict(sorted(by_dtype.items()))}


# ONNX TensorProto data types a runner can view in place (onnx.TensorProto.DataType values -> numpy dtype names).
_VIEW_DTYPES = {1: "float32", 2: "uint8", 3: "int8", 5: "int16", 6: "int32", 7: "int64", 10: "float16", 11: "float64"}


def _varint(data: bytes, at: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        byte = data[at]
        value |= (byte & 0x7F) << shift
        at += 1
        if byte < 0x80:
            return value, at
        shift += 7


def _fields(data: bytes, start: int = 0, end: int | None = None):
    """(field number, wire type, value) of one protobuf message: ints for varints, (start, end) spans for
    length-delimited fields; fixed-width fields are skipped. Raises IndexError/ValueError if malformed."""
    at, end = start, len(data) if end is None else end
    while at < end:
        key, at = _varint(data, at)
        number, wire = key >> 3, key & 7
        if wire == 0:
            value, at = _varint(data, at)
            yield number, wire, value
        elif wire == 2:
            length, at = _varint(data, at)
            if at + length > end:
                raise ValueError("truncated field")
            yield number, wire, (at, at + length)
            at += length
        elif wire in (1, 5):
            at += 8 if wire == 1 else 4
        else:
            raise ValueError(f"wire type {wire}")


def external_tensors(graph: Path, name: str = WEIGHTS) -> list[tuple[str, int, int, str, tuple[int, ...]]]:
    """The top-level initializers of the ONNX file `graph` stored in the external file `name`: (tensor name,
    offset, length, numpy dtype name, dims), read with a minimal protobuf reader (no onnx import: the
    runner shares one mapping of the weights file between its sessions, see edgelin.export.onnx_runtime).
    Tensors of other dtypes are left out (ONNX Runtime then reads them from the file itself). ValueError
    if the file is not a readable ONNX model."""
    data = Path(graph).read_bytes()
    found = []
    try:
        for number, _, span in _fields(data):
            if number != 7:  # ModelProto.graph
                continue
            for field, wire, tensor in _fields(data, *span):
                if field != 5 or wire != 2:  # GraphProto.initializer
                    continue
                dims: list[int] = []
                dtype, tname, location, info = 0, "", 0, {}
                for f, w, v in _fields(data, *tensor):
                    if f == 1 and w == 0:
                        dims.append(v)
                    elif f == 1 and w == 2:  # packed dims
                        at = v[0]
                        while at < v[1]:
                            d, at = _varint(data, at)
                            dims.append(d)
                    elif f == 2 and w == 0:
                        dtype = v
                    elif f == 8 and w == 2:
                        tname = data[v[0]:v[1]].decode()
                    elif f == 14 and w == 0:
                        location = v
                    elif f == 13 and w == 2:  # StringStringEntryProto key = 1, value = 2
                        kv = {k: data[s[0]:s[1]].decode() for k, kw, s in _fields(data, *v) if kw == 2}
                        info[kv.get(1, "")] = kv.get(2, "")
                if location != 1 or info.get("location") != name or dtype not in _VIEW_DTYPES:
                    continue
                found.append((tname, int(info.get("offset", 0)), int(info["length"]), _VIEW_DTYPES[dtype],
                              tuple(d - (1 << 64) if d >= 1 << 63 else d for d in dims)))
    except (IndexError, KeyError, UnicodeDecodeError) as exc:
        raise ValueError(f"{graph} is not a readable ONNX model ({type(exc).__name__})") from exc
    return found
