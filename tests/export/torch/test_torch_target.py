"""The torch target (edgelin.export.torch.target / torch_runtime): the PyTorch reference exported as
config.json + model.safetensors and run behind the Runner interface, so `validate DIR` and `bench DIR`
take it unchanged. CPU here (eager torch); the CUDA-graph and fused decode runners are
tests/gpu/test_torch_target_gpu.py."""

from __future__ import annotations

import importlib.util
import json

import numpy as np
import pytest
import torch

from edgelin.errors import EdgelinError
from edgelin.integrity import checking
from helpers import make_checkpoint

PICKLES = (".pt", ".pth", ".pkl", ".bin", ".ckpt", ".pickle")


@pytest.fixture(scope="module")
def export(tmp_path_factory):
    """One tiny hybrid (Gated DeltaNet + sliding-window softmax + GLA) exported to the torch target."""
    from edgelin.export.pipeline import export_checkpoint

    root = tmp_path_factory.mktemp("torch-target")
    ckpt = make_checkpoint(root / "ckpt", "hybrid", tokenizer=False)
    return ckpt, export_checkpoint(ckpt, root / "out", "torch").folder


def test_folder_is_the_model_in_safetensors_and_no_pickles(export):
    from safetensors.torch import load_file

    ckpt, folder = export
    names = sorted(p.name for p in folder.iterdir())
    assert names == ["config.json", "manifest.json", "model.safetensors", "reference.npz", "torch.json"]
    assert not [n for n in names if n.endswith(PICKLES)]
    manifest = json.loads((folder / "manifest.json").read_text())
    assert manifest["target"] == "torch" and manifest["precision"] == "fp32"
    assert {g["file"] for g in manifest["graphs"].values()} == {"model.safetensors"}
    assert sorted(manifest["files"]) == names
    # The weights are the checkpoint's, bit for bit (read with safetensors, not with the code under test).
    theirs, mine = load_file(str(ckpt / "model.safetensors")), load_file(str(folder / "model.safetensors"))
    assert sorted(mine) == sorted(theirs) and all(torch.equal(mine[k], theirs[k]) for k in theirs)
    contract = json.loads((folder / "torch.json").read_text())
    assert contract["bytes"] == (folder / "model.safetensors").stat().st_size
    assert contract["tensor_bytes"] == {"float32": sum(t.numel() * 4 for t in theirs.values())}


def test_validate_replays_the_recorded_vectors(export):
    from edgelin.replay import replay

    report = replay(export[1])
    assert report.passed and report.runner == "torch eager (cpu)"
    assert {m.check for m in report.metrics} >= {"prefill", "rollout", "prefill-vs-steps"}
    assert max(m.max_rel for m in report.metrics) < 1e-5  # the same model and ops as the recording


def test_runner_matches_the_checkpoint_and_handles_are_independent(export):
    from edgelin.checkpoint import load_model
    from edgelin.runtime import CONSTANT_PIECE, open_runner

    ckpt, folder = export
    model, _ = load_model(ckpt)
    runner = open_runner(folder)
    assert runner.prefill_piece == CONSTANT_PIECE == 256  # on a CPU: 256-token pieces, as for ONNX Runtime
    assert runner.label == "torch eager (cpu)"
    ids = np.random.default_rng(0).integers(0, 97, (2, 21))
    handle = runner.new_state(2)
    got = runner.prefill(ids[:, :13], handle, np.zeros(2, np.int64))
    fork = runner.fork(handle)
    with torch.no_grad():
        want, state = model(torch.from_numpy(ids[:, :13]), mode="chunked", last_only=True)
        np.testing.assert_allclose(got, want.numpy(), rtol=0, atol=1e-6)
        for t in range(13, 21):
            got = runner.step(ids[:, t], handle, np.full(2, t, np.int64))
            want, state = model(torch.from_numpy(ids[:, t:t + 1]), state, torch.full((2,), t), mode="recurrent",
                                last_only=True)
            np.testing.assert_allclose(got, want.numpy(), rtol=0, atol=1e-6)
    read = runner.read_state(handle)
    np.testing.assert_array_equal(read["past_key_values.0.recurrent_state"], state[0]["recurrent_state"].numpy())
    # The fork stayed at position 13; writing the read state into it makes it equal again.
    assert not np.array_equal(runner.read_state(fork)["past_key_values.0.recurrent_state"],
                              read["past_key_values.0.recurrent_state"])
    runner.write_state(fork, read)
    a = runner.step(ids[:, 0], fork, np.full(2, 21, np.int64))
    b = runner.step(ids[:, 0], handle, np.full(2, 21, np.int64))
    np.testing.assert_array_equal(a, b)
    with pytest.raises(EdgelinError, match="another runner"):
        open_runner(folder).step(ids[:, 0], handle, np.full(2, 22, np.int64))


def test_bench_measures_it_like_any_runner(export):
    from edgelin.bench import bench

    report = bench(export[1], positions=[1, 8], warmup=1, iters=3, prefill_tokens=16, prefill_chunk=16)
    assert report.target == "torch" and [r.position for r in report.positions] == [1, 8]
    assert all(r.p50_ms > 0 for r in report.positions) and report.runner == "torch eager (cpu)"
    assert report.runtime_bytes == (export[1] / "model.safetensors").stat().st_size
    assert report.environment["runtime"] == "torch" and report.environment["runtime_version"] == torch.__version__


def test_fp16_weights_load_exactly_and_keep_the_decay_float32(tmp_path):
    from edgelin.export.pipeline import build_manifest
    from edgelin.export.torch.runner import TorchRunner
    from edgelin.export.torch.contract import WEIGHTS
    from edgelin.export.torch.target import write_model
    from edgelin.model.lm import CausalLM, with_compute_dtype
    from safetensors.torch import load_file
    from conftest import family_layers, tiny_config

    model = CausalLM(tiny_config(family_layers("gated_deltanet"))).eval()
    write_model(model, "fp16", tmp_path)
    stored = load_file(str(tmp_path / WEIGHTS))
    assert stored["model.layers.0.mixer.A_log"].dtype == torch.float32
    assert stored["model.layers.0.mixer.q_proj.weight"].dtype == torch.float16
    files = {"step": WEIGHTS, "prefill": WEIGHTS}
    manifest = build_manifest(model, "torch", "fp16", files, {"path": "x"}, None)
    runner = TorchRunner(tmp_path, manifest)
    ids = np.arange(10).reshape(1, 10) * 7 % 97
    got = runner.prefill(ids, runner.new_state(1))
    with torch.no_grad():
        half = with_compute_dtype(model, torch.float16)
        want, _ = half(torch.from_numpy(ids), half.initial_state(1, dtype=torch.float16), mode="chunked",
                       last_only=True)
    np.testing.assert_array_equal(got, want.float().numpy())
    assert runner.read_state(runner.new_state(1))["past_key_values.0.conv_state"].dtype == np.float32


def test_refusals_are_one_line(export, monkeypatch, tmp_path):
    import shutil

    from edgelin.devices import export_settings, get_device
    from edgelin.export.targets import get_target
    from edgelin.runtime import open_runner

    folder = export[1]
    target = get_target("torch")
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "torch" else real(name, *a))
    with pytest.raises(EdgelinError, match=r"torch target cannot run here \(run phase\).*torch is not installed"):
        open_runner(folder)
    monkeypatch.undo()
    assert not target.can_run(get_device("iphone")).ok and target.can_run(get_device("desktop-cpu")).ok
    with pytest.raises(EdgelinError, match="torch target takes no weight quantisation"):
        export_settings(None, "torch", quantize="int8")
    if not torch.cuda.is_available():
        monkeypatch.setenv("EDGELIN_TORCH_DEVICE", "cuda")
        with pytest.raises(EdgelinError, match="torch sees no CUDA device"):
            open_runner(folder)
        monkeypatch.setenv("EDGELIN_TORCH_DEVICE", "cpu")
        monkeypatch.setenv("EDGELIN_TORCH_DECODE", "graph")
        with pytest.raises(EdgelinError, match="CUDA graphs need a CUDA device"):
            open_runner(folder)
    monkeypatch.delenv("EDGELIN_TORCH_DECODE", raising=False)
    broken = tmp_path / "broken"
    shutil.copytree(folder, broken)
    with open(broken / "model.safetensors", "r+b") as fh:
        fh.truncate(1000)
    with pytest.raises(EdgelinError, match="model.safetensors does not match its manifest"):
        open_runner(broken)
    with checking(verify=False), pytest.raises(EdgelinError, match="truncated or belongs to another export"):
        open_runner(broken)  # --no-verify: the runner's own check


class _CpuGraphDecoder:
    """GraphDecoder's interface on the CPU (static state buffers, `start`, reset/step/current_state), the
    step run eagerly: the runner's bookkeeping of which handle lives in a decoder's buffers, without CUDA."""

    def __init__(self, model, batch: int):
        self.model, self.batch = model, batch
        self.state = model.initial_state(batch)
        self.start = torch.zeros(batch, dtype=torch.long)

    def reset(self, state=None, start=0):
        for mine, new in zip(self.state, state):
            for name, tensor in mine.items():
                tensor.copy_(new[name])
        self.start.fill_(start)

    def step(self, ids):
        with torch.no_grad():
            logits, new = self.model(ids.view(self.batch, 1), self.state, self.start, mode="recurrent",
                                     last_only=True)
        self.reset(new, 0)
        return logits

    def current_state(self):
        return [{name: t.clone() for name, t in layer.items()} for layer in self.state]


def test_decoder_buffers_follow_the_handle_that_steps(export, monkeypatch):
    """Handles stepped in turn on one decoder per batch size (the resident one's state copied out, the next
    one's in), a fork and write_state while resident, and MAX_DECODERS = 1 so batch 1 and 3 evict each
    other's decoder: every handle's logits equal the eager runner's for that handle alone."""
    from edgelin.export.torch import runner as torch_runtime
    from edgelin.export.torch import graph_decode as graph_decode
    from edgelin.runtime import open_runner

    folder = export[1]
    eager = open_runner(folder)
    graph = open_runner(folder)
    graph.decode = "graph"  # what a CUDA device picks for this hybrid (the fused decode refuses softmax)
    monkeypatch.setattr(graph_decode, "GraphDecoder", _CpuGraphDecoder)
    monkeypatch.setattr(torch_runtime, "MAX_DECODERS", 1)
    rng = np.random.default_rng(0)
    seqs = [rng.integers(0, 97, (b, 14)) for b in (1, 1, 3)]

    def alone(ids):
        handle = eager.new_state(len(ids))
        out = [eager.prefill(ids[:, :5], handle, np.zeros(len(ids), np.int64))]
        return out + [eager.step(ids[:, t], handle, np.full(len(ids), t, np.int64)) for t in range(5, 14)]

    want = [alone(ids) for ids in seqs]
    handles = [graph.new_state(len(ids)) for ids in seqs]
    got = [[graph.prefill(ids[:, :5], h, np.zeros(len(ids), np.int64))] for ids, h in zip(seqs, handles)]
    for t in range(5, 14):
        for ids, h, out in zip(seqs, handles, got):
            out.append(graph.step(ids[:, t], h, np.full(len(ids), t, np.int64)))
        if t == 7:
            assert handles[2]._value.decoder is graph._decoders[3]  # stepped last: its tensors are the buffers
            fork = graph.fork(handles[2])
            graph.write_state(handles[2], graph.read_state(graph.new_state(3)))  # zeros into the buffers ...
            graph.write_state(handles[2], graph.read_state(fork))  # ... and back from the fork
    for i in range(3):
        for t in range(len(want[i])):
            np.testing.assert_allclose(got[i][t], want[i][t], rtol=0, atol=1e-6, err_msg=f"handle {i} call {t}")
    assert list(graph._decoders) == [3] and handles[0]._value.decoder is None
