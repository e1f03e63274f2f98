"""What `edgelin families` shows: each family's math and state, read off its spec."""

from __future__ import annotations

from edgelin.export.targets import get_target, target_names
from edgelin.families import FAMILIES, OutputGate
from edgelin.families.spec import Decay
from edgelin.precision import state_verdict


def tensorrt_step(spec) -> str:
    """How a TensorRT engine runs this family's decode step: which part goes through edgelin's CUDA
    step kernel (the EdgelinStep plugin, edgelin/plugins/tensorrt/) with which attributes, and which
    part stays in plain ONNX ops around it."""
    gate = {Decay.NONE: 0, Decay.FIXED: 1, Decay.SCALAR: 1, Decay.PER_KEY: 2}[spec.decay]
    flags = f"gate={gate} delta={int(spec.delta_rule)}" + (" erase=1" if spec.erase_gate else "")
    around = []
    if spec.decay is Decay.FIXED:
        around.append("the fixed log-decay fed as g")
    elif spec.gate is not None:
        around.append(f"the {spec.gate.value} log-decay")
    if spec.delta_rule:
        around.append("beta")
    if spec.erase_gate:
        around.append("the erase gate")
    if spec.write_gate:
        around.append("the write gate (folded into v)")
    if spec.feature_map not in ("identity",):
        around.append(f"the {spec.feature_map} feature map")
    if spec.normalizer:
        around.append("the normaliser z' = z + phi(k) and o / (phi(q)^T z')")
    if spec.short_conv:
        around.append("the short convolution")
    if spec.skip_d:
        around.append("+ D v")
    if spec.output_gate is not OutputGate.NONE or spec.output_norm:
        around.append("the output norm/gate")
    return f"kernel ({flags}); ONNX ops: " + (", ".join(around) if around else "none")


def fp16_state(family: str) -> str:
    """The measured verdict on a float16 state (edgelin.precision; docs/performance.md#state-precision)."""
    verdict = state_verdict(family, "float16")
    if verdict is None:
        return "not measured: refused unless --force"
    return f"{'ok' if verdict.ok else 'refused unless --force'}: {verdict.figure()}"


def family_rows() -> list[dict]:
    targets = {name: get_target(name) for name in target_names()}
    rows = []
    for spec in FAMILIES.values():
        width = spec.feature.dim_label
        state = [f"recurrent_state [batch, H, {width}, d_v]"]
        if spec.normalizer:
            state.append(f"normalizer [batch, H, {width}]")
        if spec.short_conv:
            state.append("conv_state [batch, 2*Hk*d_k + H*d_v, W-1]")
        readout = ["phi(q)^T S / phi(q)^T z" if spec.normalizer else "q^T S"]
        if spec.skip_d:
            readout.append("+ D v")
        if spec.output_gate is not OutputGate.NONE:
            readout.append("gated RMSNorm")
        elif spec.output_norm:
            readout.append("RMSNorm")
        support = [f"{name}: {'yes' if t.family_support(spec) is None else f'no ({t.family_support(spec)})'}"
                   for name, t in targets.items()]
        rows.append({
            "family": spec.name,
            "summary": spec.summary,
            "rule": ("delta" + (" + erase (keys) / write (values) gates" if spec.erase_gate else ""))
            if spec.delta_rule else "additive",
            "decay": spec.decay.value + (f" ({spec.gate.value})" if spec.gate else ""),
            "feature_map": spec.feature_map,
            "readout": " ".join(readout),
            "state": state,
            "targets": ", ".join(support),
            "tensorrt_step": tensorrt_step(spec),
            "fp16_state": fp16_state(spec.name),
        })
    rows.append({"family": "+clvr", "summary": "model option (config clvr: true): every linear layer adds W_r u_t, "
                 "the value it writes (its delta-rule target), to the residual stream; W_r starts at zero",
                 "rule": "any linear family", "decay": "-", "feature_map": "-", "readout": "+ W_r u_t (residual)",
                 "state": ["no new state"], "targets": ", ".join(f"{n}: yes" for n in targets),
                 "tensorrt_step": "ONNX ops (one MatMul beside the layer's step)",
                 "fp16_state": "as the layer's family (no state of its own)"})
    rows.append({"family": "softmax", "summary": "softmax attention (hybrids, KV baseline)", "rule": "-",
                 "decay": "-", "feature_map": "-", "readout": "softmax(q k^T) v",
                 "state": ["key, value [batch, Hkv, window | past_sequence, d_h]"],
                 "targets": ", ".join(f"{n}: yes" for n in targets),
                 "tensorrt_step": "ONNX ops (attention over the KV window; no recurrence for the kernel)",
                 "fp16_state": "not checked (a KV cache, not an accumulated state)"})
    return rows
