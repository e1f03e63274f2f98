"""`edgelin export --serve triton`: a repository for Triton's Python backend, whose model runs the export folder
with edgelin's own runner (edgelin.serve.python_model) and holds every sequence's state itself
(edgelin.serve.sequences). The repository sits inside the export and serves it:

    DIR/triton/<name>/config.pbtxt   backend python, sequence batcher (oldest first), controls START, END, CORRID
    DIR/triton/<name>/1/model.py     one import: edgelin.serve.python_model.TritonPythonModel
    DIR/triton/client.py             streams one conversation through tritonclient (gRPC)

Why the Python backend and not implicit state (`--serve triton-native`, edgelin.serve.triton): Triton's implicit
state belongs to one model, so the prompt would go one token per request (no prefill graph), a growing KV cache
(a hybrid's full-attention layers) cannot be implicit state at all, and Triton's state does not reach a Python
model in any release (docs/serving.md, "Why the Python backend"). Here any target's runner serves, prompts are
prefilled in one request, and hybrids serve as they are.

The model opens DIR (the folder two levels above the model's folder: mount or copy the whole export), verified
against its manifest like every run (edgelin.integrity), so model.py and config.pbtxt are checked too.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from edgelin.artifact.manifest import Manifest
    from edgelin.devices import DeviceProfile, ServingLimits

PYTHON = "python"
MODEL_PY = ("# Written by `edgelin export --serve triton`: Triton's Python backend runs the export two folders up\n"
            "# with edgelin's runner (docs/serving.md). Needs edgelin in the server's Python environment.\n"
            "from edgelin.serve.python_model import TritonPythonModel  # noqa: F401\n")


def config_text(manifest: "Manifest", name: str, limits: "ServingLimits", device: "DeviceProfile | None") -> str:
    """config.pbtxt (Triton's ModelConfig in protobuf text format). `max_candidate_sequences` is also the number
    of sequences the model holds: Triton queues sequences beyond it, so a server never holds more than that."""
    from edgelin.serve.python_model import CORRID, DEVICE_PARAMETER, END, INPUT_IDS, LOGITS, NEXT_TOKEN, START

    lines = [f'name: "{name}"',
             f'backend: "{PYTHON}"',
             f"max_batch_size: {limits.max_batch_size}",
             "input [",
             f'  {{ name: "{INPUT_IDS}" data_type: TYPE_INT64 dims: [ -1 ] }}',
             "]",
             "output [",
             f'  {{ name: "{LOGITS}" data_type: TYPE_FP32 dims: [ {manifest.vocab_size} ] }},',
             f'  {{ name: "{NEXT_TOKEN}" data_type: TYPE_INT64 dims: [ 1 ] }}',
             "]",
             "sequence_batching {",
             f"  max_sequence_idle_microseconds: {limits.max_sequence_idle_us}",
             "  control_input [",
             f'    {{ name: "{START}" control [ {{ kind: CONTROL_SEQUENCE_START int32_false_true: [ 0, 1 ] }} ] }},',
             f'    {{ name: "{END}" control [ {{ kind: CONTROL_SEQUENCE_END int32_false_true: [ 0, 1 ] }} ] }},',
             f'    {{ name: "{CORRID}" control [ {{ kind: CONTROL_SEQUENCE_CORRID data_type: TYPE_UINT64 }} ] }}',
             "  ]",
             "  oldest {",
             f"    max_candidate_sequences: {limits.max_candidate_sequences}",
             "    preferred_batch_size: [ " + ", ".join(str(b) for b in limits.preferred_batch_sizes) + " ]",
             f"    max_queue_delay_microseconds: {limits.max_queue_delay_us}",
             "  }",
             "}",
             # the model places itself (a CUDA profile's runner takes the GPU); one instance holds its sequences
             f"instance_group [ {{ kind: KIND_CPU count: {limits.instances} }} ]"]
    if device is not None:
        lines += [f'parameters [ {{ key: "{DEVICE_PARAMETER}" value: {{ string_value: "{device.name}" }} }} ]']
    return "\n".join(lines) + "\n"


def write_repository(folder: Path, manifest: "Manifest", name: str, limits: "ServingLimits",
                     device: "DeviceProfile | None") -> dict[str, Any]:
    """DIR/triton/ for the Python backend; returns the manifest's extra["serve"]["triton"] entry."""
    from edgelin.serve.repository import CLIENT, FOLDER, client_text, parse_config

    root = Path(folder) / FOLDER
    (root / name / "1").mkdir(parents=True)
    config = root / name / "config.pbtxt"
    config.write_text(config_text(manifest, name, limits, device))
    parse_config(config.read_text(), f"{FOLDER}/{name}/config.pbtxt")
    (root / name / "1" / "model.py").write_text(MODEL_PY)
    (root / CLIENT).write_text(client_text(name, prefill=True))
    per_sequence = manifest.state_bytes(1, manifest.kv_capacity or 0)
    return {"repository": FOLDER, "model": name, "backend": PYTHON, "client": f"{FOLDER}/{CLIENT}",
            "serves": "..", "prefill": True, "state_bytes_per_sequence": per_sequence,
            "limits": {"max_batch_size": limits.max_batch_size,
                       "max_candidate_sequences": limits.max_candidate_sequences,
                       "preferred_batch_sizes": list(limits.preferred_batch_sizes),
                       "max_queue_delay_us": limits.max_queue_delay_us,
                       "max_sequence_idle_us": limits.max_sequence_idle_us,
                       "instances": limits.instances}}
