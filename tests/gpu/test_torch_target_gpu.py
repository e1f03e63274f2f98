"""The torch target's CUDA runners (edgelin.export.torch.runner) against the same runner stepping eagerly
on the same GPU: the fused Gated DeltaNet decode and the CUDA-graph decode, fp32 and fp16, batch 1 and 3,
a prefill then 16 steps, logits at every step and every state tensor at the end; handles interleaved on
one decoder (the resident state copied out and in), a decoder dropped and captured again; and
`edgelin validate DIR` (replay of the vectors recorded on the CPU) through the fused runner."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from conftest import family_layers, tiny_config
from edgelin.model.config import ModelConfig
from edgelin.model.lm import CausalLM

pytestmark = pytest.mark.gpu
STEPS, PROMPT = 16, 9
TOL = {"fp32": 1e-4, "fp16": 2e-2}
PIECE_TOL = 1e-5  # one prefill piece vs several, fp32: measured 1.3e-6 on the H200


def _gdn() -> CausalLM:
    """Two Gated DeltaNet layers the fused decode takes (head dims 128, conv 4), norms and gates moved
    away from their init so that a wrong index shows."""
    import torch

    config = ModelConfig(vocab_size=512, hidden_size=256, layer_types=("gated_deltanet",) * 2, num_heads=2,
                         head_k_dim=128, head_v_dim=128, intermediate_size=512)
    torch.manual_seed(0)
    model = CausalLM(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:
                p.add_(0.2 * torch.randn_like(p))
    return model


def _hybrid() -> CausalLM:
    """Gated DeltaNet + sliding-window softmax (positions, a ring buffer) + GLA: the fused decode refuses it."""
    import torch

    torch.manual_seed(0)
    return CausalLM(tiny_config(family_layers("hybrid"), head_k_dim=32, head_v_dim=32)).eval()


def _folder(model: CausalLM, precision: str, folder: Path):
    from edgelin.export.pipeline import build_manifest
    from edgelin.export.torch.contract import WEIGHTS
    from edgelin.export.torch.target import write_model

    folder.mkdir()
    write_model(model, precision, folder)
    return build_manifest(model, "torch", precision, {"step": WEIGHTS, "prefill": WEIGHTS}, {"path": "x"}, None)


def _rel(got: np.ndarray, want: np.ndarray) -> float:
    return float(np.abs(got - want).max() / np.abs(want).max())


def _rollout(runner, ids: np.ndarray, handle=None) -> tuple[list[np.ndarray], dict]:
    batch = ids.shape[0]
    handle = handle or runner.new_state(batch)
    out = [runner.prefill(ids[:, :PROMPT], handle, np.zeros(batch, np.int64))]
    for t in range(PROMPT, PROMPT + STEPS):
        out.append(runner.step(ids[:, t], handle, np.full(batch, t, np.int64)))
    return out, runner.read_state(handle)


CASES = [("gdn", "fused", "fp32"), ("gdn", "fused", "fp16"), ("gdn", "graph", "fp32"),
         ("hybrid", "graph", "fp32"), ("hybrid", "graph", "fp16")]


@pytest.mark.parametrize("family,decode,precision", CASES)
def test_cuda_graph_runners_match_eager(tmp_path, family, decode, precision):
    from edgelin.export.torch.runner import TorchRunner

    model = _gdn() if family == "gdn" else _hybrid()
    manifest = _folder(model, precision, tmp_path / "out")
    graph = TorchRunner(tmp_path / "out", manifest, torch_device="cuda", decode=decode)
    eager = TorchRunner(tmp_path / "out", manifest, torch_device="cuda", decode="eager")
    auto = TorchRunner(tmp_path / "out", manifest, torch_device="cuda")
    assert graph.decode == decode and eager.label.startswith("torch eager (cuda: ")
    assert auto.label.startswith("torch cuda-graph fused (" if family == "gdn" else "torch cuda-graph (")
    vocab = model.config.vocab_size
    for batch in (1, 3):
        ids = np.random.default_rng(batch).integers(0, vocab, (batch, PROMPT + STEPS))
        got, got_state = _rollout(graph, ids)
        want, want_state = _rollout(eager, ids)
        for t, (a, b) in enumerate(zip(got, want)):
            assert _rel(a, b) < TOL[precision], f"batch {batch} call {t}: {_rel(a, b):.2e}"
        for name in want_state:
            assert _rel(got_state[name], want_state[name]) < TOL[precision], name
    assert sorted(graph._decoders) == [1, 3]


def test_interleaved_handles_and_a_dropped_decoder(tmp_path, monkeypatch):
    """Two handles stepped in turn on one decoder, a fork and a write_state while resident, and
    MAX_DECODERS = 1 so batch 1 and batch 3 evict each other's decoder: each handle's logits must be
    the ones it gets when it runs alone (eager)."""
    from edgelin.export.torch import runner as torch_runtime
    from edgelin.export.torch.runner import TorchRunner

    monkeypatch.setattr(torch_runtime, "MAX_DECODERS", 1)
    model = _hybrid()
    manifest = _folder(model, "fp32", tmp_path / "out")
    graph = TorchRunner(tmp_path / "out", manifest, torch_device="cuda", decode="graph")
    eager = TorchRunner(tmp_path / "out", manifest, torch_device="cuda", decode="eager")
    rng = np.random.default_rng(0)
    seqs = [rng.integers(0, 97, (b, PROMPT + STEPS)) for b in (1, 1, 3)]
    want = [_rollout(eager, ids)[0] for ids in seqs]
    handles = [graph.new_state(ids.shape[0]) for ids in seqs]
    got = [[graph.prefill(ids[:, :PROMPT], h, np.zeros(len(ids), np.int64))] for ids, h in zip(seqs, handles)]
    for t in range(PROMPT, PROMPT + STEPS):
        for ids, h, out in zip(seqs, handles, got):
            out.append(graph.step(ids[:, t], h, np.full(len(ids), t, np.int64)))
        if t == PROMPT + 3:  # handle 2 stepped last: its tensors are the batch-3 decoder's buffers
            assert handles[2]._value.decoder is graph._decoders[3]
            fork = graph.fork(handles[2])  # a copy, not the buffers: the zeros written next must not reach it
            graph.write_state(handles[2], graph.read_state(graph.new_state(3)))  # into the resident buffers
            graph.write_state(handles[2], graph.read_state(fork))  # and back
    for t in range(len(want[0])):
        for i in range(3):
            assert _rel(got[i][t], want[i][t]) < 1e-4, f"handle {i} call {t}"
    assert list(graph._decoders) == [3] and handles[0]._value.decoder is None


def test_validate_replays_on_the_fused_runner(tmp_path):
    """The full export (reference vectors recorded on the CPU), then `edgelin validate DIR` on the GPU."""
    from edgelin.checkpoint import save_checkpoint
    from edgelin.export.pipeline import export_checkpoint
    from edgelin.replay import replay

    ckpt = save_checkpoint(_gdn(), tmp_path / "ckpt")
    folder = export_checkpoint(ckpt, tmp_path / "out", "torch").folder
    report = replay(folder)
    assert report.runner.startswith("torch cuda-graph fused (")
    assert report.passed, [(m.check, m.output, m.max_rel) for m in report.metrics if not m.passed]


def test_cuda_runner_prefills_in_long_pieces_with_the_same_numbers(tmp_path):
    """On a GPU runtime.prefill hands the runner pieces of CUDA_PREFILL_PIECE tokens, not the CPU's 256
    (8x slower on the H200 for a 2,048-token prompt, docs/performance.md#gpu-decode); one 700-token piece and
    pieces of 256 + 256 + 188 give the same logits and state (the chunked kernels carry the state across)."""
    from edgelin.export.torch.runner import CUDA_PREFILL_PIECE, TorchRunner
    from edgelin.runtime import CONSTANT_PIECE, prefill

    model = _gdn()
    manifest = _folder(model, "fp32", tmp_path / "out")
    runner = TorchRunner(tmp_path / "out", manifest, torch_device="cuda", decode="eager")
    assert runner.prefill_piece == CUDA_PREFILL_PIECE >= 2048
    ids = np.random.default_rng(1).integers(0, 512, (2, 700))
    long_logits, long_state = prefill(runner, ids)
    runner.prefill_piece = CONSTANT_PIECE  # the CPU default: 256-token pieces
    short_logits, short_state = prefill(runner, ids)
    errors = [_rel(long_logits, short_logits)] + [_rel(runner.read_state(long_state)[name], value)
                                                   for name, value in runner.read_state(short_state).items()]
    print(f"one piece vs 256-token pieces, max relative error: {max(errors):.3g}")
    assert max(errors) < PIECE_TOL
