"""The config-driven causal LM: embeddings, pre-norm blocks (token mixer per layer + SwiGLU MLP),
final norm, LM head. The recurrent state is explicit: a list (one entry per layer) of dicts."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from edgelin.families import SOFTMAX, StateTensor
from edgelin.model.attention import SoftmaxAttention
from edgelin.model.config import ModelConfig
from edgelin.model.layers import RMSNorm
from edgelin.model.mixer import LinearMixer

Tensor = torch.Tensor
State = list[dict[str, Tensor]]


class MLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):
    def __init__(self, config: ModelConfig, layer: int):
        super().__init__()
        self.input_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        if config.layer_types[layer] == SOFTMAX:
            self.mixer: nn.Module = SoftmaxAttention(config.hidden_size, config.attention, config.rms_norm_eps)
        else:
            self.mixer = LinearMixer(
                config.spec(layer), config.dims(), config.rms_norm_eps, config.rope_theta, config.feature_seed + layer,
                clvr=config.clvr,
            )
        if config.intermediate_size:
            self.post_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
            self.mlp = MLP(config.hidden_size, config.intermediate_size)

    def forward(self, x: Tensor, state: dict[str, Tensor], start: Tensor | None, mode: str, last_only: bool = False):
        mixed, state = self.mixer(self.input_norm(x), state, start, mode)
        x = x + mixed
        if last_only:  # the state needed every token; what follows only feeds the last logits
            x = x[:, -1:]
        return (x + self.mlp(self.post_norm(x)) if hasattr(self, "mlp") else x), state


class Backbone(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(Block(config, i) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class CausalLM(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.model = Backbone(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.apply(_init_weights)

    # ---- state ---------------------------------------------------------------------------------
    def state_tensors(self) -> list[list[StateTensor]]:
        return [block.mixer.state_tensors() for block in self.model.layers]

    @property
    def needs_position(self) -> bool:
        return any(
            isinstance(b.mixer, SoftmaxAttention) or b.mixer.spec.needs_position for b in self.model.layers
        )

    def initial_state(self, batch: int, past: int = 0, device=None, dtype: torch.dtype = torch.float32) -> State:
        """Zeros for every state tensor ('past_sequence' dims get length `past`). Accumulators
        (recurrent states, normalisers) stay fp32 whatever `dtype` is; conv and KV caches take
        `dtype`, the weights' precision, since they hold projected activations."""
        sizes = {"batch": batch, "past_sequence": past}
        return [
            {t.name: torch.zeros([sizes.get(d, d) for d in t.dims], device=device,
                                 dtype=torch.float32 if t.accumulates else dtype) for t in layer}
            for layer in self.state_tensors()
        ]

    # ---- forward -------------------------------------------------------------------------------
    def forward(
        self,
        input_ids: Tensor,
        state: State | None = None,
        start: Tensor | None = None,
        mode: str = "chunked",
        last_only: bool = False,
    ) -> tuple[Tensor, State]:
        """input_ids [B, T] -> (logits [B, T, V] or [B, V] with last_only, new state).
        start [B]: position of input_ids[:, 0] (None: 0). mode: 'chunked' or 'recurrent'."""
        if state is None:
            state = self.initial_state(input_ids.shape[0], device=input_ids.device)
        x = self.model.embed_tokens(input_ids)
        new_state: State = []
        last = len(self.model.layers) - 1
        for i, (block, layer_state) in enumerate(zip(self.model.layers, state)):
            x, layer_state = block(x, layer_state, start, mode, last_only=last_only and i == last)
            new_state.append(layer_state)
        if last_only:
            x = x[:, -1]
        return self.lm_head(self.model.norm(x)), new_state

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())


def _init_weights(module: nn.Module) -> None:
    if isinstance(module, (nn.Linear, nn.Embedding)):
        if getattr(module, "zero_init", False):  # starts as a no-op (CLVR's route, GDN-2's gates: mixer.py)
            nn.init.zeros_(module.weight)
        else:
            nn.init.normal_(module.weight, std=0.02)
        if getattr(module, "bias", None) is not None:
            nn.init.zeros_(module.bias)


# What stays float32 in a half-precision copy: decay rates and rotary frequencies. Rounded to fp16 they
# would shift every decay (exp(A) by up to 0.1 %, compounding over the steps) and, at long positions,
# every rotary angle; they are a few numbers per layer.
FLOAT32_TENSORS = ("A_log", "dt_bias", "log_gamma", "inv_freq")


def with_compute_dtype(model: CausalLM, dtype: torch.dtype) -> CausalLM:
    """A copy of `model` whose weights are `dtype` (fp16 graphs) except FLOAT32_TENSORS, which keep
    the original's float32 values. The recurrence casts its inputs to float32 itself (LinearMixer)."""
    import copy

    if dtype == torch.float32:
        return model
    originals = {**dict(model.named_parameters()), **dict(model.named_buffers())}
    low = copy.deepcopy(model)  # deepcopy keeps tied weights tied
    limit = torch.finfo(dtype).max
    with torch.no_grad():  # a value beyond dtype's range is stored saturated, not as inf (beyond_range warns)
        for tensor in [*low.parameters(), *low.buffers()]:
            if tensor.is_floating_point():
                tensor.clamp_(-limit, limit)
    low = low.to(dtype)
    for name, tensor in [*low.named_parameters(), *low.named_buffers()]:
        if name.rsplit(".", 1)[-1] in FLOAT32_TENSORS:
            tensor.data = originals[name].detach().clone().float()
    return low


RANGE_PIECE = 1 << 24  # elements beyond_range reads at a time


def beyond_range(model: CausalLM, dtype: torch.dtype, matmul_weights: bool = False,
                 embeddings: bool = True) -> tuple[int, str, float] | None:
    """Values a `dtype` copy stores saturated at its largest finite value: (how many, the tensor holding the
    largest magnitude, that value), or None. Over what with_compute_dtype converts, or with `matmul_weights`
    over what --quantize fp16 stores in float16: the Linear weights and (`embeddings`) the embedding table."""
    limit = torch.finfo(dtype).max
    if matmul_weights:
        kinds = (nn.Linear, nn.Embedding) if embeddings else (nn.Linear,)
        tensors = [(f"{m}.weight", module.weight) for m, module in model.named_modules() if isinstance(module, kinds)]
    else:
        tensors = [(name, t) for name, t in [*model.named_parameters(), *model.named_buffers()]
                   if t.is_floating_point() and name.rsplit(".", 1)[-1] not in FLOAT32_TENSORS]
    count, worst_name, worst_value, seen = 0, "", 0.0, set()
    with torch.no_grad():
        for name, tensor in tensors:
            if id(tensor) in seen:  # a tied LM head is the embedding table
                continue
            seen.add(id(tensor))
            flat = tensor.detach().reshape(-1)
            for lo in range(0, flat.numel(), RANGE_PIECE):  # a slice at a time: a 248k-token table's |x| is 1 GB
                magnitude = flat[lo:lo + RANGE_PIECE].abs()
                over = int((magnitude > limit).sum())
                if over:
                    count += over
                    peak = float(flat[lo + int(magnitude.argmax())])
                    if abs(peak) > abs(worst_value):
                        worst_name, worst_value = name, peak
    return (count, worst_name, worst_value) if count else None
