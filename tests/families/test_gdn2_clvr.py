"""Gated DeltaNet-2 (erase and write gates on the delta rule) and CLVR (cross-layer value routing):
the erase-gated recurrence against an explicit float64 computation, its chunked form against the
token loop (odd lengths, batch 1 and 3, outputs and state), the model's chunked forward, token loop
and step rollout, the init claims (a fresh GDN-2 layer is a Gated DeltaNet with beta * sigmoid(3); a
fresh CLVR model is the model without it), the ONNX export validated, and every place that cannot
run the erase gate refusing it in one line rather than computing plain Gated DeltaNet."""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F
from typer.testing import CliRunner

from conftest import tiny_config
from helpers import jitter
from edgelin.checkpoint import save_checkpoint
from edgelin.cli import app
from edgelin.errors import EdgelinError
from edgelin.families import FAMILIES, SOFTMAX, FamilySpec
from edgelin.model.config import ModelConfig
from edgelin.model.lm import CausalLM
from edgelin.model.mixer import use_engine
from edgelin.reference.engine import TorchEngine
from edgelin.reference.recurrence import chunked, recurrent, recurrent_step
from helpers import assert_close, assert_states_close

cli = CliRunner()
GDN2 = "gated_deltanet2"


def gated_inputs(b, t, h, d_k, d_v, decay, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = F.normalize(torch.randn(b, t, h, d_k, generator=gen), dim=-1)
    k = F.normalize(torch.randn(b, t, h, d_k, generator=gen), dim=-1)
    v = torch.randn(b, t, h, d_v, generator=gen)
    g = {"none": None, "scalar": F.logsigmoid(torch.randn(b, t, h, 1, generator=gen) + 3),
         "per_key": F.logsigmoid(torch.randn(b, t, h, d_k, generator=gen) + 3)}[decay]
    beta, erase = torch.rand(b, t, h, generator=gen), torch.rand(b, t, h, d_k, generator=gen)
    return torch.randn(b, h, d_k, d_v, generator=gen) * 0.1, q, k, v, g, beta, erase


# ---- the recurrence ----------------------------------------------------------------------------
def test_erase_gated_step_is_the_formula_by_hand():
    """S' = a (I - beta (e * k) k^T) S + beta k v^T and o = S'^T q, with explicit float64 matrices."""
    s0, q, k, v, _, _, _ = gated_inputs(1, 1, 1, 4, 3, "none", seed=2)
    a, beta = 0.9, 0.7
    e = torch.tensor([1.0, 0.0, 0.5, 0.25])  # channel 0 erased fully, channel 1 never
    S, qv, kv, vv = (x.double() for x in (s0[0, 0], q[0, 0, 0], k[0, 0, 0], v[0, 0, 0]))
    ek = e.double() * kv
    expected = a * (torch.eye(4, dtype=torch.float64) - beta * torch.outer(ek, kv)) @ S + beta * torch.outer(kv, vv)
    o, s = recurrent_step(s0, q[:, 0], k[:, 0], v[:, 0], torch.full((1, 1, 1), math.log(a)),
                          torch.tensor([[beta]]), e.view(1, 1, 4))
    assert_close(s[0, 0], expected, 1e-6, "state")
    assert_close(o[0, 0], expected.t() @ qv, 1e-6, "output")
    # Row 1 of S (a key channel the gate never erases) only decays and receives the write.
    assert_close(s[0, 0, 1], a * S[1] + beta * kv[1] * vv, 1e-6, "unerased row")


def test_erase_gate_of_ones_is_the_delta_rule_and_other_gates_are_not():
    s0, q, k, v, g, beta, erase = gated_inputs(2, 9, 2, 8, 5, "scalar")
    o_delta, s_delta = recurrent(s0, q, k, v, g, beta)
    o_ones, s_ones = recurrent(s0, q, k, v, g, beta, torch.ones_like(erase))
    assert_close(o_ones, o_delta, 1e-6)
    assert_close(s_ones, s_delta, 1e-6)
    _, s_gated = recurrent(s0, q, k, v, g, beta, erase)
    assert (s_gated - s_delta).abs().max() > 1e-2


@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("length", [1, 37, 101])
@pytest.mark.parametrize("decay", ["none", "scalar", "per_key"])
def test_erase_chunked_matches_token_loop(batch, length, decay):
    """Outputs AND final state; odd lengths over several 16-token chunks, GVA-free heads of d_k != d_v."""
    s0, q, k, v, g, beta, erase = gated_inputs(batch, length, 2, 8, 5, decay, seed=length)
    o_ref, s_ref = recurrent(s0, q, k, v, g, beta, erase)
    o, s = chunked(s0, q, k, v, g, beta, 16, erase=erase)
    assert_close(o, o_ref, 2e-5, "outputs")
    assert_close(s, s_ref, 2e-5, "state")


# ---- the model -----------------------------------------------------------------------------------
MODELS = {  # (layer types, config changes)
    "gdn2": ((GDN2, GDN2), {}),
    "gdn-clvr": (("gated_deltanet", "gated_deltanet"), {"clvr": True}),
    "hybrid-gdn2-clvr": ((GDN2, SOFTMAX), {"clvr": True, "num_k_heads": 1}),
}


def build(kind: str) -> CausalLM:
    torch.manual_seed(0)
    layers, changes = MODELS[kind]
    return jitter(CausalLM(tiny_config(layers, **changes)).eval())


@pytest.mark.parametrize("kind", list(MODELS))
@pytest.mark.parametrize("batch", [1, 3])
def test_model_chunked_token_loop_and_step_rollout_agree(kind, batch):
    model, (total, prompt) = build(kind), (45, 19)
    ids = torch.randint(0, 97, (batch, total), generator=torch.Generator().manual_seed(batch))
    with torch.no_grad():
        full, full_state = model(ids)
        loop, loop_state = model(ids, mode="recurrent")
        assert_close(full, loop, 1e-5, "chunked vs token loop")
        assert_states_close(full_state, loop_state, 1e-5)
        logits, state = model(ids[:, :prompt], last_only=True)
        assert_close(logits, full[:, prompt - 1], 1e-5, "prefill")
        for t in range(prompt, total):
            logits, state = model(ids[:, t:t + 1], state, torch.full((batch,), t), mode="recurrent", last_only=True)
            assert_close(logits, full[:, t], 1e-5, f"step {t}")
    assert_states_close(state, full_state, 1e-5)


def test_gdn2_has_gated_deltanets_state():
    gdn2 = CausalLM(tiny_config((GDN2,))).state_tensors()
    gdn = CausalLM(tiny_config(("gated_deltanet",))).state_tensors()
    assert gdn2 == gdn
    assert [(t.name, t.dims) for t in gdn2[0]] == [("recurrent_state", ("batch", 2, 8, 8)),
                                                   ("conv_state", ("batch", 2 * 16 + 16, 3))]


def test_fresh_gdn2_is_gated_deltanet_with_beta_scaled_by_sigmoid_3():
    """Zero gate weights and bias 3: every gate is sigmoid(3), and the layer is exactly a Gated
    DeltaNet whose beta is scaled by it (erase and write both carry the factor)."""
    torch.manual_seed(0)
    gdn2 = CausalLM(tiny_config((GDN2, GDN2))).eval()
    scale = 1 / (1 + math.exp(-3.0))
    gdn = CausalLM(tiny_config(("gated_deltanet",) * 2,
                               family_overrides={"gated_deltanet": {"beta_scale": scale}})).eval()
    weights = gdn2.state_dict()
    gates = {n for n in weights if "erase_" in n or "write_" in n}
    assert gates and all(weights[n].abs().max() == 0 for n in gates if n.endswith(".weight"))
    missing, unexpected = gdn.load_state_dict({n: w for n, w in weights.items() if n not in gates}, strict=False)
    assert not missing and not unexpected
    ids = torch.randint(0, 97, (2, 40))
    with torch.no_grad():
        assert_close(gdn2(ids)[0], gdn(ids)[0], 1e-6)
        jitter(gdn2)
        assert (gdn2(ids)[0] - gdn(ids)[0]).abs().max() > 1e-3  # the gates do act once trained


def test_fresh_clvr_model_is_the_model_without_it_and_adds_no_state():
    torch.manual_seed(0)
    routed = CausalLM(tiny_config(("gated_deltanet", SOFTMAX, "gla"), clvr=True)).eval()
    plain = CausalLM(tiny_config(("gated_deltanet", SOFTMAX, "gla"))).eval()
    weights = routed.state_dict()
    routes = sorted(n for n in weights if "clvr_proj" in n)
    assert routes == ["model.layers.0.mixer.clvr_proj.weight", "model.layers.2.mixer.clvr_proj.weight"]
    assert all(weights[n].shape == (32, 16) and weights[n].abs().max() == 0 for n in routes)
    plain.load_state_dict({n: w for n, w in weights.items() if n not in routes})
    assert routed.state_tensors() == plain.state_tensors()
    ids = torch.randint(0, 97, (2, 30))
    with torch.no_grad():
        assert_close(routed(ids)[0], plain(ids)[0], 1e-6)
        jitter(routed)
        assert (routed(ids)[0] - plain(ids)[0]).abs().max() > 1e-3


def test_clvr_routes_the_written_value_into_the_residual():
    """One layer, by hand: the mixer's output minus the same mixer without the route is W_r u, u the
    value written into the state (v after the conv and the write gate)."""
    model = build("gdn2")
    routed_model = CausalLM(tiny_config((GDN2, GDN2), clvr=True)).eval()
    missing, _ = routed_model.load_state_dict(model.state_dict(), strict=False)
    assert sorted(missing) == [f"model.layers.{i}.mixer.clvr_proj.weight" for i in (0, 1)]
    mixer, plain = routed_model.model.layers[0].mixer, model.model.layers[0].mixer
    with torch.no_grad():
        mixer.clvr_proj.weight.normal_()
    x = torch.randn(1, 6, 32)
    state = {n: t[:1] for n, t in model.initial_state(1)[0].items()}
    with torch.no_grad():
        out, _ = mixer(x, state)
        base, _ = plain(x, state)
        qkv = F.silu(F.conv1d(torch.cat([state["conv_state"], torch.cat(
            [mixer.q_proj(x), mixer.k_proj(x), mixer.v_proj(x)], -1).transpose(1, 2)], -1),
            mixer.conv1d.unsqueeze(1), groups=mixer.conv1d.shape[0])).transpose(1, 2)
        written = qkv[..., 32:] * torch.sigmoid(mixer.write_proj(x) + mixer.write_bias)
        assert_close(out - base, written @ mixer.clvr_proj.weight.t(), 1e-5)


# ---- config, spec, catalog -----------------------------------------------------------------------
def test_config_clvr_round_trips_and_bad_values_are_refused():
    config = tiny_config((GDN2, SOFTMAX), clvr=True)
    again = ModelConfig.from_dict(config.to_dict())
    assert again.clvr is True and again.layer_types == (GDN2, SOFTMAX)
    with pytest.raises(EdgelinError, match="clvr"):
        tiny_config(("gated_deltanet",), clvr="yes")
    with pytest.raises(EdgelinError, match="clvr.*without linear-attention layers"):
        tiny_config((SOFTMAX,), clvr=True)


def test_erase_and_write_gates_need_the_delta_rule_and_are_not_knobs():
    with pytest.raises(ValueError, match="erase and write gates need the delta rule"):
        FamilySpec(name="x", summary="", erase_gate=True)
    with pytest.raises(EdgelinError, match="erase_gate"):
        FAMILIES["gated_deltanet"].with_overrides({"erase_gate": True})


def test_families_lists_gdn2_and_clvr_with_states_and_targets():
    rows = {r["family"]: r for r in json.loads(cli.invoke(app, ["families", "--json"]).stdout)}
    gdn2 = rows[GDN2]
    assert gdn2["state"] == ["recurrent_state [batch, H, d_k, d_v]", "conv_state [batch, 2*Hk*d_k + H*d_v, W-1]"]
    assert gdn2["targets"] == "coreai: yes, coreml: yes, onnx: yes, tensorrt: yes, torch: yes"  # the registry lists by name
    assert "erase" in gdn2["rule"] and gdn2["tensorrt_step"].startswith("kernel (gate=1 delta=1 erase=1)")
    assert "no new state" in rows["+clvr"]["state"][0]


# ---- export and the places that refuse the erase gate --------------------------------------------
@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    root = tmp_path_factory.mktemp("gdn2")
    ckpt = save_checkpoint(build("hybrid-gdn2-clvr"), root / "ckpt")
    result = cli.invoke(app, ["export", str(ckpt), "--out", str(root / "onnx"), "--no-tokenizer"])
    assert result.exit_code == 0, result.output
    return ckpt, root / "onnx"


@pytest.mark.slow
def test_onnx_export_validates(exported):
    """`edgelin validate DIR` (the vectors recorded at export, batch 1 and 3) and `--against CKPT` at
    batch 3 (sizes the graphs were not traced at): a GDN-2 + softmax hybrid with CLVR and grouped
    value heads, gates and route moved off their init."""
    ckpt, folder = exported
    result = cli.invoke(app, ["validate", str(folder), "--json"])
    assert result.exit_code == 0, result.output
    replayed = json.loads(result.stdout)
    assert {m["batch"] for m in replayed["metrics"]} == {1, 3}
    result = cli.invoke(app, ["validate", str(folder), "--against", str(ckpt), "--steps", "24",
                              "--prompt-len", "21", "--batch", "3", "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert {m["check"] for m in report["metrics"]} == {"prefill", "rollout", "final", "prefill-vs-steps"}
    for metrics in (replayed["metrics"], report["metrics"]):
        assert max(m["max_rel"] for m in metrics) < 1e-5


def test_a_target_without_the_erase_gate_refuses_it_by_name():
    """Every registered target takes the erase gate now (TensorRT through the plugin's erase input:
    tests/export/tensorrt/test_tensorrt_target.py exports and validates it); a lowering without it is refused by name."""
    from edgelin.export.targets import get_target
    from edgelin.families.spec import erase_gate_refusal

    assert get_target("tensorrt").family_support(FAMILIES[GDN2]) is None
    assert erase_gate_refusal(FAMILIES[GDN2], "tflite", False) == "the tflite lowering has no erase gate yet; it is planned"
    assert erase_gate_refusal(FAMILIES["gated_deltanet"], "tflite", False) is None


def test_every_lowering_agrees_with_the_erase_gate_targets():
    """Each target's erase_gate (what `families` and export refusals say) matches what its lowering's engine
    can actually run."""
    from edgelin.export.lowering import all_lowerings
    from edgelin.export.targets import get_target
    from edgelin.reference.engine import takes_erase

    lowerings = all_lowerings()
    assert {"onnx", "tensorrt", "coreml"} <= set(lowerings)  # every target that traces graphs declares one
    for target, entry in lowerings.items():
        runs = takes_erase(entry.engine, "step") and takes_erase(entry.engine, "chunked")
        assert runs == get_target(target).erase_gate, target


def test_an_engine_without_the_erase_gate_is_refused_not_run_as_gated_deltanet():
    class NoEraseStep(TorchEngine):
        def step(self, state, q, k, v, g=None, beta=None):
            return super().step(state, q, k, v, g, beta)

    model = build("gdn2")
    with torch.no_grad(), use_engine(NoEraseStep(name="old-plugin")):
        model(torch.zeros(1, 5, dtype=torch.long))  # chunked: takes the gate
        with pytest.raises(EdgelinError, match="old-plugin engine cannot run a gated_deltanet2 layer.*no erase-gate input"):
            model(torch.zeros(1, 1, dtype=torch.long), mode="recurrent")


def test_kernel_dispatch_takes_gdn2_steps_and_prefill(monkeypatch):
    """The kernel engines take the erase gate in their chunked prefill too (the Triton chunk kernel,
    here under the interpreter): it matches the reference and differs from plain Gated DeltaNet."""
    from edgelin.kernels import dispatch

    s0, q, k, v, g, beta, erase = gated_inputs(1, 37, 2, 8, 8, "scalar")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    engine = dispatch.KERNEL_ENGINES["triton"]
    want_o, want_s = chunked(s0, q, k, v, g, beta, 4, erase=erase)
    plain_o, _ = chunked(s0, q, k, v, g, beta, 4)
    with dispatch.use_backend("triton"):
        assert dispatch.engine_for(s0, q, k, v, g, beta, erase) is engine
        o, s = engine.chunked(s0, q, k, v, g, beta, 4, erase=erase)
    assert_close(o, want_o, 1e-5, "o")
    assert_close(s, want_s, 1e-5, "state")
    assert (want_o - plain_o).abs().max() > 1e-3  # the gate matters at these inputs
