"""Test helpers: tiny checkpoints in the real on-disk format, and a small BPE tokenizer."""

from __future__ import annotations

import glob
import sysconfig
from pathlib import Path

import numpy as np
import torch

from conftest import family_layers, tiny_config
from edgelin.checkpoint import save_checkpoint
from edgelin.export.pipeline import export_checkpoint
from edgelin.model.lm import CausalLM


def _as_float64(x) -> np.ndarray:
    if isinstance(x, torch.Tensor):
        x = x.detach().cpu().double().numpy()
    return np.asarray(x, dtype=np.float64)


def rms_rel(got, want, floor: float = 1e-12) -> float:
    """RMS of the error relative to the RMS of the reference (floor: for references near zero)."""
    got, want = _as_float64(got), _as_float64(want)
    return float(np.sqrt(np.mean((got - want) ** 2)) / max(np.sqrt(np.mean(want ** 2)), floor))


def assert_close(got, want, rtol: float, what: str = "", floor: float = 1e-12) -> None:
    """The one closeness check of the tests: same shape, all finite, RMS-relative error <= rtol.
    The message also gives the max-relative error and where it is, to read a failure at a glance."""
    g, w = _as_float64(got), _as_float64(want)
    label = f"{what}: " if what else ""
    assert g.shape == w.shape, f"{label}shape {g.shape} != reference {w.shape}"
    assert np.isfinite(g).all(), f"{label}{int((~np.isfinite(g)).sum())} non-finite values"
    err = rms_rel(g, w, floor)
    if not err <= rtol:
        diff = np.abs(g - w)
        worst = np.unravel_index(int(diff.argmax()), diff.shape) if diff.size else ()
        max_rel = float(diff.max(initial=0.0) / max(np.abs(w).max(initial=0.0), floor))
        raise AssertionError(f"{label}RMS-relative error {err:.3g} > {rtol:g} "
                             f"(max-relative {max_rel:.3g} at {tuple(int(i) for i in worst)})")


def assert_states_close(got, want, rtol: float) -> None:
    """Per-layer state dicts (the model's [{name: tensor}] form): every tensor with assert_close."""
    assert len(got) == len(want), f"{len(got)} layers != {len(want)}"
    for layer, (a, b) in enumerate(zip(got, want)):
        assert a.keys() == b.keys(), f"layer {layer}: {sorted(a)} != {sorted(b)}"
        for name in b:
            assert_close(a[name], b[name], rtol, f"layer {layer} {name}")


def make_tokenizer(path: Path, vocab_size: int = 97) -> Path:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    files = sorted(glob.glob(sysconfig.get_paths()["stdlib"] + "/*.py"))[:3]
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train(files, trainer)
    tok.save(str(path))
    return path


# A checkpoint with a tokenizer has its vocabulary (a byte-level BPE needs 256); one without, 97 unless told. The
# tokenizer-less hybrids that export ONNX ask for 256: their graphs are then the tokenized hybrid's, traced once a run.
TOKENIZER_VOCAB = 256


def make_checkpoint(folder: Path, family: str = "hybrid", tokenizer: bool = True, seed: int = 0,
                    layers: tuple[str, ...] | None = None, **changes) -> Path:
    """`layers`: the layer types (default: two of `family`, or the hybrid's three)."""
    torch.manual_seed(seed)
    vocab = changes.pop("vocab_size", 97)
    vocab = max(vocab, TOKENIZER_VOCAB) if tokenizer else vocab
    model = CausalLM(tiny_config(layers or family_layers(family), vocab_size=vocab, **changes))
    tok = make_tokenizer(folder.parent / f"{folder.name}-tokenizer.json", model.config.vocab_size) if tokenizer else None
    return save_checkpoint(model, folder, tok)


def export_family(root: Path, family: str, **changes) -> Path:
    ckpt = make_checkpoint(root / f"{family}-ckpt", family, tokenizer=False, **changes)
    return export_checkpoint(ckpt, root / f"{family}-onnx").folder


def run_state_in_place(session, feeds: dict, output: str, past: str = "past",
                       present: str = "present") -> tuple[np.ndarray, np.ndarray]:
    """One ONNX Runtime run with the state's past input and present output bound to one buffer, as the runner binds
    them: (the other output, the state after the run); the feeds other than `past` bound as inputs."""
    import onnxruntime as ort

    state = ort.OrtValue.ortvalue_from_numpy(feeds[past].copy())
    binding = session.io_binding()
    for name, value in feeds.items():
        if name != past:
            binding.bind_cpu_input(name, value)
    binding.bind_ortvalue_input(past, state)
    binding.bind_output(output)  # get_outputs() follows the order of binding
    binding.bind_ortvalue_output(present, state)
    session.run_with_iobinding(binding)
    return binding.copy_outputs_to_cpu()[0], state.numpy().copy()  # (a view would die with the OrtValue)



def qwen_attention_checkpoint(folder: Path, seed: int = 0) -> Path:
    """A tiny GLA + full-attention hybrid whose attention layer is Qwen3.5's (grouped kv heads, q/k norm, partial
    rotary, output gate): the model --kv-cache static is for."""
    from edgelin.model.config import AttentionConfig

    torch.manual_seed(seed)
    attention = AttentionConfig(num_heads=4, num_kv_heads=2, head_dim=16, window=None, rotary_dim=8, qk_norm=True,
                                output_gate=True)
    return save_checkpoint(CausalLM(tiny_config(("gla", "softmax"), attention=attention)), folder, None)


def export_growing_hybrid(root: Path) -> Path:
    """qwen_attention_checkpoint's ONNX export: a hybrid whose KV cache grows a row per position."""
    from edgelin.export.pipeline import export_checkpoint

    return export_checkpoint(qwen_attention_checkpoint(root / "qwen-ckpt"), root / "qwen-onnx").folder


def assert_not_fused(proto, fuse) -> None:
    """A step-graph fusion `fuse(proto, float32 tensor names)` refuses `proto`: 0 fused, the same nodes."""
    from edgelin.export.onnx.kernels import float_tensor_names

    before = [n.op_type for n in proto.graph.node]
    assert fuse(proto, float_tensor_names(proto)) == 0
    assert [n.op_type for n in proto.graph.node] == before


# The trainer tests' tiny recipe (tests/train/test_train.py; also the CLI, quality and outputs tests): a 200 kB
# stdlib corpus, 10% held out.
TINY = """
[model]
hidden_size = 32
layer_types = ["gla", "softmax"]
num_heads = 2
head_k_dim = 16
head_v_dim = 16
intermediate_size = 64

[model.attention]
num_heads = 2
num_kv_heads = 1
head_dim = 16
window = 32

[data]
source = "python-stdlib"
max_bytes = 200_000
val_fraction = 0.1

[tokenizer]
kind = "bpe"
vocab_size = 300

[train]
seed = 0
steps = 30
batch_size = 8
seq_len = 64
lr = 1e-2
warmup = 5
eval_every = 10
eval_windows = 8
threads = 1  # one thread: no OpenMP barrier stalls when the test machine is busy
save_dtype = "float32"
"""


def jitter(model: CausalLM, seed: int = 1) -> CausalLM:
    """Move the zero-initialised gate and route weights off zero (what training does), so the erase
    and write gates differ per channel and token and the CLVR route carries a signal."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("erase_proj.weight", "write_proj.weight", "clvr_proj.weight")):
                p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
            elif name.endswith(("erase_bias", "write_bias")):
                p.copy_(torch.randn(p.shape, generator=gen))
    return model


def tied_head_model(rng: np.random.Generator, vocab: int, dim: int, hidden: int):
    """(an ONNX model as an export writes a tied LM: a Gather on the table, two projections, the head as Gemm x W^T
    on the same table; its weights {"table", "up", "down"} as random float32 arrays)."""
    from onnx import TensorProto, helper, numpy_helper

    arrays = {"table": rng.standard_normal((vocab, dim)).astype(np.float32),
              "up": rng.standard_normal((dim, hidden)).astype(np.float32),
              "down": rng.standard_normal((hidden, dim)).astype(np.float32)}
    nodes = [helper.make_node("Gather", ["table", "ids"], ["x"], name="embed"),
             helper.make_node("MatMul", ["x", "up"], ["h"], name="up_proj"),
             helper.make_node("MatMul", ["h", "down"], ["y"], name="down_proj"),
             helper.make_node("Gemm", ["y", "table"], ["logits"], name="lm_head", transB=1)]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("ids", TensorProto.INT64, [3])],
                              [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [3, vocab])],
                              [numpy_helper.from_array(a, n) for n, a in arrays.items()])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)]), arrays
