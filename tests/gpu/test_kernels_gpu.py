"""edgelin's kernels on a CUDA GPU against the naive engines in float64 (run: pytest -m gpu tests/gpu).

Every gate kind x update rule; fp32/fp16/bf16 inputs; T = 1, 63, 1000; head dims 16, 64, 100, 128,
256 (and an odd d_v, 65); in-place and ping-pong; varlen prefill; outputs
written into NaN-filled buffers. Then the CUDA C++ extension, the model on GPU (kernels) vs the
CPU torch engines, and CUDA-graph decode vs eager. Kernels are imported lazily, inside the tests:
importing them at collection could fix Triton's interpreter mode for the whole session.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from conftest import ALL_FAMILIES, family_layers, tiny_config
from edgelin.errors import EdgelinError
from edgelin.kernels.dispatch import use_backend
from edgelin.model.lm import CausalLM
from edgelin.reference.recurrence import recurrent

pytestmark = pytest.mark.gpu
DEV = "cuda"
DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
GATES = ["none", "scalar", "per_key"]
RULES, RULE_IDS = [False, True], ["additive", "delta"]
# ||out - ref|| / ||ref|| bounds: fp32 math (tf32x3 matmuls in the chunked kernel); 16-bit inputs
# add rounding of the output and, in the chunked kernel, of matmul operands (as fla does)
STEP_TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.2e-2}
CHUNK_TOL = {torch.float32: 1e-4, torch.float16: 5e-3, torch.bfloat16: 3e-2}
DIMS = [(16, 16), (100, 100), (128, 128), (256, 256), (64, 65)]


def kern():
    from edgelin import kernels

    return kernels


def make(b, t, h, d_k, d_v, gate, delta, dtype, seed=0):
    gen = torch.Generator(device=DEV).manual_seed(seed)
    q = torch.randn(b, t, h, d_k, device=DEV, generator=gen)
    k = torch.randn(b, t, h, d_k, device=DEV, generator=gen)
    v = torch.randn(b, t, h, d_v, device=DEV, generator=gen)
    q, k = (F.normalize(q, dim=-1), F.normalize(k, dim=-1)) if delta else (q * d_k**-0.5, k * d_k**-0.5)
    width = {"none": 0, "scalar": 1, "per_key": d_k}[gate]
    g = F.logsigmoid(torch.randn(b, t, h, width, device=DEV, generator=gen) + 3) if width else None
    beta = torch.rand(b, t, h, device=DEV, generator=gen) if delta else None
    s0 = torch.randn(b, h, d_k, d_v, device=DEV, generator=gen) * 0.1
    cast = lambda x: None if x is None else x.to(dtype)  # noqa: E731
    return s0, cast(q), cast(k), cast(v), cast(g), cast(beta)


def reference(s0, q, k, v, g, beta):
    """The naive token loop (pure torch, never a kernel) in float64 on the (already rounded) inputs."""
    return recurrent(*(None if x is None else x.double() for x in (s0, q, k, v, g, beta)))


def rel(x, ref) -> float:
    assert torch.isfinite(x).all(), "non-finite or unwritten (NaN-poisoned) elements"
    return ((x.double() - ref).norm() / ref.norm().clamp_min(1e-12)).item()


def nans(shape, dtype=torch.float32):
    return torch.full(shape, float("nan"), dtype=dtype, device=DEV)


def run_step(impl, q, k, v, s0, g, beta, mode):
    fn = kern().fused_step if impl == "triton" else kern().cuda_step
    out = nans(v.shape, v.dtype)
    if mode == "inplace":
        state = s0.clone()
        o, s = fn(q, k, v, state, g, beta, out=out, inplace=True)
        assert s.data_ptr() == state.data_ptr()
    else:
        o, s = fn(q, k, v, s0, g, beta, out=out, state_out=nans(s0.shape))
    assert o.data_ptr() == out.data_ptr()
    return o, s


# ---- step: Triton and CUDA ----------------------------------------------------------------------
@pytest.mark.parametrize("impl", ["triton", "cuda"])
@pytest.mark.parametrize("mode", ["inplace", "pingpong"])
@pytest.mark.parametrize("dtype", list(DTYPES.values()), ids=list(DTYPES))
@pytest.mark.parametrize("gate", GATES)
@pytest.mark.parametrize("delta", RULES, ids=RULE_IDS)
def test_step(impl, mode, dtype, gate, delta):
    s0, q, k, v, g, beta = make(4, 1, 8, 64, 64, gate, delta, dtype)
    o_ref, s_ref = reference(s0, q, k, v, g, beta)
    sq = lambda x: None if x is None else x[:, 0]  # noqa: E731
    o, s = run_step(impl, sq(q), sq(k), sq(v), s0, sq(g), sq(beta), mode)
    assert rel(o, o_ref[:, 0]) < STEP_TOL[dtype] and rel(s, s_ref) < STEP_TOL[dtype] / 4


@pytest.mark.parametrize("impl", ["triton", "cuda"])
@pytest.mark.parametrize("dims", DIMS, ids=[f"K{a}-V{b}" for a, b in DIMS])
@pytest.mark.parametrize("gate", GATES)
@pytest.mark.parametrize("delta", RULES, ids=RULE_IDS)
def test_step_head_dims(impl, dims, gate, delta):
    dtype = torch.bfloat16 if dims[0] >= 128 else torch.float32
    s0, q, k, v, g, beta = make(3, 1, 5, *dims, gate, delta, dtype, seed=1)
    o_ref, s_ref = reference(s0, q, k, v, g, beta)
    sq = lambda x: None if x is None else x[:, 0]  # noqa: E731
    o, s = run_step(impl, sq(q), sq(k), sq(v), s0, sq(g), sq(beta), "pingpong")
    assert rel(o, o_ref[:, 0]) < STEP_TOL[dtype] and rel(s, s_ref) < STEP_TOL[dtype] / 4


@pytest.mark.parametrize("mode", ["inplace", "pingpong"])
@pytest.mark.parametrize("gate", GATES)
@pytest.mark.parametrize("delta", RULES, ids=RULE_IDS)
def test_step_large_grid(mode, gate, delta):
    """B*H = 1024: the step's large-grid tile (BV=64 at d_k=128), as in the bandwidth benchmark."""
    s0, q, k, v, g, beta = make(64, 1, 16, 128, 128, gate, delta, torch.bfloat16, seed=3)
    o_ref, s_ref = reference(s0, q, k, v, g, beta)
    sq = lambda x: None if x is None else x[:, 0]  # noqa: E731
    o, s = run_step("triton", sq(q), sq(k), sq(v), s0, sq(g), sq(beta), mode)
    assert rel(o, o_ref[:, 0]) < STEP_TOL[torch.bfloat16] and rel(s, s_ref) < STEP_TOL[torch.bfloat16] / 4


# (B, H, d_k, d_v) -> the CUDA launcher's CTA shape (edgelin/kernels/cuda/step.cu): B*H*ceil(d_v/32) < 1024
# takes the [128, 16] tile, from 1024 on the [128, 64] tile; d_k > 128 or d_v % 4 != 0 the [256, 32] one
CUDA_TILES = {"small-1020": (15, 17, 128, 128), "large-1024": (16, 16, 128, 128), "large-partial": (64, 16, 100, 100),
              "wide": (16, 16, 256, 256), "wide-unvectorised": (64, 16, 64, 65)}


@pytest.mark.parametrize("mode", ["inplace", "pingpong"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("gate", GATES)
@pytest.mark.parametrize("delta", RULES, ids=RULE_IDS)
@pytest.mark.parametrize("shape", list(CUDA_TILES.values()), ids=list(CUDA_TILES))
def test_cuda_step_tiles(shape, delta, gate, dtype, mode):
    """Every CTA shape the CUDA launcher picks, on both sides of its grid-size threshold."""
    b, h, d_k, d_v = shape
    s0, q, k, v, g, beta = make(b, 1, h, d_k, d_v, gate, delta, dtype, seed=5)
    o_ref, s_ref = reference(s0, q, k, v, g, beta)
    sq = lambda x: None if x is None else x[:, 0]  # noqa: E731
    o, s = run_step("cuda", sq(q), sq(k), sq(v), s0, sq(g), sq(beta), mode)
    assert rel(o, o_ref[:, 0]) < STEP_TOL[dtype] and rel(s, s_ref) < STEP_TOL[dtype] / 4


# ---- token loop and chunked prefill -------------------------------------------------------------
@pytest.mark.parametrize("length", [1, 63, 1000])
@pytest.mark.parametrize("dtype", list(DTYPES.values()), ids=list(DTYPES))
@pytest.mark.parametrize("gate", GATES)
@pytest.mark.parametrize("delta", RULES, ids=RULE_IDS)
def test_recurrent_and_chunked(length, dtype, gate, delta):
    s0, q, k, v, g, beta = make(2, length, 4, 64, 64, gate, delta, dtype, seed=length)
    o_ref, s_ref = reference(s0, q, k, v, g, beta)
    o, s = kern().fused_recurrent(q, k, v, s0, g, beta, out=nans(v.shape, dtype), state_out=nans(s0.shape))
    assert rel(o, o_ref) < STEP_TOL[dtype] and rel(s, s_ref) < STEP_TOL[dtype], "fused_recurrent"
    o, s = kern().chunk_prefill(q, k, v, g, beta, s0, out=nans(v.shape, dtype), final_state=nans(s0.shape))
    err_o, err_s = rel(o, o_ref), rel(s, s_ref)
    assert err_o < CHUNK_TOL[dtype] and err_s < CHUNK_TOL[dtype], f"chunk_prefill: {err_o:.2e} {err_s:.2e}"


@pytest.mark.parametrize("dims", DIMS, ids=[f"K{a}-V{b}" for a, b in DIMS])
@pytest.mark.parametrize("gate", GATES)
@pytest.mark.parametrize("delta", RULES, ids=RULE_IDS)
def test_chunked_head_dims(dims, gate, delta):
    dtype = torch.bfloat16 if dims[0] >= 128 else torch.float32
    s0, q, k, v, g, beta = make(1, 200, 3, *dims, gate, delta, dtype, seed=7)
    o_ref, s_ref = reference(s0, q, k, v, g, beta)
    o, s = kern().chunk_prefill(q, k, v, g, beta, s0, out=nans(v.shape, dtype), final_state=nans(s0.shape))
    err_o, err_s = rel(o, o_ref), rel(s, s_ref)
    assert err_o < CHUNK_TOL[dtype] and err_s < CHUNK_TOL[dtype], f"{err_o:.2e} {err_s:.2e}"


@pytest.mark.parametrize("t_in_state", [True, False], ids=["U-in-state-kernel", "W-U-through-memory"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("gate", GATES)
def test_chunked_delta_rule_both_wy_paths(gate, dtype, t_in_state, monkeypatch):
    """The delta rule with U formed by the state kernel from T (`t_in_state`: the default with per-key decays
    and from 64 sequence-heads on) and with W and U through memory, at 4 x 16 heads (the threshold), a
    partial last chunk and NaN-poisoned outputs."""
    from edgelin.kernels import chunk

    s0, q, k, v, g, beta = make(4, 130, 16, 64, 64, gate, True, dtype, seed=17)
    assert chunk.chunk_config(64, 64, 64, dtype, q.device, True, False, GATES.index(gate))["t_in_state"]
    default = chunk.chunk_config
    monkeypatch.setattr(chunk, "chunk_config", lambda *a, **kw: {**default(*a, **kw), "t_in_state": t_in_state})
    o_ref, s_ref = reference(s0, q, k, v, g, beta)
    o, s = kern().chunk_prefill(q, k, v, g, beta, s0, out=nans(v.shape, dtype), final_state=nans(s0.shape))
    err_o, err_s = rel(o, o_ref), rel(s, s_ref)
    assert err_o < CHUNK_TOL[dtype] and err_s < CHUNK_TOL[dtype], f"{err_o:.2e} {err_s:.2e}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("gate", GATES)
@pytest.mark.parametrize("delta", RULES, ids=RULE_IDS)
def test_varlen(dtype, gate, delta):
    lengths = [1, 63, 1000, 0, 64, 130]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=DEV)
    _, q, k, v, g, beta = make(1, sum(lengths), 4, 64, 64, gate, delta, dtype, seed=11)
    states = torch.randn(len(lengths), 4, 64, 64, device=DEV) * 0.1
    o_c, s_c = kern().chunk_prefill(q, k, v, g, beta, states, cu_seqlens=cu, out=nans(v.shape, dtype),
                                    final_state=nans(states.shape))
    o_r, s_r = kern().fused_recurrent(q, k, v, states, g, beta, cu_seqlens=cu, out=nans(v.shape, dtype))
    for n, (a, z) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        if z == a:
            assert torch.equal(s_c[n], states[n]) and torch.equal(s_r[n], states[n])
            continue
        piece = lambda x: None if x is None else x[:, a:z]  # noqa: E731
        o_ref, s_ref = reference(states[n:n + 1], *(piece(x) for x in (q, k, v, g, beta)))
        assert rel(o_c[:, a:z], o_ref) < CHUNK_TOL[dtype] and rel(s_c[n:n + 1], s_ref) < CHUNK_TOL[dtype]
        assert rel(o_r[:, a:z], o_ref) < STEP_TOL[dtype] and rel(s_r[n:n + 1], s_ref) < STEP_TOL[dtype]


@pytest.mark.parametrize("length", [1, 63, 1000])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("gate", ["none", "scalar"])
def test_chunked_erase_gate(length, dtype, gate):
    """Gated DeltaNet-2's erase gate in the chunked kernels, fixed-length (B=2) and varlen (the two rows packed)."""
    s0, q, k, v, g, beta = make(2, length, 4, 128, 128, gate, True, dtype, seed=13)
    erase = torch.sigmoid(torch.randn(q.shape, device=DEV) - 1)
    o_ref, s_ref = recurrent(*(None if x is None else x.double() for x in (s0, q, k, v, g, beta, erase)))
    o, s = kern().chunk_prefill(q, k, v, g, beta, s0, erase=erase, out=nans(v.shape, dtype),
                                final_state=nans(s0.shape))
    assert rel(o, o_ref) < CHUNK_TOL[dtype] and rel(s, s_ref) < CHUNK_TOL[dtype], f"{rel(o, o_ref):.2e}"
    flat = lambda x: None if x is None else x.reshape(1, 2 * length, *x.shape[2:])  # noqa: E731
    cu = torch.tensor([0, length, 2 * length], dtype=torch.int32, device=DEV)
    o_v, s_v = kern().chunk_prefill(*(flat(x) for x in (q, k, v, g, beta)), s0, erase=flat(erase), cu_seqlens=cu)
    assert rel(o_v.reshape(o.shape), o_ref) < CHUNK_TOL[dtype] and rel(s_v, s_ref) < CHUNK_TOL[dtype]


# ---- the model: GPU kernels vs the CPU torch engines; CUDA-graph decode -------------------------
FAMILIES = [*ALL_FAMILIES, "hybrid"]


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("backend", ["auto", "cuda"])
def test_model_on_gpu_matches_cpu_torch(family, backend):
    torch.manual_seed(0)
    config = tiny_config(family_layers(family), head_k_dim=32, head_v_dim=32, chunk_size=32)
    model = CausalLM(config).eval()
    ids = torch.randint(0, config.vocab_size, (2, 77))
    start = torch.full((2,), 77)
    with torch.no_grad():
        with use_backend("torch"):
            ref, ref_state = model(ids, mode="chunked")
            ref_step, ref_next = model(ids[:, :1], ref_state, start, mode="recurrent")
        gpu = model.to(DEV)
        with use_backend(backend):
            out, state = gpu(ids.to(DEV), mode="chunked")
            step, nxt = gpu(ids[:, :1].to(DEV), state, start.to(DEV), mode="recurrent")
    assert rel(out.cpu(), ref.double()) < 1e-4 and rel(step.cpu(), ref_step.double()) < 1e-4
    for layer, ref_layer in zip(nxt, ref_next):
        for name, tensor in layer.items():
            assert rel(tensor.cpu(), ref_layer[name].double()) < 1e-4, name


@pytest.mark.parametrize("family", ["gated_deltanet", "gla", "kda"])
def test_fp16_model_runs_through_kernels(family):
    """fp16 weights and activations, fp32 state: the decode path the benchmark measures."""
    torch.manual_seed(0)
    model = CausalLM(tiny_config(family_layers(family), head_k_dim=32, head_v_dim=32)).eval()
    ids = torch.randint(0, 97, (1, 40))
    with torch.no_grad():
        with use_backend("torch"):
            ref, _ = model(ids, mode="chunked")
        half = model.to(DEV).half()
        out, state = half(ids.to(DEV), kern().decode_state(half, 1, DEV), mode="chunked")
        step, _ = half(ids[:, :1].to(DEV), state, torch.full((1,), 40, device=DEV), mode="recurrent")
    assert all(layer["recurrent_state"].dtype == torch.float32 for layer in state)
    assert rel(out.float().cpu(), ref.double()) < 2e-2 and torch.isfinite(step).all()


@pytest.mark.parametrize("family", ["gated_deltanet", "gla", "hybrid"])
def test_graph_decode_matches_eager(family):
    torch.manual_seed(0)
    model = CausalLM(tiny_config(family_layers(family), head_k_dim=32, head_v_dim=32)).eval().to(DEV)
    prompt = torch.randint(0, 97, (2, 19), device=DEV)
    tokens = torch.randint(0, 97, (2, 12), device=DEV)
    with torch.no_grad():
        _, state = model(prompt, mode="chunked")
        decoder = kern().GraphDecoder(model, batch=2)
        decoder.reset(state, 19)
        eager_state, graph_logits, eager_logits = state, [], []
        for i in range(tokens.shape[1]):
            graph_logits.append(decoder.step(tokens[:, i]).clone())
            logits, eager_state = model(tokens[:, i:i + 1], eager_state, torch.full((2,), 19 + i, device=DEV),
                                        mode="recurrent", last_only=True)
            eager_logits.append(logits)
    assert rel(torch.stack(graph_logits), torch.stack(eager_logits).double()) < 1e-6
    for layer, ref_layer in zip(decoder.current_state(), eager_state):
        for name, tensor in layer.items():
            assert rel(tensor, ref_layer[name].double()) < 1e-6, name
    assert decoder.start.tolist() == [19 + tokens.shape[1]] * 2


# ---- the erase gate (Gated DeltaNet-2): Triton step / token loop and the CUDA step's ERASE ---------
@pytest.mark.parametrize("impl", ["triton", "cuda"])
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("gate", GATES)
@pytest.mark.parametrize("dims", [(128, 128), (256, 256), (64, 65)], ids=lambda d: f"K{d[0]}-V{d[1]}")
@pytest.mark.parametrize("mode", ["inplace", "pingpong"])
def test_erase_step_matches_reference(impl, dtype, gate, dims, mode):
    s0, q, k, v, g, beta = make(3, 1, 4, *dims, gate, True, DTYPES[dtype], seed=21)
    erase = torch.rand(k.shape, device=DEV, generator=torch.Generator(device=DEV).manual_seed(5))
    o_ref, s_ref = recurrent(*(None if x is None else x.double() for x in (s0, q, k, v, g, beta, erase)))
    o_plain, _ = reference(s0, q, k, v, g, beta)
    assert rel(o_plain, o_ref) > 1e-3  # the gate matters: a kernel ignoring it fails
    fn = kern().fused_step if impl == "triton" else kern().cuda_step
    step = [None if x is None else x[:, 0] for x in (q, k, v, g, beta)]
    out = nans(step[2].shape, step[2].dtype)
    if mode == "inplace":
        state = s0.clone()
        o, s = fn(*step[:3], state, *step[3:], erase[:, 0], out=out, inplace=True)
        assert s.data_ptr() == state.data_ptr()
    else:
        o, s = fn(*step[:3], s0, *step[3:], erase[:, 0], out=out, state_out=nans(s0.shape))
    tol = STEP_TOL[DTYPES[dtype]]
    assert rel(o, o_ref[:, 0]) < tol and rel(s, s_ref) < max(tol, 1e-5)


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_erase_token_loop_matches_reference(dtype):
    s0, q, k, v, g, beta = make(2, 200, 4, 128, 128, "scalar", True, DTYPES[dtype], seed=22)
    erase = torch.rand(k.shape, device=DEV, generator=torch.Generator(device=DEV).manual_seed(6))
    o_ref, s_ref = recurrent(*(None if x is None else x.double() for x in (s0, q, k, v, g, beta, erase)))
    o, s = kern().fused_recurrent(q, k, v, s0, g, beta, erase, out=nans(v.shape, v.dtype),
                                  state_out=nans(s0.shape))
    tol = STEP_TOL[DTYPES[dtype]]
    assert rel(o, o_ref) < tol and rel(s, s_ref) < max(tol, 1e-5)


def test_cuda_step_refuses_erase_without_beta():
    s0, q, k, v, g, beta = make(1, 1, 2, 16, 16, "scalar", True, torch.float32)
    with pytest.raises(EdgelinError, match="erase gate without beta"):
        kern().cuda_step(q[:, 0], k[:, 0], v[:, 0], s0, g[:, 0], None, torch.rand_like(k[:, 0]))
