"""The ONNX step graph stays small (issue 13): ONNX Runtime pays a few microseconds per node, about as
much as a small model's step arithmetic, so the node count after ONNX Runtime's own optimiser is pinned
for one Mamba2 layer (one key head broadcast over the value heads, conv bias: transformers' Mamba2) and
one Gated DeltaNet layer with grouped key heads (Qwen3.5's layout), and the small forms must keep the
reference's numbers (the grouped heads' broadcast path is checked here, test_onnx covers the rest)."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
import torch

from conftest import tiny_config
from edgelin.export.onnx import target as onnx_target
from edgelin.export.graphs import GRAPHS, graph_io
from edgelin.export.lowering import lowering
from edgelin.model.lm import CausalLM

# Nodes of the step graph after ONNX Runtime's optimiser (ORT_ENABLE_ALL), one linear layer + embedding,
# final norm and LM head, by --step-ops: contrib (the recurrence and the short conv as one LinearAttention and one
# CausalConvWithState node) and standard. Before the small step forms (edgelin.export.lowering.OnnxEngine): 79
# and 95.
MAX_NODES = {("mamba2", "contrib"): 39, ("gated_deltanet", "contrib"): 49,
             ("mamba2", "standard"): 45, ("gated_deltanet", "standard"): 61}
# Elementwise Muls among them. Standard ops: the state update's outer product k v^T is a K = 1 MatMul (exact;
# a broadcast Mul before: 7 and 7), one fewer pass of broadcast writes over the state per layer.
MAX_MULS = {("mamba2", "contrib"): 4, ("gated_deltanet", "contrib"): 3,
            ("mamba2", "standard"): 6, ("gated_deltanet", "standard"): 6}
LAYOUTS = {  # transformers' Mamba2: n_groups = 1, conv bias, no MLP; Qwen3.5's GDN: fewer key heads than value heads
    "mamba2": dict(num_heads=4, num_k_heads=1, conv_bias=True, intermediate_size=0),
    "gated_deltanet": dict(num_heads=4, num_k_heads=2),
}


@pytest.fixture(scope="module", params=[(f, forms) for f in sorted(LAYOUTS) for forms in ("contrib", "standard")],
                ids=lambda p: "-".join(p))
def step_graph(request, tmp_path_factory):
    family, forms = request.param
    torch.manual_seed(0)
    model = CausalLM(tiny_config((family,), **LAYOUTS[family])).eval()
    with torch.no_grad():  # decay and dt off their init, so that a wrong broadcast would show
        for name, p in model.named_parameters():
            if name.endswith(("A_log", "dt_bias", "D", "conv1d_bias")):
                p.add_(torch.randn_like(p) * 0.3)
    path = tmp_path_factory.mktemp(f"nodes-{family}") / "step.onnx"
    with lowering("onnx", contrib_ops=forms == "contrib"):  # --step-ops
        inputs, outputs = graph_io(model, "step")
        onnx_target.export_onnx_graph(GRAPHS["step"](model).eval(), model, inputs, outputs, path, 18)
    return (family, forms), model, path


def test_step_graph_node_count_after_onnx_runtime(step_graph, tmp_path):
    import onnxruntime as ort

    key, _, path = step_graph
    options = ort.SessionOptions()
    options.optimized_model_filepath = str(tmp_path / "optimized.onnx")
    ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    ops = [n.op_type for n in onnx.load(options.optimized_model_filepath, load_external_data=False).graph.node]
    assert len(ops) <= MAX_NODES[key], sorted(ops)
    # No shape plumbing around the recurrence (Gathers: the embedding and the last position's hidden
    # state), softplus one node (no Greater + Where), the L2 norms fused like RMSNorm; LinearAttention takes
    # one key head per value head (one Expand repeats them) and applies the decay itself (no Exp), and the
    # conv's window shift is inside CausalConvWithState (no Slice)
    contrib = key[1] == "contrib"
    assert ops.count("LinearAttention") == ops.count("CausalConvWithState") == ops.count("Expand") == int(contrib), \
        sorted(ops)
    assert ops.count("Gather") <= 2 and not {"Squeeze", "Where", "Reciprocal"} & set(ops), sorted(ops)
    assert ops.count("Exp") == ops.count("Slice") == int(not contrib) and ops.count("Mul") <= MAX_MULS[key], sorted(ops)


def test_step_graph_matches_reference_steps(step_graph):
    """Eight steps from a prefilled state, batch 3: logits and every state tensor vs the reference."""
    import onnxruntime as ort

    _, model, path = step_graph
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    names = [i.name for i in session.get_inputs()][1:]
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        _, state = model(torch.randint(0, 97, (3, 20), generator=gen), mode="chunked", last_only=True)
        for _ in range(8):
            ids = torch.randint(0, 97, (3,), generator=gen)
            flat = [t for layer in state for t in layer.values()]
            got = session.run(None, {"input_ids": ids.numpy(), **{n: t.numpy() for n, t in zip(names, flat)}})
            logits, state = model(ids[:, None], state, mode="recurrent", last_only=True)
            want = [logits, *[t for layer in state for t in layer.values()]]
            for a, b in zip(got, want):
                np.testing.assert_allclose(a, b.numpy(), rtol=0, atol=1e-5 * float(b.abs().max()))
