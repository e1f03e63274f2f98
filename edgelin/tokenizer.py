"""Text <-> token ids through a Hugging Face `tokenizer.json` (the `tokenizers` library)."""

from __future__ import annotations

from pathlib import Path

from edgelin.errors import EdgelinError


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
