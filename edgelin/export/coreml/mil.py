"""A numpy interpreter for the MIL programs edgelin's Core ML export emits.

A check of the conversion, not of Apple's runtime: it reads the ML program back from the saved
package (the proto and its weight file, as coremltools' own milproto loader does) and evaluates each
op with numpy, every result cast to the dtype the program declares for it (so an fp16 program is
evaluated with fp16 intermediates). It lets Linux compare the converted functions with the PyTorch
reference; what the Neural Engine or the GPU compute on a device only a Mac can show. Ops outside the
set below are refused by name.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any, Callable

import numpy as np

from edgelin.errors import EdgelinError


def load_program(package: Path) -> Any:
    """The MIL program (a coremltools Program: every function) of a saved .mlpackage, read through a private view
    of it (edgelin.export.coreml.contract.package_view: coremltools' loader writes into a package it opens)."""
    from edgelin.export.coreml.contract import coremltools_module, package_view

    ct = coremltools_module()
    from coremltools.converters.mil.frontend.milproto.load import load as milproto_load

    with package_view(Path(package)) as view, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = ct.models.MLModel(str(view), skip_model_load=True)
        spec = model.get_spec()  # the weights are read into the program here: the view can go afterwards
        return milproto_load(spec, spec.specificationVersion, file_weights_dir=model.weights_dir)


def _np_dtype(var) -> np.dtype | None:
    from coremltools.converters.mil.mil import types

    dtype = var.dtype
    if types.is_tensor(var.sym_type) or types.is_scalar(var.sym_type):
        return np.dtype(types.nptype_from_builtin(dtype))
    return None


_CASTS = {"fp16": np.float16, "fp32": np.float32, "int32": np.int32, "int16": np.int16, "int8": np.int8,
          "uint8": np.uint8, "uint16": np.uint16, "bool": np.bool_}


def _axes(value) -> tuple[int, ...] | None:
    return None if value is None else tuple(int(a) for a in np.atleast_1d(value))


def _index(x, begin, end, stride=None, begin_mask=None, end_mask=None, squeeze_mask=None) -> tuple:
    index = []
    for axis in range(x.ndim):
        lo = None if begin_mask is not None and begin_mask[axis] else int(begin[axis])
        hi = None if end_mask is not None and end_mask[axis] else int(end[axis])
        step = 1 if stride is None else int(stride[axis])
        if squeeze_mask is not None and squeeze_mask[axis]:
            index.append(int(begin[axis]))
            continue
        index.append(slice(lo, hi, step))
    return tuple(index)


def _slice_by_index(x, begin, end, stride=None, begin_mask=None, end_mask=None, squeeze_mask=None):
    return x[_index(x, begin, end, stride, begin_mask, end_mask, squeeze_mask)]


def _slice_update(x, update, begin, end, stride=None, begin_mask=None, end_mask=None, squeeze_mask=None):
    out = np.array(x, copy=True)
    out[_index(x, begin, end, stride, begin_mask, end_mask, squeeze_mask)] = update
    return out


def _conv(x, weight, bias=None, strides=None, pad_type="valid", pad=None, dilations=None, groups=1):
    """1-D convolution [B, Cin, L] * [Cout, Cin/groups, K] (the short convolutions' form)."""
    if x.ndim != 3 or pad_type not in ("valid", "custom") or (pad is not None and np.any(pad)) or \
            (strides is not None and np.any(np.asarray(strides) != 1)) or \
            (dilations is not None and np.any(np.asarray(dilations) != 1)):
        raise NotImplementedError("conv other than a stride-1, undilated, unpadded 1-D convolution")
    groups = int(groups)
    out_ch, per_group, width = weight.shape
    length = x.shape[-1] - width + 1
    windows = np.stack([x[..., j:j + length] for j in range(width)], -1)  # [B, Cin, L', K]
    per_out = out_ch // groups
    out = np.empty((x.shape[0], out_ch, length), np.result_type(x, weight))
    for g in range(groups):
        xs = windows[:, g * per_group:(g + 1) * per_group]  # [B, per_group, L', K]
        out[:, g * per_out:(g + 1) * per_out] = np.einsum("bclk,ock->bol", xs, weight[g * per_out:(g + 1) * per_out])
    return out if bias is None else out + bias.reshape(1, -1, 1)


def _gather(x, indices, axis=0, batch_dims=0, validate_indices=False):
    if int(batch_dims) != 0:
        raise NotImplementedError("gather with batch_dims")
    axis = int(axis)
    indices = np.asarray(indices).astype(np.int64)
    indices = np.where(indices < 0, indices + x.shape[axis], indices)
    return np.take(x, indices, axis=axis)


def _split(x, axis, num_splits=None, split_sizes=None):
    if split_sizes is not None:
        return tuple(np.split(x, np.cumsum(np.asarray(split_sizes))[:-1], axis=int(axis)))
    return tuple(np.split(x, int(num_splits), axis=int(axis)))


def _softmax(x, axis=-1):
    shifted = x.astype(np.float32) - x.max(axis=int(axis), keepdims=True)
    e = np.exp(shifted)
    return e / e.sum(axis=int(axis), keepdims=True)


def _cumsum(x, axis=0, exclusive=False, reverse=False):
    axis = int(axis)
    y = np.flip(x, axis) if reverse else x
    out = np.cumsum(y, axis=axis, dtype=x.dtype)
    if exclusive:
        out = out - y
    return np.flip(out, axis) if reverse else out


def _reduce(fn: Callable) -> Callable:
    return lambda x, axes=None, keep_dims=False: fn(x, axis=_axes(axes), keepdims=bool(keep_dims))


def _sigmoid(x):
    return 1.0 / (1.0 + np.exp(-x.astype(np.float32)))


def _binary(fn: Callable) -> Callable:
    return lambda x, y: fn(x, y)  # MIL names the operands x, y; numpy's ufuncs take them positionally


def _unary(fn: Callable) -> Callable:
    return lambda x: fn(x)


_BINARY = {"add": np.add, "sub": np.subtract, "mul": np.multiply, "real_div": np.divide, "pow": np.power,
           "maximum": np.maximum, "minimum": np.minimum, "floor_div": np.floor_divide, "mod": np.mod,
           "equal": np.equal, "not_equal": np.not_equal, "greater": np.greater, "greater_equal": np.greater_equal,
           "less": np.less, "less_equal": np.less_equal, "logical_and": np.logical_and, "logical_or": np.logical_or}
_UNARY = {"exp": np.exp, "log": np.log, "sqrt": np.sqrt, "sin": np.sin, "cos": np.cos, "abs": np.abs, "tanh": np.tanh,
          "square": np.square, "logical_not": np.logical_not, "identity": lambda x: x}

OPS: dict[str, Callable[..., Any]] = {
    **{name: _binary(fn) for name, fn in _BINARY.items()},
    **{name: _unary(fn) for name, fn in _UNARY.items()},
    "rsqrt": lambda x, epsilon=1e-12: 1.0 / np.sqrt(x + epsilon),
    "inverse": lambda x, epsilon=1e-4: 1.0 / (x + epsilon),
    "sigmoid": _sigmoid, "silu": lambda x: x * _sigmoid(x), "relu": lambda x: np.maximum(x, 0),
    "softplus": lambda x: np.logaddexp(0, x.astype(np.float32)),
    "elu": lambda x, alpha=1.0: np.where(x > 0, x, alpha * (np.exp(np.minimum(x, 0)) - 1)),
    "clip": lambda x, alpha, beta: np.clip(x, alpha, beta),
    "cast": lambda x, dtype: x.astype(_CASTS[str(dtype)]),
    "linear": lambda x, weight, bias=None: x @ weight.T + (0 if bias is None else bias),
    "matmul": lambda x, y, transpose_x=False, transpose_y=False: np.matmul(
        np.swapaxes(x, -1, -2) if transpose_x else x, np.swapaxes(y, -1, -2) if transpose_y else y),
    "concat": lambda values, axis, interleave=False: np.concatenate(values, axis=int(axis)),
    "reshape": lambda x, shape: x.reshape(tuple(int(s) for s in shape)),
    "expand_dims": lambda x, axes: np.expand_dims(x, _axes(axes)),
    "squeeze": lambda x, axes=None: np.squeeze(x, _axes(axes)),
    "transpose": lambda x, perm: np.transpose(x, tuple(int(p) for p in perm)),
    "tile": lambda x, reps: np.tile(x, tuple(int(r) for r in reps)),
    "slice_by_index": _slice_by_index, "slice_update": _slice_update,
    "slice_by_size": lambda x, begin, size: x[tuple(slice(int(b), None if int(s) == -1 else int(b) + int(s))
                                                    for b, s in zip(begin, size))],
    "gather": _gather,
    "gather_along_axis": lambda x, indices, axis=0, validate_indices=False: np.take_along_axis(
        x, np.where(indices < 0, indices + x.shape[int(axis)], indices).astype(np.int64), axis=int(axis)),
    "select": lambda cond, a, b: np.where(cond, a, b),
    "split": _split, "softmax": _softmax, "cumsum": _cumsum, "conv": _conv,
    "reduce_sum": _reduce(np.sum), "reduce_mean": _reduce(np.mean), "reduce_max": _reduce(np.max),
    "reduce_min": _reduce(np.min), "reduce_prod": _reduce(np.prod),
    "shape": lambda x: np.array(x.shape, np.int32),
    "fill": lambda shape, value=0.0: np.full(tuple(int(s) for s in shape), value),
    "range_1d": lambda start, end, step: np.arange(start, end, step),
}


def run_function(function: Any, feeds: dict[str, np.ndarray], states: dict[str, np.ndarray] | None = None
                 ) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """Evaluate one MIL function: feeds by input name, states (MLState) by state name, both numpy.
    Returns (outputs by name, the states after the call)."""
    env: dict[str, Any] = {}
    states = dict(states or {})
    for name, var in function.inputs.items():
        if name in feeds:
            dtype = _np_dtype(var)
            env[name] = np.asarray(feeds[name]).astype(dtype) if dtype is not None else feeds[name]
        elif name not in states:
            raise EdgelinError(f"MIL function input {name} was not fed", "every input needs a value",
                               "report this as an edgelin bug")

    def value(var):
        if var.name in env:
            return env[var.name]
        if var.val is not None:
            return var.val
        raise EdgelinError(f"MIL variable {var.name} has no value", "ops run in program order",
                           "report this as an edgelin bug")

    for op in function.operations:
        kind = op.op_type
        if kind == "const":
            env[op.outputs[0].name] = op.outputs[0].val
            continue
        if kind == "read_state":
            env[op.outputs[0].name] = np.array(states[op.inputs["input"].name], copy=True)
            continue
        if kind == "coreml_update_state":
            new = value(op.inputs["value"])
            states[op.inputs["state"].name] = np.array(new, copy=True)
            env[op.outputs[0].name] = new
            continue
        if kind not in OPS:
            raise EdgelinError(f"MIL op {kind!r} ({op.name})", "edgelin's numpy check of the conversion does not "
                               "implement it", "check this export on a Mac, or add the op to "
                               "edgelin/export/coreml/mil.py")
        args = {k: (tuple(value(v) for v in var) if isinstance(var, (list, tuple)) else value(var))
                for k, var in op.inputs.items()}
        with np.errstate(over="ignore", divide="ignore", invalid="ignore"):
            result = OPS[kind](**args)
        results = result if isinstance(result, tuple) else (result,)
        for out, res in zip(op.outputs, results):
            dtype = _np_dtype(out)
            env[out.name] = np.asarray(res).astype(dtype) if dtype is not None else res
    outputs = {var.name: env[var.name] for var in function.outputs}
    return outputs, states
