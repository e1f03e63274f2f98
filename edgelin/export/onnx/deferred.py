"""The traced graph's weights computed when they are written, not when the graph is traced.

torch's exporter folds each `Transpose` of a weight into a new constant as it optimises (onnxscript always folds a
Transpose whose large input has no other reader), and fusing sibling projections concatenates those copies again:
at Qwen3.5-0.8B's size that is 2 GB of float32 held beside the model's own weights while a graph is traced. Here the
optimiser leaves those transposes alone and each becomes an initializer that transposes its source when written
(onnx_ir.LazyTensor), so writing the graph holds one weight's copy at a time (edgelin.export.fuse_matmuls makes its
concatenations lazy the same way).
"""

from __future__ import annotations

from typing import Any

LARGE = 1 << 16  # elements: smaller constants fold as the optimiser would (shapes, biases, norms)


def _large_initializer(value: Any) -> bool:
    return (value is not None and value.is_initializer() and value.const_value is not None
            and value.const_value.size > LARGE)


def optimize_traced(model: Any) -> None:
    """The exporter's own optimisation (onnxscript.optimizer.optimize_ir, what `torch.onnx.export(optimize=True)`
    runs), leaving the transposes of large initializers to transpose_when_written."""
    from onnxscript import optimizer

    def should_fold(node: Any) -> bool | None:
        if node.domain == "" and node.op_type == "Transpose" and _large_initializer(node.inputs[0]):
            return False
        return None  # the optimiser's own rules

    optimizer.optimize_ir(model, should_fold=should_fold)
    transpose_when_written(model.graph)


def transpose_when_written(graph: Any) -> int:
    """Replace each top-level Transpose of a large initializer by an initializer that transposes it when read
    (written); the source goes once nothing else reads it. Returns how many were replaced."""
    import numpy as np
    import onnx_ir as ir

    replaced = 0
    for node in list(graph):
        if node.domain != "" or node.op_type != "Transpose" or not _large_initializer(node.inputs[0]):
            continue
        source = node.inputs[0]
        tensor = source.const_value
        attr = node.attributes.get("perm")
        perm = tuple(attr.as_ints()) if attr is not None else tuple(reversed(range(len(tensor.shape))))
        output = node.outputs[0]
        name = output.name
        lazy = ir.LazyTensor(lambda t=tensor, p=perm: ir.tensor(np.ascontiguousarray(t.numpy().transpose(p))),
                             dtype=tensor.dtype, shape=ir.Shape([tensor.shape[p] for p in perm]), name=name)
        output.name = f"{name}.traced"  # (the name passes to the initializer that replaces it)
        value = ir.Value(name=name, shape=lazy.shape, type=ir.TensorType(tensor.dtype), const_value=lazy)
        ir.convenience.replace_all_uses_with(output, value)
        graph.remove(node, safe=True)
        graph.register_initializer(value)
        if not source.uses() and source not in graph.outputs:
            graph.initializers.pop(source.name)
        replaced += 1
    return replaced
