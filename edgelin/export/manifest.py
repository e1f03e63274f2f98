"""manifest.json: the contract between an exported folder and whoever runs it."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from edgelin import __version__
from edgelin.errors import EdgelinError
from edgelin.export.graphs import TensorIO

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
                {"input": t.name, "output": f"present.{t.layer}.{t.state_name}", "layer": t.layer,
                 "name": t.state_name, "dims": list(t.dims), "dtype": t.dtype, "init": "zeros"}
                for t in self.state_inputs
            ],
            "extra": self.extra,
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
            if data.get("format") != FORMAT:
                raise ValueError(f"format is {data.get('format')!r}, expected {FORMAT!r}")
            if data.get("manifest_version") != MANIFEST_VERSION:
                raise ValueError(f"manifest_version {data.get('manifest_version')} is not {MANIFEST_VERSION}")
            model = data["model"]
            for name in [g["file"] for g in data["graphs"].values()] + [data.get("tokenizer")]:
                if name is not None and (Path(name).name != name or name in (".", "..")):
                    raise ValueError(f"file name {name!r} escapes the export folder")
            return cls(
                target=data["target"], precision=data["precision"],
                graphs={k: GraphEntry.from_dict(v) for k, v in data["graphs"].items()},
                layers=tuple(model["layers"]), vocab_size=model["vocab_size"],
                needs_position=model["needs_position"], source=data["source"], tokenizer=data.get("tokenizer"),
                bos_token_id=data.get("bos_token_id"), eos_token_id=data.get("eos_token_id"),
                num_parameters=model.get("num_parameters", 0), extra=data.get("extra", {}),
                edgelin_version=data.get("edgelin_version", "?"),
            )
        except (KeyError, TypeError, ValueError, json.JSONDecodeError) as exc:
            raise EdgelinError(f"{path} is malformed", f"{type(exc).__name__}: {exc}",
                               "re-run `edgelin export` to regenerate the folder") from exc


def _shape(dims: tuple, batch: int, past: int) -> list[int]:
    sizes = {"batch": batch, "past_sequence": past}
    return [sizes[d] if isinstance(d, str) else d for d in dims]
