"""Sibling projections as one MatMul (edgelin.export.fuse_matmuls, issue 13): the step graph's MatMuls
that read one activation with constant weights become one MatMul + Split, Mamba2's conv-input Concat of
three projections becomes one piece of that Split, the outputs stay those of the unfused graph, and an
export's two graphs still share every weight (tests/export/test_shared_weights.py checks that through the pipeline)."""

from __future__ import annotations

import shutil
from collections import Counter

import numpy as np
import onnx
import pytest
import torch

from conftest import tiny_config
from edgelin.export.onnx import target as onnx_target
from edgelin.export import fuse_matmuls as fuse_module
from edgelin.export.fuse_matmuls import FUSED_MODULES, fuse_matmuls
from edgelin.export.graphs import GRAPHS, graph_io
from edgelin.export.lowering import lowering
from edgelin.model.lm import CausalLM

LAYOUTS = {  # as tests/export/onnx/test_onnx_nodes.py: transformers' Mamba2 and Qwen3.5's grouped-head Gated DeltaNet
    "mamba2": dict(num_heads=4, num_k_heads=1, conv_bias=True, intermediate_size=0),
    "gated_deltanet": dict(num_heads=4, num_k_heads=2),
}
# Weight MatMuls that read the layer's normed input, before -> after (hand-counted from the modules:
# Mamba2's in_proj is z, x, B, C, dt; the GDN layer's q, k, v, gate, beta, decay (a) projections, and its MLP's
# gate and up read the post-norm): fused, one per shared activation.
SIBLINGS = {"mamba2": (5, 1), "gated_deltanet": (8, 2)}


def _weight_matmuls(graph) -> Counter:
    inits = {t.name for t in graph.initializer}
    return Counter(n.input[0] for n in graph.node if n.op_type == "MatMul" and n.input[1] in inits)


@pytest.fixture(scope="module", params=sorted(LAYOUTS))
def graphs(request, tmp_path_factory):
    family = request.param
    torch.manual_seed(0)
    model = CausalLM(tiny_config((family,), **LAYOUTS[family])).eval()
    root = tmp_path_factory.mktemp(f"fuse-{family}")
    plain, fused = root / "plain.onnx", root / "fused.onnx"
    # the export fuses as it writes (edgelin.export.onnx.target.export_onnx_graph): the plain graph without it
    with lowering("onnx"), pytest.MonkeyPatch.context() as patch:
        patch.setattr(fuse_module, "fuse_graph", lambda graph: 0)
        inputs, outputs = graph_io(model, "step")
        onnx_target.export_onnx_graph(GRAPHS["step"](model).eval(), model, inputs, outputs, plain, 18)
    shutil.copy(plain, fused)
    merged = fuse_matmuls(fused)
    return family, plain, fused, merged


def test_siblings_become_one_matmul_and_split(graphs):
    family, plain, fused, merged = graphs
    before, after = onnx.load(str(plain)).graph, onnx.load(str(fused)).graph
    siblings, fused_count = SIBLINGS[family]
    assert sum(c for c in _weight_matmuls(before).values() if c > 1) == siblings
    assert merged == siblings - fused_count
    assert max(_weight_matmuls(after).values()) == 1  # no activation read by two weight MatMuls any more
    nodes = [n for n in after.node if any(p.key == FUSED_MODULES for p in n.metadata_props)]
    assert len(nodes) == fused_count and all(n.op_type == "MatMul" for n in nodes)
    modules = [m for n in nodes for p in n.metadata_props if p.key == FUSED_MODULES for m in eval(p.value)]
    assert len(modules) == siblings and all(m.endswith("_proj") or "proj" in m for m in modules), modules
    if family == "mamba2":  # conv input cat(x, B, C) of three projections: now one piece of the Split
        assert Counter(n.op_type for n in before.node)["Concat"] - Counter(n.op_type for n in after.node)["Concat"] == 1


def test_fused_graph_gives_the_same_numbers(graphs):
    import onnxruntime as ort

    _, plain, fused, _ = graphs
    a = ort.InferenceSession(str(plain), providers=["CPUExecutionProvider"])
    b = ort.InferenceSession(str(fused), providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(3)
    feeds = {}
    for i in a.get_inputs():
        shape = [3 if not isinstance(d, int) else d for d in i.shape]
        feeds[i.name] = rng.integers(0, 97, shape) if "int" in i.type else rng.standard_normal(shape).astype(np.float32)
    for x, y in zip(a.run(None, feeds), b.run(None, feeds)):
        np.testing.assert_allclose(y, x, rtol=0, atol=1e-6 * float(np.abs(x).max()))
