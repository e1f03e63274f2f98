"""The one linear-attention token mixer. Its parameters and its forward pass are read off the
layer's `FamilySpec`; no family is named here.

x -> q, k, v projections -> [short conv + SiLU] -> heads -> [rotary] -> feature map -> [L2 norm]
  -> [scale q] -> decay g, beta [, erase gate e, write gate w] from x -> recurrence engine
  -> [normaliser] -> [D skip] -> [norm / gate] -> o_proj [+ CLVR route]

CLVR (cross-layer value routing, a model option: ModelConfig.clvr): the value the layer writes into
its memory (the delta rule's target before the subtraction: v after the conv, the write gate and
Mamba2's dt) is projected into the shared hidden stream through a zero-initialised projection and
added to the layer's output, i.e. to the residual, where every later layer reads it. No state.

The recurrence runs through an engine (edgelin.reference.engine): the one a target's lowering
installed with `use_engine` (edgelin.export.lowering), else the kernel dispatch's choice for the
tensors at hand (GPU kernels for CUDA tensors under EDGELIN_KERNELS=auto, the torch reference
otherwise). The mixer itself holds no target- or device-specific code.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import nn

from edgelin.families import Decay, FamilySpec, Gate, LayerDims, OutputGate, StateTensor
from edgelin.families.feature_maps import orthogonal_random_features
from edgelin.families.spec import linear_state_tensors
from edgelin.kernels.dispatch import KernelEngine, engine_for
from edgelin.model.layers import GroupRMSNorm, RMSNorm, Rotary, positions_from, short_conv
from edgelin.errors import EdgelinError
from edgelin.reference.engine import Engine, takes_erase

Tensor = torch.Tensor
# An engine installed for this context (a target's lowering while its graphs are traced, see
# edgelin.export.lowering); None: the kernel dispatch chooses per call (edgelin.kernels.dispatch).
_ENGINE: contextvars.ContextVar[Engine | None] = contextvars.ContextVar("edgelin_engine", default=None)


@contextlib.contextmanager
def use_engine(engine: Engine | None) -> Iterator[Engine | None]:
    """Run every linear mixer's recurrence through `engine` inside the block (None: dispatch)."""
    token = _ENGINE.set(engine)
    try:
        yield engine
    finally:
        _ENGINE.reset(token)


def select_engine(state: Tensor, q: Tensor, k: Tensor, v: Tensor, g: Tensor | None, beta: Tensor | None,
                  erase: Tensor | None = None) -> Engine:
    installed = _ENGINE.get()
    return installed if installed is not None else engine_for(state, q, k, v, g, beta, erase)


def _projection(hidden: int, out: int, low_rank: int, low_rank_bias: bool = True) -> nn.Module:
    if low_rank:
        return nn.Sequential(nn.Linear(hidden, low_rank, bias=False), nn.Linear(low_rank, out, bias=low_rank_bias))
    return nn.Linear(hidden, out, bias=False)


# Gated DeltaNet-2's gates start at sigmoid(3) ~ 0.95 for every token (zero weights): the layer
# starts as Gated DeltaNet with beta * 0.95, a gate still far enough from saturation to learn.
GATE_BIAS_INIT = 3.0


def _zero_linear(hidden: int, out: int) -> nn.Linear:
    """A Linear whose weight CausalLM's init leaves at zero (`zero_init`): it starts as a no-op."""
    layer = nn.Linear(hidden, out, bias=False)
    nn.init.zeros_(layer.weight)
    layer.zero_init = True
    return layer


class LinearMixer(nn.Module):
    def __init__(self, spec: FamilySpec, dims: LayerDims, eps: float, rope_theta: float, feature_seed: int,
                 clvr: bool = False):
        super().__init__()
        self.spec, self.dims = spec, dims
        h, d_k, d_v = dims.num_heads, dims.head_k_dim, dims.head_v_dim
        self.d_state = spec.feature.out_dim(d_k)
        self.q_proj = nn.Linear(dims.hidden_size, dims.key_width, bias=False)
        self.k_proj = nn.Linear(dims.hidden_size, dims.key_width, bias=False)
        self.v_proj = nn.Linear(dims.hidden_size, dims.value_width, bias=False)
        if spec.short_conv:
            self.conv1d = nn.Parameter(torch.randn(dims.conv_channels, dims.conv_size) / dims.conv_size**0.5)
            if dims.conv_bias:
                self.conv1d_bias = nn.Parameter(torch.zeros(dims.conv_channels))
        if spec.feature.needs_projection:
            self.register_buffer("feature_projection", orthogonal_random_features(self.d_state, d_k, feature_seed))
        if spec.feature.module is not None:
            self.feature_map_q, self.feature_map_k = spec.feature.module(d_k), spec.feature.module(d_k)
        if spec.rotary:
            self.rotary = Rotary(self.d_state, rope_theta)
        if spec.decay is Decay.FIXED:
            self.register_buffer("log_gamma", spec.fixed_log_decay(h), persistent=False)
        if spec.gate is not None:
            gate_width = h if spec.decay is Decay.SCALAR else h * self.d_state
            self.gate_proj = _projection(dims.hidden_size, gate_width, spec.gate_low_rank, spec.gate_low_rank_bias)
        if spec.gate is Gate.SOFTPLUS:
            self.A_log = nn.Parameter(torch.log(torch.empty(h).uniform_(1, 16)))
            self.dt_bias = nn.Parameter(torch.log(torch.expm1(torch.empty(gate_width).uniform_(1e-3, 1e-1))))
        if spec.delta_rule and spec.use_beta:
            self.b_proj = nn.Linear(dims.hidden_size, h, bias=False)
        if spec.erase_gate:  # over the key channels of each value head's state
            self.erase_proj = _zero_linear(dims.hidden_size, h * self.d_state)
            self.erase_bias = nn.Parameter(torch.full((h * self.d_state,), GATE_BIAS_INIT))
        if spec.write_gate:  # over the value channels
            self.write_proj = _zero_linear(dims.hidden_size, dims.value_width)
            self.write_bias = nn.Parameter(torch.full((dims.value_width,), GATE_BIAS_INIT))
        self.clvr = clvr
        if clvr:
            self.clvr_proj = _zero_linear(dims.value_width, dims.hidden_size)
        if spec.skip_d:
            self.D = nn.Parameter(torch.ones(h))
        if spec.output_norm:  # per head (weights shared by heads), or per group of heads sharing a key head
            self.o_norm = RMSNorm(d_v, eps) if spec.output_norm_scope == "head" else \
                GroupRMSNorm(dims.value_width, dims.num_k_heads, eps)
        if spec.output_gate is not OutputGate.NONE:
            self.g_proj = _projection(dims.hidden_size, dims.value_width, spec.output_gate_low_rank)
        self.o_proj = nn.Linear(dims.value_width, dims.hidden_size, bias=False)

    # ---- state ---------------------------------------------------------------------------------
    def state_tensors(self) -> list[StateTensor]:
        return linear_state_tensors(self.spec, self.dims)

    # ---- forward -------------------------------------------------------------------------------
    def forward(
        self, x: Tensor, state: dict[str, Tensor], start: Tensor | None = None, mode: str = "chunked"
    ) -> tuple[Tensor, dict[str, Tensor]]:
        """x [B, T, hidden]; state per `state_tensors`; start [B]: position of x[:, 0].
        mode: 'chunked' (parallel form) or 'recurrent' (token loop; the step graph uses T = 1)."""
        spec, dims = self.spec, self.dims
        batch, length, _ = x.shape
        h, hk = dims.num_heads, dims.num_k_heads
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        new_state: dict[str, Tensor] = {}
        # A lowering's engine may take one token with its time axis kept (`step_t1`: the ONNX step, fewer
        # nodes; edgelin.export.lowering): then the conv sums its window in one reduction and grouped key
        # heads are broadcast by the engine, not repeated here. The reference's step math, summed in
        # another order (rounding-level differences); the engine also brings its softplus and L2 norm.
        installed = _ENGINE.get()
        t1 = (mode != "chunked" and length == 1 and hasattr(installed, "step_t1") and not spec.normalizer
              and not spec.erase_gate)
        if spec.short_conv:
            conv_t1 = getattr(installed, "short_conv_t1", None) if t1 else None  # the engine's one-token conv
            if conv_t1 is not None:
                qkv, new_state["conv_state"] = conv_t1(torch.cat([q, k, v], -1), self.conv1d, state["conv_state"],
                                                       getattr(self, "conv1d_bias", None))
            else:
                qkv, new_state["conv_state"] = short_conv(torch.cat([q, k, v], -1), self.conv1d, state["conv_state"],
                                                          getattr(self, "conv1d_bias", None), taps=mode == "recurrent",
                                                          window_sum=t1)
            q, k, v = qkv.split([dims.key_width, dims.key_width, dims.value_width], -1)
        q = q.reshape(batch, length, hk, dims.head_k_dim)
        k = k.reshape(batch, length, hk, dims.head_k_dim)
        v = v.reshape(batch, length, h, dims.head_v_dim)
        q = spec.feature.fn(q, getattr(self, "feature_map_q", getattr(self, "feature_projection", None)), True)
        k = spec.feature.fn(k, getattr(self, "feature_map_k", getattr(self, "feature_projection", None)), False)
        if spec.rotary:
            positions = positions_from(start, batch, length, x.device)
            q, k = self.rotary(q, positions), self.rotary(k, positions)
        scaled = False  # q already scaled by d_state^-0.5
        l2_normalize = getattr(installed, "l2_normalize", None)  # a lowering's fused form (ONNX: one node)
        if spec.qk_norm == "l2" and l2_normalize is not None:
            scaled = spec.scale_queries
            q, k = l2_normalize(q, 1e-6, self.d_state**-0.5 if scaled else 1.0), l2_normalize(k, 1e-6)
        elif spec.qk_norm == "l2":  # x / sqrt(|x|^2 + eps): fla's and transformers' form
            q, k = (t * torch.rsqrt((t * t).sum(-1, keepdim=True) + 1e-6) for t in (q, k))
        elif spec.qk_norm == "sum":
            q, k = F.normalize(q, p=1, dim=-1, eps=1e-6), F.normalize(k, p=1, dim=-1, eps=1e-6)
        if spec.scale_queries and not scaled:
            q = q * self.d_state**-0.5
        # One key head for all (Mamba2's single group): an engine whose chunked form broadcasts it takes it as is
        # (not a normaliser's: its forms take them repeated)
        shared = (hk == 1 and mode == "chunked" and not spec.normalizer
                  and getattr(installed, "broadcasts_one_key_head", False))
        if hk != h and not t1 and not shared:  # grouped value heads share a key head
            q, k = q.repeat_interleave(h // hk, dim=2), k.repeat_interleave(h // hk, dim=2)

        g, dt = self._log_decay(x, batch, length)  # float32 whatever x's dtype (see there)
        beta = None
        if spec.delta_rule:
            beta = torch.sigmoid(self.b_proj(x).float()) if spec.use_beta else x.new_ones(batch, length, h)
            beta = beta * spec.beta_scale if spec.beta_scale != 1.0 else beta
        values = v * dt.to(v.dtype) if spec.value_dt else v  # dt [B, T, H, 1]
        erase = None
        if spec.erase_gate:
            erase = torch.sigmoid(self.erase_proj(x).float() + self.erase_bias).reshape(batch, length, h, -1)
        if spec.write_gate:  # it writes k (w * v)^T: folded into v, the engines never see it
            gate = torch.sigmoid(self.write_proj(x).float() + self.write_bias).reshape(v.shape)
            values = values * gate.to(values.dtype)

        # The precision boundary (fp16 graphs, issue 11): the recurrence, its state, the decay and the
        # gates run in float32; only its output returns to the weights' dtype. The one place it is cast
        # (a no-op, and no graph node, for float32 models), so every target's lowering sees the same cut.
        # The GPU kernels take q, k, v in the weights' dtype and g, beta in float32 (launcher ABI 2's
        # aux dtype: a half-precision step still decays in float32), accumulating in float32 inside.
        compute = x.dtype
        engine = select_engine(state["recurrent_state"], q, k, values, g, beta, erase)
        takes_compute_dtype = isinstance(engine, KernelEngine) or (  # the TensorRT plugin node's step too
            mode != "chunked" and length == 1 and getattr(engine, "step_takes_compute_dtype", False))
        if takes_compute_dtype:  # q, k, v as they are; g and beta float32
            g, beta = (None if t is None else t.float() for t in (g, beta))
        else:
            q, k, values, g, beta = (None if t is None else t.float() for t in (q, k, values, g, beta))
        if t1:  # o [B, 1, H, d_v] straight from the engine: no squeeze / unsqueeze around it
            o, new_state["recurrent_state"] = engine.step_t1(state["recurrent_state"], q, k, values, g, beta)
        else:
            o, new_state["recurrent_state"] = self._recurrence(engine, mode, state["recurrent_state"], q, k, values,
                                                               g, beta, erase)
        if spec.normalizer:  # its own state z: o = q^T S / (q^T z + eps), S and z updated apart
            den, new_state["normalizer"] = self._normalizer(engine, mode, state["normalizer"], q, k, g)
            o = (o / (den.unsqueeze(-1) + spec.normalizer_eps)).to(o.dtype)  # fp32 z, o in v's dtype
        o = o.to(compute)
        ordered = {t.name: new_state[t.name] for t in self.state_tensors()}  # the spec's order
        out = self._readout(o, v, x)
        if self.clvr:  # the written value, routed into the residual stream
            out = out + self.clvr_proj(values.to(compute).flatten(-2))
        return out, ordered

    def _recurrence(self, engine: Engine, mode: str, s: Tensor, q: Tensor, k: Tensor, v: Tensor, g: Tensor | None,
                    beta: Tensor | None, erase: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """S through the engine's form for `mode`: chunked, one step (T = 1: the step graph) or a loop."""
        form = "chunked" if mode == "chunked" else "step" if q.shape[1] == 1 else "recurrent"
        extra = {} if erase is None else {"erase": erase if form != "step" else erase[:, 0]}
        if erase is not None and not takes_erase(engine, form):  # never run a GDN-2 layer as plain GDN
            raise EdgelinError(
                f"the {engine.name} engine cannot run a {self.spec.name} layer",
                f"its {form} form has no erase-gate input (an engine built before the erase gate)",
                "use an engine that takes `erase` (every edgelin target and kernel does), or the torch reference")
        if form == "chunked":
            return engine.chunked(s, q, k, v, g, beta, self.spec.chunk_size, **extra)
        if form == "step":
            o, s = engine.step(s, *(None if t is None else t[:, 0] for t in (q, k, v, g, beta)), **extra)
            return o.unsqueeze(1), s
        return engine.recurrent(s, q, k, v, g, beta, **extra)

    def _normalizer(self, engine: Engine, mode: str, z: Tensor, q: Tensor, k: Tensor,
                    g: Tensor | None) -> tuple[Tensor, Tensor]:
        """(q^T z at every token [B, T, H], final z), the same form as `_recurrence` picks."""
        if mode == "chunked":
            return engine.normalizer_chunked(z, q, k, g, self.spec.chunk_size)
        if q.shape[1] == 1:
            den, z = engine.normalizer_step(z, *(None if t is None else t[:, 0] for t in (q, k, g)))
            return den.unsqueeze(1), z
        return engine.normalizer_recurrent(z, q, k, g)

    def _log_decay(self, x: Tensor, batch: int, length: int) -> tuple[Tensor | None, Tensor | None]:
        """(g, dt): g is [B, T, H, 1 | d_state] or None; dt is the softplus step size (or None)."""
        spec, h = self.spec, self.dims.num_heads
        if spec.decay is Decay.NONE:
            return None, None
        if spec.decay is Decay.FIXED:
            return self.log_gamma.view(1, 1, h, 1).expand(batch, length, h, 1), None
        raw = self.gate_proj(x).reshape(batch, length, h, -1).float()  # decay arithmetic in float32 (fp16 graphs)
        if spec.gate is Gate.LOGSIGMOID:
            g = F.logsigmoid(raw) / spec.gate_normalizer
            return (g if spec.gate_clamp_min is None else g.clamp_min(spec.gate_clamp_min)), None
        softplus = getattr(_ENGINE.get(), "softplus", F.softplus)  # a lowering's may export as one node
        dt = softplus(raw + self.dt_bias.view(h, -1))
        if spec.dt_clamp is not None:
            dt = dt.clamp(*spec.dt_clamp)
        g = -torch.exp(self.A_log).view(1, 1, h, 1) * dt
        return g, dt  # dt [B, T, H, 1 | d_state]

    def _readout(self, o: Tensor, v: Tensor, x: Tensor) -> Tensor:
        """o, v [B, T, H, d_v] -> [B, T, hidden]. Heads are flattened as soon as nothing reads them
        per head (a per-head norm does): the gate, a group norm and o_proj then take [B, T, H * d_v]
        as it comes, with no reshape back and forth (graph nodes in every step)."""
        spec = self.spec
        if spec.skip_d:
            o = o + self.D.view(-1, 1) * v
        per_head = spec.output_norm and spec.output_norm_scope == "head"
        if not per_head:
            o = o.flatten(-2)
        if spec.output_gate is not OutputGate.NONE:
            raw = self.g_proj(x)
            raw = raw.reshape(o.shape) if per_head else raw
            gate = torch.sigmoid(raw) if spec.output_gate_activation == "sigmoid" else F.silu(raw)
            if spec.output_gate is OutputGate.BEFORE_NORM:
                o = o * gate
        if spec.output_norm:  # RMSNorm per head, or GroupRMSNorm over the flat heads
            o = self.o_norm(o)
        if spec.output_gate is OutputGate.AFTER_NORM:
            o = o * gate
        return self.o_proj(o.flatten(-2) if per_head else o)
