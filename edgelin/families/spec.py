"""The declarative family spec: the one place a family's math is stated.

Everything else derives from a `FamilySpec`: the mixer's parameters and projections
(`edgelin.model.mixer`), the recurrence engines (`edgelin.reference.engine` over the pure-torch
`edgelin.reference.recurrence`, which only see "is there a decay tensor / a beta tensor"), the
state tensors of the step and prefill graphs and every export target. A family file is a single
`FamilySpec(...)` value.

Shared math per head (state S is d_k x d_v):
    S_t = decay_t * S_{t-1}                                 (Decay: none, fixed, scalar, per_key)
    S_t = S_t + k_t v_t^T                                   (additive rule), or
    S_t = S_t + beta_t k_t (v_t - S_t^T k_t)^T              (delta rule)
    S_t = S_t - beta_t (e_t * k_t)(k_t^T S_t) + beta_t k_t (w_t * v_t)^T
                                          (delta rule with erase gate e over key channels and
                                           write gate w over value channels: Gated DeltaNet-2)
    o_t = S_t^T q_t   [ / (q_t^T z_t + eps) with normaliser z_t = decay z_{t-1} + k_t ]

A family is its identity (decay kind, gate, update rule, Mamba2's dt-scaled values and D skip,
RetNet's rotary); the knobs below it (`KNOBS`) are details real checkpoints vary, which a model
config may set per family. Anything else is refused.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from enum import Enum
from typing import TYPE_CHECKING

from edgelin.artifact.vocabulary import STATE_DTYPES
from edgelin.errors import EdgelinError
from edgelin.families.feature_maps import FEATURE_MAPS
from edgelin.rules import COUNT, FLAG, POSITIVE, SIZE, Rule, invalid

if TYPE_CHECKING:
    import torch


class Decay(str, Enum):
    NONE = "none"  # plain accumulation (linear transformer, DeltaNet)
    FIXED = "fixed"  # one constant gamma per head (RetNet)
    SCALAR = "scalar"  # data-dependent, one value per head and token (Mamba2, Gated DeltaNet)
    PER_KEY = "per_key"  # data-dependent, one value per key channel (GLA, Kimi Delta Attention)


class Gate(str, Enum):
    """How a data-dependent log-decay is computed from the layer input x."""

    LOGSIGMOID = "logsigmoid"  # log a = logsigmoid(W x) / gate_normalizer              (GLA)
    SOFTPLUS = "softplus"  # log a = -exp(A_log) * softplus(W x + dt_bias)   (Mamba2, GDN, KDA)


class OutputGate(str, Enum):
    NONE = "none"
    AFTER_NORM = "after_norm"  # rmsnorm(o) * act(W_g x)   (GLA, GDN, RetNet, KDA)
    BEFORE_NORM = "before_norm"  # rmsnorm(o * act(W_z x))  (Mamba2)


KNOBS = (
    "feature_map", "qk_norm", "scale_queries", "short_conv", "gate_low_rank", "gate_low_rank_bias", "gate_normalizer",
    "gate_clamp_min", "dt_clamp", "use_beta", "beta_scale", "normalizer", "normalizer_eps", "output_norm",
    "output_norm_scope", "output_gate", "output_gate_activation", "output_gate_low_rank", "chunk_size",
)
# Type and range of each knob a config may set (dt_clamp, a pair, is checked on its own).
KNOB_RULES: dict[str, Rule] = {
    "feature_map": Rule("str", choices=tuple(FEATURE_MAPS)), "qk_norm": Rule("str", choices=("none", "l2", "sum")),
    "scale_queries": FLAG, "short_conv": FLAG, "gate_low_rank": COUNT, "gate_low_rank_bias": FLAG,
    "gate_normalizer": POSITIVE, "gate_clamp_min": Rule("float", optional=True), "use_beta": FLAG,
    "beta_scale": POSITIVE, "normalizer": FLAG, "normalizer_eps": POSITIVE, "output_norm": FLAG,
    "output_norm_scope": Rule("str", choices=("head", "group")),
    "output_gate": Rule("str", choices=("none", "after_norm", "before_norm")),
    "output_gate_activation": Rule("str", choices=("silu", "sigmoid")), "output_gate_low_rank": COUNT,
    "chunk_size": SIZE,
}


@dataclass(frozen=True)
class FamilySpec:
    name: str
    summary: str
    # ---- identity ----
    decay: Decay = Decay.NONE
    gate: Gate | None = None
    delta_rule: bool = False
    rotary: bool = False  # rotary position on q and k after the feature map (RetNet)
    value_dt: bool = False  # v is scaled by the step size dt (Mamba2's x * dt)
    skip_d: bool = False  # o += D * v (Mamba2's skip)
    # Delta rule only (Gated DeltaNet-2): e = sigmoid(W_e x + b_e) per key channel says which key
    # channels the delta rule erases (it erases along e * k); w = sigmoid(W_w x + b_w) per value
    # channel says which value channels it writes (k (w * v)^T). W zero at init, b = 3: a fresh
    # layer is its family without the gates, with beta scaled by sigmoid(3) ~ 0.95.
    erase_gate: bool = False
    write_gate: bool = False
    fixed_decay_offset: float = 5.0  # Decay.FIXED: gamma_h = 1 - 2^-(offset + h)
    # ---- knobs ----
    feature_map: str = "identity"
    qk_norm: str = "none"  # none | l2: x / sqrt(|x|^2 + 1e-6) | sum: x / sum(x)
    scale_queries: bool = True  # multiply q by d_k^-0.5 before the readout
    short_conv: bool = False  # causal depthwise conv + SiLU over q, k, v (conv state)
    gate_low_rank: int = 0  # 0: W x is one Linear; r > 0: Linear(hidden, r) -> Linear(r, out)
    gate_low_rank_bias: bool = True  # bias on the second Linear of a low-rank gate
    gate_normalizer: float = 1.0
    gate_clamp_min: float | None = None  # logsigmoid gates: floor of the log-decay (GLA's clamp_min)
    dt_clamp: tuple[float, float] | None = None  # softplus gates: clamp of dt (Mamba2's time_step_limit)
    use_beta: bool = True  # delta rule: beta = sigmoid(W_b x); False: beta = 1
    beta_scale: float = 1.0  # 2.0 allows negative eigenvalues (beta in (0, 2))
    normalizer: bool = False
    normalizer_eps: float = 1e-6
    output_norm: bool = False  # RMSNorm over each head's output
    output_norm_scope: str = "head"  # head | group: one norm over the value heads sharing a key head
    output_gate: OutputGate = OutputGate.NONE
    output_gate_activation: str = "silu"  # silu | sigmoid
    output_gate_low_rank: int = 0  # like gate_low_rank, for the output gate (KDA); second Linear has a bias
    chunk_size: int = 64

    def __post_init__(self) -> None:
        problems = []
        if self.feature_map not in FEATURE_MAPS:
            problems.append(f"unknown feature map {self.feature_map!r} (known: {', '.join(FEATURE_MAPS)})")
        if (self.decay in (Decay.SCALAR, Decay.PER_KEY)) != (self.gate is not None):
            problems.append("a data-dependent decay needs a gate, and only it")
        if self.value_dt and (self.gate is not Gate.SOFTPLUS or self.decay is not Decay.SCALAR):
            problems.append("value_dt needs a scalar softplus step size")
        if self.output_gate is not OutputGate.NONE and not self.output_norm:
            problems.append("an output gate comes with the output norm")
        if self.qk_norm not in ("none", "l2", "sum"):
            problems.append(f"qk_norm must be none, l2 or sum, not {self.qk_norm!r}")
        if self.output_norm_scope not in ("head", "group"):
            problems.append(f"output_norm_scope must be head or group, not {self.output_norm_scope!r}")
        if self.output_gate_activation not in ("silu", "sigmoid"):
            problems.append(f"output_gate_activation must be silu or sigmoid, not {self.output_gate_activation!r}")
        if self.chunk_size < 1:
            problems.append("chunk_size must be >= 1")
        if self.normalizer and self.delta_rule:  # z_t = decay z_{t-1} + k_t is the additive rule's
            problems.append("the normaliser needs the additive rule (delta_rule=False)")
        if (self.erase_gate or self.write_gate) and not self.delta_rule:  # they split the delta rule's update
            problems.append("erase and write gates need the delta rule (delta_rule=True)")
        if problems:
            raise ValueError(f"{self.name}: " + "; ".join(problems))

    @property
    def feature(self):
        return FEATURE_MAPS[self.feature_map]

    @property
    def needs_position(self) -> bool:
        return self.rotary

    def fixed_log_decay(self, num_heads: int) -> "torch.Tensor":
        """log gamma_h for Decay.FIXED (RetNet's schedule), one value per head."""
        import torch

        heads = torch.arange(num_heads, dtype=torch.float64)
        return torch.log1p(-torch.pow(2.0, -(self.fixed_decay_offset + heads))).float()

    def with_overrides(self, overrides: dict, where: str = "model config") -> "FamilySpec":
        """Apply config overrides, refusing any field that is not a knob or a value of the wrong type."""
        if not overrides:
            return self
        bad = sorted(set(overrides) - set(KNOBS))
        if bad:
            raise EdgelinError(
                f"config sets {', '.join(bad)} for family {self.name!r}",
                "these fields define the family (or are unknown) and cannot be overridden",
                f"remove them; settable per family: {', '.join(KNOBS)}",
            )
        values = dict(overrides)
        for key, rule in KNOB_RULES.items():
            value = values.get(key)
            if key in values and not (key == "output_gate" and isinstance(value, OutputGate)):
                rule.check(f"family_overrides.{self.name}.{key}", value, where)
        if "output_gate" in values:
            values["output_gate"] = OutputGate(values["output_gate"])
        if values.get("dt_clamp") is not None:
            values["dt_clamp"] = _dt_clamp(values["dt_clamp"], f"family_overrides.{self.name}.dt_clamp", where)
        try:
            return dataclasses.replace(self, **values)
        except ValueError as exc:
            raise EdgelinError(f"config overrides for {self.name!r}", str(exc), "fix the overrides") from exc


def _dt_clamp(value: object, name: str, where: str) -> tuple[float, float]:
    """Mamba2's time_step_limit: (low, high) with 0 <= low <= high; high may be inf."""
    allowed = "null or a pair [low, high] of numbers with 0 <= low <= high (high may be inf)"
    bound = Rule("float", low=0, finite=False)
    if not isinstance(value, (list, tuple)) or len(value) != 2 or not all(bound.accepts(v) for v in value) \
            or value[0] > value[1] or value[0] == float("inf"):
        raise invalid(name, value, allowed, where)
    return (float(value[0]), float(value[1]))


def erase_gate_refusal(spec: FamilySpec, target: str, takes_erase: bool) -> str | None:
    """Why `target` cannot take a layer of `spec` for its erase gate (Gated DeltaNet-2), or None. `takes_erase`:
    whether the target's lowering runs it (Target.erase_gate, kept in step with each lowering's engine by
    tests/families/test_gdn2_clvr.py); elsewhere a layer with one is refused by name before anything is traced."""
    if not spec.erase_gate or takes_erase:
        return None
    return f"the {target} lowering has no erase gate yet; it is planned"


@dataclass(frozen=True)
class LayerDims:
    """Sizes of one linear-attention layer; state shapes follow from these and the spec."""

    hidden_size: int
    num_heads: int  # value heads: one state matrix each
    num_k_heads: int  # query/key heads, shared by groups of value heads (GVA), <= num_heads
    head_k_dim: int  # query/key width before the feature map
    head_v_dim: int
    conv_size: int = 4
    conv_bias: bool = False

    @property
    def key_width(self) -> int:
        return self.num_k_heads * self.head_k_dim

    @property
    def value_width(self) -> int:
        return self.num_heads * self.head_v_dim

    @property
    def conv_channels(self) -> int:
        return 2 * self.key_width + self.value_width


# What a state tensor holds. Accumulators sum over every past token (precision matters: they stay
# float32 in the reference); caches only hold recent inputs (conv taps, attention keys/values).
STATE_ROLES = ("recurrent", "normalizer", "conv", "key", "value")
ACCUMULATOR_ROLES = ("recurrent", "normalizer")


@dataclass(frozen=True)
class StateTensor:
    """One recurrent-state tensor of a layer. Dims are ints or symbolic names ('batch').
    `role` is one of STATE_ROLES; `dtype` is its storage dtype in exported graphs."""

    name: str
    dims: tuple[int | str, ...]
    role: str
    dtype: str = "float32"
    init: str = "zeros"

    def __post_init__(self) -> None:
        if self.role not in STATE_ROLES:
            raise ValueError(f"state tensor {self.name!r}: role {self.role!r} is not one of {', '.join(STATE_ROLES)}")
        if self.dtype not in STATE_DTYPES:
            raise ValueError(f"state tensor {self.name!r}: dtype {self.dtype!r} is not one of "
                             f"{', '.join(STATE_DTYPES)}")

    @property
    def accumulates(self) -> bool:
        return self.role in ACCUMULATOR_ROLES


def linear_state_tensors(spec: FamilySpec, dims: LayerDims) -> list[StateTensor]:
    d_state = spec.feature.out_dim(dims.head_k_dim)
    tensors = [StateTensor("recurrent_state", ("batch", dims.num_heads, d_state, dims.head_v_dim), "recurrent")]
    if spec.normalizer:  # its own tensor, updated on its own (never a column appended to S)
        tensors.append(StateTensor("normalizer", ("batch", dims.num_heads, d_state), "normalizer"))
    if spec.short_conv:
        tensors.append(StateTensor("conv_state", ("batch", dims.conv_channels, dims.conv_size - 1), "conv"))
    return tensors
