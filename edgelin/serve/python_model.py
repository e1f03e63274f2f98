"""The model Triton's Python backend runs for `edgelin export --serve triton` (the repository's model.py imports
TritonPythonModel from here): the export folder that holds the repository, run by edgelin's own runner (the one `generate` uses),
many sequences at once through a SequencePool (edgelin.serve.sequences; docs/serving.md, "How a request is
served").

A request carries `input_ids` [1, T] (T == 1: one step; T > 1: a prompt or a turn, prefilled in one request) and
the sequence batcher's controls START, END (int32 0/1) and CORRID (uint64). It answers the outputs asked for:
`logits` [1, V] (float32, the last position's) and `next_token` [1, 1] (int64, their argmax: what a greedy
client needs, 8 bytes instead of 4 V). A refused request is answered with one error line; the other requests of
its batch are unaffected.

Runs inside Triton's Python backend stub (triton_python_backend_utils is the stub's module, imported here only),
in an environment with numpy < 2 (docs/serving.md, "The serving environment"). Run side: reads the artifact
contract only.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from edgelin.errors import EdgelinError

LOGITS, NEXT_TOKEN, INPUT_IDS = "logits", "next_token", "input_ids"
START, END, CORRID = "START", "END", "CORRID"
DEVICE_PARAMETER = "device"


def parameters(config: dict[str, Any]) -> dict[str, str]:
    return {key: value.get("string_value", "") for key, value in config.get("parameters", {}).items()}


def open_pool(config: dict[str, Any], folder: Path):
    """The SequencePool serving the export `folder` under a model config (Triton's JSON form); refuses, in one
    line, a pool whose states would not fit in this machine's available memory."""
    from edgelin.devices import get_device
    from edgelin.runtime import open_runner
    from edgelin.serve.sequences import SequencePool

    params = parameters(config)
    device = get_device(params[DEVICE_PARAMETER]) if params.get(DEVICE_PARAMETER) else None
    runner = open_runner(folder, None, device)
    batching = config.get("sequence_batching", {})
    capacity = int(batching.get("oldest", {}).get("max_candidate_sequences", 1))
    idle = int(batching.get("max_sequence_idle_microseconds", 60_000_000)) / 1e6
    check_memory(runner.manifest, capacity)
    return SequencePool(runner, capacity, idle, evict_when_full=True)  # Triton queues the rest


def check_memory(manifest, capacity: int) -> None:
    """Refuse to load when `capacity` sequences' states (held twice at most: own rows and the batch being built)
    exceed the memory this machine has available now."""
    need = 2 * capacity * manifest.state_bytes(1, manifest.kv_capacity or 0)  # a growing cache: at its capacity
    try:
        with open("/proc/meminfo") as f:
            available = next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    except (OSError, StopIteration):
        return
    if need > available:
        raise EdgelinError(f"{capacity} live sequences need {need / 2**20:.0f} MiB of state",
                           f"this machine has {available / 2**20:.0f} MiB available",
                           "lower max_candidate_sequences (the device profile's [serving] table) and re-export")


class TritonPythonModel:
    """Triton's Python-backend interface (initialize / execute / finalize)."""

    def initialize(self, args: dict[str, str]) -> None:
        config = json.loads(args["model_config"])
        # the export that holds the repository: DIR/triton/<name> -> DIR (edgelin.serve.triton_python)
        try:
            self.pool = open_pool(config, Path(args["model_repository"]).resolve().parents[1])
        except EdgelinError as exc:  # Triton logs the message and marks the model unavailable
            raise RuntimeError(f"error: {exc}") from None
        self.outputs = [o["name"] for o in config.get("output", [])]

    def execute(self, requests: list[Any]) -> list[Any]:
        import triton_python_backend_utils as pb_utils

        from edgelin.serve.sequences import Call

        def read(request, name):
            tensor = pb_utils.get_input_tensor_by_name(request, name)
            return None if tensor is None else tensor.as_numpy()

        calls = []
        for request in requests:
            ids = read(request, INPUT_IDS)
            start, end, corrid = read(request, START), read(request, END), read(request, CORRID)
            calls.append(Call(int(corrid.reshape(-1)[0]) if corrid is not None else request.correlation_id(),
                              np.asarray(ids, np.int64).reshape(-1),
                              bool(start is not None and start.reshape(-1)[0]),
                              bool(end is not None and end.reshape(-1)[0])))
        responses = []
        for request, result in zip(requests, self.pool.run(calls)):
            if result.error is not None:
                responses.append(pb_utils.InferenceResponse(error=pb_utils.TritonError(result.error)))
                continue
            wanted = set(request.requested_output_names()) or set(self.outputs)
            tensors = []
            if LOGITS in wanted:
                tensors.append(pb_utils.Tensor(LOGITS, np.ascontiguousarray(result.logits[None], np.float32)))
            if NEXT_TOKEN in wanted:
                tensors.append(pb_utils.Tensor(NEXT_TOKEN, np.array([[int(np.argmax(result.logits))]], np.int64)))
            responses.append(pb_utils.InferenceResponse(output_tensors=tensors))
        return responses

    def finalize(self) -> None:
        self.pool = None

