"""The PyTorch reference's side of the checks, shared by the export (edgelin/export/reference_vectors.py
records it) and `validate --against CKPT` (computes it live): the reference's state as flat arrays, its
quality figures, and the reference a weight-quantised export's parity is checked against.

An int4 model is not the fp32 model. Its recurrent state drifts from the fp32 model's by the
quantisation alone (a trained 12-layer Mamba2 at int4: states 0.26-0.85 of their scale away, logits
0.06-0.14, top-1 92%), so a parity check against the fp32 reference mixes two questions: what the
quantisation costs, and whether the runtime computes this artifact right. edgelin keeps them apart:

  fp32 reference --(quality figures: top-1, perplexity change, against the precision's bounds)-->
  reference with the export's dequantised weights --(parity: logits and every state, the precision's
  threshold)--> the artifact

The second reference is built here: every quantised tensor of the graphs, unpacked to float in numpy
(edgelin/artifact/quantized.py), gives each 2-D parameter or buffer of the model the rows that match it
within half a quantisation step (round-to-nearest's bound), found by value, so fused matmuls (several
modules' weights side by side), transposed heads and tied tables need no name bookkeeping. One tie is split:
a table whose rows are not a whole number of blocks stays float in the graphs while the LM head tied to it is
quantised, so the reference's head takes the dequantised rows and its embedding keeps the float ones
(_untie_products). The reference's products take their activations as the artifact's do: MatMulNBits at
accuracy_level 4 rounds each block of inputs to int8 steps, so each nn.Linear whose weight came from such a product
rounds its input the same way (round_activation_blocks). What stays between the two is the float arithmetic's order
and the roundings it flips (docs/checks.md "Quantised exports: two references").

Torch is imported inside the functions (they take a CausalLM); the replay on a device reads only what the
recorded reference vectors hold.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import copy
import functools
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from edgelin.artifact.quality import (GREEDY_PROMPT, GREEDY_STEPS, RANDOM_SOURCE, QualityReference, greedy_steps_for,
                                      quantization_of)
from edgelin.artifact.quantized import Dequantized, float_lookups, iter_quantized
from edgelin.artifact.state import state_input_name

if TYPE_CHECKING:
    import torch

    from edgelin.artifact.manifest import Manifest
    from edgelin.model.lm import CausalLM


def flat_state(state: list[dict[str, Any]]) -> dict[str, np.ndarray]:
    """The reference's per-layer state as {past_key_values.{layer}.{name}: numpy array}."""
    return {state_input_name(i, name): t.detach().cpu().numpy() for i, layer in enumerate(state)
            for name, t in layer.items()}


def reference_quality(model: "CausalLM", vocab: int, text_ids: np.ndarray | None = None,
                      source: str = RANDOM_SOURCE, seed: int = 0, greedy_steps: int | None = None,
                      window_bytes: int = 64 << 20) -> QualityReference:
    """The fp32 reference's side of the quality figures (edgelin/artifact/quality.py): its greedy rollout from
    the text's first GREEDY_PROMPT tokens (seeded random ones without text), through the recurrent
    form, token by token as a decoder runs; and its log p(next) and argmax over the text (chunked
    forward in windows of at most `window_bytes` of float64 log-probs, carrying the state, so memory
    stays flat for any vocabulary and text length)."""
    import torch

    if greedy_steps is None:  # fewer for a large model (greedy_steps_for; recorded); GREEDY_STEPS read here: tests shorten it
        greedy_steps = min(GREEDY_STEPS, greedy_steps_for(model.num_parameters()))
    rng = np.random.default_rng(seed)
    prompt = (text_ids[:GREEDY_PROMPT] if text_ids is not None and len(text_ids) > GREEDY_PROMPT
              else rng.integers(0, vocab, GREEDY_PROMPT, dtype=np.int64))
    feed = np.concatenate([prompt, np.zeros(greedy_steps - 1, np.int64)])  # the prompt, then each greedy token
    greedy = np.empty(greedy_steps, np.int64)
    state = None
    with torch.no_grad():
        for t in range(len(feed)):
            logits, state = model(torch.from_numpy(feed[None, t:t + 1]), state, torch.tensor([t]), mode="recurrent")
            if t + 1 >= len(prompt):
                greedy[t + 1 - len(prompt)] = int(logits.reshape(-1).argmax())
                if t + 1 < len(feed):
                    feed[t + 1] = greedy[t + 1 - len(prompt)]
        if text_ids is None:
            return QualityReference(source, np.concatenate([prompt, greedy]), len(prompt))
        scored = len(text_ids) - 1
        window = max(1, min(256, window_bytes // (vocab * 8)))
        logprob, argmax, state = np.empty(scored), np.empty(scored, np.int64), None
        for lo in range(0, scored, window):
            ids = torch.from_numpy(text_ids[None, lo:min(lo + window, scored)])
            logits, state = model(ids, state, torch.tensor([lo]), mode="chunked")
            logp = torch.log_softmax(logits[0].double(), -1)
            nxt = torch.from_numpy(text_ids[lo + 1:lo + 1 + ids.shape[1]])
            logprob[lo:lo + ids.shape[1]] = logp.gather(-1, nxt[:, None])[:, 0].numpy()
            argmax[lo:lo + ids.shape[1]] = logits[0].argmax(-1).numpy()
    return QualityReference(source, np.concatenate([prompt, greedy]), len(prompt), np.asarray(text_ids, np.int64),
                            logprob, argmax)



# ---- the reference with the export's dequantised weights -------------------------------------------
MATCH_ROWS = 4096  # rows compared at a time: a 248k-token table's temporaries would be 1 GB each
SCREEN_COLUMNS = 8  # elements of a weight's first row checked one by one before candidate rows are compared whole
def _match(param: np.ndarray, tensor: Dequantized) -> int | None:
    """The first row offset at which `param` [A, K] lies within half a step of `tensor`'s rows, or None."""
    rows, cols = param.shape
    if cols != tensor.rows.shape[1] or rows > tensor.rows.shape[0]:
        return None
    bound = tensor.bound
    # Candidates by the first element (cheap), then the whole block.
    first = np.flatnonzero(np.abs(tensor.rows[:, 0] - param[0, 0]) <= bound[:, 0])
    first = first[first + rows <= tensor.rows.shape[0]]
    # A few more single elements before whole rows: at int4 a random weight's first element lies within half a step
    # of ~12% of a 248k-token table's rows, whose whole rows would be compared for every weight of its width.
    for column in range(1, min(cols, SCREEN_COLUMNS)):
        if len(first) <= 1:
            break
        first = first[np.abs(tensor.rows[first, column] - param[0, column]) <= bound[first, column]]
    first = first[(np.abs(tensor.rows[first] - param[0]) <= bound[first]).all(1)]
    for offset in first:
        pieces = [(lo, min(lo + MATCH_ROWS, rows)) for lo in range(0, rows, MATCH_ROWS)]
        if all((np.abs(tensor.rows[offset + lo:offset + hi] - param[lo:hi]) <= bound[offset + lo:offset + hi]).all()
               for lo, hi in pieces):
            return int(offset)
    return None


@dataclass(frozen=True)
class Account:
    """What the dequantised reference took: parameters replaced, and quantised rows no parameter matched
    (0 when the reference carries every quantised weight of the artifact)."""

    replaced: tuple[str, ...]
    unmatched_rows: int
    total_rows: int

    @property
    def complete(self) -> bool:
        return self.unmatched_rows == 0 and bool(self.replaced)

    def to_dict(self) -> dict[str, Any]:
        return {"weights": "the export's own dequantised weights", "replaced": list(self.replaced),
                "unmatched_rows": self.unmatched_rows, "total_rows": self.total_rows}


def _same_table(param: np.ndarray, table: np.ndarray) -> bool:
    """`table` is `param` stored float (in the graph's dtype: float16 graphs hold float16 tables)."""
    return table.shape == param.shape and np.array_equal(param.astype(table.dtype), table)


def _untie_products(model: "CausalLM", weight: Any, dequantized: Any) -> list[str]:
    """The artifact looks `weight`'s rows up in a float copy but multiplies by its quantised copy (a table tied to
    the LM head whose rows are not a whole number of blocks: edgelin.export.quantize): every module but the
    embeddings that holds `weight` gets its own parameter with the `dequantized` values; the embeddings keep the
    float one. Returns the parameters given the dequantised values."""
    import torch

    untied, own = [], dequantized.clone()
    for module_name, module in list(model.named_modules()):
        if isinstance(module, torch.nn.Embedding):
            continue
        for attr, held in list(module.named_parameters(recurse=False)):
            if held is weight:
                setattr(module, attr, torch.nn.Parameter(own, requires_grad=held.requires_grad))
                untied.append(f"{module_name}.{attr}" if module_name else attr)
    return untied


def _replace(model: "CausalLM", held: Any, value: Any) -> None:
    """Every module of `model` holding tensor `held` (tied ones too) gets `value` instead (never written in place:
    the tensor is the original model's)."""
    import torch

    for module in model.modules():
        for attr, tensor in list(module.named_parameters(recurse=False)):
            if tensor is held:
                setattr(module, attr, torch.nn.Parameter(value, requires_grad=tensor.requires_grad))
        for attr, tensor in list(module.named_buffers(recurse=False)):
            if tensor is held:
                module.register_buffer(attr, value, persistent=attr not in module._non_persistent_buffers_set)


def with_export_weights(model: "CausalLM", folder: Path, graph_files: list[str],
                        in_place: bool = False) -> tuple["CausalLM", Account]:
    """A copy of `model` whose weights are the export's dequantised ones (the model is left as it is; `in_place`:
    the model itself becomes it, see with_dequantized)."""
    return with_dequantized(model, iter_quantized(folder, graph_files, lazy=True), float_lookups(folder, graph_files),
                            in_place)


def with_dequantized(model: "CausalLM", tensors: Iterable[Dequantized], lookups: list[np.ndarray],
                     in_place: bool = False) -> tuple["CausalLM", Account]:
    """A copy of `model` whose weights are `tensors` where they match one (within each element's half step);
    `lookups`: float tables the artifact looks rows up in while multiplying by their quantised copy.

    The tensors are taken one at a time, each matched against the float weights not yet replaced. `in_place`
    (the export's own model, whose float weights nothing needs once its figures are recorded): `model` itself
    becomes the reference, each float weight's storage taking its dequantised values a slice of rows at a time
    (lazily unpacked tensors: PackedRows), so the reference costs a few slices beyond the model, not a second
    model's worth (3 GB at 0.75 B parameters) nor a whole unpacked table (1 GB for Qwen3.5's)."""
    import torch

    # The twin shares every tensor with `model` (deepcopy's memo maps them to themselves): only the replaced
    # weights are new.
    twin = model if in_place else copy.deepcopy(model, {id(t): t for t in [*model.parameters(), *model.buffers()]})
    pending = {name: value for name, value in [*twin.named_parameters(), *twin.named_buffers()]
               if value.ndim == 2 and value.is_floating_point()}
    matched: dict[str, np.ndarray] = {}  # the weights already replaced, as compared (a graph may hold one twice)
    rounded: dict[int, int] = {}  # storage of a replacement multiplied by rounded activations -> their block
    replaced, unmatched, total = [], 0, 0
    with torch.no_grad():
        for tensor in tensors:
            covered = np.zeros(tensor.rows.shape[0], bool)
            for name in list(pending):
                value = pending[name]
                param = value.detach().float().numpy()
                offset = _match(param, tensor)
                if offset is None:
                    continue
                rows = slice(offset, offset + param.shape[0])
                covered[rows] = True
                if any(_same_table(param, table) for table in lookups):  # looked up float, multiplied quantised
                    dequantized = torch.from_numpy(np.ascontiguousarray(tensor.rows[rows])).to(value.dtype)
                    untied = _untie_products(twin, value, dequantized)
                    replaced.extend(untied)
                    given = twin.get_parameter(untied[0]) if untied else dequantized
                    compared = param if not in_place else dequantized.numpy()
                elif in_place:  # the export's own model: its float tensor takes the values, a slice at a time
                    for lo in range(0, param.shape[0], MATCH_ROWS):
                        hi = min(lo + MATCH_ROWS, param.shape[0])
                        value[lo:hi] = torch.from_numpy(np.ascontiguousarray(tensor.rows[offset + lo:offset + hi]))
                    replaced.append(name)
                    given = value
                    compared = value.detach().float().numpy()  # the float values are gone: compared by these
                else:
                    dequantized = torch.from_numpy(np.ascontiguousarray(tensor.rows[rows])).to(value.dtype)
                    _replace(twin, value, dequantized)
                    replaced.append(name)
                    given, compared = dequantized, param
                if tensor.input_block:
                    rounded[given.data_ptr()] = tensor.input_block
                matched[name] = compared
                del pending[name], value, param
            for name, param in matched.items():  # every match counts: the same weight in a second tensor
                offset = _match(param, tensor)
                if offset is not None:
                    covered[offset:offset + param.shape[0]] = True
            unmatched, total = unmatched + int((~covered).sum()), total + len(covered)
    for module in twin.modules():
        block = rounded.get(module.weight.data_ptr()) if isinstance(module, torch.nn.Linear) else None
        if block:
            module.register_forward_pre_hook(functools.partial(_round_input, block=block))
    return twin.eval(), Account(tuple(replaced), unmatched, total)


def round_activation_blocks(x: "torch.Tensor", block: int) -> "torch.Tensor":
    """`x` as the artifact's product takes it (edgelin.artifact.quantized.ACTIVATIONS_ROUNDED): along the last axis,
    each block of `block` values (a last partial one zero-padded) rounded half to even to an integer number of steps
    of its largest magnitude / 127, in float32 as the kernels compute it."""
    import torch

    width = x.shape[-1]
    padded = torch.nn.functional.pad(x, (0, -width % block)) if width % block else x
    blocks = padded.reshape(*padded.shape[:-1], -1, block)
    amax = blocks.abs().amax(-1, keepdim=True)
    # (true divisions, as the kernels': torch divides by a scalar as a product with its reciprocal, an ulp away, and
    # the activations of a quantised table's rows land on exact ties)
    levels = torch.full_like(amax, 127.0)
    inverse = torch.where(amax > 0, levels / amax, torch.zeros_like(amax))
    steps = torch.round(blocks * inverse)
    return (steps * (amax / levels)).reshape(padded.shape)[..., :width]


def _round_input(module: Any, args: tuple, block: int) -> tuple:
    return (round_activation_blocks(args[0], block), *args[1:])


FLOAT_NOISE = 2.0 ** -23  # one float32 ulp: what another order of the same arithmetic moves a value by


def rounded_products(model: Any) -> list[Any]:
    """The modules of `model` that round their activations (hooked by with_dequantized)."""
    return [module for module in model.modules()
            if any(getattr(hook, "func", None) is _round_input for hook in module._forward_pre_hooks.values())]


def with_float_noise(model: Any, seed: int = 0) -> list[Any]:
    """Before each rounding product, its input times (1 + FLOAT_NOISE * N(0, 1)): what another order of the same
    float arithmetic does to it (a runtime's, not the reference's). The reference run again so is its own distance
    from an equally right runtime: where a value sits on a rounding tie, the noise tips it a whole step, and
    every later layer carries it (the noise floor, edgelin.export.reference_vectors). Returns the hooks' handles
    (`.remove()` each to go back)."""
    import torch

    generator = torch.Generator().manual_seed(seed)

    def jiggle(module: Any, args: tuple) -> tuple:
        x = args[0]
        noise = torch.randn(x.shape, generator=generator, dtype=x.dtype)
        return (x * (1 + FLOAT_NOISE * noise), *args[1:])

    return [module.register_forward_pre_hook(jiggle, prepend=True) for module in rounded_products(model)]


def parity_reference(model: "CausalLM", folder: Path, manifest: "Manifest",
                     read: "Callable[[Path, Manifest], list[Dequantized]] | None" = None,
                     in_place: bool = False) -> tuple["CausalLM", Account | None]:
    """(what the artifact's parity is checked against, the account): for a weight-quantised export the
    model with the export's dequantised weights, else `model` itself (and None). `read`: where the export's target
    keeps its weights its own way, how it reads them back (its Target.dequantized_weights; the caller looks it up,
    this module imports nothing of the export side); else they are read off the ONNX graphs."""
    if quantization_of(manifest.extra) is None:
        return model, None
    if read is not None:
        return with_dequantized(model, read(folder, manifest), [], in_place)
    return with_export_weights(model, folder, [graph.file for graph in manifest.graphs.values()], in_place)
