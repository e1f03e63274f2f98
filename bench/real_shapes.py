"""Checkpoints with the published shapes of real 0.8-2 B models and seeded random weights (issue 46).

    python bench/real_shapes.py --list                       # shapes table (parameters, bf16 bytes); writes nothing
    python bench/real_shapes.py [--out runs/real-shapes] [--only qwen3.5-0.8b,...] [--seed 0]
                                [--max-shard-size 2GB]       # force sharding (default: as upstream)
    python bench/real_shapes.py --tiny --out DIR             # the same layouts at toy sizes (tests)
    python bench/real_shapes.py --check DIR                  # edgelin loads it; a few greedy tokens, finite logits

Each folder is what the upstream library's own `save_pretrained` lays out: config.json written by the
upstream config class (transformers' Qwen3_5TextConfig / Mamba2Config, fla's GLAConfig), bf16
safetensors with the tensor names and shapes of the upstream model class (laid out on torch's meta
device, so nothing is allocated), sharded with an index where upstream shards, plus a tokenizer.json
whose vocabulary is exactly the config's vocab_size (a byte-level BPE trained on the Python standard
library's source, padded with unreachable filler tokens; the config's special ids hold <|endoftext|>
etc.) and a tokenizer_config.json, so transformers, llama.cpp's convert_hf_to_gguf.py and `edgelin
generate` all read it.

The weights are RANDOM (seeded: each tensor from its own generator, seed + crc32(name), so values do
not depend on the shard layout), scaled like each model's own init (matrices N(0, 0.02), A_log / dt_bias /
D as the model initialises them; norms about their identity with a spread across channels, as trained ones
have), which keeps bf16 activations finite. They are good for memory, time and speed figures only: any
quality figure belongs to the trained peers.
Memory: one shard's bf16 tensors at a time plus one fp32 chunk of <= 64 MiB while drawing; never an
fp32 copy of the model.

Shapes (config.json fields as published; see SHAPES for the source of each):
- Qwen3.5-0.8B / -2B: the text model of the published multimodal checkpoint (`text_config`), written as
  transformers' text-only `Qwen3_5ForCausalLM` (model_type qwen3_5_text, a format transformers and
  llama.cpp load as is). Left out: the vision tower and the one-layer MTP head (edgelin drops both from
  the upstream checkpoint; `mtp_num_hidden_layers` is omitted so no converter looks for it). Sharded as
  upstream: model.safetensors.index.json + model.safetensors-00001-of-00001.safetensors.
- Mamba2-1.3b: state-spaces/mamba2-1.3b in transformers' Mamba2 format (as transformers' conversion
  script writes it: d_model 2048, 48 layers, d_state 128, headdim 64, ngroups 1, vocab 50277 padded to
  a multiple of 16 = 50288, tied embeddings); one model.safetensors.
- GLA-1.3B: fla-hub/gla-1.3B-100B (fla's GLAConfig: hidden 2048, 24 layers, 4 heads, expand_k 0.5,
  expand_v 1, hidden_ratio 4, vocab 32000, untied head); one model.safetensors.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
import zlib
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUT = ROOT / "runs" / "real-shapes"
CHUNK_ELEMENTS = 16 << 20  # fp32 elements drawn at once (64 MiB)

_QWEN_TEXT = {  # fields shared by the published Qwen3.5-0.8B and -2B text_config
    "num_hidden_layers": 24, "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 256,
    "linear_num_key_heads": 16, "linear_num_value_heads": 16, "linear_key_head_dim": 128,
    "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4, "vocab_size": 248320, "rms_norm_eps": 1e-6,
    "hidden_act": "silu", "attention_bias": False, "attn_output_gate": True, "full_attention_interval": 4,
    "max_position_embeddings": 262144, "tie_word_embeddings": True, "eos_token_id": 248044,
    "layer_types": (["linear_attention"] * 3 + ["full_attention"]) * 6,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000000, "partial_rotary_factor": 0.25,
                        "mrope_section": [11, 11, 10], "mrope_interleaved": True},
}
_QWEN_TINY = {"hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 4, "num_attention_heads": 2,
              "num_key_value_heads": 1, "head_dim": 32, "linear_num_key_heads": 2, "linear_num_value_heads": 4,
              "linear_key_head_dim": 16, "linear_value_head_dim": 16, "vocab_size": 512, "eos_token_id": 300,
              "layer_types": ["linear_attention"] * 3 + ["full_attention"],
              "rope_parameters": {"rope_type": "default", "rope_theta": 10000000, "partial_rotary_factor": 0.25}}


@dataclass(frozen=True)
class Shape:
    name: str  # the folder name
    source: str  # where the published config.json lives
    library: str  # "transformers" | "fla"
    model_type: str
    architecture: str
    fields: dict[str, Any]
    specials: dict[int, str]  # token id -> special token text
    shard_name: str | None = None  # upstream's shard file pattern (None: one model.safetensors)
    tiny_fields: dict[str, Any] = field(default_factory=dict)
    tiny_specials: dict[int, str] | None = None  # where the special ids lie past the toy vocabulary

    def tiny(self) -> Shape:
        """The same layout at toy sizes (tests): every tensor kind, a few KB each."""
        return replace(self, name=f"{self.name}-tiny", fields={**self.fields, **self.tiny_fields},
                       specials=self.tiny_specials or self.specials)


SHAPES = [
    Shape("qwen3.5-0.8b", "https://huggingface.co/Qwen/Qwen3.5-0.8B/blob/main/config.json (text_config)",
          "transformers", "qwen3_5_text", "Qwen3_5ForCausalLM",
          {**_QWEN_TEXT, "hidden_size": 1024, "intermediate_size": 3584}, {248044: "<|endoftext|>"},
          "model.safetensors-{index:05d}-of-{count:05d}.safetensors", _QWEN_TINY, {300: "<|endoftext|>"}),
    Shape("qwen3.5-2b", "https://huggingface.co/Qwen/Qwen3.5-2B/blob/main/config.json (text_config)",
          "transformers", "qwen3_5_text", "Qwen3_5ForCausalLM",
          {**_QWEN_TEXT, "hidden_size": 2048, "intermediate_size": 6144}, {248044: "<|endoftext|>"},
          "model.safetensors-{index:05d}-of-{count:05d}.safetensors", _QWEN_TINY, {300: "<|endoftext|>"}),
    Shape("mamba2-1.3b", "https://huggingface.co/state-spaces/mamba2-1.3b/blob/main/config.json "
          "(transformers' Mamba2 names)", "transformers", "mamba2", "Mamba2ForCausalLM",
          {"vocab_size": 50288, "hidden_size": 2048, "num_hidden_layers": 48, "state_size": 128, "expand": 2,
           "head_dim": 64, "num_heads": 64, "n_groups": 1, "conv_kernel": 4, "chunk_size": 256,
           "use_conv_bias": True, "use_bias": False, "layer_norm_epsilon": 1e-5, "residual_in_fp32": True,
           "tie_word_embeddings": True, "bos_token_id": 0, "eos_token_id": 0, "pad_token_id": 0},
          {0: "<|endoftext|>"},
          tiny_fields={"vocab_size": 512, "hidden_size": 64, "num_hidden_layers": 2, "state_size": 16,
                       "head_dim": 16, "num_heads": 8, "chunk_size": 16}),
    Shape("gla-1.3b", "https://huggingface.co/fla-hub/gla-1.3B-100B/blob/main/config.json", "fla", "gla",
          "GLAForCausalLM",
          {"vocab_size": 32000, "hidden_size": 2048, "num_hidden_layers": 24, "num_heads": 4, "expand_k": 0.5,
           "expand_v": 1, "hidden_ratio": 4, "intermediate_size": None, "use_short_conv": False,
           "use_output_gate": True, "hidden_act": "swish", "norm_eps": 1e-6, "tie_word_embeddings": False,
           "bos_token_id": 1, "eos_token_id": 2, "max_position_embeddings": 2048},
          {0: "<unk>", 1: "<s>", 2: "</s>"},
          tiny_fields={"vocab_size": 512, "hidden_size": 64, "num_hidden_layers": 2, "num_heads": 2}),
]


def shape(name: str) -> Shape:
    found = {s.name: s for s in SHAPES} | {s.tiny().name: s.tiny() for s in SHAPES}
    if name not in found:
        raise SystemExit(f"unknown shape {name!r}; known: {', '.join(found)}")
    return found[name]


# ---- the upstream classes, laid out on the meta device ----------------------------------------------
CONFIG_CLASSES = {"qwen3_5_text": "Qwen3_5TextConfig", "mamba2": "Mamba2Config"}


def upstream_config(s: Shape):
    if s.library == "fla":
        from fla.models import GLAConfig

        config = GLAConfig(**s.fields)
    else:  # by class, not AutoConfig: importing fla registers fla's own "mamba2" config under that name
        import transformers

        config = getattr(transformers, CONFIG_CLASSES[s.model_type])(**s.fields)
    config.architectures = [s.architecture]
    config.dtype = "bfloat16"
    return config


def _model_class(s: Shape):
    if s.library == "fla":
        from fla.models import GLAForCausalLM

        return GLAForCausalLM
    hidden = sys.modules.get("fla", "absent")
    sys.modules["fla"] = None  # transformers' Qwen3.5 would pick fla's Triton kernels at import time
    try:
        import transformers

        return getattr(transformers, s.architecture)
    finally:
        if hidden == "absent":
            del sys.modules["fla"]
        else:
            sys.modules["fla"] = hidden


def layout(s: Shape) -> list[tuple[str, tuple[int, ...]]]:
    """(name, shape) of every tensor save_pretrained writes, in the model's order (tied copies left out)."""
    import torch

    with torch.device("meta"):
        model = _model_class(s)(upstream_config(s))
    tied = set((getattr(model, "_tied_weights_keys", None) or {}))
    if not s.fields.get("tie_word_embeddings"):
        tied = set()
    return [(k, tuple(v.shape)) for k, v in model.state_dict().items() if k not in tied]


# ---- seeded values, scaled like each model's init -------------------------------------------------
NORM_SPREAD = 0.1  # norm weights: identity + N(0, 0.1^2) per channel (see draw)


def init_kind(s: Shape, name: str, dims: tuple[int, ...]) -> str:
    leaf = name.rsplit(".", 1)[-1]
    if leaf in ("A_log", "dt_bias", "D"):
        return f"{s.model_type}:{leaf}"
    if leaf == "bias":
        return "zeros"
    if "conv1d" in name:
        return "conv"  # torch's Conv1d init: U(-1/sqrt(fan_in), 1/sqrt(fan_in))
    if len(dims) == 1 and "norm" in name:
        # Qwen3.5's RMSNorms multiply by (1 + w) and start at w = 0; its gated RMSNorm (linear_attn.norm) by w
        zero_centred = s.model_type == "qwen3_5_text" and "linear_attn.norm" not in name
        return "norm-zero-centred" if zero_centred else "norm"
    return "normal"


def draw(s: Shape, name: str, dims: tuple[int, ...], seed: int):
    """One bf16 tensor, drawn from its own generator; fp32 only one chunk of rows at a time."""
    import torch

    gen = torch.Generator().manual_seed(seed + zlib.crc32(name.encode()))
    kind = init_kind(s, name, dims)
    out = torch.empty(dims, dtype=torch.bfloat16)
    if kind == "zeros":
        return out.fill_(0.0)
    if kind in ("norm", "norm-zero-centred"):
        # A trained model's norm weights differ per channel; all equal (the init), a quantised embedding table's
        # normed rows would be integers times one scale, whose int8 activation blocks (the quantised products')
        # hold exact ties (x * 127 / amax = k + 0.5): coin flips between the runtime's float order and the
        # reference's, which made validate's first layers 1e-3 apart instead of 1e-7 (docs/benchmarks.md).
        values = torch.randn(dims, generator=gen).mul_(NORM_SPREAD)
        return out.copy_(values if kind == "norm-zero-centred" else values.add_(1.0))
    heads = dims[0] if dims else 1
    if kind == "qwen3_5_text:A_log":  # Qwen3.5: A ~ U(0, 16), A_log = log A
        return out.copy_(torch.rand(dims, generator=gen).mul(16).clamp_min(1e-4).log())
    if kind == "qwen3_5_text:dt_bias":
        return out.fill_(1.0)
    if kind == "mamba2:A_log":  # transformers' Mamba2: A = 1..num_heads
        return out.copy_(torch.arange(1, heads + 1, dtype=torch.float32).log())
    if kind == "mamba2:D":
        return out.fill_(1.0)
    if kind == "mamba2:dt_bias":  # dt ~ logU(1e-3, 1e-1), floored at 1e-4, stored as softplus^-1(dt)
        dt = torch.exp(torch.rand(dims, generator=gen) * (math.log(0.1) - math.log(1e-3)) + math.log(1e-3))
        dt = dt.clamp_min(1e-4)
        return out.copy_(dt + torch.log(-torch.expm1(-dt)))
    flat = out.view(dims[0], -1) if len(dims) > 1 else out.view(1, -1)
    rows = max(1, CHUNK_ELEMENTS // max(1, flat.shape[1]))
    bound = 1.0 / math.sqrt(math.prod(dims[1:])) if kind == "conv" else 0.0
    for start in range(0, flat.shape[0], rows):
        chunk = flat[start:start + rows]
        if kind == "conv":
            values = torch.rand(chunk.shape, generator=gen).mul_(2 * bound).sub_(bound)
        else:
            values = torch.randn(chunk.shape, generator=gen).mul_(0.02)
        chunk.copy_(values)
    return out


# ---- files ------------------------------------------------------------------------------------------
def parse_size(text: str) -> int:
    units = {"KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "B": 1}
    upper = text.strip().upper()
    for unit, scale in sorted(units.items(), key=lambda u: -len(u[0])):
        if upper.endswith(unit):
            return int(float(upper[:-len(unit)]) * scale)
    return int(upper)


def plan_shards(entries: list[tuple[str, tuple[int, ...]]], max_bytes: int | None) -> list[list[str]]:
    """transformers' rule: fill a shard in model order until the next tensor would pass max_bytes."""
    shards: list[list[str]] = [[]]
    size = 0
    for name, dims in entries:
        nbytes = 2 * math.prod(dims)
        if max_bytes is not None and shards[-1] and size + nbytes > max_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    return shards


def write_weights(s: Shape, out: Path, seed: int, max_shard_bytes: int | None,
                  progress: Callable[[str], None] = print) -> tuple[int, int, list[str]]:
    """The safetensors files (+ index); returns (parameters, bytes, file names)."""
    from safetensors.torch import save_file

    entries = layout(s)
    dims_of = dict(entries)
    shards = plan_shards(entries, max_shard_bytes)
    pattern = s.shard_name or "model-{index:05d}-of-{count:05d}.safetensors"
    indexed = s.shard_name is not None or len(shards) > 1
    names = [pattern.format(index=i + 1, count=len(shards)) for i in range(len(shards))] if indexed \
        else ["model.safetensors"]
    weight_map: dict[str, str] = {}
    for file, members in zip(names, shards):
        started = time.time()
        tensors = {name: draw(s, name, dims_of[name], seed) for name in members}
        save_file(tensors, str(out / file), metadata={"format": "pt"})
        (out / file).chmod(0o644)  # save_file writes through a private 0600 temp file
        weight_map.update(dict.fromkeys(members, file))
        progress(f"  {file}: {len(members)} tensors, {sum(t.nbytes for t in tensors.values()) / 1e9:.2f} GB "
                 f"in {time.time() - started:.0f} s")
        del tensors
    params = sum(math.prod(d) for _, d in entries)
    if indexed:
        index = {"metadata": {"total_parameters": params, "total_size": 2 * params}, "weight_map": weight_map}
        (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    return params, 2 * params, names


def corpus_text(limit: int) -> str:
    """The Python standard library's source (always on this machine; what the shipped recipe trains on)."""
    import sysconfig

    parts, size = [], 0
    for file in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py")):
        text = file.read_text(errors="replace")
        parts.append(text)
        size += len(text)
        if size >= limit:
            break
    return "".join(parts)


def write_tokenizer(s: Shape, out: Path, trained: int = 4096, corpus_chars: int = 4_000_000) -> None:
    """tokenizer.json with exactly vocab_size ids: a byte-level BPE (`trained` tokens) trained here, the
    config's special tokens at their ids, unreachable fillers elsewhere; + tokenizer_config.json."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    vocab_size = s.fields["vocab_size"]
    trained = min(trained, vocab_size - len(s.specials))
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=trained, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator([corpus_text(corpus_chars)], trainer)
    data = json.loads(tok.to_str())
    learned = sorted(data["model"]["vocab"], key=data["model"]["vocab"].get)
    free = (i for i in range(vocab_size) if i not in s.specials)
    vocab = {token: next(free) for token in learned}
    vocab.update({text: i for i, text in s.specials.items()})
    vocab.update({f"<|filler_{i}|>": i for i in free})
    data["model"]["vocab"] = vocab
    data["added_tokens"] = [{"id": i, "content": text, "single_word": False, "lstrip": False, "rstrip": False,
                             "normalized": False, "special": True} for i, text in sorted(s.specials.items())]
    text = json.dumps(data, ensure_ascii=False)
    check = Tokenizer.from_str(text)
    assert check.get_vocab_size() == vocab_size, (check.get_vocab_size(), vocab_size)
    (out / "tokenizer.json").write_text(text)
    eos = s.specials.get(s.fields.get("eos_token_id"))
    bos = s.specials.get(s.fields.get("bos_token_id"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": 1 << 20, "eos_token": eos,
              "bos_token": bos, "pad_token": eos, "unk_token": s.specials.get(0) if s.library == "fla" else None,
              "clean_up_tokenization_spaces": False}
    (out / "tokenizer_config.json").write_text(json.dumps({k: v for k, v in config.items() if v}, indent=2) + "\n")


def write_checkpoint(s: Shape, out: Path, seed: int = 0, max_shard_bytes: int | None = None,
                     progress: Callable[[str], None] = print, tokenizer_kwargs: dict | None = None) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    started = time.time()
    upstream_config(s).save_pretrained(str(out))
    params, nbytes, files = write_weights(s, out, seed, max_shard_bytes, progress)
    write_tokenizer(s, out, **(tokenizer_kwargs or {}))
    return {"name": s.name, "parameters": params, "bytes": nbytes, "files": files,
            "seconds": round(time.time() - started, 1)}


# ---- commands ---------------------------------------------------------------------------------------
def cmd_list(shapes: list[Shape]) -> None:
    print(f"{'checkpoint':<16} {'parameters':>15} {'bf16 bytes':>15}  source (random weights)")
    for s in shapes:
        params = sum(math.prod(d) for _, d in layout(s))
        print(f"{s.name:<16} {params:>15,} {2 * params:>15,}  {s.source}")


def cmd_check(folder: Path, tokens: int) -> None:
    """edgelin loads the folder (its converter, its reference model) and decodes a few greedy tokens."""
    import resource

    import torch

    from edgelin.checkpoint import load_model
    from edgelin.tokenizer import TextTokenizer

    started = time.time()
    model, info = load_model(folder)
    loaded = time.time() - started
    tok = TextTokenizer(info.tokenizer) if info.tokenizer else None
    ids = tok.encode("def main():\n    return") if tok else [1, 2, 3]
    with torch.no_grad():
        logits, state = model(torch.tensor([ids]), mode="chunked", last_only=True)
        finite, out = bool(torch.isfinite(logits).all()), []
        for position in range(len(ids), len(ids) + tokens):
            out.append(int(logits[0].argmax()))
            logits, state = model(torch.tensor([out[-1:]]), state, torch.tensor([position]), "recurrent", True)
            finite = finite and bool(torch.isfinite(logits).all())
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    print(json.dumps({"folder": str(folder), "parameters": model.num_parameters(), "load_seconds": round(loaded, 1),
                      "peak_rss_gib": round(peak, 2), "finite_logits": finite, "tokens": out,
                      "text": tok.decode(out) if tok else None}))
    if not finite:
        raise SystemExit("non-finite logits")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--only", help="comma-separated names (default: all): " + ", ".join(s.name for s in SHAPES))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-shard-size", help="e.g. 2GB: shard past this size (default: as upstream)")
    parser.add_argument("--tiny", action="store_true", help="toy sizes of the same layouts")
    parser.add_argument("--list", action="store_true", help="print the shapes table, write nothing")
    parser.add_argument("--check", type=Path, metavar="DIR", help="load DIR with edgelin, decode a few tokens")
    parser.add_argument("--tokens", type=int, default=4)
    args = parser.parse_args()
    if args.check:
        return cmd_check(args.check, args.tokens)
    shapes = [shape(n) for n in args.only.split(",")] if args.only else SHAPES
    shapes = [s.tiny() if args.tiny and not s.name.endswith("-tiny") else s for s in shapes]
    if args.list:
        return cmd_list(shapes)
    max_bytes = parse_size(args.max_shard_size) if args.max_shard_size else None
    for s in shapes:
        print(f"{s.name}: writing {args.out / s.name} (random weights, seed {args.seed})", flush=True)
        done = write_checkpoint(s, args.out / s.name, args.seed, max_bytes)
        print(json.dumps(done), flush=True)


if __name__ == "__main__":
    main()
