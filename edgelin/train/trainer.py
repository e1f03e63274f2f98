"""Recipes as data, one generic trainer: a TOML recipe ([model], [data], [tokenizer], [train]) ->
byte-level BPE tokenizer + token stream -> CausalLM trained in fp32 (CPU, or a CUDA GPU) -> a checkpoint
directory (config.json, model.safetensors, tokenizer.json) + training_log.json. See recipes/README.md.
    python -m edgelin.train recipes/tiny-gdn-hybrid/recipe.toml [--steps N] [--out DIR [--force]]
                            [--seed S] [--device cpu|cuda|cuda:N]
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import math
import os
import platform
import shutil
import sys
import time
import tomllib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import tokenizers
import torch
import torch.nn.functional as F
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from edgelin.checkpoint import check_fits_in_memory, write_checkpoint_files
from edgelin.data import RECIPE_COPY, SEPARATOR, DataConfig, encode_files, split_files, stdlib_files
from edgelin.devices import MAX_THREADS
from edgelin.errors import EdgelinError
from edgelin.model.config import AttentionConfig, ModelConfig
from edgelin.model.lm import CausalLM
from edgelin.outputs import CHECKPOINT, CHECKPOINT_FILES, TRAINING_LOG, claim_output, fresh_folder, resolve_output

SAMPLE_PROMPT, SAMPLE_TOKENS = "def main(", 200
CACHE_FORMAT = 1  # bump when the cached corpus layout changes


@dataclass(frozen=True)
class TokenizerConfig:
    kind: str = "bpe"
    vocab_size: int = 2048


@dataclass(frozen=True)
class TrainConfig:
    seed: int = 0
    steps: int = 1000
    batch_size: int = 16
    seq_len: int = 256
    lr: float = 3e-3
    warmup: int = 50
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    threads: int = 2
    eval_every: int = 100
    eval_windows: int = 32  # periodic evals use this many val windows; the final eval uses all
    save_dtype: str = "float32"


@dataclass(frozen=True)
class Recipe:
    path: Path
    sha256: str
    model: dict[str, Any]  # ModelConfig fields except vocab_size (known once the tokenizer exists)
    data: DataConfig
    tokenizer: TokenizerConfig
    train: TrainConfig

    @classmethod
    def load(cls, path: Path | str) -> "Recipe":
        path = Path(path)
        try:
            raw = path.read_bytes()
            doc = tomllib.loads(raw.decode())
        except OSError as exc:
            raise EdgelinError(f"cannot read recipe {path}", exc.strerror or str(exc), "pass a recipe.toml") from exc
        except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
            raise EdgelinError(f"{path} is not valid TOML", str(exc), "fix the syntax") from exc
        _reject_unknown(path, "the top level", doc, {"model", "data", "tokenizer", "train"})
        model = dict(doc.get("model", {}))
        _reject_unknown(path, "[model]", model, {f.name for f in dataclasses.fields(ModelConfig)} - {"vocab_size"})
        if "attention" in model:
            _reject_unknown(path, "[model.attention]", model["attention"],
                            {f.name for f in dataclasses.fields(AttentionConfig)})
        recipe = cls(path.resolve(), hashlib.sha256(raw).hexdigest(), model,
                     _section(path, "data", doc, DataConfig), _section(path, "tokenizer", doc, TokenizerConfig),
                     _section(path, "train", doc, TrainConfig))
        recipe._check_values()
        config = recipe.model_config(recipe.tokenizer.vocab_size)  # fail now on a bad [model], not after tokenizing
        check_fits_in_memory(config, str(path))  # absurd sizes too, before anything is allocated
        return recipe

    def _check_values(self) -> None:
        for section, key, value, allowed in [("data", "source", self.data.source, ("python-stdlib",)),
                                             ("tokenizer", "kind", self.tokenizer.kind, ("bpe",)),
                                             ("train", "save_dtype", self.train.save_dtype, ("float32", "float16"))]:
            if value not in allowed:
                raise EdgelinError(f"{self.path}: [{section}] {key} = {value!r}", "not supported",
                                   f"use one of: {', '.join(allowed)}")
        for (section, key), (allowed, what) in _RANGES.items():  # before any work: nan, inf, 0 threads, ...
            value = getattr(getattr(self, section), key)
            if not allowed.holds(value):
                raise EdgelinError(f"{self.path}: [{section}] {key} = {value!r}",
                                   f"{key} ({what}) must be a finite number {allowed}",
                                   f"set {key} in that range (the default is {_default(section, key)!r})")
        if not 0 <= self.train.seed <= MAX_SEED:
            raise seed_error(f"{self.path}: [train] seed = {self.train.seed}", "use a seed in that range")

    def model_config(self, vocab_size: int, **extra: Any) -> ModelConfig:
        data = {**self.model, **extra, "vocab_size": vocab_size}
        try:
            data["layer_types"] = tuple(data["layer_types"])
            if isinstance(data.get("attention"), dict):
                data["attention"] = AttentionConfig(**data["attention"])
            return ModelConfig(**data)
        except (TypeError, KeyError) as exc:
            why = f"missing field {exc}" if isinstance(exc, KeyError) else str(exc)
            raise EdgelinError(f"{self.path}: invalid [model] section", why, "see recipes/README.md") from exc


@dataclass(frozen=True)
class _Range:
    """Where a recipe number may lie: finite, above `low` (or at it), at most `high` (or below it)."""
    low: float
    high: float | None = None
    open_low: bool = False
    open_high: bool = False

    def holds(self, value: float) -> bool:
        return (math.isfinite(value) and (value > self.low if self.open_low else value >= self.low)
                and (self.high is None or (value < self.high if self.open_high else value <= self.high)))

    def __str__(self) -> str:
        text = f"{'>' if self.open_low else '>='} {self.low:g}"
        return text if self.high is None else f"{text} and {'<' if self.open_high else '<='} {self.high:g}"


BYTE_LEVEL_VOCAB = 257  # the byte-level BPE's 256 byte tokens and the separator: a smaller vocab_size is ignored
_POSITIVE, _COUNT = _Range(0, open_low=True), _Range(1)
# Every number a recipe sets besides [model] (ModelConfig checks those) and seed. threads: the cap device
# profiles have (far beyond it libgomp fails to start them, or crashes).
_RANGES: dict[tuple[str, str], tuple[_Range, str]] = {
    ("data", "max_bytes"): (_COUNT, "the corpus size in bytes"),
    ("data", "val_fraction"): (_Range(0, 0.5, open_low=True, open_high=True), "the share of files held out"),
    ("tokenizer", "vocab_size"): (_Range(BYTE_LEVEL_VOCAB), "256 byte tokens, the separator, then merges"),
    ("train", "steps"): (_COUNT, "optimizer steps"),
    ("train", "batch_size"): (_COUNT, "windows per step"),
    ("train", "seq_len"): (_COUNT, "tokens per window"),
    ("train", "lr"): (_POSITIVE, "the peak learning rate"),
    ("train", "warmup"): (_Range(0), "steps of linear warmup"),
    ("train", "weight_decay"): (_Range(0), "AdamW's decoupled weight decay"),
    ("train", "grad_clip"): (_POSITIVE, "the largest gradient norm a step takes"),
    ("train", "threads"): (_Range(1, MAX_THREADS), "CPU threads"),
    ("train", "eval_every"): (_COUNT, "steps between evaluations"),
    ("train", "eval_windows"): (_COUNT, "validation windows per evaluation"),
}


def _default(section: str, key: str) -> Any:
    cls = {"data": DataConfig, "tokenizer": TokenizerConfig, "train": TrainConfig}[section]
    return next(f.default for f in dataclasses.fields(cls) if f.name == key)


# torch.manual_seed takes [-2**63, 2**64 - 1] and numpy's default_rng non-negative integers: both is [0, 2**64 - 1]
MAX_SEED = 2**64 - 1


def seed_error(what: str, fix: str) -> EdgelinError:
    return EdgelinError(what, f"the seed seeds both torch and numpy, which take an integer in [0, {MAX_SEED}] "
                        "(0 to 2**64 - 1)", fix)


def _reject_unknown(path: Path, section: str, table: Any, known: set[str]) -> None:
    if not isinstance(table, dict):
        raise EdgelinError(f"{path}: {section} is not a table", "it must map fields to values", "fix the recipe")
    unknown = sorted(set(table) - known)
    if unknown:
        raise EdgelinError(f"{path}: unknown key(s) {', '.join(unknown)} in {section}",
                           "a misspelt setting would otherwise be silently ignored",
                           f"use only: {', '.join(sorted(known))}")


def _section(path: Path, name: str, doc: dict, cls: type) -> Any:
    table = doc.get(name, {})
    fields = {f.name: f for f in dataclasses.fields(cls)}
    _reject_unknown(path, f"[{name}]", table, set(fields))
    for key, value in table.items():
        want = type(fields[key].default)
        if type(value) is not want and not (want is float and type(value) is int):  # bool is not an int here
            raise EdgelinError(f"{path}: [{name}] {key} = {value!r}", f"expected {want.__name__}",
                               f"write {key} as a {want.__name__}")
    return cls(**table)


# ---- corpus and tokenizer --------------------------------------------------------------------------
def train_tokenizer(texts: list[str], vocab_size: int) -> Tokenizer:
    """Byte-level BPE: every string maps to bytes, so any text (any Unicode) round-trips exactly."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[SEPARATOR], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


@dataclass(frozen=True)
class Corpus:
    tokenizer_path: Path
    train: np.ndarray
    val: np.ndarray
    val_bytes: int  # UTF-8 bytes the val tokens encode (for bits per byte)


def build_corpus(recipe: Recipe, cache_root: Path) -> Corpus:
    """Tokenizer + token streams, cached by a hash of the corpus text and the settings that shape it."""
    files = stdlib_files(recipe.data.max_bytes)
    key = hashlib.sha256(json.dumps([CACHE_FORMAT, tokenizers.__version__, dataclasses.asdict(recipe.data),
                                     dataclasses.asdict(recipe.tokenizer)]).encode())
    for name, text in files:
        key.update(name.encode() + b"\0" + text.encode() + b"\0")
    cache = cache_root / f"corpus-{key.hexdigest()[:16]}"
    if not (cache / "tokens.npz").is_file():
        train_texts, val_texts = split_files(files, recipe.data.val_fraction)
        tok = train_tokenizer(train_texts, recipe.tokenizer.vocab_size)  # fit on train files only
        tmp = cache.with_name(cache.name + f".tmp-{os.getpid()}")
        tmp.mkdir(parents=True, exist_ok=True)
        tok.save(str(tmp / "tokenizer.json"))
        val_bytes = sum(len(t.encode()) for t in val_texts)  # source bytes only, not the separators
        np.savez(tmp / "tokens.npz", train=encode_files(tok, train_texts), val=encode_files(tok, val_texts),
                 val_bytes=np.int64(val_bytes))
        shutil.rmtree(tmp) if cache.exists() else tmp.rename(cache)  # a racing process wrote the same
    arrays = np.load(cache / "tokens.npz")
    return Corpus(cache / "tokenizer.json", arrays["train"], arrays["val"], int(arrays["val_bytes"]))


# ---- training --------------------------------------------------------------------------------------
@dataclass(frozen=True)
class TrainResult:
    out_dir: Path
    model: CausalLM  # weights as saved (rounded through save_dtype), eval mode
    train_losses: tuple[float, ...]  # every step
    final_val_loss: float
    val_bpb: float
    wall_time_s: float
    sample: str
    log: dict[str, Any]


def lr_at(step: int, cfg: TrainConfig, total: int) -> float:
    """Linear warmup, then cosine down to 10% of the peak."""
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    progress = (step - cfg.warmup) / max(1, total - cfg.warmup)
    return cfg.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))


def _optimizer(model: CausalLM, cfg: TrainConfig) -> torch.optim.Optimizer:
    # Decay matrices only: decaying norms, biases or decay rates (A_log, dt_bias) just hurts.
    params = list(model.parameters())  # deduplicated: tied embeddings count once
    groups = [{"params": [p for p in params if p.ndim >= 2], "weight_decay": cfg.weight_decay},
              {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(0.9, 0.95), eps=1e-8)


def _windows(stream: np.ndarray, starts: np.ndarray, length: int) -> torch.Tensor:
    return torch.from_numpy(np.stack([stream[s:s + length + 1] for s in starts]).astype(np.int64))


def _device_of(model: CausalLM) -> torch.device:
    return next(model.parameters()).device


def _loss(model: CausalLM, batch: torch.Tensor) -> torch.Tensor:
    batch = batch.to(_device_of(model))  # windows are cut on the CPU; a no-op there
    logits, _ = model(batch[:, :-1], mode="chunked")
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))


@torch.no_grad()
def evaluate(model: CausalLM, stream: np.ndarray, seq_len: int, batch_size: int, windows: int | None) -> float:
    """Mean loss over non-overlapping val windows (the first `windows` of them; None: all)."""
    starts = np.arange(0, len(stream) - seq_len - 1, seq_len)[:windows]
    if len(starts) == 0:
        raise EdgelinError("the validation set is shorter than one window", f"{len(stream)} tokens",
                           "raise [data] val_fraction or max_bytes, or lower [train] seq_len")
    was_training, total = model.training, 0.0
    model.eval()
    for i in range(0, len(starts), batch_size):
        chunk = starts[i:i + batch_size]
        total += _loss(model, _windows(stream, chunk, seq_len)).item() * len(chunk)
    model.train(was_training)
    return total / len(starts)


@torch.no_grad()
def generate(model: CausalLM, ids: list[int], new_tokens: int) -> list[int]:
    """Greedy decoding: chunked prefill, then one recurrent step per token (the edge runtime's path)."""
    model.eval()
    device = _device_of(model)
    logits, state = model(torch.tensor([ids], device=device), mode="chunked", last_only=True)
    out: list[int] = []
    for position in range(len(ids), len(ids) + new_tokens):
        out.append(int(logits[0].argmax()))
        logits, state = model(torch.tensor([out[-1:]], device=device), state,
                              torch.tensor([position], device=device), "recurrent", True)
    return out


def default_out_dir(recipe: Recipe) -> Path:
    """A fresh folder, never the recipe's: runs/<recipe folder name> (then -2, -3, ...) under the
    current folder. Re-training the checkpoint beside a recipe takes an explicit --out DIR --force."""
    return fresh_folder(Path("runs"), recipe.path.parent.name or "run")


def train(recipe_path: Path | str, out_dir: Path | str | None = None, steps: int | None = None,
          progress: Callable[[int, int, float], None] | None = None, force: bool = False,
          seed: int | None = None, device: str | None = None) -> TrainResult:
    """Train a recipe into `out_dir` (default: default_out_dir). An existing folder needs `force`,
    and then only a checkpoint edgelin trained is replaced: the files training writes, others kept.
    `seed` overrides [train] seed (seed studies without copying recipes; the log records it);
    `device` ("cpu", "cuda", "cuda:N"; default cpu) is where the model trains, evaluates and samples:
    the weights are initialised on the CPU first (the same init on every device) and saved from it."""
    recipe = Recipe.load(recipe_path)
    if seed is not None and not 0 <= seed <= MAX_SEED:  # before --out is claimed: a refusal leaves nothing
        raise seed_error(f"--seed {seed} is out of range", f"pass --seed between 0 and {MAX_SEED}")
    if seed is not None:
        recipe = dataclasses.replace(recipe, train=dataclasses.replace(recipe.train, seed=seed))
    target = training_device(device)
    out = Path(out_dir) if out_dir is not None else default_out_dir(recipe)
    copy_recipe = resolve_output(out) != recipe.path.parent  # keep the recipe next to what it made
    writes = CHECKPOINT_FILES + ((RECIPE_COPY,) if copy_recipe else ())
    # Claimed before training, so a refused --out costs nothing and two runs cannot race for it.
    with claim_output(out, force, CHECKPOINT, writes=writes) as tmp:
        result = _train_into(recipe, tmp, steps, progress, copy_recipe, target)
    return dataclasses.replace(result, out_dir=out)


def training_device(name: str | None) -> torch.device:
    """The torch device for `name` (None: cpu), refused in one line when it is unknown or absent."""
    if name is not None and not name.strip():  # `--device ''` is a mistake, never read as the default
        raise EdgelinError(f"training device {name!r}", "the device name is empty",
                           "use cpu, cuda or cuda:N, or leave --device out (cpu)")
    try:
        device = torch.device(name or "cpu")
    except RuntimeError as exc:
        raise EdgelinError(f"unknown training device {name!r}", "torch knows no such device",
                           "use cpu, cuda or cuda:N") from exc
    if device.type not in ("cpu", "cuda"):
        raise EdgelinError(f"training device {name!r}", "edgelin trains on cpu or cuda only", "use cpu or cuda")
    if device.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if (device.index or 0) >= count:
            raise EdgelinError(f"training device {name!r}", f"this machine has {count} CUDA device(s)",
                               "train on cpu (the default), or on a machine with an NVIDIA GPU")
    return device


def _train_into(recipe: Recipe, out: Path, steps: int | None, progress: Callable[[int, int, float], None] | None,
                copy_recipe: bool, device: torch.device = torch.device("cpu")) -> TrainResult:
    """Train and write the checkpoint, recipe copy and training_log.json into `out` (a temp folder)."""
    cfg = recipe.train
    total = steps if steps is not None else cfg.steps
    cache_root = Path(os.environ.get("EDGELIN_CACHE", recipe.path.parent / ".edgelin-cache"))
    started = time.perf_counter()
    torch.set_num_threads(cfg.threads)
    torch.manual_seed(cfg.seed)
    corpus = build_corpus(recipe, cache_root)
    corpus_time = time.perf_counter() - started
    tok = Tokenizer.from_file(str(corpus.tokenizer_path))
    extra = {} if "eos_token_id" in recipe.model else {"eos_token_id": tok.token_to_id(SEPARATOR)}
    model = CausalLM(recipe.model_config(tok.get_vocab_size(), **extra)).train().to(device)  # init on the CPU
    optimizer = _optimizer(model, cfg)
    rng = np.random.default_rng(cfg.seed)  # batches depend on the seed only, not on torch's RNG use
    if len(corpus.train) <= cfg.seq_len + 1 or total < 1:
        raise EdgelinError("nothing to train", f"{len(corpus.train)} train tokens, {total} steps",
                           "raise [data] max_bytes, lower [train] seq_len, use steps >= 1")

    losses: list[float] = []
    curve: list[dict[str, float]] = []
    for step in range(total):
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, cfg, total)
        starts = rng.integers(0, len(corpus.train) - cfg.seq_len - 1, cfg.batch_size)
        loss = _loss(model, _windows(corpus.train, starts, cfg.seq_len))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        optimizer.step()
        losses.append(loss.item())
        if not math.isfinite(losses[-1]):
            raise EdgelinError(f"training diverged at step {step}", f"loss is {losses[-1]}",
                               "lower [train] lr or raise warmup")
        if (step + 1) % cfg.eval_every == 0 or step + 1 == total:
            val = evaluate(model, corpus.val, cfg.seq_len, cfg.batch_size, cfg.eval_windows)
            curve.append({"step": step + 1, "train_loss": float(np.mean(losses[-cfg.eval_every:])), "val_loss": val})
        if progress is not None:
            progress(step + 1, total, losses[-1])
    train_time = time.perf_counter() - started - corpus_time

    # Round the weights through the storage dtype: the numbers below describe the shipped file.
    dtype = {"float32": torch.float32, "float16": torch.float16}[cfg.save_dtype]
    with torch.no_grad():
        for value in model.state_dict().values():  # shares storage with the parameters and buffers
            if value.is_floating_point():
                value.copy_(value.to(dtype).float())
    model.eval()
    val_loss = evaluate(model, corpus.val, cfg.seq_len, cfg.batch_size, None)
    bpb = val_loss / math.log(2) * len(corpus.val) / corpus.val_bytes
    sample = tok.decode(generate(model, tok.encode(SAMPLE_PROMPT, add_special_tokens=False).ids, SAMPLE_TOKENS),
                        skip_special_tokens=False)
    model.cpu()  # saved, and returned, from the CPU
    wall = time.perf_counter() - started

    written = write_checkpoint_files(model, out, corpus.tokenizer_path, dtype=dtype)
    if copy_recipe:
        shutil.copyfile(recipe.path, out / RECIPE_COPY)
        written.append(RECIPE_COPY)
    log = {
        "recipe": recipe.path.name, "recipe_sha256": recipe.sha256, "steps": total, "wall_time_s": round(wall, 1),
        "corpus_time_s": round(corpus_time, 1), "train_loop_time_s": round(train_time, 1),
        "tokens_seen": total * cfg.batch_size * cfg.seq_len, "parameters": model.num_parameters(),
        "train_tokens": len(corpus.train), "val_tokens": len(corpus.val), "val_bytes": corpus.val_bytes,
        "seed": cfg.seed, "device": str(device), "save_dtype": cfg.save_dtype, "curve": curve,
        "final_val_loss": val_loss, "val_bits_per_byte": bpb,
        "sample_prompt": SAMPLE_PROMPT, "sample": SAMPLE_PROMPT + sample,
        "machine": {"platform": platform.platform(), "processor": platform.processor() or platform.machine(),
                    "cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads(),
                    "python": platform.python_version(), torch.__name__: torch.__version__,
                    **({"gpu": torch.cuda.get_device_name(device)} if device.type == "cuda" else {})},
        "files": sorted(written + [TRAINING_LOG]),  # what --force may replace in this folder later
    }
    (out / "training_log.json").write_text(json.dumps(log, indent=2) + "\n")
    return TrainResult(out, model, tuple(losses), val_loss, bpb, wall, SAMPLE_PROMPT + sample, log)


def _main() -> None:
    parser = argparse.ArgumentParser(prog="python -m edgelin.train", description="Train a recipe.")
    parser.add_argument("recipe", type=Path)
    parser.add_argument("--steps", type=int, default=None, help="override [train] steps")
    parser.add_argument("--out", type=Path, default=None,
                        help="output folder (default: a fresh runs/<recipe folder name>[-N] under the current folder)")
    parser.add_argument("--force", action="store_true",
                        help="write into an existing --out: replaces a checkpoint edgelin trained, keeps other files")
    parser.add_argument("--seed", type=int, default=None, help="override [train] seed")
    parser.add_argument("--device", default=None, help="cpu (default), cuda or cuda:N")
    args = parser.parse_args()
    marks: list[float] = []  # step end times, for the s/step shown

    def report(step: int, total: int, loss: float) -> None:
        marks.append(time.perf_counter())
        if step % 10 == 0 or step == total:
            rate = (marks[-1] - marks[0]) / max(1, len(marks) - 1)  # from step 1: excludes tokenizing
            print(f"step {step}/{total}  loss {loss:.3f}  {rate:.2f} s/step", file=sys.stderr, flush=True)

    try:
        result = train(args.recipe, args.out, args.steps, report, force=args.force, seed=args.seed,
                       device=args.device)
    except EdgelinError as exc:
        print(f"error: {exc.line()}", file=sys.stderr)
        raise SystemExit(exc.exit_code) from None
    print(f"val loss {result.final_val_loss:.4f}  val bpb {result.val_bpb:.4f}  "
          f"wall {result.wall_time_s:.0f} s  -> {result.out_dir}\n{result.sample}")


if __name__ == "__main__":
    _main()
