"""What `edgelin families` shows: each family's math and state, read off its spec."""

from __future__ import annotations

from edgelin.export.targets import get_target, target_names
from edgelin.families import FAMILIES, OutputGate


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
        support = [f"{name}: {'yes' if t.family_support(spec) is None else t.family_support(spec)}"
                   for name, t in targets.items()]
        rows.append({
            "family": spec.name,
            "summary": spec.summary,
            "rule": "delta" if spec.delta_rule else "additive",
            "decay": spec.decay.value + (f" ({spec.gate.value})" if spec.gate else ""),
            "feature_map": spec.feature_map,
            "readout": " ".join(readout),
            "state": state,
            "targets": ", ".join(support),
        })
    rows.append({"family": "softmax", "summary": "softmax attention (hybrids, KV baseline)", "rule": "-",
                 "decay": "-", "feature_map": "-", "readout": "softmax(q k^T) v",
                 "state": ["key, value [batch, Hkv, window | past_sequence, d_h]"],
                 "targets": ", ".join(f"{n}: yes" for n in targets)})
    return rows
