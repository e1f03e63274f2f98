"""Target lowering as patches and the state policy: a target installs its engine only while it
traces; the ONNX step graph updates the recurrent state and the normaliser without Concat/Slice;
state names, roles and dtypes come from one place."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import onnx
import pytest
import torch

from conftest import HYBRID, ZOO, tiny_config
from helpers import TOKENIZER_VOCAB, assert_close, export_family
from edgelin.devices import ExportSettings
from edgelin.errors import EdgelinError
from edgelin.export import lowering as lowering_mod
from edgelin.export.graphs import graph_io
from edgelin.export.lowering import Lowering, get_lowering, lowering, register_lowering, scan_loop
from edgelin.export.onnx.options import OnnxOptions
from edgelin.export.onnx.target import OnnxTarget
from edgelin.artifact.state import output_name_for, parse_state_name, state_input_name, state_output_name
from edgelin.families.spec import StateTensor
from edgelin.model.lm import CausalLM
from edgelin.reference import recurrence
from edgelin.reference.engine import TorchEngine

RESHAPING = {"Concat", "Slice", "Split", "Gather"}  # copies: a plugin updates its state in place


def state_path_ops(graph: onnx.GraphProto, source: str, sink: str) -> list[str]:
    """Op types of the nodes on any path from graph input `source` to graph output `sink`."""
    producers = {out: n for n in graph.node for out in n.output}
    ancestors, todo = set(), [sink]
    while todo:  # nodes `sink` depends on
        node = producers.get(todo.pop())
        if node is not None and id(node) not in ancestors:
            ancestors.add(id(node))
            todo.extend(node.input)
    reached, names, changed = set(), {source}, True
    while changed:  # nodes depending on `source` (graph.node is topologically sorted, but be safe)
        changed = False
        for n in graph.node:
            if id(n) not in reached and names.intersection(n.input):
                reached.add(id(n))
                names.update(n.output)
                changed = True
    return [n.op_type for n in graph.node if id(n) in ancestors and id(n) in reached]


@pytest.fixture(scope="module")
def shared_exports(tmp_path_factory) -> dict[str, Path]:
    """test_onnx.py's two exports, through the whole export (the ONNX target's lowering included): the zoo (one
    layer of each family, linear_attn first) and the tokenizer-less hybrid (Gated DeltaNet, softmax, GLA). The
    run's graph cache traces their graphs once for both files."""
    root = tmp_path_factory.mktemp("lowering")
    return {"zoo": export_family(root, "zoo", layers=ZOO),
            "hybrid": export_family(root, "hybrid", vocab_size=TOKENIZER_VOCAB)}


def test_step_graph_updates_state_and_normalizer_without_concat_or_slice(shared_exports):
    """linear_attn's step: S' = S + k v^T and z' = z + k, each its own tensor; no Concat/Slice
    between a past_key_values.* input and its present.* output (a TensorRT plugin updates its
    state in place). The prefill graph keeps one Scan over chunks per layer; z's is a CumSum."""
    assert ZOO[0] == "linear_attn"
    folder = shared_exports["zoo"]
    step = onnx.load(str(folder / "step.onnx"), load_external_data=False).graph
    inputs = [i.name for i in step.input if i.name.startswith("past_key_values.0.")]
    assert sorted(inputs) == ["past_key_values.0.normalizer", "past_key_values.0.recurrent_state"]
    for name in inputs:
        ops = state_path_ops(step, name, name.replace("past_key_values.", "present.", 1))
        assert ops, f"{name} never reaches its output"
        assert not RESHAPING.intersection(ops), f"{name}: {ops}"
    prefill = onnx.load(str(folder / "prefill.onnx"), load_external_data=False).graph
    scans = [n for n in prefill.node if n.op_type == "Scan"]
    assert len(scans) == len(ZOO)
    assert [out for n in scans for out in n.output if out.startswith("present.0.")] == ["present.0.recurrent_state"]


def test_lowering_registry_refuses_unknown_targets():
    with pytest.raises(EdgelinError) as err:
        with lowering("bogus"):
            pass
    assert "no lowering for target 'bogus'" in err.value.line() and "onnx" in err.value.line()
    assert get_lowering("coreml").engine.name == "coreml-static-chunks"  # tests/export/coreml/test_coreml.py checks its math


CALLS: list[str] = []


class _Counting(TorchEngine):
    def chunked(self, *args, **kwargs):
        CALLS.append("chunked")
        return super().chunked(*args, **kwargs)


def test_a_lowering_patches_the_model_only_inside_its_block(monkeypatch):
    """A registered lowering's engine runs every linear mixer inside `with lowering(...)`, and
    only there (a later target, e.g. TensorRT's step node, plugs in the same way)."""
    engine = _Counting(name="counting")
    monkeypatch.setattr(lowering_mod, "LOWERINGS", dict(lowering_mod.LOWERINGS))
    register_lowering(Lowering("test-target", engine, "counts chunked calls"))
    model = CausalLM(tiny_config(("linear_attn", "softmax", "gla"))).eval()
    ids = torch.randint(0, 97, (2, 9))
    with torch.no_grad():
        with lowering("test-target") as entry:
            assert entry.engine is engine
            patched, _ = model(ids)
        assert CALLS == ["chunked", "chunked"]  # the two linear layers
        plain, _ = model(ids)
    assert CALLS == ["chunked", "chunked"]
    assert torch.allclose(patched, plain, atol=1e-6)


def test_onnx_lowering_runs_the_chunk_loop_as_scan():
    entry = get_lowering("onnx")
    assert entry.engine.loop is scan_loop
    gen = torch.Generator().manual_seed(0)
    q, k = torch.randn(2, 37, 2, 8, generator=gen) * 0.3, torch.randn(2, 37, 2, 8, generator=gen) * 0.3
    v, g = torch.randn(2, 37, 2, 5, generator=gen), -torch.rand(2, 37, 2, 1, generator=gen) * 0.1
    s0 = torch.randn(2, 2, 8, 5, generator=gen)
    o, s = entry.engine.chunked(s0, q, k, v, g, None, 16)
    o_ref, s_ref = recurrence.recurrent(s0, q, k, v, g)
    assert (o - o_ref).abs().max() < 1e-5 and (s - s_ref).abs().max() < 1e-5


@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("kind", ["additive", "scalar-decay", "per-key-decay", "delta", "gated-delta",
                                  "per-key-delta", "erase"])
def test_onnx_chunked_form_with_the_prep_in_the_loop_matches_the_token_loop(kind, batch):
    """The ONNX engine runs each chunk's preparation inside its scan body (one chunk at a time, the
    default) or batched before it: both equal the naive token loop, at an odd length and from a state."""
    gen = torch.Generator().manual_seed(len(kind) + batch)
    length, heads, d_k, d_v = 45, 2, 8, 5
    q, k = (torch.nn.functional.normalize(torch.randn(batch, length, heads, d_k, generator=gen), dim=-1)
            for _ in range(2))
    v = torch.randn(batch, length, heads, d_v, generator=gen)
    width = d_k if "per-key" in kind or kind == "erase" else 1
    g = None if kind in ("additive", "delta") else -torch.rand(batch, length, heads, width, generator=gen) * 0.2
    beta = torch.rand(batch, length, heads, generator=gen) if "delta" in kind or kind == "erase" else None
    erase = torch.rand(batch, length, heads, d_k, generator=gen) if kind == "erase" else None
    s0 = torch.randn(batch, heads, d_k, d_v, generator=gen) * 0.5
    want_o, want_s = recurrence.recurrent(s0, q, k, v, g, beta, erase)
    engine = get_lowering("onnx").engine
    assert engine.prep_in_loop  # the shipped default
    for prep_in_loop in (True, False):
        o, s = dataclasses.replace(engine, prep_in_loop=prep_in_loop).chunked(s0, q, k, v, g, beta, 16, erase=erase)
        assert_close(o, want_o, 1e-4, f"{kind} outputs, prep in loop: {prep_in_loop}")
        assert_close(s, want_s, 1e-4, f"{kind} state, prep in loop: {prep_in_loop}")


@pytest.mark.parametrize(("family", "key_heads"), [("mamba2", 1), ("mamba2", 2), ("gated_deltanet2", 1),
                                                   ("gated_deltanet", 2), ("linear_attn", 1)])
def test_onnx_chunked_form_keeps_one_shared_key_head(family, key_heads, monkeypatch):
    """One key head shared by the 4 value heads (Mamba2's single group): under the ONNX lowering the chunked
    form gets q and k with that one head (its products broadcast over the value heads); other groupings, and a
    normaliser's layers (whose forms take them repeated), get them repeated. Outputs equal the reference
    engine's, which always repeats them."""
    heads_seen = []
    chunk_inputs = recurrence.chunk_inputs

    def recording(q, *args):
        heads_seen.append(q.shape[2])
        return chunk_inputs(q, *args)

    monkeypatch.setattr(recurrence, "chunk_inputs", recording)
    model = CausalLM(tiny_config((family, family), num_heads=4, num_k_heads=key_heads)).eval()
    ids = torch.randint(0, 97, (3, 37))
    with torch.no_grad():
        plain, _ = model(ids)
        with lowering("onnx"):
            patched, _ = model(ids)
    shared = key_heads == 1 and family != "linear_attn"
    assert heads_seen[:2] == [4, 4] and heads_seen[2:] == [1 if shared else 4] * 2, heads_seen
    assert_close(patched, plain, 1e-5, family)


def test_onnx_prefill_prepares_each_chunk_inside_the_scan(shared_exports):
    """A per-key decay's [C, C, d_k] decays exist for one chunk at a time: the exported prefill graph computes
    GLA's decays and pair products (Exp, Einsum) only inside its Scan body, none over all chunks before it."""
    gla = HYBRID.index("gla")
    graph = onnx.load(shared_exports["hybrid"] / "prefill.onnx", load_external_data=False).graph
    (scan,) = [n for n in graph.node if n.op_type == "Scan" and f"present.{gla}.recurrent_state" in n.output]
    (body,) = [a.g for a in scan.attribute if a.type == onnx.AttributeProto.GRAPH]
    top = {n.op_type for n in graph.node}
    assert {"Exp", "Einsum"} <= {n.op_type for n in body.node} and not {"Exp", "Einsum"} & top


def test_state_names_and_roles_come_from_one_place():
    assert state_input_name(3, "conv_state") == "past_key_values.3.conv_state"
    assert state_output_name(3, "conv_state") == "present.3.conv_state"
    assert parse_state_name("present.12.key") == (12, "key")
    assert output_name_for("past_key_values.0.normalizer") == "present.0.normalizer"
    with pytest.raises(EdgelinError, match="not a state tensor name"):
        parse_state_name("logits")
    model = CausalLM(tiny_config(("linear_attn", "softmax")))
    inputs, outputs = graph_io(model, "step")
    roles = {t.name: t.state_role for t in inputs if t.role == "state"}
    assert roles == {"past_key_values.0.recurrent_state": "recurrent", "past_key_values.0.normalizer": "normalizer",
                     "past_key_values.1.key": "key", "past_key_values.1.value": "value"}
    assert {t.name: t.feeds for t in outputs if t.feeds} == {output_name_for(n): n for n in roles}
    assert {t.dtype for t in graph_io(model, "prefill", "float16")[0] if t.role == "state"} == {"float16"}


def test_onnx_target_refuses_a_float16_state(tmp_path):
    model = CausalLM(tiny_config(("gla",)))
    with pytest.raises(EdgelinError) as err:
        OnnxTarget().export(model, None, ExportSettings(state_dtype="float16"), OnnxOptions(), tmp_path)
    assert "ONNX state dtype 'float16'" in err.value.line() and "\n" not in err.value.line()
    assert not list(tmp_path.iterdir())


def test_state_tensor_role_and_dtype_are_checked():
    t = StateTensor("normalizer", ("batch", 2, 8), "normalizer")
    assert t.accumulates and t.dtype == "float32"
    assert not StateTensor("conv_state", ("batch", 4, 3), "conv").accumulates
    with pytest.raises(ValueError, match="role 'cache'"):
        StateTensor("x", ("batch",), "cache")
    with pytest.raises(ValueError, match="dtype 'int8'"):
        dataclasses.replace(t, dtype="int8")
