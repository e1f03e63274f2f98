"""The model for every family and a hybrid: chunked forward == token loop, prefill + steps ==
whole sequence (logits and state), state tensors as the spec declares, bad configs refused."""

from __future__ import annotations

import pytest
import torch

from conftest import ALL_FAMILIES, family_layers, tiny_config
from edgelin.errors import EdgelinError
from edgelin.families import FAMILIES, get_family
from edgelin.model.config import AttentionConfig, ModelConfig
from edgelin.model.lm import CausalLM
from helpers import assert_close, assert_states_close

FAMILIES_AND_HYBRID = ALL_FAMILIES + ["hybrid"]


def build(family: str, **changes) -> CausalLM:
    return CausalLM(tiny_config(family_layers(family), **changes)).eval()




@pytest.mark.parametrize("family", FAMILIES_AND_HYBRID)
@pytest.mark.parametrize("length", [1, 63, 100])
def test_chunked_forward_matches_token_loop(family, length):
    model = build(family)
    ids = torch.randint(0, 97, (2, length))
    with torch.no_grad():
        logits_c, state_c = model(ids, mode="chunked")
        logits_r, state_r = model(ids, mode="recurrent")
    assert_close(logits_c, logits_r, 1e-5)
    assert_states_close(state_c, state_r, 1e-5)


@pytest.mark.parametrize("family", FAMILIES_AND_HYBRID)
def test_prefill_then_steps_equals_whole_sequence(family):
    model, (batch, total, prompt) = build(family), (2, 45, 19)
    ids = torch.randint(0, 97, (batch, total))
    with torch.no_grad():
        full, full_state = model(ids)
        logits, state = model(ids[:, :prompt], last_only=True)
        assert_close(logits, full[:, prompt - 1], 1e-5)
        for t in range(prompt, total):
            logits, state = model(ids[:, t:t + 1], state, torch.full((batch,), t), mode="recurrent", last_only=True)
            assert_close(logits, full[:, t], 1e-5, f"step {t}")
    assert_states_close(state, full_state, 1e-5)


@pytest.mark.parametrize("family", FAMILIES_AND_HYBRID)
def test_prefill_in_pieces_equals_one_prefill(family):
    """Prefill takes a state: a prompt prefilled in three pieces gives the same state and logits."""
    model = build(family)
    ids = torch.randint(0, 97, (2, 50))
    with torch.no_grad():
        whole, whole_state = model(ids, last_only=True)
        state, start = None, 0
        for end in (7, 31, 50):
            start_t = torch.full((2,), start)
            logits, state = model(ids[:, start:end], state, start_t, last_only=True)
            start = end
    assert_close(logits, whole, 1e-5)
    assert_states_close(state, whole_state, 1e-5)


@pytest.mark.parametrize("family", FAMILIES_AND_HYBRID)
def test_state_tensors_match_the_spec(family):
    model = build(family)
    declared = model.state_tensors()
    _, state = model(torch.randint(0, 97, (3, 5)))
    for layer, (tensors, actual) in enumerate(zip(declared, state)):
        assert [t.name for t in tensors] == list(actual), f"layer {layer}"
        for t in tensors:
            assert list(actual[t.name].shape) == [3 if d == "batch" else d for d in t.dims]


def test_rows_of_a_batch_are_independent():
    model = build("hybrid")
    ids = torch.randint(0, 97, (3, 30))
    with torch.no_grad():
        together, _ = model(ids)
        alone, _ = model(ids[1:2])
    assert_close(together[1], alone[0], 1e-5)


def test_sliding_window_forgets_beyond_the_window():
    """Softmax layers only see `window` tokens: changing token 0 cannot change a pure-softmax model's
    output at position >= window, while it does change it inside the window."""
    config = tiny_config(("softmax",), attention=AttentionConfig(2, 1, 16, window=8))
    model = CausalLM(config).eval()
    ids = torch.randint(0, 97, (1, 20))
    changed = ids.clone()
    changed[0, 0] = (ids[0, 0] + 1) % 97
    with torch.no_grad():
        a, _ = model(ids)
        b, _ = model(changed)
    assert (a[0, 8:] - b[0, 8:]).abs().max() == 0
    assert (a[0, 1:8] - b[0, 1:8]).abs().max() > 1e-4


def test_full_context_kv_cache_grows():
    config = tiny_config(("softmax",), attention=AttentionConfig(2, 2, 16, window=None))
    model = CausalLM(config).eval()
    ids = torch.randint(0, 97, (2, 12))
    with torch.no_grad():
        full, _ = model(ids)
        _, state = model(ids[:, :5], model.initial_state(2, past=0))
        assert state[0]["key"].shape[2] == 5
        logits, state = model(ids[:, 5:6], state, torch.full((2,), 5), mode="recurrent", last_only=True)
    assert state[0]["key"].shape[2] == 6
    assert_close(logits, full[:, 5], 1e-5)


def test_grouped_value_heads():
    model = build("gated_deltanet", num_heads=4, num_k_heads=2)
    ids = torch.randint(0, 97, (1, 40))
    with torch.no_grad():
        c, _ = model(ids)
        r, _ = model(ids, mode="recurrent")
    assert_close(c, r, 1e-5)


@pytest.mark.parametrize("feature_map", ["identity", "relu", "poly2"])
def test_linear_attn_feature_maps(feature_map):
    normalizer = feature_map != "identity"
    overrides = {"linear_attn": {"feature_map": feature_map, "normalizer": normalizer, "output_norm": not normalizer}}
    model = build("linear_attn", family_overrides=overrides)
    width = model.state_tensors()[0][0].dims[2]
    assert width == (1 + 8 + 64 if feature_map == "poly2" else 8)
    ids = torch.randint(0, 97, (2, 33))
    with torch.no_grad():
        c, _ = model(ids)
        r, _ = model(ids, mode="recurrent")
    assert_close(c, r, 1e-5)


def test_performer_projection_is_stored_and_seeded():
    a, b = build("performer"), build("performer")
    proj = a.model.layers[0].mixer.feature_projection
    assert "model.layers.0.mixer.feature_projection" in a.state_dict()
    assert torch.equal(proj, b.model.layers[0].mixer.feature_projection)
    assert not torch.equal(proj, a.model.layers[1].mixer.feature_projection)


def test_retnet_decay_schedule():
    spec = FAMILIES["retnet"]
    gamma = spec.fixed_log_decay(4).exp()
    assert torch.allclose(gamma, torch.tensor([1 - 2**-5, 1 - 2**-6, 1 - 2**-7, 1 - 2**-8]))


def test_unknown_family_lists_supported_ones():
    with pytest.raises(EdgelinError) as err:
        get_family("gated_deltnet")
    assert "closest: 'gated_deltanet'" in err.value.line() and "mamba2" in err.value.line()


def test_override_of_a_fixed_field_is_refused():
    with pytest.raises(EdgelinError, match="define the family"):
        tiny_config(("gla",), family_overrides={"gla": {"delta_rule": True}})


def test_softmax_layers_need_an_attention_section():
    with pytest.raises(EdgelinError, match="no 'attention' section"):
        ModelConfig(vocab_size=10, hidden_size=8, layer_types=("softmax",), num_heads=1, head_k_dim=8,
                    head_v_dim=8, intermediate_size=8)


def test_config_json_round_trip_and_unknown_field():
    config = tiny_config(("gla", "softmax"))
    assert ModelConfig.from_dict(config.to_dict()) == config
    with pytest.raises(EdgelinError, match="unknown fields use_magic"):
        ModelConfig.from_dict({**config.to_dict(), "use_magic": True})


KNOB_VARIANTS = {
    "linear_attn-hadamard": ("linear_attn", {"linear_attn": {"feature_map": "hadamard"}}, {}),
    "linear_attn-hedgehog": ("linear_attn", {"linear_attn": {"feature_map": "hedgehog", "normalizer_eps": 1e-10}}, {}),
    "linear_attn-t2r": ("linear_attn", {"linear_attn": {"feature_map": "t2r"}}, {}),
    "linear_attn-dpfp": ("linear_attn", {"linear_attn": {"feature_map": "dpfp"}}, {}),
    "gla-clamp-conv-bias": ("gla", {"gla": {"gate_clamp_min": -0.05, "short_conv": True}}, {"conv_bias": True}),
    "retnet-relu": ("retnet", {"retnet": {"feature_map": "relu"}}, {}),
    "deltanet-sum-nobeta": ("deltanet", {"deltanet": {"qk_norm": "sum", "use_beta": False}}, {}),
    "gdn-negeig-sigmoid": ("gated_deltanet", {"gated_deltanet": {"beta_scale": 2.0, "output_gate_activation": "sigmoid"}},
                           {"num_heads": 4, "num_k_heads": 2}),
    "mamba2-groups-clamp-nomlp": ("mamba2", {"mamba2": {"dt_clamp": (0.0, 0.05)}},
                                  {"num_heads": 4, "num_k_heads": 2, "intermediate_size": 0, "conv_bias": True}),
}


@pytest.mark.parametrize("variant", KNOB_VARIANTS)
def test_knob_variants_keep_the_chain(variant):
    """Every knob real checkpoints use keeps chunked == token loop and prefill + steps == whole."""
    family, overrides, changes = KNOB_VARIANTS[variant]
    model = build(family, family_overrides=overrides, **changes)
    for p in model.parameters():  # non-trivial biases and norms
        p.data.add_(torch.randn_like(p) * 0.02)
    ids = torch.randint(0, 97, (2, 41))
    with torch.no_grad():
        full, full_state = model(ids)
        loop, _ = model(ids, mode="recurrent")
        logits, state = model(ids[:, :30], last_only=True)
        for t in range(30, 41):
            logits, state = model(ids[:, t:t + 1], state, torch.full((2,), t), mode="recurrent", last_only=True)
    assert_close(full, loop, 1e-5)
    assert_close(logits, full[:, -1], 1e-5)
    assert_states_close(state, full_state, 1e-5)


def test_gated_attention_with_qk_norm_and_partial_rotary():
    attention = AttentionConfig(4, 2, 16, window=None, rotary_dim=4, qk_norm=True, output_gate=True, qkv_bias=True)
    model = CausalLM(tiny_config(("gated_deltanet", "softmax"), attention=attention)).eval()
    assert {"q_norm", "k_norm", "g_proj"} <= set(dict(model.model.layers[1].mixer.named_children()))
    ids = torch.randint(0, 97, (2, 23))
    with torch.no_grad():
        full, _ = model(ids)
        logits, state = model(ids[:, :10], last_only=True)
        for t in range(10, 23):
            logits, state = model(ids[:, t:t + 1], state, torch.full((2,), t), mode="recurrent", last_only=True)
            assert_close(logits, full[:, t], 1e-5)
    # partial rotary: channels past rotary_dim are position-independent
    rot = model.model.layers[1].mixer.rotary
    x = torch.randn(1, 2, 1, 16)
    y = rot(x, torch.tensor([[0, 7]]))
    assert torch.equal(y[..., 4:], x[..., 4:]) and not torch.allclose(y[0, 1, :, :4], x[0, 1, :, :4])


@pytest.mark.parametrize("family", ["linear_attn", "performer", "gla"])
@pytest.mark.parametrize("batch", [1, 3])
def test_normalizer_state_chunked_loop_and_steps_agree(family, batch):
    """The normaliser is its own state tensor: chunked forward == token loop == prompt + single
    steps (logits and every state tensor) at batch 1 and 3, odd lengths across 16-token chunks;
    gla with a normaliser covers a decaying z (per-key decay)."""
    model = build(family, family_overrides={"gla": {"normalizer": True}} if family == "gla" else {})
    ids = torch.randint(0, 97, (batch, 37))
    with torch.no_grad():
        full, full_state = model(ids)
        loop, loop_state = model(ids, mode="recurrent")
        logits, state = model(ids[:, :21], last_only=True)
        for t in range(21, 37):
            logits, state = model(ids[:, t:t + 1], state, torch.full((batch,), t), mode="recurrent", last_only=True)
            assert_close(logits, full[:, t], 1e-5, f"step {t}")
    assert_close(full, loop, 1e-5)
    assert_states_close(loop_state, full_state, 1e-5)
    assert_states_close(state, full_state, 1e-5)
    z = full_state[0]["normalizer"]
    assert z.shape == (batch, 2, model.state_tensors()[0][1].dims[2])
    if family != "gla":
        assert (z > 0).all()  # a sum of positive features


def test_state_tensors_carry_roles_and_accumulators_stay_fp32():
    model = build("hybrid", family_overrides={"gla": {"normalizer": True}})
    roles = [[(t.name, t.role) for t in layer] for layer in model.state_tensors()]
    assert roles == [[("recurrent_state", "recurrent"), ("conv_state", "conv")],
                     [("key", "key"), ("value", "value")],
                     [("recurrent_state", "recurrent"), ("normalizer", "normalizer")]]
    state = model.initial_state(2, dtype=torch.float16)
    assert [{n: t.dtype for n, t in layer.items()} for layer in state] == [
        {"recurrent_state": torch.float32, "conv_state": torch.float16},
        {"key": torch.float16, "value": torch.float16},
        {"recurrent_state": torch.float32, "normalizer": torch.float32}]


def test_normalizer_with_the_delta_rule_is_refused():
    """z_t = decay z_{t-1} + k_t belongs to the additive rule; a delta-rule layer with a
    normaliser has no defined update, so the config is refused rather than guessed."""
    with pytest.raises(EdgelinError, match="normaliser needs the additive rule"):
        tiny_config(("deltanet",), family_overrides={"deltanet": {"normalizer": True}})


@pytest.mark.parametrize("family", ["gated_deltanet", "gla"])
def test_half_model_hands_the_kernels_float32_decay_and_beta(family):
    """An fp16 model on the kernel path: q/k/v in fp16, but g and beta reach the kernels in float32 (the
    launcher's own aux dtype), so a half-precision step still decays in float32. A spy engine standing in
    for the kernels (a KernelEngine running the torch reference) records what the mixer hands it."""
    from dataclasses import dataclass

    from edgelin.kernels.dispatch import KernelEngine
    from edgelin.model.mixer import use_engine
    from edgelin.reference.engine import TorchEngine

    seen: list[tuple[torch.dtype, ...]] = []

    @dataclass(frozen=True)
    class Spy(KernelEngine):
        def step(self, state, q, k, v, g=None, beta=None):
            seen.append((q.dtype, g.dtype, beta.dtype if beta is not None else None))
            o, new = TorchEngine.step(self, state, q.float(), k.float(), v.float(), g, beta)  # what it computes
            return o.to(q.dtype), new  # is not under test here, only what it was handed

    torch.manual_seed(0)
    model = CausalLM(tiny_config(family_layers(family))).eval().half()
    ids = torch.randint(0, 97, (2, 1))
    with torch.no_grad(), use_engine(Spy(name="spy")):
        model(ids, model.initial_state(2), torch.zeros(2, dtype=torch.long), mode="recurrent")
    assert seen and all(g == torch.float32 and beta in (None, torch.float32) for _, g, beta in seen), seen
    if family == "gla":  # q is not L2-normalised (in float32) here: it stays in the weights' fp16
        assert all(q == torch.float16 for q, _, _ in seen), seen
