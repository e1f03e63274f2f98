"""The engines: naive token loop == chunked parallel form, outputs AND final state, for every
combination of decay kind and update rule, odd lengths, several chunk sizes; the normaliser's own
forms likewise; and the reference stays pure torch (no kernels, no export or compile checks)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import edgelin.reference
from edgelin.reference.recurrence import (
    chunked, invert_unit_lower, normalizer_chunked, normalizer_recurrent, normalizer_step, recurrent, recurrent_step,
)
from helpers import assert_close, assert_states_close

DECAYS = ["none", "fixed", "scalar", "per_key"]
CASES = [(b, t, h, d) for b, t, h, d in [(2, 1, 4, 32), (2, 63, 4, 32), (1, 257, 2, 16), (3, 100, 1, 8)]]


def make_inputs(b, t, h, d_k, d_v, decay, delta, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q, k = torch.randn(b, t, h, d_k, generator=gen), torch.randn(b, t, h, d_k, generator=gen)
    v = torch.randn(b, t, h, d_v, generator=gen)
    if delta:  # the delta rule is contractive only with normalised keys (what every model does)
        q, k = F.normalize(q, dim=-1), F.normalize(k, dim=-1)
    else:
        q, k = q * d_k**-0.5, k * d_k**-0.5
    g = {
        "none": None,
        "fixed": torch.full((b, t, h, 1), -0.05),
        "scalar": F.logsigmoid(torch.randn(b, t, h, 1, generator=gen) + 3),
        "per_key": F.logsigmoid(torch.randn(b, t, h, d_k, generator=gen) + 3),
    }[decay]
    beta = torch.rand(b, t, h, generator=gen) if delta else None
    s0 = torch.randn(b, h, d_k, d_v, generator=gen) * 0.1
    return s0, q, k, v, g, beta


def case_id(case):
    b, t, h, d = case
    return f"B{b}-T{t}-H{h}-D{d}"


@pytest.mark.parametrize("case", CASES, ids=case_id)
@pytest.mark.parametrize("decay", DECAYS)
@pytest.mark.parametrize("delta", [False, True], ids=["additive", "delta"])
@pytest.mark.parametrize("chunk", [16, 64])
def test_chunked_matches_recurrent(case, decay, delta, chunk):
    b, t, h, d = case
    s0, q, k, v, g, beta = make_inputs(b, t, h, d, d + 3, decay, delta)
    o_ref, s_ref = recurrent(s0, q, k, v, g, beta)
    o, s = chunked(s0, q, k, v, g, beta, chunk)
    assert o.shape == o_ref.shape and s.shape == s_ref.shape
    assert_close(o, o_ref, 2e-5, "outputs")
    assert_close(s, s_ref, 2e-5, "state")


def test_step_is_the_recurrence_by_hand():
    """One step of each rule, computed independently with explicit matrices."""
    s0, q, k, v, _, _ = make_inputs(1, 1, 1, 4, 3, "none", True)
    beta, a = torch.tensor([[0.7]]), torch.tensor(0.9)
    S, qv, kv, vv = s0[0, 0], q[0, 0, 0], k[0, 0, 0], v[0, 0, 0]
    # Gated DeltaNet: S' = a S (I - b k k^T)^T-form, written as in the literature with S [d_k, d_v]
    expected = (torch.eye(4) - 0.7 * torch.outer(kv, kv)) @ (a * S) + 0.7 * torch.outer(kv, vv)
    o, s = recurrent_step(s0[:, 0:1], q[:, 0, 0:1], k[:, 0, 0:1], v[:, 0, 0:1],
                          torch.log(a).view(1, 1, 1), beta)
    assert torch.allclose(s[0, 0], expected, atol=1e-6)
    assert torch.allclose(o[0, 0], expected.t() @ qv, atol=1e-6)
    # linear transformer: S' = S + k v^T
    o, s = recurrent_step(s0[:, 0:1], q[:, 0, 0:1], k[:, 0, 0:1], v[:, 0, 0:1])
    assert torch.allclose(s[0, 0], S + torch.outer(kv, vv), atol=1e-6)


@pytest.mark.parametrize("size", [1, 2, 15, 16, 32, 64])
def test_invert_unit_lower_matches_triangular_solve(size):
    a = torch.randn(3, size, size).tril(-1) * 0.3
    eye = torch.eye(size).expand(3, size, size)
    expected = torch.linalg.solve_triangular(eye + a, eye, upper=False, unitriangular=True)
    assert torch.allclose(invert_unit_lower(a), expected, atol=1e-5)


def test_long_sequence_state_stays_finite_and_matches():
    """A decaying delta rule over 2000 tokens: chunked and recurrent agree at the end."""
    s0, q, k, v, g, beta = make_inputs(1, 2000, 2, 16, 16, "scalar", True, seed=3)
    o_ref, s_ref = recurrent(s0, q, k, v, g, beta)
    o, s = chunked(s0, q, k, v, g, beta, 64)
    assert torch.isfinite(s).all()
    assert_close(s, s_ref, 1e-4, "state")
    assert_close(o, o_ref, 1e-4, "outputs")


@pytest.mark.parametrize("size", [32, 64])
def test_invert_unit_lower_stays_accurate_when_keys_align(size):
    """beta ~ 1 and nearly parallel unit keys (what trained delta-rule layers produce): the plain
    product form (I + N)(I + N^2)... loses digits here (N's powers grow like binomials); the blocked
    inverse must stay at fp32 rounding of the float64 solve."""
    gen = torch.Generator().manual_seed(0)
    base = F.normalize(torch.randn(1, 1, 16, generator=gen), dim=-1)
    k = F.normalize(base + 0.1 * torch.randn(4, size, 16, generator=gen), dim=-1)
    beta = 0.9 + 0.1 * torch.rand(4, size, 1, generator=gen)
    a = (beta * (k @ k.transpose(-1, -2))).tril(-1)
    eye = torch.eye(size, dtype=torch.float64).expand(4, size, size)
    exact = torch.linalg.solve_triangular(eye + a.double(), eye, upper=False, unitriangular=True)
    got = invert_unit_lower(a).double()
    assert_close(got, exact, 1e-5)


def test_trained_checkpoint_chunked_state_matches_token_loop():
    """The shipped model's trained Gated DeltaNet layers: chunked == token loop in fp32."""
    from pathlib import Path

    from edgelin.checkpoint import load_model

    model, _ = load_model(Path(__file__).resolve().parents[2] / "recipes" / "tiny-gdn-hybrid")
    ids = torch.randint(0, model.config.vocab_size, (2, 130), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        chunked_logits, chunked_state = model(ids)
        loop_logits, loop_state = model(ids, mode="recurrent")
    assert_close(chunked_logits, loop_logits, 1e-5)
    assert_states_close(chunked_state, loop_state, 1e-5)


# ---- the normaliser: its own state z, never a column of S ----------------------------------------
def _normalizer_by_hand(z0, q, k, g):
    """z_t = e^{g_t} z_{t-1} + k_t and q_t^T z_t, token by token in float64 with explicit loops."""
    z, dens = z0.double(), []
    for t in range(q.shape[1]):
        decay = torch.ones(()) if g is None else g[:, t].double().exp()
        z = decay * z + k[:, t].double()
        dens.append((q[:, t].double() * z).sum(-1))
    return torch.stack(dens, 1), z


@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("length", [1, 17, 101])
@pytest.mark.parametrize("decay", DECAYS)
def test_normalizer_naive_chunked_and_steps_agree(batch, length, decay):
    """naive (float64 by hand) == token loop == chunked == a rollout of single steps, outputs
    (q^T z at every token) and final z; odd lengths across several 16-token chunks."""
    s0, q, k, _, g, _ = make_inputs(batch, length, 3, 8, 1, decay, False, seed=length)
    q, k = F.elu(q) + 1, F.elu(k) + 1  # positive features, as the normalised families use
    z0 = s0[..., 0].abs()  # [B, H, d_k]
    den_ref, z_ref = _normalizer_by_hand(z0, q, k, g)
    den_loop, z_loop = normalizer_recurrent(z0, q, k, g)
    den_chunk, z_chunk = normalizer_chunked(z0, q, k, g, chunk_size=16)
    z, steps = z0, []
    for t in range(length):
        den, z = normalizer_step(z, q[:, t], k[:, t], None if g is None else g[:, t])
        steps.append(den)
    den_steps = torch.stack(steps, 1)
    assert den_ref.shape == (batch, length, 3) and z_ref.shape == (batch, 3, 8)
    for den, zz in ((den_loop, z_loop), (den_chunk, z_chunk), (den_steps, z)):
        assert den.shape == den_ref.shape and zz.shape == z_ref.shape
        assert_close(den, den_ref, 1e-6, "denominator")
        assert_close(zz, z_ref, 1e-6, "normalizer")


def test_reference_is_pure_torch():
    """edgelin.reference knows no target, kernel or tracer: no import of edgelin.kernels, triton or
    an export module, and no export/compile/tracing checks (those live in export/ and kernels/)."""
    banned_calls = ("is_in_onnx_export", "is_compiling", "is_tracing", "is_exporting", "kernel_path")
    folder = Path(edgelin.reference.__file__).parent
    files = sorted(folder.glob("*.py"))
    assert {f.name for f in files} >= {"recurrence.py", "engine.py"}
    for path in files:
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                modules = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):  # `from edgelin import kernels` names edgelin.kernels
                modules = [f"{node.module}.{a.name}" for a in node.names]
            else:
                modules = []
            for module in modules:
                assert not module.startswith(("edgelin.kernels", "triton", "edgelin.export", "torch.onnx")), \
                    f"{path.name} imports {module}"
            if isinstance(node, (ast.Attribute, ast.Name)):
                name = node.attr if isinstance(node, ast.Attribute) else node.id
                assert name not in banned_calls, f"{path.name} uses {name}"
