"""The torch target's run half: the PyTorch reference behind the Runner interface.

Where it runs: `choose_device` (module docstring of edgelin.export.torch.target). How a decode step runs
(`decode`, chosen once at open; the runner's label says which):
  "fused"  CUDA, and edgelin.export.torch.fused_decode.fused_support takes the model: FusedDecoder (5 kernels per
           Gated DeltaNet layer, one CUDA graph per batch size)
  "graph"  CUDA, a constant-memory model: GraphDecoder (the model's recurrent step in one CUDA graph)
  "eager"  the CPU, or a growing KV cache (its shape changes every step: no graph): model(mode="recurrent")
`EDGELIN_TORCH_DECODE` (or the `decode` argument) forces one (fused/graph need CUDA; fused a model it takes).
Prefill always runs the model's chunked forward (the Triton kernels under EDGELIN_KERNELS=auto on CUDA).

State handles hold device tensors in the model's layout (a list of per-layer dicts). A CUDA-graph decoder
reads its state from static buffers: the handle that last stepped at a batch size lives in them ("resident",
its tensors are the buffers), so consecutive steps copy no state; stepping another handle first copies the
resident one out (a clone on the device) and the new one in. read_state / write_state copy to and from numpy
(float32 at the I/O, as the manifest says); fork clones on the device.
"""

from __future__ import annotations

import contextlib
import os
import weakref
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from edgelin.errors import EdgelinError
from edgelin.export.base import Runner, State, StateHandle
from edgelin.artifact.manifest import NUMPY_DTYPES, Manifest
from edgelin.artifact.state import state_input_name

if TYPE_CHECKING:
    import torch

    from edgelin.devices import DeviceProfile

DEVICE_ENV = "EDGELIN_TORCH_DEVICE"  # cpu | cuda | cuda:N: where the torch target runs
DECODE_ENV = "EDGELIN_TORCH_DECODE"  # fused | graph | eager: force the step's form
DECODES = ("fused", "graph", "eager")
CUDA_PREFILL_PIECE = 2048  # tokens per prefill piece on a GPU (Runner.prefill_piece; runtime.prefill's chunk caps it)
MAX_DECODERS = 4  # CUDA-graph decoders kept at once (one per batch size; the oldest is dropped)


def choose_device(profile: "DeviceProfile | None" = None, asked: str | None = None) -> "torch.device":
    """EDGELIN_TORCH_DEVICE (or `asked`), else the profile's compute, else CUDA when torch sees a GPU."""
    import torch

    asked = asked or os.environ.get(DEVICE_ENV, "") or None
    if asked is None:
        if profile is not None:
            asked = "cuda" if profile.compute == "cuda" else "cpu"
        else:
            asked = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        device = torch.device(asked)
    except (RuntimeError, TypeError) as exc:
        raise EdgelinError(f"{DEVICE_ENV}={asked}", "it names where the torch target runs",
                           f"set {DEVICE_ENV} to cpu, cuda or cuda:N") from exc
    if device.type not in ("cpu", "cuda"):
        raise EdgelinError(f"{DEVICE_ENV}={asked}", "the torch target runs on the CPU or an NVIDIA GPU",
                           f"set {DEVICE_ENV} to cpu, cuda or cuda:N")
    if device.type == "cuda":
        if not torch.cuda.is_available():
            where = f"device {profile.name} computes on cuda" if profile is not None and asked == "cuda" else \
                f"{asked} was asked for"
            raise EdgelinError(f"the torch target cannot run on CUDA here ({where})", "torch sees no CUDA device",
                               f"run it on a machine with an NVIDIA GPU, or on the CPU ({DEVICE_ENV}=cpu, or "
                               "--device desktop-cpu)")
        index = device.index if device.index is not None else torch.cuda.current_device()
        if index >= torch.cuda.device_count():
            raise EdgelinError(f"{DEVICE_ENV}={asked}", f"torch sees {torch.cuda.device_count()} CUDA device(s)",
                               "pick an index below that")
        device = torch.device("cuda", index)
    return device


def load_model(folder: Path, manifest: Manifest, device: "torch.device") -> Any:
    """The export's model on `device` at its precision, loaded with edgelin's own checkpoint code from
    config.json + model.safetensors (no pickles, no code from the folder), checked against the manifest."""
    import torch
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    from edgelin.checkpoint import assign_weights, read_config
    from edgelin.export.torch.contract import CONTRACT, read_contract
    from edgelin.model.config import ModelConfig
    from edgelin.model.lm import CausalLM, with_compute_dtype

    folder = Path(folder)
    contract = read_contract(folder)
    if contract["precision"] != manifest.precision:
        raise EdgelinError(f"{folder}: {CONTRACT} says precision {contract['precision']}, manifest.json "
                           f"{manifest.precision}", "the folder was edited or mixed with another export",
                           "re-run `edgelin export --target torch`")
    config = ModelConfig.from_dict(read_config(folder), source=str(folder / contract["config"]))
    path = folder / contract["weights"]
    try:
        tensors = load_file(str(path), device=str(device))
    except (SafetensorError, OSError, ValueError, RuntimeError) as exc:
        raise EdgelinError(f"cannot read {path}", f"corrupt or truncated safetensors ({exc})",
                           "re-run `edgelin export --target torch`") from exc
    with torch.device(device):
        model = CausalLM(config)
    assign_weights(model, tensors, folder)  # names, shapes, float dtypes and finiteness checked
    del tensors
    model = model.eval().requires_grad_(False)
    if manifest.precision == "fp16":  # the exported fp16 copy exactly: its float32 tensors were stored float32
        model = with_compute_dtype(model, torch.float16).eval().requires_grad_(False)
    check_contract(model, manifest, folder)
    return model


def check_contract(model: Any, manifest: Manifest, folder: Path) -> None:
    """The model from config.json must have the manifest's graphs' I/O (names, dims, dtypes)."""
    from edgelin.export.graphs import graph_io

    for kind, entry in manifest.graphs.items():
        inputs, outputs = graph_io(model, kind, "float32")
        for direction, mine, listed in (("inputs", inputs, entry.inputs), ("outputs", outputs, entry.outputs)):
            if [t.to_dict() for t in mine] != [t.to_dict() for t in listed]:
                raise EdgelinError(f"manifest and {folder}/config.json disagree on the {kind} graph's {direction}",
                                   "the folder was edited or mixed with another export",
                                   "re-run `edgelin export --target torch`")


class _State:
    """A handle's contents: the state tensors (per layer, the model's layout) and, while resident, the
    decoder whose static buffers they are."""

    __slots__ = ("layers", "decoder", "__weakref__")

    def __init__(self, layers: list, decoder: Any = None):
        self.layers, self.decoder = layers, decoder


class TorchRunner(Runner):
    def __init__(self, folder: Path, manifest: Manifest, device: "DeviceProfile | None" = None,
                 threads: int | None = None, torch_device: str | None = None, decode: str | None = None):
        super().__init__(manifest)
        import torch

        self._torch = torch
        self.device = choose_device(device, torch_device)
        self.threads = threads or None
        self.model = load_model(folder, manifest, self.device)
        self.dtype = next(self.model.parameters()).dtype
        if self.device.type == "cuda":
            # The chunked Triton kernels hold no arena between calls, and an eager forward costs its
            # launches per call: 256-token pieces (the CPU default) made a 2,048-token prefill of the
            # 147.6 M model 8x slower on the H200 (docs/performance.md#gpu-decode).
            self.prefill_piece = CUDA_PREFILL_PIECE
        self._layout = [(layer, name, state_input_name(layer, name)) for layer, tensors in
                        enumerate(self.model.state_tensors()) for name in (t.name for t in tensors)]
        self._io_dtype = {t.name: NUMPY_DTYPES[t.dtype] for t in manifest.state_inputs}
        self.decode = self._pick_decode(decode or os.environ.get(DECODE_ENV, "") or None)
        self._decoders: dict[int, Any] = {}  # batch -> CUDA-graph decoder (insertion order: oldest first)
        self._resident: dict[int, weakref.ref] = {}  # batch -> the handle contents living in its buffers
        gpu = torch.cuda.get_device_name(self.device) if self.device.type == "cuda" else None
        self.label = {"fused": f"torch cuda-graph fused ({gpu})", "graph": f"torch cuda-graph ({gpu})",
                      "eager": f"torch eager (cuda: {gpu})" if gpu else "torch eager (cpu)"}[self.decode]

    def _pick_decode(self, asked: str | None) -> str:
        cuda = self.device.type == "cuda"
        if asked is not None and asked not in DECODES:
            raise EdgelinError(f"{DECODE_ENV}={asked}", f"the step runs as one of: {', '.join(DECODES)}",
                               f"set {DECODE_ENV} to one of those, or unset it")
        reason = None
        if cuda and self.manifest.constant_memory:
            from edgelin.kernels import triton_available

            reason = "triton is not installed" if not triton_available() else None
            if reason is None:
                from edgelin.export.torch.fused_decode import fused_support

                reason = fused_support(self.model)
        if asked is None:
            return "eager" if not (cuda and self.manifest.constant_memory) else "fused" if reason is None else "graph"
        if asked != "eager" and not cuda:
            raise EdgelinError(f"{DECODE_ENV}={asked} on {self.device}", "CUDA graphs need a CUDA device",
                               f"unset {DECODE_ENV} or set it to eager")
        if asked != "eager" and not self.manifest.constant_memory:
            raise EdgelinError(f"{DECODE_ENV}={asked}", "this model keeps a growing KV cache (its shape changes "
                               "every step), which a CUDA graph cannot replay", f"set {DECODE_ENV} to eager")
        if asked == "fused" and reason is not None:
            raise EdgelinError(f"{DECODE_ENV}=fused", f"the fused decode cannot take this model: {reason}",
                               f"set {DECODE_ENV} to graph")
        return asked

    # ---- handles ---------------------------------------------------------------------------------
    def _new(self, batch: int) -> _State:
        return _State(self.model.initial_state(batch, device=self.device, dtype=self.dtype))

    def _read(self, state: StateHandle) -> State:
        layers = state._value.layers
        return {key: np.array(layers[layer][name].detach().to("cpu", self._torch.float32).numpy(),
                              self._io_dtype[key], copy=True) for layer, name, key in self._layout}

    def _write(self, state: StateHandle, values: State) -> None:
        value: _State = state._value
        new = [dict(layer) for layer in value.layers]
        for layer, name, key in self._layout:
            dtype = value.layers[layer][name].dtype
            new[layer][name] = self._torch.from_numpy(np.array(values[key], copy=True)).to(self.device, dtype)
        self._store(value, new)

    def _copy(self, state: StateHandle) -> _State:
        return _State([{n: t.clone() for n, t in layer.items()} for layer in state._value.layers])

    def _store(self, value: _State, layers: list) -> None:
        """Replace a handle's tensors; a resident handle's are the decoder's buffers: copied into them."""
        if value.decoder is None:
            value.layers = layers
            return
        with self._torch.no_grad():
            for mine, new in zip(value.layers, layers):
                for name, tensor in mine.items():
                    tensor.copy_(new[name])

    # ---- calls -----------------------------------------------------------------------------------
    @contextlib.contextmanager
    def _threads(self):
        """`threads` applies to this runner's CPU work only (torch's thread count is process-wide)."""
        if self.threads is None or self.device.type != "cpu":
            yield
            return
        before = self._torch.get_num_threads()
        self._torch.set_num_threads(self.threads)
        try:
            yield
        finally:
            self._torch.set_num_threads(before)

    def _run(self, kind: str, input_ids: np.ndarray, state: StateHandle, position: np.ndarray | None) -> np.ndarray:
        torch = self._torch
        value: _State = state._value
        ids = torch.from_numpy(np.ascontiguousarray(input_ids, np.int64))
        if kind == "step" and self.decode != "eager":
            return self._graph_step(ids, value, position)
        start = None if position is None else torch.from_numpy(np.ascontiguousarray(position, np.int64))
        with torch.no_grad(), self._threads():
            tokens = ids.to(self.device).view(len(input_ids), -1)
            logits, new = self.model(tokens, value.layers, None if start is None else start.to(self.device),
                                     mode="recurrent" if kind == "step" else "chunked", last_only=True)
            self._store(value, new)
            return logits.to("cpu", torch.float32).numpy().copy()

    def _graph_step(self, ids: "torch.Tensor", value: _State, position: np.ndarray | None) -> np.ndarray:
        decoder = self._decoder(len(ids))
        if value.decoder is not decoder:
            self._make_resident(decoder, value)
        if position is not None and hasattr(decoder, "start"):
            decoder.start.copy_(self._torch.from_numpy(np.ascontiguousarray(position, np.int64)))
        return decoder.step(ids).to("cpu", self._torch.float32).numpy().copy()

    def _decoder(self, batch: int) -> Any:
        decoder = self._decoders.get(batch)
        if decoder is not None:
            return decoder
        while len(self._decoders) >= MAX_DECODERS:
            oldest = next(iter(self._decoders))
            self._evict(oldest)
        if self.decode == "fused":
            from edgelin.export.torch.fused_decode import FusedDecoder as Decoder
        else:
            from edgelin.export.torch.graph_decode import GraphDecoder as Decoder
        decoder = self._decoders[batch] = Decoder(self.model, batch=batch)
        return decoder

    def _evict(self, batch: int) -> None:
        decoder = self._decoders.pop(batch)
        resident = self._resident.pop(batch, None)
        value = resident() if resident is not None else None
        if value is not None and value.decoder is decoder:
            value.layers, value.decoder = decoder.current_state(), None

    def _make_resident(self, decoder: Any, value: _State) -> None:
        """Copy the current resident's state out of the decoder's buffers, then `value`'s in."""
        batch = decoder.batch
        previous = self._resident.get(batch)
        old = previous() if previous is not None else None
        if old is not None and old.decoder is decoder:
            old.layers, old.decoder = decoder.current_state(), None
        decoder.reset(value.layers)
        value.layers, value.decoder = decoder.state, decoder
        self._resident[batch] = weakref.ref(value)
