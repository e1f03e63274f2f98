"""One copy of the weights for the step and prefill graphs: ONNX external data in one shared file.

The exporter writes each graph with its weights inside. `share_weights` moves every initializer of
at least MIN_EXTERNAL bytes out to `weights.bin`, deduplicated by content (the exporter names the same
matrix differently in each graph, e.g. the constant-folded transposes `val_18` / `val_21`, so names
cannot be matched): both graphs then reference the same bytes at the same offset, through onnx's own
external-data fields (location, offset, length). Small tensors (shapes, scalars,
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
DATA_SUFFIX = ".data"  # a graph's own data file before share_weights: step.onnx.0.data, ...


def _aligned(offset: int, size: int) -> int:
    step = ALLOCATION_GRANULARITY if size >= PAGE_ALIGN_FROM else SMALL_ALIGN
    return -(-offset // step) * step


def graph_data_files(proto: Any) -> set[str]:
    """The external-data files an ONNX graph's initializers live in (loaded without them)."""
    import onnx

    return {entry.value for tensor in proto.graph.initializer if tensor.data_location == onnx.TensorProto.EXTERNAL
            for entry in tensor.external_data if entry.key == "location"}


def save_graph(proto: Any, path: Path) -> None:
    """Save an export's graph (loaded with its data: onnx.load) to `path`, its initializers of MIN_EXTERNAL bytes
    or more in a new data file beside it: a protobuf holds at most 2 GiB, and a 0.75 B-parameter model's float32
    weights are 3 GB. The data files the graph no longer reads are removed once the new one is written (they lie in
    the export's temp folder: only files this export wrote)."""
    import onnx

    _save_with_data(path, lambda data: onnx.save_model(proto, str(path), save_as_external_data=True,
                                                       all_tensors_to_one_file=True, location=data,
                                                       size_threshold=MIN_EXTERNAL))


def save_ir_graph(model: Any, path: Path) -> None:
    """save_graph for an onnx_ir model (loaded with ir.load, or the exporter's: its tensors are read from where
    they are while the new data file is written)."""
    import onnx_ir as ir

    _save_with_data(path, lambda data: ir.save(model, str(path), external_data=data,
                                               size_threshold_bytes=MIN_EXTERNAL))


def _save_with_data(path: Path, write: Any) -> None:
    """`write(data_file_name)` saves the graph at `path` with its weights in that new file; then the graph's older
    data files that it no longer reads go."""
    path = Path(path)
    before = set(path.parent.glob(f"{path.name}*{DATA_SUFFIX}"))
    target = _next_data_file(path)
    write(target.name)
    _drop_unreferenced(path, before - {target})


def _next_data_file(path: Path) -> Path:
    """The graph's next data file name (step.onnx.0.data, step.onnx.1.data, ...): one not yet there."""
    count = 0
    while (path.parent / f"{path.name}.{count}{DATA_SUFFIX}").exists():
        count += 1
    return path.parent / f"{path.name}.{count}{DATA_SUFFIX}"


class DataSpill:
    """The initializers a pass over a graph loaded without its data makes (packed panels, float16 copies,
    block-quantised weights), written to a new data file beside the graph as they are made and added to it as
    external data, so the pass holds one weight at a time: kept in the protobuf until the graph is saved they
    were the export's peak (a 2 B-parameter model's packed float32 panels are 5 GiB). Use it as a context manager
    around the pass: the file is closed at the end, and removed if the pass fails (this export wrote it)."""

    def __init__(self, graph: Path):
        self.path = _next_data_file(Path(graph))
        self.size = 0
        self._file: Any = None

    def __enter__(self) -> "DataSpill":
        self._file = open(self.path, "xb")
        return self

    def __exit__(self, kind: Any, *_: Any) -> None:
        self._file.close()
        if kind is not None or not self.size:
            self.path.unlink(missing_ok=True)

    def add(self, proto: Any, array: Any, name: str) -> None:
        """Append `array` to the graph as initializer `name` (inside the protobuf when small)."""
        self.add_pieces(proto, name, array.dtype, array.shape, [array])

    def add_pieces(self, proto: Any, name: str, dtype: Any, shape: Sequence[int], pieces: Any) -> None:
        """Initializer `name` of `dtype` and `shape` whose bytes are `pieces` (arrays, in order) concatenated: a
        large table is written a slice at a time."""
        import numpy as np
        import onnx
        from onnx import helper, numpy_helper

        length = int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
        if length < MIN_EXTERNAL:
            proto.graph.initializer.append(numpy_helper.from_array(
                np.concatenate([np.ravel(p) for p in pieces]).astype(dtype).reshape(shape), name))
            return
        start = _aligned(self.size, length)
        self._file.write(b"\0" * (start - self.size))
        written = 0
        for piece in pieces:
            piece = np.ascontiguousarray(piece, dtype)
            self._file.write(memoryview(piece).cast("B"))
            written += piece.nbytes
        if written != length:
            raise ValueError(f"{name}: {written} bytes written for a {list(shape)} {np.dtype(dtype).name} tensor")
        self._file.flush()
        self.size = start + length
        tensor = onnx.TensorProto(name=name, data_type=helper.np_dtype_to_tensor_dtype(np.dtype(dtype)))
        tensor.dims.extend(int(d) for d in shape)
        _point(tensor, self.path.name, start, length)
        proto.graph.initializer.append(tensor)


class HeldInitializers:
    """DataSpill's interface for a graph held in memory (no folder): each new weight goes into the protobuf."""

    def add(self, proto: Any, array: Any, name: str) -> None:
        from onnx import numpy_helper

        proto.graph.initializer.append(numpy_helper.from_array(array, name))

    def add_pieces(self, proto: Any, name: str, dtype: Any, shape: Sequence[int], pieces: Any) -> None:
        import numpy as np

        self.add(proto, np.concatenate([np.ravel(np.asarray(p, dtype)) for p in pieces]).reshape(shape), name)


def _drop_unreferenced(path: Path, old: set[Path]) -> None:
    """Remove the graph's earlier data files that it no longer reads (a graph loaded without its data, e.g. block
    quantised, still reads its float tensors that stayed float from the file they were in)."""
    import onnx

    kept = graph_data_files(onnx.load(str(path), load_external_data=False))
    for file in old:
        if file.name not in kept:
            file.unlink()


def share_weights(folder: Path, graph_files: Sequence[str], name: str = WEIGHTS) -> str:
    """Move the large initializers of `graph_files` (in `folder`, rewritten in place) into one
    deduplicated file `name` next to them; returns `name`. Call it on a folder being written (the
    pipeline's temp folder). Streams: each tensor is read from the graph's own data file (or its
    protobuf) and written before the next is read, so a model of any size takes one tensor of memory;
    small tensors come back inside the graph files, and the graphs' own data files are removed."""
    import mmap

    import onnx

    folder = Path(folder)
    protos = {file: onnx.load(str(folder / file), load_external_data=False) for file in graph_files}
    sources = {location: folder / location for proto in protos.values() for location in graph_data_files(proto)}
    maps = {}
    for location, path in sources.items():
        with open(path, "rb") as fh:
            maps[location] = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) if path.stat().st_size else b""
    where: dict[str, tuple[int, int]] = {}  # content hash -> (offset, length)
    size = 0
    with open(folder / name, "wb") as out:
        for file, proto in protos.items():
            for tensor in proto.graph.initializer:
                if tensor.data_location == onnx.TensorProto.EXTERNAL:
                    info = {entry.key: entry.value for entry in tensor.external_data}
                    mapped = (maps[info["location"]], int(info.get("offset", 0)), int(info["length"]))
                    # a view of the mapped bytes: a large tensor is hashed and written without a copy
                    raw = memoryview(mapped[0])[mapped[1]:mapped[1] + mapped[2]]
                    del tensor.external_data[:]
                    tensor.data_location = onnx.TensorProto.DEFAULT
                    if len(raw) < MIN_EXTERNAL:
                        tensor.raw_data = bytes(raw)  # inside the graph again (small)
                        raw.release()
                        continue
                elif tensor.HasField("raw_data"):
                    mapped, raw = None, memoryview(tensor.raw_data)
                    if len(raw) < MIN_EXTERNAL:
                        continue
                else:
                    continue  # typed-field tensors are small constants (the exporter writes raw_data)
                key = hashlib.sha256(raw).hexdigest()
                if key not in where:
                    start = _aligned(size, len(raw))
                    out.write(b"\0" * (start - size))
                    out.write(raw)
                    where[key] = (start, len(raw))
                    size = start + len(raw)
                raw.release()
                if mapped is not None:
                    _forget(*mapped)
                _point(tensor, name, *where[key])
    for view in maps.values():
        if isinstance(view, mmap.mmap):
            view.close()
    for file, proto in protos.items():
        onnx.save(proto, str(folder / file))
    for path in sources.values():
        if path.name != name:
            path.unlink()
    return name


def _point(tensor: Any, location: str, offset: int, length: int) -> None:
    """`tensor` reads its bytes from `location` (onnx's external-data fields; its helper wants the bytes in the
    tensor first, which a mapped large tensor never is)."""
    import onnx

    tensor.ClearField("raw_data")
    del tensor.external_data[:]
    for key, value in (("location", location), ("offset", str(offset)), ("length", str(length))):
        entry = tensor.external_data.add()
        entry.key, entry.value = key, value
    tensor.data_location = onnx.TensorProto.EXTERNAL


def _forget(view: Any, start: int, length: int) -> None:
    """Drop a read range of a file map from the process's resident pages (the page cache keeps them): streaming
    both graphs' float32 data files (6 GB at 0.75 B parameters) would otherwise leave all of them resident."""
    import mmap

    if not isinstance(view, mmap.mmap) or not hasattr(mmap, "MADV_DONTNEED"):
        return
    first = start - start % mmap.PAGESIZE
    view.madvise(mmap.MADV_DONTNEED, first, start + length - first)


def describe(folder: Path, graph_files: Sequence[str], name: str = WEIGHTS) -> dict[str, Any]:
    """manifest extra["weights"], read off the written files (so it states what is there): the weights
    file, its size and sha256, its distinct tensors, how many of them every graph reads, and the
    bytes per dtype. EdgelinError if the graphs reference any other file."""
    import onnx

    from edgelin.errors import EdgelinError
    from edgelin.integrity import sha256_of

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
    digest = sha256_of(folder / name)
    return {"file": name, "bytes": (folder / name).stat().st_size, "sha256": digest, "tensors": len(everything),
            "read_by": {file: len(r) for file, r in regions.items()},
            "shared_tensors": len(set.intersection(*regions.values())) if regions else 0,
            "bytes_by_dtype": dict(sorted(by_dtype.items())),
            "tensors_by_graph": tensors}
