"""The declarative family spec: the one place a family's math is stated.

Everything else derives from a `FamilySpec`: the mixer's parameters and projections
(`edgelin.model.mixer`), the recurrence engines (`edgelin.reference.recurrence`, which only see
"is there a decay tensor / a beta tensor"), the state tensors of the step and prefill graphs and
every export target. A family file is a single `FamilySpec(...)` value.

Shared math per head (state S is d_k x d_v):
    S_t = decay_t * S_{t-1}                                 (Decay: none, fixed, scalar, per_key)
    S_t = S_t + k_t v_t^T                                   (additive rule), or
    S_t = S_t + beta_t k_t (v_t - S_t^T k_t)^T              (delta rule)
    o_t = S_t^T q_t   [ / (q_t^T z_t + eps) with normaliser z_t = decay z_{t-1} + k_t ]

A family is its identity (decay kind, gate, update rule, Mamba2's dt-scaled values and D skip,
RetNet's rotary); the knobs below it (`KNOBS`) are details real checkpoints vary, which a model
config may set per family. Anything else is refused.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from enum import Enum

from edgelin.errors import EdgelinError
from edgelin.families.feature_maps import FEATURE_MAPS


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

    def with_overrides(self, overrides: dict) -> "FamilySpec":
        """Apply config overrides, refusing any field that is not a knob."""
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
        if "output_gate" in values and isinstance(values["output_gate"], str):
            values["output_gate"] = OutputGate(values["output_gate"])
        if isinstance(values.get("dt_clamp"), list):
            values["dt_clamp"] = tuple(values["dt_clamp"])
        try:
            return dataclasses.replace(self, **values)
        except ValueError as exc:
            raise EdgelinError(f"config overrides for {self.name!r}", str(exc), "fix the overrides") from exc


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


@dataclass(frozen=True)
class StateTensor:
    """One recurrent-state tensor of a layer. Dims are ints or symbolic names ('batch')."""

    name: str
    dims: tuple[int | str, ...]
    dtype: str = "float32"
    init: str = "zeros"


def linear_state_tensors(spec: FamilySpec, dims: LayerDims) -> list[StateTensor]:
    d_state = spec.feature.out_dim(dims.head_k_dim)
    tensors = [StateTensor("recurrent_state", ("batch", dims.num_heads, d_state, dims.head_v_dim))]
    if spec.normalizer:
        tensors.append(StateTensor("normalizer", ("batch", dims.num_heads, d_state)))
    if spec.short_conv:
        tensors.append(StateTensor("conv_state", ("batch", dims.conv_channels, dims.conv_size - 1)))
    return tensors
