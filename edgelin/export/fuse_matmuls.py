"""Sibling projections as one MatMul: the ONNX graphs' MatMuls that read the same activation with
constant weights (a layer's q/k/v/gate projections, Mamba2's z/xBC/dt, an MLP's gate and up) become one
MatMul on the weights concatenated along the output axis, then one Split.

Why: at a one-token step each projection is a matrix-vector product of a few hundred columns, and
ONNX Runtime pays its dispatch (a few microseconds) per node, about as much as the product itself;
one wider product reads the same bytes with one dispatch and keeps the activation in cache. ONNX
Runtime's optimiser does not do this on CPU (its attention fusions only match transformer QKV
patterns). Exact: every output column is the same dot product as before.

Where the pieces are concatenated again right away (Mamba2's conv input is cat(x, B, C) of three
projections), the pieces are laid out in that order and the Concat becomes one piece of the Split.

Both graphs of an export are traced from the same modules in the same order, so their fused weights
are byte-identical and `edgelin.export.weights.share_weights` stores them once (its dedup is by content).
The fused node records the modules it came from (FUSED_MODULES metadata) so `describe`-style accounts
(edgelin.export.quantize) still name every matrix. Export-side module: imports onnx_ir inside.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

FUSED_MODULES = "edgelin.fused_modules"  # metadata_props key: JSON list of the fused projections' modules
_SCOPES = "pkg.torch.onnx.name_scopes"  # the exporter's module path of a node


def _weight(node: Any) -> Any | None:
    """The constant 2-D float weight of a plain MatMul(x, W), or None."""
    import onnx_ir as ir

    if node.op_type != "MatMul" or node.domain not in ("", "ai.onnx") or len(node.inputs) != 2:
        return None
    activation, weight = node.inputs
    if activation is None or activation.is_initializer() or weight is None or not weight.is_initializer():
        return None
    tensor = weight.const_value
    if tensor is None or len(tensor.shape) != 2 or tensor.dtype not in (ir.DataType.FLOAT, ir.DataType.FLOAT16):
        return None
    return weight


def _concat_run(members: list[Any], graph_outputs: set[int]) -> tuple[Any, list[Any]] | None:
    """A last-axis Concat fed only by (two or more of) these members' outputs, each used by it alone."""
    outputs = {id(m.outputs[0]): m for m in members}
    for member in members:
        for use in member.outputs[0].uses():
            concat = use.node
            if concat.op_type != "Concat" or concat.domain not in ("", "ai.onnx"):
                continue
            axis = concat.attributes.get_int("axis", 0)
            rank = member.outputs[0].shape.rank() if member.outputs[0].shape is not None else None
            if rank is None or axis not in (-1, rank - 1) or len(concat.inputs) < 2:
                continue
            if all(id(v) in outputs and len(v.uses()) == 1 and id(v) not in graph_outputs for v in concat.inputs) \
                    and len({id(v) for v in concat.inputs}) == len(concat.inputs):
                return concat, [outputs[id(v)] for v in concat.inputs]
    return None


def _modules(node: Any) -> list[str]:
    import ast

    if FUSED_MODULES in node.metadata_props:
        return json.loads(node.metadata_props[FUSED_MODULES])
    scopes = node.metadata_props.get(_SCOPES)
    try:
        names = ast.literal_eval(scopes) if scopes else []
    except (ValueError, SyntaxError):
        names = []
    return [names[-2]] if len(names) >= 2 else [node.name]


def fuse_graph(graph: Any) -> int:
    """Fuse the sibling MatMuls of one onnx_ir graph (top level; a Scan body's products read the loop's
    own values, not a shared activation). Returns how many MatMuls were merged away."""
    import numpy as np
    import onnx_ir as ir

    groups: dict[int, list[Any]] = {}
    for node in graph:
        weight = _weight(node)
        if weight is not None:
            groups.setdefault(id(node.inputs[0]), []).append(node)
    graph_outputs = {id(v) for v in graph.outputs}
    merged = 0
    for index, members in enumerate(groups.values()):
        weights = [m.inputs[1] for m in members]
        if len(members) < 2 or len({(w.const_value.dtype, w.const_value.shape[0]) for w in weights}) != 1 \
                or any(id(m.outputs[0]) in graph_outputs for m in members):
            continue
        # Layout: graph order, except that a Concat's pieces sit together in its order (it becomes one piece).
        pieces: list[tuple[list[Any], Any | None]] = []  # (members, the Concat they replace or None)
        placed: set[int] = set()
        for member in members:
            if id(member) in placed:
                continue
            run = _concat_run([m for m in members if id(m) not in placed], graph_outputs)
            if run is not None and member in run[1]:
                pieces.append((run[1], run[0]))
                placed.update(id(m) for m in run[1])
            else:
                pieces.append(([member], None))
                placed.add(id(member))
        order = [m for run, _ in pieces for m in run]
        # concatenated when written (edgelin.export.onnx.deferred): one fused weight's copy alive at a time
        parts = tuple(m.inputs[1].const_value for m in order)
        name = f"{order[0].inputs[1].name}.fused{len(order)}"
        fused = ir.LazyTensor(lambda parts=parts: ir.tensor(np.concatenate([p.numpy() for p in parts], axis=1)),
                              dtype=parts[0].dtype, shape=ir.Shape([parts[0].shape[0], sum(p.shape[1] for p in parts)]),
                              name=name)
        weight = ir.Value(name=name, shape=fused.shape, type=ir.TensorType(fused.dtype), const_value=fused)
        graph.register_initializer(weight)
        sizes = [sum(m.inputs[1].const_value.shape[1] for m in run) for run, _ in pieces]
        split_sizes = ir.Value(name=f"{weight.name}.sizes", const_value=ir.tensor(np.array(sizes, np.int64)))
        split_sizes.const_value.name = split_sizes.name
        graph.register_initializer(split_sizes)
        matmul = ir.Node("", "MatMul", [members[0].inputs[0], weight], num_outputs=1,
                         name=f"{members[0].name}.fused{len(order)}")
        matmul.metadata_props[FUSED_MODULES] = json.dumps([name for m in order for name in _modules(m)])
        split = ir.Node("", "Split", [matmul.outputs[0], split_sizes], attributes=[ir.AttrInt64("axis", -1)],
                        num_outputs=len(pieces), name=f"{matmul.name}.split")
        matmul.outputs[0].name = f"{matmul.name}.out"
        graph.insert_before(members[0], [matmul, split])
        removed = []
        for (run, concat), piece in zip(pieces, split.outputs):
            replaced = (concat or run[0]).outputs[0]
            piece.name, piece.shape, piece.type = f"{replaced.name}.piece", replaced.shape, replaced.type
            ir.convenience.replace_all_uses_with(replaced, piece)
            removed.extend([concat, *run] if concat is not None else run)
        graph.remove(removed, safe=True)
        for old in weights:
            if not old.uses() and old.name in graph.initializers:
                graph.initializers.pop(old.name)
        merged += len(members) - 1
    return merged


def fuse_matmuls(path: Path) -> int:
    """Rewrite the ONNX graph at `path` in place with its sibling MatMuls fused; returns how many merged away."""
    import onnx_ir as ir

    from edgelin.export.weights import save_ir_graph

    model = ir.load(str(path))  # external tensors stay on disk until the fused ones are written
    merged = fuse_graph(model.graph)
    if merged:
        save_ir_graph(model, path)
    return merged
