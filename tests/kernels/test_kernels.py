"""edgelin's kernels against the naive engines (float64), on CPU through Triton's interpreter.

Tiny fp32 shapes (the interpreter is 100-1000x slower than torch, and wrong for bf16); every gate
kind x update rule, odd lengths, odd d_v, in-place
and ping-pong state, varlen prefill, NaN-poisoned output buffers. On a machine with a CUDA device
the same tests run the compiled kernels on the GPU instead. Also: the CUDA C++ source compiles
with nvcc for every target arch, and its C launcher rejects bad arguments before touching a GPU.
"""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest
import torch
import torch.nn.functional as F

if not torch.cuda.is_available():  # before triton is imported: triton.jit reads it at decoration
    os.environ["TRITON_INTERPRET"] = "1"
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

pytest.importorskip("triton", reason="triton is not installed (pip install -c constraints.txt triton)")

from conftest import tiny_config  # noqa: E402
from edgelin import kernels  # noqa: E402
from edgelin.errors import EdgelinError  # noqa: E402
from edgelin.kernels import abi, cuda_ext  # noqa: E402
from edgelin.kernels import dispatch  # noqa: E402
from edgelin.model.lm import CausalLM  # noqa: E402
from edgelin.model.mixer import use_engine  # noqa: E402
from edgelin.reference.engine import TORCH  # noqa: E402
from edgelin.reference.recurrence import recurrent  # noqa: E402
from helpers import assert_close  # noqa: E402

GATES = ["none", "scalar", "per_key"]
RULES = [False, True]
RULE_IDS = ["additive", "delta"]


def make(b, t, h, d_k, d_v, gate, delta, seed=0, strong_decay=False):
    """Fresh random inputs in the engines' layouts; g <= 0 (a decay), keys normalised for delta."""
    gen = torch.Generator().manual_seed(seed)
    q, k = torch.randn(b, t, h, d_k, generator=gen), torch.randn(b, t, h, d_k, generator=gen)
    v = torch.randn(b, t, h, d_v, generator=gen)
    q, k = (F.normalize(q, dim=-1), F.normalize(k, dim=-1)) if delta else (q * d_k**-0.5, k * d_k**-0.5)
    width = {"none": 0, "scalar": 1, "per_key": d_k}[gate]
    g = F.logsigmoid(torch.randn(b, t, h, width, generator=gen) + (-3.0 if strong_decay else 2.0)) if width else None
    if strong_decay and g is not None:
        g = g * 20  # e^{-60} within a few tokens: e^{+b} would overflow fp32, the kernels must never form it
    beta = torch.rand(b, t, h, generator=gen) if delta else None
    s0 = torch.randn(b, h, d_k, d_v, generator=gen) * 0.1
    return [x if x is None else x.to(DEVICE) for x in (s0, q, k, v, g, beta)]


def reference(s0, q, k, v, g, beta):
    d = [None if x is None else x.double().cpu() for x in (s0, q, k, v, g, beta)]
    return recurrent(*d)  # the pure-torch reference: no backend can route it to a kernel




def nan_like(shape, dtype=torch.float32):
    return torch.full(shape, float("nan"), dtype=dtype, device=DEVICE)


def case_id(case) -> str:
    b, t, h, d_k, d_v = case
    return f"B{b}-T{t}-H{h}-K{d_k}-V{d_v}"


# ---- fused step ---------------------------------------------------------------------------------
@pytest.mark.parametrize("case", [(2, 1, 3, 16, 9), (1, 1, 2, 32, 33)], ids=case_id)
@pytest.mark.parametrize("gate", GATES)
@pytest.mark.parametrize("delta", RULES, ids=RULE_IDS)
@pytest.mark.parametrize("mode", ["inplace", "pingpong"])
def test_fused_step(case, gate, delta, mode):
    b, _, h, d_k, d_v = case
    s0, q, k, v, g, beta = make(*case, gate, delta)
    o_ref, s_ref = reference(s0, q, k, v, g, beta)
    sq = lambda x: None if x is None else x[:, 0]  # noqa: E731
    state = s0.clone()
    out = nan_like((b, h, d_v))
    if mode == "inplace":
        o, s = kernels.fused_step(sq(q), sq(k), sq(v), state, sq(g), sq(beta), out=out, inplace=True)
        assert s.data_ptr() == state.data_ptr()
    else:
        other = nan_like(state.shape)
        o, s = kernels.fused_step(sq(q), sq(k), sq(v), state, sq(g), sq(beta), out=out, state_out=other)
        assert s.data_ptr() == other.data_ptr() and torch.equal(state, s0)  # the input state is untouched
    assert o.data_ptr() == out.data_ptr()
    assert_close(o, o_ref[:, 0], 1e-5)
    assert_close(s, s_ref, 1e-5)


@pytest.mark.parametrize("block_v", [16, 64])
def test_fused_step_tile_configs(block_v):
    """Other d_v tiles than the default (the large-grid default is BV=64 at d_k=128)."""
    s0, q, k, v, g, beta = make(1, 1, 2, 128, 96, "per_key", True, seed=6)
    o_ref, s_ref = reference(s0, q, k, v, g, beta)
    o, s = kernels.fused_step(q[:, 0], k[:, 0], v[:, 0], s0, g[:, 0], beta[:, 0], block_v=block_v)
    assert_close(o, o_ref[:, 0], 1e-5)
    assert_close(s, s_ref, 1e-5)


def test_fused_step_strided_inputs_and_expanded_gate():
    """The model hands over views: q/k sliced from a wider tensor, a fixed decay expanded over B."""
    s0, q, k, v, _, beta = make(3, 1, 4, 16, 16, "none", True)
    wide = torch.randn(3, 4, 40, device=DEVICE)
    qs, ks = wide[..., :16], wide[..., 20:36]
    qs, ks = F.normalize(qs, dim=-1), F.normalize(ks, dim=-1)
    g = torch.tensor([-0.1, -0.2, -0.3, -0.4], device=DEVICE).view(1, 4, 1).expand(3, 4, 1)
    o_ref, s_ref = reference(s0, qs[:, None], ks[:, None], v, g[:, None], beta)
    o, s = kernels.fused_step(qs, ks, v[:, 0], s0, g, beta[:, 0])
    assert_close(o, o_ref[:, 0], 1e-5)
    assert_close(s, s_ref, 1e-5)


# ---- fused recurrence (token loop in one kernel) ------------------------------------------------
@pytest.mark.parametrize("case", [(2, 63, 2, 16, 9)], ids=case_id)
@pytest.mark.parametrize("gate", GATES)
@pytest.mark.parametrize("delta", RULES, ids=RULE_IDS)
def test_fused_recurrent(case, gate, delta):
    s0, q, k, v, g, beta = make(*case, gate, delta, seed=1)
    o_ref, s_ref = reference(s0, q, k, v, g, beta)
    o, s = kernels.fused_recurrent(q, k, v, s0, g, beta, out=nan_like(v.shape), state_out=nan_like(s0.shape))
    assert_close(o, o_ref, 1e-5)
    assert_close(s, s_ref, 1e-5)


# ---- the erase gate (Gated DeltaNet-2): the ERASE flag of the step and the fused recurrence ------
def erase_like(k, seed=7):
    gen = torch.Generator().manual_seed(seed)
    return torch.rand(k.shape, generator=gen).to(DEVICE)  # e in (0, 1) per key channel


def erase_reference(s0, q, k, v, g, beta, erase):
    d = [None if x is None else x.double().cpu() for x in (s0, q, k, v, g, beta, erase)]
    return recurrent(*d)  # the reference's erase-gated rule: S - beta (e*k)(k^T S) + beta k v^T


@pytest.mark.parametrize("case", [(1, 1, 3, 16, 9), (3, 1, 2, 32, 33)], ids=case_id)
@pytest.mark.parametrize("gate", GATES)
@pytest.mark.parametrize("mode", ["inplace", "pingpong"])
def test_fused_step_with_erase_gate(case, gate, mode):
    s0, q, k, v, g, beta = make(*case, gate, True, seed=11)
    erase = erase_like(k)
    o_ref, s_ref = erase_reference(s0, q, k, v, g, beta, erase)
    o_plain, _ = reference(s0, q, k, v, g, beta)
    assert (o_ref - o_plain).abs().max() > 1e-3  # the gate changes the answer: a kernel ignoring it fails
    state = s0.clone()
    kw = dict(inplace=True) if mode == "inplace" else dict(state_out=nan_like(s0.shape))
    o, s = kernels.fused_step(q[:, 0], k[:, 0], v[:, 0], state, None if g is None else g[:, 0], beta[:, 0],
                              erase[:, 0], out=nan_like(v[:, 0].shape), **kw)
    assert_close(o, o_ref[:, 0], 1e-5, "o")
    assert_close(s, s_ref, 1e-5, "state")
    assert (s.data_ptr() == state.data_ptr()) == (mode == "inplace")


@pytest.mark.parametrize("gate", ["scalar", "per_key"])
def test_fused_recurrent_with_erase_gate_fixed_and_varlen(gate):
    """A 37-token loop at batch 3 with a given state, and varlen (lengths 1, 0, 23, 6) from per-sequence
    states, against the reference token loop."""
    s0, q, k, v, g, beta = make(3, 37, 2, 16, 9, gate, True, seed=12)
    erase = erase_like(k)
    o_ref, s_ref = erase_reference(s0, q, k, v, g, beta, erase)
    o, s = kernels.fused_recurrent(q, k, v, s0, g, beta, erase, out=nan_like(v.shape), state_out=nan_like(s0.shape))
    assert_close(o, o_ref, 1e-5, "o")
    assert_close(s, s_ref, 1e-5, "state")

    lengths = [1, 0, 23, 6]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=DEVICE)
    piece = lambda x, a, z: None if x is None else x[1:2, a:z]  # noqa: E731  (batch row 1, packed along T)
    o_var, s_var = kernels.fused_recurrent(*(piece(x, 0, sum(lengths)) for x in (q, k, v)), s0[[0, 1, 2, 0]],
                                           *(piece(x, 0, sum(lengths)) for x in (g, beta, erase)), cu_seqlens=cu)
    for n, (a, z) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        start = s0[[0, 1, 2, 0]][n:n + 1]
        if z == a:
            assert_close(s_var[n:n + 1], start, 0.0, f"empty sequence {n} keeps its state")
            continue
        o_n, s_n = erase_reference(start, *(piece(x, a, z) for x in (q, k, v, g, beta, erase)))
        assert_close(o_var[:, a:z], o_n, 1e-5, f"o of sequence {n}")
        assert_close(s_var[n:n + 1], s_n, 1e-5, f"state of sequence {n}")


def test_erase_gate_is_refused_without_the_delta_rule_or_in_a_wrong_shape():
    s0, q, k, v, g, beta = make(1, 1, 2, 8, 8, "scalar", True)
    erase = erase_like(k)
    with pytest.raises(EdgelinError, match="erase gate without beta"):
        kernels.fused_step(q[:, 0], k[:, 0], v[:, 0], s0, g[:, 0], None, erase[:, 0])
    with pytest.raises(EdgelinError, match="erase has shape"):
        kernels.fused_step(q[:, 0], k[:, 0], v[:, 0], s0, g[:, 0], beta[:, 0], erase[:, 0, :, :1])


# ---- chunked prefill ----------------------------------------------------------------------------
@pytest.mark.parametrize("case", [(2, 63, 2, 16, 9), (1, 130, 1, 32, 17)], ids=case_id)
@pytest.mark.parametrize("gate", GATES)
@pytest.mark.parametrize("delta", RULES, ids=RULE_IDS)
def test_chunk_prefill(case, gate, delta):
    s0, q, k, v, g, beta = make(*case, gate, delta, seed=2)
    o_ref, s_ref = reference(s0, q, k, v, g, beta)
    o, s = kernels.chunk_prefill(q, k, v, g, beta, s0, out=nan_like(v.shape), final_state=nan_like(s0.shape))
    assert_close(o, o_ref, 1e-5)
    assert_close(s, s_ref, 1e-5)


@pytest.mark.parametrize("gate", GATES)
@pytest.mark.parametrize("delta", RULES, ids=RULE_IDS)
def test_chunk_prefill_without_initial_state(gate, delta):
    s0, q, k, v, g, beta = make(1, 70, 2, 16, 16, gate, delta, seed=3)
    o_ref, s_ref = reference(torch.zeros_like(s0), q, k, v, g, beta)
    o, s = kernels.chunk_prefill(q, k, v, g, beta)
    assert_close(o, o_ref, 1e-5)
    assert_close(s, s_ref, 1e-5)


@pytest.mark.parametrize("gate", GATES)
def test_chunk_prefill_32_row_chunks(gate):
    """fp32 with d_k > 64 takes 32-row chunks: the WY inverse's two-block path (64-row chunks take four)."""
    from edgelin.kernels.chunk import chunk_config

    s0, q, k, v, g, beta = make(1, 45, 1, 96, 8, gate, True, seed=6)
    assert chunk_config(1, 96, 8, torch.float32, q.device, True)["BT"] == 32
    o_ref, s_ref = reference(s0, q, k, v, g, beta)
    o, s = kernels.chunk_prefill(q, k, v, g, beta, s0)
    assert_close(o, o_ref, 1e-5)
    assert_close(s, s_ref, 1e-5)


@pytest.mark.parametrize("shape", [(1, 70, 1, 48, 8), (1, 45, 1, 96, 8)], ids=["K48-BT64", "K96-BT32"])
@pytest.mark.parametrize("delta", RULES, ids=RULE_IDS)
def test_chunk_prefill_per_key_d_k_tiles(shape, delta):
    """Per-key decay with d_k over several of the intra kernels' d_k tiles (off-diagonal blocks: 32,
    diagonal blocks: 64; the last tile part-masked), 64-row chunks (six block pairs) and 32-row ones
    (one pair), a partial last chunk."""
    s0, q, k, v, g, beta = make(*shape, "per_key", delta, seed=7)
    o_ref, s_ref = reference(s0, q, k, v, g, beta)
    o, s = kernels.chunk_prefill(q, k, v, g, beta, s0, out=nan_like(v.shape), final_state=nan_like(s0.shape))
    assert_close(o, o_ref, 1e-5)
    assert_close(s, s_ref, 1e-5)


PATHS = {  # (gate, chunk_config keys that pick another kernel path than the default at this shape)
    "diag-d_k-tiles": ("per_key", {"diag": "loop"}),
    "diag-token-1-head": ("per_key", {"diag": "token", "BH_DIAG": 1}),
    "diag-token-2-heads": ("per_key", {"diag": "token", "BH_DIAG": 2}),
    "cumsum-64-keys-one-warp": ("per_key", {"BK_CS": 64, "warps_cs": 1}),
    "one-prep-launch-cumsum-loop": ("per_key", {"prep_split": False, "cumsum_split": False, "warps_prep": 2,
                                                "BK_CS": 16, "t_in_state": False}),
    "w-u-through-memory": ("per_key", {"t_in_state": False}),
    "scalar-two-prep-launches": ("scalar", {"prep_split": True, "BK_P": 16, "BV_P": 16}),
    "kg-in-cumsum": ("per_key", {"kg_in_diag": False}),
    "diag-d_k-tiles-kg-in-cumsum": ("per_key", {"diag": "loop", "kg_in_diag": False}),
    "t-in-state-diag-d_k-tiles": ("per_key", {"t_in_state": True, "diag": "loop"}),
    "t-in-state-scalar": ("scalar", {"t_in_state": True}),
    "t-in-state-no-decay": ("none", {"t_in_state": True}),
}


@pytest.mark.parametrize("path", PATHS.values(), ids=PATHS.keys())
@pytest.mark.parametrize("delta", RULES, ids=RULE_IDS)
def test_chunk_prefill_other_paths(path, delta, monkeypatch):
    """Each path a sweep may pick (the diagonal blocks by d_k tiles instead of a program per row, one
    or two heads per row program, KDA's prep in one launch or W and U through memory (no `t_in_state`), the
    state kernel forming U from T with a scalar or no decay, K e^{b_last - b} stored by the cumsum kernel
    instead of the diagonal-block one, the cumsum looping over d_k tiles or in one part-masked 64-key
    tile, a scalar decay's prep in two launches over several d_k and d_v tiles) gives the reference's
    numbers too: odd length, a partial last chunk, two sequences, NaN-poisoned outputs and scratch."""
    from edgelin.kernels import chunk

    gate, override = path
    default = chunk.chunk_config
    monkeypatch.setattr(chunk, "chunk_config", lambda *a, **kw: {**default(*a, **kw), **override})
    s0, q, k, v, g, beta = make(2, 77, 1, 32, 9, gate, delta, seed=8)
    o_ref, s_ref = reference(s0, q, k, v, g, beta)
    empty = torch.empty  # the kernels' scratch (P, A, W, U, b, ...) NaN-poisoned: every entry read is written first

    def poisoned(*args, **kwargs):
        x = empty(*args, **kwargs)
        return x.fill_(float("nan")) if x.is_floating_point() else x

    monkeypatch.setattr(torch, "empty", poisoned)
    o, s = kernels.chunk_prefill(q, k, v, g, beta, s0, out=nan_like(v.shape), final_state=nan_like(s0.shape))
    assert_close(o, o_ref, 1e-5)
    assert_close(s, s_ref, 1e-5)


@pytest.mark.parametrize("diag", ["token", "loop"])
@pytest.mark.parametrize("varlen", [False, True], ids=["fixed", "varlen"])
@pytest.mark.parametrize("delta", RULES, ids=["gla", "kda"])
def test_chunk_prefill_kg_either_kernel(delta, varlen, diag, monkeypatch):
    """The state kernel's operand K e^{b_last - b} (per-key decay) stored by the diagonal-block kernel
    (`kg_in_diag`: a program per row and 4 of 3 heads, or d_k tiles of 32 over 48 keys) or by the cumsum
    kernel: the same formula on the same b, so the same bits out, with partial last chunks (b_last:
    the last valid row), sequences that start mid-chunk, initial states and NaN-poisoned scratch."""
    from edgelin.kernels import chunk

    default = chunk.chunk_config
    s0, q, k, v, g, beta = make(1, 150, 3, 48, 9, "per_key", delta, seed=11)
    cu = torch.tensor([0, 1, 70, 150], dtype=torch.int32, device=DEVICE) if varlen else None
    states = torch.randn(3, 3, 48, 9, device=DEVICE) * 0.1 if varlen else s0
    empty = torch.empty

    def poisoned(*args, **kwargs):
        x = empty(*args, **kwargs)
        return x.fill_(float("nan")) if x.is_floating_point() else x

    runs = []
    for in_diag in (True, False):
        with monkeypatch.context() as m:
            m.setattr(chunk, "chunk_config", lambda *a, **kw: {**default(*a, **kw), "diag": diag, "BK_DIAG": 32,
                                                                "kg_in_diag": in_diag})
            m.setattr(torch, "empty", poisoned)
            runs.append(kernels.chunk_prefill(q, k, v, g, beta, states, cu_seqlens=cu, out=nan_like(v.shape),
                                              final_state=nan_like(states.shape)))
    assert default(3, 48, 9, torch.float32, q.device, delta, False, 2)["kg_in_diag"]
    assert not default(3, 48, 9, torch.float32, q.device, delta, False, 1)["kg_in_diag"]
    assert torch.isfinite(runs[0][0]).all() and torch.isfinite(runs[0][1]).all()
    assert torch.equal(runs[0][0], runs[1][0]) and torch.equal(runs[0][1], runs[1][1])
    if not varlen:
        o_ref, s_ref = reference(s0, q, k, v, g, beta)
        assert_close(runs[0][0], o_ref, 1e-5)
        assert_close(runs[0][1], s_ref, 1e-5)


@pytest.mark.parametrize("delta", RULES, ids=RULE_IDS)
def test_chunk_prefill_per_key_wide_keys(delta):
    """d_k = 160 > 128: the diagonal blocks go by d_k tiles (the row kernel holds all of d_k in
    registers), fp32 takes 32-row chunks."""
    s0, q, k, v, g, beta = make(1, 41, 1, 160, 8, "per_key", delta, seed=9)
    o_ref, s_ref = reference(s0, q, k, v, g, beta)
    o, s = kernels.chunk_prefill(q, k, v, g, beta, s0)
    assert_close(o, o_ref, 1e-5)
    assert_close(s, s_ref, 1e-5)


@pytest.mark.parametrize("gate", ["scalar", "per_key"])
@pytest.mark.parametrize("delta", RULES, ids=RULE_IDS)
def test_chunk_prefill_strong_decay_stays_finite(gate, delta):
    """Decays of e^-20 per token: a factorisation through e^{+b} would overflow fp32 inside a chunk."""
    s0, q, k, v, g, beta = make(1, 80, 1, 16, 16, gate, delta, seed=4, strong_decay=True)
    assert g.sum(1).min() < -200  # the cumulative decay really leaves fp32's exponent range
    o_ref, s_ref = reference(s0, q, k, v, g, beta)
    o, s = kernels.chunk_prefill(q, k, v, g, beta, s0)
    assert_close(o, o_ref, 1e-5)
    assert_close(s, s_ref, 1e-5)


@pytest.mark.parametrize("gate", GATES)
@pytest.mark.parametrize("delta", RULES, ids=RULE_IDS)
def test_varlen_prefill_and_recurrence(gate, delta):
    """One call for prompts of lengths 1, 0, 65, 20 packed along T, each with its own state."""
    lengths = [1, 0, 65, 20]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=DEVICE)
    s0, q, k, v, g, beta = make(1, sum(lengths), 2, 16, 9, gate, delta, seed=5)
    states = torch.randn(len(lengths), 2, 16, 9, device=DEVICE) * 0.1
    o_chunk, s_chunk = kernels.chunk_prefill(q, k, v, g, beta, states, cu_seqlens=cu, out=nan_like(v.shape),
                                             final_state=nan_like(states.shape))
    o_rec, s_rec = kernels.fused_recurrent(q, k, v, states, g, beta, cu_seqlens=cu)
    for n, (a, z) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        piece = lambda x: None if x is None else x[:, a:z]  # noqa: E731
        if z == a:  # an empty prompt keeps its state
            s_ref = states[n:n + 1].double().cpu()
        else:
            o_ref, s_ref = reference(states[n:n + 1], *(piece(x) for x in (q, k, v, g, beta)))
            assert_close(o_chunk[:, a:z], o_ref, 1e-5)
            assert_close(o_rec[:, a:z], o_ref, 1e-5)
        assert_close(s_chunk[n:n + 1], s_ref, 1e-5)
        assert_close(s_rec[n:n + 1], s_ref, 1e-5)


@pytest.mark.parametrize("gate", ["none", "scalar"])
def test_chunk_prefill_erase_gate(gate):
    """Gated DeltaNet-2's erase gate (the delta rule erases along e * k): against the naive token loop,
    odd length, an initial state, and a varlen pair in one call. e far from 1, so plain delta fails."""
    s0, q, k, v, g, beta = make(1, 70, 2, 16, 9, gate, True, seed=8)
    erase = torch.sigmoid(torch.randn(q.shape, generator=torch.Generator().manual_seed(9)) - 1).to(DEVICE)
    d = lambda x: None if x is None else x.double().cpu()  # noqa: E731
    o_ref, s_ref = recurrent(*(d(x) for x in (s0, q, k, v, g, beta, erase)))
    o, s = kernels.chunk_prefill(q, k, v, g, beta, s0, erase=erase, out=nan_like(v.shape),
                                 final_state=nan_like(s0.shape))
    assert_close(o, o_ref, 1e-5)
    assert_close(s, s_ref, 1e-5)
    assert (kernels.chunk_prefill(q, k, v, g, beta, s0)[0].double().cpu() - o_ref).abs().max() > 1e-3
    cu = torch.tensor([0, 5, 70], dtype=torch.int32, device=DEVICE)
    states = torch.cat([s0, s0 * 2])
    o_v, s_v = kernels.chunk_prefill(q, k, v, g, beta, states, erase=erase, cu_seqlens=cu)
    for n, (a, z) in enumerate([(0, 5), (5, 70)]):
        piece = lambda x: None if x is None else d(x[:, a:z])  # noqa: E731
        o_n, s_n = recurrent(d(states[n:n + 1]), *(piece(x) for x in (q, k, v, g, beta, erase)))
        assert_close(o_v[:, a:z], o_n, 1e-5)
        assert_close(s_v[n:n + 1], s_n, 1e-5)
    with pytest.raises(EdgelinError, match="erase gate needs the delta rule"):
        kernels.chunk_prefill(q, k, v, g, None, s0, erase=erase)


# ---- errors -------------------------------------------------------------------------------------
def test_wrappers_refuse_bad_arguments_with_clear_errors():
    s0, q, k, v, g, beta = make(1, 4, 2, 16, 8, "per_key", True)
    with pytest.raises(EdgelinError, match="last dim 3"):
        kernels.chunk_prefill(q, k, v, g[..., :3], beta, s0)
    with pytest.raises(EdgelinError, match="share one of"):
        kernels.fused_recurrent(q.double(), k, v, s0)
    with pytest.raises(EdgelinError, match="always float32"):
        kernels.chunk_prefill(q, k, v, g, beta, s0.half())
    with pytest.raises(EdgelinError, match="1..256"):
        big = torch.zeros(1, 1, 1, 300, device=DEVICE)
        kernels.fused_recurrent(big, big, big)
    with pytest.raises(EdgelinError, match="offsets must rise"):
        kernels.chunk_prefill(q, k, v, cu_seqlens=torch.tensor([0, 3, 2, 4], dtype=torch.int32, device=DEVICE))


# ---- the backend switch (edgelin.kernels.dispatch) -----------------------------------------------
def test_backend_switch_routes_only_what_it_may(monkeypatch):
    s0, q, k, v, g, beta = make(1, 5, 2, 16, 8, "scalar", True)
    calls = []
    real = kernels.chunk_prefill
    monkeypatch.setattr("edgelin.kernels.chunk.chunk_prefill", lambda *a, **kw: calls.append(1) or real(*a, **kw))

    def run():
        return dispatch.engine_for(s0, q, k, v, g, beta).chunked(s0, q, k, v, g, beta, 4)

    run()
    assert calls == ([1] if DEVICE == "cuda" else [])  # auto: kernels for CUDA tensors only
    with dispatch.use_backend("torch"):
        assert dispatch.engine_for(s0, q, k, v, g, beta) is TORCH
        run()
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    with dispatch.use_backend("triton"):
        run()  # compiling/exporting: always the torch reference
    assert len(calls) == (1 if DEVICE == "cuda" else 0)
    monkeypatch.undo()
    monkeypatch.setenv("EDGELIN_KERNELS", "bogus")
    with pytest.raises(EdgelinError, match="unknown recurrence backend"):
        run()
    monkeypatch.setenv("EDGELIN_KERNELS", "triton")
    q.requires_grad_(True)
    with pytest.raises(EdgelinError, match="forward-only"):
        run()
    with torch.no_grad():
        o, s = run()
    o_ref, s_ref = reference(s0, q.detach(), k, v, g, beta)
    assert_close(o, o_ref, 1e-5)
    assert_close(s, s_ref, 1e-5)


def test_installed_engine_wins_over_the_backend(monkeypatch):
    """A target's lowering (an engine installed with use_engine) is what the model runs, even
    under a forced kernel backend; without it the same call reaches the kernels."""
    calls = []
    real = kernels.fused_step
    monkeypatch.setattr("edgelin.kernels.step.fused_step", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    model = CausalLM(tiny_config(("gated_deltanet",))).eval().to(DEVICE)
    ids, start = torch.randint(0, 97, (2, 1), device=DEVICE), torch.zeros(2, dtype=torch.long, device=DEVICE)
    with torch.no_grad(), dispatch.use_backend("triton"):
        with use_engine(TORCH):
            model(ids, None, start, mode="recurrent")
        assert calls == []
        model(ids, None, start, mode="recurrent")
    assert calls == [1]


@pytest.mark.parametrize("family", ["gated_deltanet", "gla", "linear_attn", "retnet"])
def test_model_through_kernels_matches_torch_engines(family):
    """The whole model with the Triton backend (interpreted on CPU): prefill logits and state, and
    decode steps, equal the torch reference's. Covers expanded gates (RetNet) and the normaliser
    (linear_attn: S through the kernels, z through torch)."""
    torch.manual_seed(0)
    model = CausalLM(tiny_config((family, family))).eval().to(DEVICE)
    ids = torch.randint(0, 97, (2, 21), device=DEVICE)
    with torch.no_grad():
        with dispatch.use_backend("torch"):
            ref_logits, ref_state = model(ids, mode="chunked")
            ref_step, _ = model(ids[:, :1], ref_state, torch.full((2,), 21, device=DEVICE), mode="recurrent")
        with dispatch.use_backend("triton"):
            logits, state = model(ids, mode="chunked")
            step, _ = model(ids[:, :1], state, torch.full((2,), 21, device=DEVICE), mode="recurrent")
    assert_close(logits, ref_logits.double().cpu(), 1e-5)
    assert_close(step, ref_step.double().cpu(), 1e-5)
    for layer, ref_layer in zip(state, ref_state):
        for name in layer:
            assert_close(layer[name], ref_layer[name].double().cpu(), 1e-5, str(name))


def test_gdn2_model_decodes_through_the_kernels_erase_flag():
    """A Gated DeltaNet-2 model's decode steps through the Triton backend (the erase flag) equal the
    torch reference's; its prefill stays on the reference until the chunk kernel takes the gate."""
    torch.manual_seed(0)
    model = CausalLM(tiny_config(("gated_deltanet2", "gated_deltanet2"))).eval().to(DEVICE)
    ids = torch.randint(0, 97, (2, 9), device=DEVICE)
    start = torch.full((2,), 9, device=DEVICE)
    with torch.no_grad(), dispatch.use_backend("torch"):
        ref_logits, ref_state = model(ids, mode="chunked")
        ref_step, ref_next = model(ids[:, :1], ref_state, start, mode="recurrent")
        ref_loop, _ = model(ids[:, :5], ref_state, start, mode="recurrent")
    with torch.no_grad(), dispatch.use_backend("triton"):
        step, nxt = model(ids[:, :1], ref_state, start, mode="recurrent")  # T = 1: fused_step
        loop, _ = model(ids[:, :5], ref_state, start, mode="recurrent")  # T = 5: fused_recurrent
    assert_close(step, ref_step.double().cpu(), 1e-5, "step logits")
    assert_close(loop, ref_loop.double().cpu(), 1e-5, "token-loop logits")
    for layer, ref_layer in zip(nxt, ref_next):
        assert_close(layer["recurrent_state"], ref_layer["recurrent_state"].double().cpu(), 1e-5, "state")


# ---- the CUDA C++ kernel: build check for every target arch, launcher validation ---------------
NVCC = shutil.which("nvcc")


@pytest.fixture(scope="module")
def cuda_object(tmp_path_factory):
    if NVCC is None:
        pytest.skip("nvcc not found on PATH: the CUDA step kernel build check needs the CUDA toolkit")
    # One PTX (sm_86's) assembled for every arch: the front end runs once (CI's slowest setup); each arch's
    # own front end runs where the kernel is built for a GPU (the extension on the H200, the plugin's CMake).
    return cuda_ext.nvcc_build(tmp_path_factory.mktemp("cuda"), cuda_ext.ARCHS, one_ptx=True)


@pytest.mark.slow
def test_cuda_kernel_compiles_for_every_target_arch(cuda_object):
    import triton

    bundled = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    cuobjdump = shutil.which("cuobjdump") or (bundled if os.path.exists(bundled) else None)
    if cuobjdump is None:
        pytest.skip("cuobjdump not found (CUDA toolkit or triton's bundled copy); the compile itself succeeded")
    listing = subprocess.run([cuobjdump, "--list-elf", str(cuda_object)], capture_output=True, text=True)
    assert listing.returncode == 0, listing.stderr
    for arch in cuda_ext.ARCHS:
        assert f"sm_{arch}" in listing.stdout, f"no sm_{arch} code in the object"


def input_waits_before_state_loads(sass: str) -> dict[str, int]:
    """Per step-kernel instance with 16-byte state loads: the instructions before its last state load
    (LDG.E.128) that wait on a scoreboard last set by another global load (q, k, v, g, beta). Each
    such wait costs every CTA one memory round trip before its state is requested (issue 12). SASS of
    sm_70 and later: cuobjdump prints each instruction as two 64-bit words, the second holding the
    control bits (scoreboard set: bits 46-48, 7 = none; scoreboards waited on: mask in bits 52-57)."""
    import re

    found = {}
    for block in sass.split("Function : ")[1:]:
        lines = block.splitlines()
        code = []
        for line, nxt in zip(lines, lines[1:]):
            m = re.search(r"/\*[0-9a-f]{4}\*/\s+(.*?);\s*/\* 0x[0-9a-f]+ \*/", line)
            hi = re.search(r"/\* (0x[0-9a-f]+) \*/", nxt)
            if m and hi:
                bits = int(hi.group(1), 16)
                code.append((m.group(1), (bits >> 46) & 7, (bits >> 52) & 0x3F))
        state = [i for i, (text, _, _) in enumerate(code) if "LDG.E.128" in text]
        if not state:
            continue  # the unvectorised instances load the state as scalars: nothing to tell apart
        setter, waits = {}, 0
        for text, board, mask in code[:state[-1]]:
            waits += any(mask >> b & 1 and setter.get(b) == "input" for b in range(6))
            if board != 7:
                setter[board] = "state" if "LDG.E.128" in text else "input" if "LDG" in text else "other"
        found[f"{lines[0].strip()} #{len(found)}"] = waits
    return found


@pytest.mark.slow
def test_cuda_kernel_requests_the_state_before_waiting_on_inputs(cuda_object):
    """Regression (issue 12): ptxas had hoisted the q/k/g loads, their conversions and exp(g) above the
    state loads, so each CTA paid two memory round trips (77-88% of copy bandwidth at B=256). The
    kernel now issues every state load before anything waits on an input load, for every arch."""
    import triton

    bundled = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    cuobjdump = shutil.which("cuobjdump") or (bundled if os.path.exists(bundled) else None)
    if cuobjdump is None:
        pytest.skip("cuobjdump not found (CUDA toolkit or triton's bundled copy)")
    dump = subprocess.run([cuobjdump, "-sass", str(cuda_object)], capture_output=True, text=True)
    assert dump.returncode == 0, dump.stderr[-2000:]
    waits = input_waits_before_state_loads(dump.stdout)
    assert len(waits) >= 4 * 50, f"expected the vectorised instances of 4 archs, found {len(waits)}"
    late = {name: n for name, n in waits.items() if n}
    assert not late, f"{len(late)} instances wait on an input load before their last state load: {list(late)[:3]}"


LAUNCHER_CHECK = r"""
#include <stdio.h>
#include "edgelin_step.h"
int main(void) {
  float state[16 * 9];
  float qkv[32];
  EdgelinStepArgs a = {0};
  int bad_null = edgelin_step_launch(&a, 0);
  a.q = qkv; a.k = qkv; a.v = qkv; a.o = qkv; a.state_in = state; a.state_out = state;
  a.batch = 1; a.heads = 1; a.d_k = 300; a.d_v = 9;
  int bad_dims = edgelin_step_launch(&a, 0);
  a.d_k = 16; a.gate = 7;
  int bad_flags = edgelin_step_launch(&a, 0);
  a.gate = EDGELIN_GATE_SCALAR;
  int no_gate_tensor = edgelin_step_launch(&a, 0);
  a.gate = EDGELIN_GATE_NONE; a.dtype = EDGELIN_F16; a.aux_dtype = EDGELIN_BF16;
  int mixed_aux = edgelin_step_launch(&a, 0);  /* g/beta: float32 or the inputs' dtype, not a third */
  a.aux_dtype = EDGELIN_F32; a.q = (const char*)qkv + 1;
  int misaligned = edgelin_step_launch(&a, 0);
  a.q = qkv; a.erase_flag = 1;
  int erase_without_delta = edgelin_step_launch(&a, 0);  /* the erase gate splits the delta rule */
  a.delta = 1; a.beta = qkv;
  int no_erase_tensor = edgelin_step_launch(&a, 0);
  a.erase_flag = 2; a.erase = qkv;
  int bad_erase_flag = edgelin_step_launch(&a, 0);
  printf("%d %d %d %d %d %d %d %d %d %d|%s\n", bad_null, bad_dims, bad_flags, no_gate_tensor, mixed_aux, misaligned,
         erase_without_delta, no_erase_tensor, bad_erase_flag, edgelin_step_abi_version(),
         edgelin_step_status_string(bad_dims));
  return 0;
}
"""


@pytest.mark.slow
def test_c_launcher_is_plain_c_and_validates_before_launching(cuda_object, tmp_path):
    """The header compiles as C; bad arguments come back as codes (no GPU needed to see them)."""
    src = tmp_path / "check.c"
    src.write_text(LAUNCHER_CHECK)
    exe = tmp_path / "check"
    for cmd in ([NVCC, "-c", str(src), "-o", str(tmp_path / "check.o"), f"-I{abi.CUDA_DIR}",
                 "-Xcompiler=-std=c99,-Wall,-Werror"],  # nvcc hands a .c file to the host C compiler
                [NVCC, str(tmp_path / "check.o"), str(cuda_object), "-o", str(exe)]):
        build = subprocess.run(cmd, capture_output=True, text=True)
        assert build.returncode == 0, build.stderr[-2000:]
    run = subprocess.run([str(exe)], capture_output=True, text=True, timeout=60)
    codes, message = run.stdout.strip().split("|")
    # the last number is the linked launcher's ABI version: 3 since the erase gate (2: g and beta's own dtype)
    assert codes.split() == ["-1", "-2", "-3", "-1", "-3", "-4", "-3", "-1", "-3", "3"], run.stdout
    assert "1..256" in message


def test_step_destination_refuses_two_destinations():
    """Both step entry points (Triton and CUDA) choose where the new state goes through one helper."""
    from edgelin.kernels._common import KernelError, state_destination

    state, other = torch.zeros(1, 1, 2, 2), torch.zeros(1, 1, 2, 2)
    assert state_destination(state, None, True, "t") is state
    assert state_destination(state, other, False, "t") is other
    assert state_destination(state, None, False, "t") is None
    with pytest.raises(KernelError, match="different state_out"):
        state_destination(state, other, True, "t")


def test_cuda_step_keeps_gate_and_beta_out_of_half_precision():
    """ABI 2: g and beta reach the launcher in float32 unless both already are in q's dtype
    (before, a half-precision step cast them to fp16 and decayed in fp16)."""
    half, bf16, f32 = torch.float16, torch.bfloat16, torch.float32
    g16, b16, b32 = torch.zeros(1, 1, 1, dtype=half), torch.zeros(1, 1, dtype=half), torch.zeros(1, 1)
    assert cuda_ext.aux_dtype(half, g16, None) is half
    assert cuda_ext.aux_dtype(half, g16, b16) is half
    assert cuda_ext.aux_dtype(half, g16, b32) is f32
    assert cuda_ext.aux_dtype(bf16, g16, None) is f32
    assert cuda_ext.aux_dtype(half, None, None) is f32
    assert cuda_ext.aux_dtype(half, torch.zeros(1, 1, 1), None) is f32
    assert cuda_ext.aux_dtype(half, g16, b16, torch.zeros(1, 1, 4)) is f32  # the erase gate goes with them
    assert cuda_ext.aux_dtype(half, g16, b16, torch.zeros(1, 1, 4, dtype=half)) is half
    assert abi.header_abi_version() == 3
