"""`edgelin chat`: a multi-turn conversation on an export, each turn prefilling only its own text (docs/state.md).

A line of text is a turn: its tokens are prefilled after everything said so far, then the model answers (up to
`max_new_tokens`, or its end-of-text token). Commands: `/save FILE` and `/load FILE` (a state file: the
conversation continues in a later session), `/undo` (back to before the last turn), `/reset`, `/quit`. Each turn
starts from a snapshot kept for /undo (a fork of the state: the state's size per turn kept, UNDO_TURNS at most).
Run side: a runner, the tokenizer, edgelin.conversation."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable

import numpy as np

from edgelin.conversation import Conversation, Snapshot
from edgelin.errors import EdgelinError
from edgelin.generate import Sampling, check_finite, no_tokenizer, sampled_tokens
from edgelin.runtime import open_runner
from edgelin.tokenizer import TextTokenizer

if TYPE_CHECKING:
    from edgelin.devices import DeviceProfile

UNDO_TURNS = 16


@dataclass(frozen=True)
class ChatRequest:
    folder: Path
    max_new_tokens: int = 200
    sampling: Sampling = Sampling()
    threads: int | None = None
    device: "DeviceProfile | None" = None
    load_state: Path | None = None


class ChatSession:
    def __init__(self, request: ChatRequest):
        self.request = request
        self.runner = open_runner(request.folder, request.threads, request.device)
        manifest = self.runner.manifest
        if manifest.tokenizer is None:
            raise no_tokenizer(request.folder, manifest.source.get("path"))
        self.tokenizer = TextTokenizer(Path(request.folder) / manifest.tokenizer)
        self.rng = np.random.default_rng(request.sampling.seed)
        self.conv = (Conversation.load(self.runner, request.load_state, keep=0) if request.load_state is not None
                     else Conversation(self.runner, keep=0))
        self.turns: deque[Snapshot] = deque(maxlen=UNDO_TURNS)

    def handle(self, line: str, on_text: Callable[[str], None]) -> str | None:
        """One line: a command's answer (a short message), or None after a turn whose answer went to `on_text`.
        A refused command or turn raises EdgelinError and leaves the conversation as it was."""
        words = line.strip().split(maxsplit=1)
        command = words[0] if words and words[0].startswith("/") else None
        argument = words[1] if len(words) > 1 else ""
        if command in ("/save", "/load") and not argument:
            raise EdgelinError(f"{command} without a file", "it names the state file", f"type {command} FILE")
        if command == "/save":
            path = self.conv.save(Path(argument).expanduser())
            return f"saved {self.conv.position} tokens to {path}"
        if command == "/load":
            self.conv = Conversation.load(self.runner, Path(argument).expanduser(), keep=0)
            self.turns.clear()
            return f"loaded {argument}: {self.conv.position} tokens"
        if command == "/undo":
            if not self.turns:
                raise EdgelinError("/undo with no turn to undo", f"the last {UNDO_TURNS} turns of this session can be "
                                   "undone", "type a message first")
            self.conv.restore(self.turns.pop())
            return f"back to {self.conv.position} tokens"
        if command == "/reset":
            self.conv = Conversation(self.runner, keep=0)
            self.turns.clear()
            return "a new conversation"
        if command is not None:
            raise EdgelinError(f"unknown command {command}", "commands are /save, /load, /undo, /reset, /quit",
                               "type text to talk, or one of those")
        self.turn(line, on_text)
        return None

    def turn(self, text: str, on_text: Callable[[str], None]) -> int:
        """Prefill `text`'s tokens, then answer; returns the tokens generated."""
        ids = self.tokenizer.encode(text)
        if not ids:
            return 0
        before = self.conv.snapshot()
        logits = self.conv.prefill(np.asarray(ids, np.int64))
        check_finite(logits[0], 1, self.request.folder)
        self.turns.append(before)
        feed, eos, produced = self.tokenizer.stream(), self.runner.manifest.eos_token_id, 0
        for token in ids:
            feed(token)
        seen = np.zeros(logits.shape[-1], bool)
        seen[ids] = True
        for token in sampled_tokens(self.conv, logits, self.request.sampling, self.rng, seen,
                                    self.request.max_new_tokens, self.request.folder):
            produced += 1
            if token == eos:  # not fed: the next turn follows the text, as generate --save-state leaves it
                break
            on_text(feed(token))
        return produced
