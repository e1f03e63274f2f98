"""The data that the trainer and the quality figures share, torch-free: the recipe corpus (the Python
stdlib's own sources, split into whole training and held-out files) and the held-out text the quality
figures score (`--text FILE`, else a recipe checkpoint's validation split, else none).

The trainer (edgelin.train, the `train` extra) builds its token streams from the same split, so the
held-out files that validate and export score are the ones the model never trained on; this module
imports no trainer and no torch (tokenizers only inside functions).
"""

from __future__ import annotations

import hashlib
import sysconfig
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from edgelin.artifact.quality import RANDOM_SOURCE, TEXT_TOKENS
from edgelin.errors import EdgelinError

if TYPE_CHECKING:
    from tokenizers import Tokenizer

    from edgelin.artifact.manifest import Manifest

SEPARATOR = "<|endoftext|>"  # between files: the model learns where a file ends
EXCLUDED_DIRS = frozenset({"test", "tests", "idlelib", "lib2to3", "site-packages"})
RECIPE_COPY = "recipe.toml"  # the recipe, copied into an output folder other than its own
MIN_TEXT_TOKENS = 64  # fewer scored tokens make the perplexity mostly noise
TEXT_READ_BYTES = 64  # bytes read from a --text file per wanted token (a BPE token is ~3-4 bytes)


@dataclass(frozen=True)
class DataConfig:
    source: str = "python-stdlib"
    max_bytes: int = 16_000_000
    val_fraction: float = 0.05


def recipe_data(path: Path) -> DataConfig | None:
    """A recipe's [data] section (what the held-out split depends on), or None when the file is not a readable
    recipe with a valid one. The trainer's Recipe.load checks the whole recipe; a checkpoint's copy passed it."""
    try:
        table = tomllib.loads(Path(path).read_text(encoding="utf-8")).get("data", {})
        data = DataConfig(**table) if isinstance(table, dict) else None
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError, TypeError):
        return None
    if data is None or not (isinstance(data.max_bytes, int) and isinstance(data.val_fraction, (int, float))):
        return None
    return data if data.max_bytes >= 1 and 0 < data.val_fraction < 0.5 else None


# ---- the recipe corpus -----------------------------------------------------------------------------
def _fill_in_hash_order(sizes: dict[str, int], cap: float) -> set[str]:
    """Names taken in a fixed hash order, skipping any that would overflow the cap: deterministic, and
    spread over the whole set rather than its first letters."""
    chosen: set[str] = set()
    total = 0
    for name in sorted(sizes, key=lambda n: hashlib.sha256(n.encode()).digest()):
        if total + sizes[name] <= cap:
            chosen.add(name)
            total += sizes[name]
    return chosen


def stdlib_files(max_bytes: int) -> list[tuple[str, str]]:
    """(relative path, text) of the stdlib's own Python sources, sorted by path, at most max_bytes."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = {p.relative_to(root).as_posix(): p for p in root.rglob("*.py")
             if not EXCLUDED_DIRS & set(p.relative_to(root).parts[:-1])}
    chosen = _fill_in_hash_order({name: path.stat().st_size for name, path in files.items()}, max_bytes)
    return [(name, files[name].read_text(encoding="utf-8", errors="replace")) for name in sorted(chosen)]


def split_files(files: list[tuple[str, str]], val_fraction: float) -> tuple[list[str], list[str]]:
    """Whole held-out files holding ~val_fraction of the text: validation measures unseen files."""
    val_names = _fill_in_hash_order({name: len(text) for name, text in files},
                                    val_fraction * sum(len(text) for _, text in files))
    if not val_names or len(val_names) == len(files):
        raise EdgelinError("the corpus is too small for a validation split", f"{len(files)} files",
                           "raise [data] max_bytes or val_fraction")
    return ([text for name, text in files if name not in val_names],
            [text for name, text in files if name in val_names])


def encode_files(tok: "Tokenizer", texts: list[str]) -> np.ndarray:
    """Token ids of `texts` as the trainer streams them: each file followed by the separator."""
    sep = [tok.token_to_id(SEPARATOR)]
    encoded = tok.encode_batch(texts, add_special_tokens=False)
    return np.asarray([i for e in encoded for i in e.ids + sep], dtype=np.int32)


# ---- held-out text for the quality figures -------------------------------------------------------
TEXT_FIX = "pass --text with a UTF-8 text file of at least a few hundred words (e.g. held-out source code or prose)"


def read_text(path: Path, tokens: int = TEXT_TOKENS) -> str:
    """The start of a UTF-8 text file (enough bytes for `tokens` tokens), or one line saying why not:
    a missing or unreadable file, an empty one, a binary or non-UTF-8 one. Needs no tokenizer and no
    model, so `export --text` checks the file before the checkpoint loads."""
    path = Path(path)
    if not path.is_file():
        raise EdgelinError(f"--text {path}", "no such file" if not path.exists() else "it is not a regular file",
                           TEXT_FIX)
    try:
        with open(path, "rb") as fh:
            raw = fh.read(max(1 << 16, tokens * TEXT_READ_BYTES))
            truncated = bool(fh.read(1))
    except OSError as exc:
        raise EdgelinError(f"cannot read --text {path}", exc.strerror or str(exc), TEXT_FIX) from exc
    if not raw.strip():
        raise EdgelinError(f"--text {path} is empty", "perplexity needs held-out text", TEXT_FIX)
    if b"\0" in raw:
        raise EdgelinError(f"--text {path} is not text", "it holds NUL bytes (a binary file)", TEXT_FIX)
    return _decode(path, raw, truncated, TEXT_FIX)


def read_text_tokens(path: Path, tokenizer: Path | None, vocab: int, tokens: int = TEXT_TOKENS) -> np.ndarray:
    """The first `tokens` tokens of a UTF-8 text file, or one line saying why not: what read_text
    refuses, a file that tokenises to fewer than MIN_TEXT_TOKENS tokens, or no tokenizer (or one whose
    ids do not fit the model's `vocab`)."""
    from edgelin.tokenizer import TextTokenizer

    path = Path(path)
    if tokenizer is None:
        raise EdgelinError(f"--text {path} cannot be tokenised", "the export has no tokenizer.json (exported with "
                           "--no-tokenizer, or the checkpoint had none)", "re-export with the checkpoint's tokenizer")
    text = read_text(path, tokens)
    ids = np.asarray(TextTokenizer(tokenizer).encode(text)[:tokens], np.int64)
    if ids.size and ids.max() >= vocab:
        raise EdgelinError(f"tokenizer {tokenizer} does not fit the model", f"--text {path} tokenises to id "
                           f"{int(ids.max())}, but the model's vocab_size is {vocab}", "re-export with the "
                           "checkpoint's own tokenizer")
    if len(ids) < MIN_TEXT_TOKENS:
        raise EdgelinError(f"--text {path} is too short", f"it tokenises to {len(ids)} tokens; perplexity needs at "
                           f"least {MIN_TEXT_TOKENS}", TEXT_FIX)
    return ids


def _decode(path: Path, raw: bytes, truncated: bool, fix: str) -> str:
    """UTF-8 text; when the read stopped early it may have cut the last character in two, so up to
    3 trailing bytes may be dropped."""
    for cut in range(4 if truncated else 1):
        try:
            return raw[:len(raw) - cut].decode("utf-8")
        except UnicodeDecodeError as exc:
            error = exc
    raise EdgelinError(f"--text {path} is not UTF-8 text", f"byte {error.start} is not valid UTF-8", fix)


def recipe_held_out(checkpoint: Path, tokens: int = TEXT_TOKENS) -> tuple[np.ndarray, str] | None:
    """The first `tokens` tokens of a recipe checkpoint's validation split (whole held-out stdlib
    files, as the trainer splits them), tokenised with its own tokenizer; None when the folder
    holds no recipe.toml and tokenizer.json, or they do not give a split. Reads only the recipe's [data]
    section: no trainer, no torch."""
    from tokenizers import Tokenizer

    recipe_path, tokenizer = Path(checkpoint) / RECIPE_COPY, Path(checkpoint) / "tokenizer.json"
    if not (recipe_path.is_file() and tokenizer.is_file()):
        return None
    data = recipe_data(recipe_path)
    if data is None:
        return None
    try:
        _, held_out = split_files(stdlib_files(data.max_bytes), data.val_fraction)
    except (EdgelinError, OSError):  # a recipe this machine cannot reproduce: no held-out text here
        return None
    tok = Tokenizer.from_file(str(tokenizer))
    if tok.token_to_id(SEPARATOR) is not None:  # as the trainer streams them: files joined by its separator
        ids = encode_files(tok, held_out)[:tokens].astype(np.int64)
    else:  # a tokenizer trained elsewhere, without the separator: the files back to back
        ids = np.asarray([i for text in held_out for i in tok.encode(text, add_special_tokens=False).ids][:tokens],
                         np.int64)
    if len(ids) < MIN_TEXT_TOKENS:
        return None
    return ids, f"recipe validation split ({len(held_out)} held-out stdlib files)"


def held_out_text(manifest: "Manifest", folder: Path, text: Path | None = None, tokens: int = TEXT_TOKENS,
                  checkpoint: Path | None = None) -> tuple[np.ndarray | None, str]:
    """(token ids, where they came from) for the quality figures: `text` (--text FILE, tokenised with
    the export's tokenizer in `folder`, else the checkpoint's), else the checkpoint's recipe validation
    split, else (None, "random tokens"). `checkpoint`: default, the one the manifest names."""
    source = manifest.source.get("path")
    checkpoint = checkpoint or (Path(source) if isinstance(source, str) else None)
    if text is not None:
        fallback = checkpoint / "tokenizer.json" if checkpoint is not None else None
        tokenizer = (Path(folder) / manifest.tokenizer if manifest.tokenizer else
                     fallback if fallback is not None and fallback.is_file() else None)
        return read_text_tokens(text, tokenizer, manifest.vocab_size, tokens), f"text {Path(text).name}"
    found = recipe_held_out(checkpoint, tokens) if checkpoint is not None and checkpoint.is_dir() else None
    return found if found is not None else (None, RANDOM_SOURCE)


