"""Text <-> token ids through a Hugging Face `tokenizer.json` (the `tokenizers` library)."""

from __future__ import annotations

from pathlib import Path

from edgelin.errors import EdgelinError

TOKENIZER = "tokenizer.json"  # its name in a checkpoint and in an export folder


class TextTokenizer:
    def __init__(self, path: Path):
        from tokenizers import Tokenizer

        try:
            self._tok = Tokenizer.from_file(str(path))
        except Exception as exc:  # tokenizers raises a bare Exception on bad files
            raise EdgelinError(f"cannot read tokenizer {path}", str(exc), "re-export with a valid tokenizer.json") from exc
        self.path = Path(path)

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size()

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=False)

    def stream(self):
        """A decoder fed one id at a time; it holds O(1) ids, so streaming memory stays flat."""
        from tokenizers.decoders import DecodeStream

        stream, tok = DecodeStream(skip_special_tokens=False), self._tok

        def feed(token: int) -> str:
            return stream.step(tok, token) or ""

        return feed


def check_tokenizer(path: Path, vocab_size: int | None = None) -> None:
    """Refuse a tokenizer.json that cannot be loaded, or whose ids do not fit the model's vocabulary
    (an id >= vocab_size would index past the embedding): one EdgelinError naming the file."""
    from tokenizers import Tokenizer

    fix = "repair or replace tokenizer.json, or pass --no-tokenizer to export without it"
    try:
        tok = Tokenizer.from_file(str(path))
    except Exception as exc:  # tokenizers raises a bare Exception on bad files; OSError when unreadable
        raise EdgelinError(f"tokenizer {path} is corrupt", _first_line(exc), fix) from exc
    if vocab_size is None:
        return
    ids = tok.get_vocab(with_added_tokens=True).values()
    top = max(ids, default=-1)
    if top >= vocab_size:
        raise EdgelinError(f"tokenizer {path} does not fit the model", f"it has token id {top}, but the model's "
                           f"vocab_size is {vocab_size} (ids 0..{vocab_size - 1})", fix)


def tokenizer_status(path: Path | None, vocab_size: int) -> str:
    """'ok', 'missing' or 'corrupt: REASON' (what `inspect` reports)."""
    if path is None:
        return "missing"
    try:
        check_tokenizer(path, vocab_size)
    except EdgelinError as exc:
        return f"corrupt: {exc.why}"
    return "ok"


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip() or type(exc).__name__
    return text.splitlines()[0]
