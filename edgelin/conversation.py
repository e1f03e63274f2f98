"""A conversation over any runner: the state as a first-class object (docs/state.md).

    conv = Conversation(open_runner(folder))
    conv.prefill(prompt_ids)            # only the new tokens: earlier turns stay in the state
    conv.step(token)                    # one token for each sequence
    snap = conv.snapshot()              # a fork of the state and where it stands: no reprocessing
    conv.restore(snap)
    branches = conv.fork(4)             # 4 independent continuations of this prefix, one batch
    conv.rewind(3)                      # back 3 tokens (kept checkpoints, else re-advanced from one)
    conv.save("chat.edgestate"); Conversation.load(runner, "chat.edgestate")

Every sequence of a batch stands at the same position. `keep`: the checkpoints kept for rewind (a fork of the
state before each of the last `keep` calls); a rewind to a kept checkpoint is exact (the same state, bit for bit),
one further back restores the nearest earlier checkpoint (or the empty state) and re-advances the tokens between
by prefill, which equals them within the export's prefill-vs-steps tolerance. A KV cache (hybrids) is part of
the state, so of every snapshot, fork and file, up to the position.
Run side: reads the artifact contract only (edgelin.runtime, edgelin.artifact).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from edgelin.artifact import state_file
from edgelin.errors import EdgelinError
from edgelin.export.base import Runner, StateHandle, check_ids
from edgelin.runtime import prefill as prefill_pieces


@dataclass(frozen=True)
class Snapshot:
    """A conversation at one moment: its own copy of the state (runner.fork), the position and the tokens so far
    ([batch, position] int64)."""

    state: StateHandle
    position: int
    tokens: np.ndarray


class Conversation:
    def __init__(self, runner: Runner, batch: int = 1, keep: int = 8, record: bool = True):
        """`record`: keep the tokens so far (8 bytes a token; without them a save holds none and a rewind past the
        kept checkpoints is refused: what a long generation that never looks back needs)."""
        if keep < 0:
            raise EdgelinError(f"keep {keep}", "it counts the checkpoints kept for rewind", "pass keep >= 0")
        self.runner, self.keep, self._record = runner, keep, record
        self._state = runner.new_state(batch)
        self._set_tokens(np.zeros((batch, 0), np.int64))
        self._checkpoints: deque[Snapshot] = deque(maxlen=keep or None)
        self._logits: np.ndarray | None = None

    # ---- where it stands ---------------------------------------------------------------------------
    @property
    def batch(self) -> int:
        return self._state.batch

    @property
    def position(self) -> int:
        return self._length

    @property
    def tokens(self) -> np.ndarray:
        """The tokens so far, [batch, position] (a copy)."""
        return self._seen.copy()

    @property
    def logits(self) -> np.ndarray | None:
        """The last call's logits [batch, vocab] (None before any token, and after a rewind or restore)."""
        return self._logits

    # the tokens so far in a buffer that doubles as it fills: a step appends in O(1), not a copy of them all
    @property
    def _seen(self) -> np.ndarray:
        if not self._record:  # unknown tokens read as -1
            return np.full((self._buffer.shape[0], self._length), -1, np.int64)
        return self._buffer[:, :self._length]

    def _set_tokens(self, tokens: np.ndarray) -> None:
        self._buffer = np.array(tokens, np.int64) if self._record else np.zeros((len(tokens), 0), np.int64)
        self._length = tokens.shape[1]

    def _append(self, ids: np.ndarray) -> None:
        end = self._length + ids.shape[1]
        if not self._record:
            self._length = end
            return
        if end > self._buffer.shape[1]:
            grown = np.zeros((self._buffer.shape[0], max(2 * self._buffer.shape[1], end, 64)), np.int64)
            grown[:, :self._length] = self._seen
            self._buffer = grown
        self._buffer[:, self._length:end] = ids
        self._length = end

    def read_state(self) -> dict[str, np.ndarray]:
        return self.runner.read_state(self._state)

    # ---- advancing -----------------------------------------------------------------------------------
    def prefill(self, ids: np.ndarray) -> np.ndarray:
        """Advance by `ids` ([batch, T], or [T] for batch 1); returns the last position's logits [batch, vocab]."""
        ids = np.asarray(ids)
        ids = ids[None] if ids.ndim == 1 and self.batch == 1 else ids
        if ids.ndim != 2 or ids.shape[0] != self.batch:
            raise EdgelinError(f"prefill ids of shape {list(ids.shape)}", f"this conversation holds {self.batch} "
                               "sequence(s)", f"pass [{self.batch}, tokens]")
        check_ids(ids, self.runner.manifest.vocab_size)  # all of them first: a prefill in pieces never stops halfway
        ids = ids.astype(np.int64, copy=False)
        self._checkpoint()
        self._logits, _ = prefill_pieces(self.runner, ids, self._state, start=self.position)
        self._append(ids)
        return self._logits

    def step(self, ids: np.ndarray | int) -> np.ndarray:
        """Advance by one token per sequence (`ids` [batch], or an int for batch 1); returns logits [batch, vocab]."""
        ids = np.atleast_1d(np.asarray(ids))
        if ids.shape != (self.batch,):
            raise EdgelinError(f"step ids of shape {list(ids.shape)}", f"this conversation holds {self.batch} "
                               "sequence(s)", f"pass one token per sequence: [{self.batch}]")
        check_ids(ids, self.runner.manifest.vocab_size)  # before the checkpoint: a refused step leaves none behind
        self._checkpoint()
        self._logits = self.runner.step(ids, self._state, np.full(self.batch, self.position, np.int64))
        self._append(ids[:, None])
        return self._logits

    def _checkpoint(self) -> None:
        if self.keep:
            self._checkpoints.append(self.snapshot())

    # ---- snapshots, forks, rewind --------------------------------------------------------------------
    def snapshot(self) -> Snapshot:
        return Snapshot(self.runner.fork(self._state), self.position, self._seen.copy())

    def restore(self, snap: Snapshot) -> None:
        """Go back (or forward) to `snap`; the snapshot stays usable (the conversation takes a fork of it)."""
        if snap.state.batch != self.batch:
            raise EdgelinError(f"the snapshot holds batch {snap.state.batch}, this conversation {self.batch}",
                               "a snapshot restores the conversation it was taken from", "fork() to change batch")
        self._state = self.runner.fork(snap.state)
        self._set_tokens(snap.tokens)
        self._checkpoints = deque((c for c in self._checkpoints if c.position < snap.position),
                                  maxlen=self.keep or None)
        self._logits = None

    def rewind(self, count: int) -> None:
        """Go back `count` tokens: to a kept checkpoint at that position (exact), else to the nearest earlier one
        (or the empty state) and prefill the tokens between again."""
        if not 0 <= count <= self.position:
            raise EdgelinError(f"rewind {count}", f"the conversation stands at position {self.position}",
                               f"pass 0 <= count <= {self.position}")
        if count == 0:
            return
        target = self.position - count
        tokens = self._seen[:, :target].copy()
        base = next((c for c in reversed(self._checkpoints) if c.position <= target), None)
        start = base.position if base is not None else 0
        if (tokens[:, start:] < 0).any():  # checked before anything changes: a refused rewind leaves all as it was
            raise EdgelinError(f"rewind to position {target}", "the tokens before it were not saved with the state, so "
                               "they cannot be prefilled again", "save with tokens (the default), or rewind only "
                               "within this process's kept checkpoints")
        if base is None:
            self._state = self.runner.new_state(self.batch)
            self._set_tokens(np.zeros((self.batch, 0), np.int64))
            self._checkpoints.clear()
        else:
            self.restore(base)
        if self.position < target:
            kept = self.keep
            self.keep = 0  # the re-advanced span is one call: no checkpoint inside it
            try:
                self.prefill(tokens[:, self.position:])
            finally:
                self.keep = kept
        self._logits = None

    def fork(self, count: int) -> "Conversation":
        """`count` independent continuations of this (batch 1) conversation: a new conversation of batch `count`,
        each row this one's state and tokens. This one is left as it is."""
        if self.batch != 1:
            raise EdgelinError(f"fork of a conversation of batch {self.batch}", "fork continues one sequence "
                               "several ways", "fork a batch-1 conversation (or restore a snapshot per row)")
        if count < 1:
            raise EdgelinError(f"fork({count})", "a fork makes one or more continuations", "pass count >= 1")
        other = Conversation(self.runner, count, self.keep, self._record)
        values = {name: np.repeat(value, count, axis=0) for name, value in self.read_state().items()}
        self.runner.write_state(other._state, values)
        other._set_tokens(np.repeat(self._seen, count, axis=0))
        if self._logits is not None:
            other._logits = np.repeat(self._logits, count, axis=0)
        return other

    # ---- the state file ------------------------------------------------------------------------------
    def save(self, path: Path | str, tokens: bool = True, overwrite: bool = False) -> Path:
        """Write the state, position and (unless `tokens` is False) the tokens so far to a state file."""
        return state_file.write(Path(path), self.runner.manifest, self.read_state(), self.position,
                                self._seen if tokens and self._record else None, overwrite)

    @classmethod
    def load(cls, runner: Runner, path: Path | str, keep: int = 8, record: bool = True) -> "Conversation":
        """A conversation continuing from a state file (refused in one line if it is not this export's, or an
        equal export's). Without its tokens, the conversation's tokens before the position read as -1."""
        saved = state_file.read(Path(path))
        state_file.check_fits(saved, runner.manifest, path)
        manifest = runner.manifest
        if not manifest.constant_memory and manifest.kv_capacity is None:  # a growing KV cache: one row a position
            want = {name: value.shape for name, value in manifest.initial_state(saved.batch, saved.position).items()}
            got = {name: value.shape for name, value in saved.state.items()}
            if got != want:
                raise EdgelinError(f"{path}'s KV cache does not hold its position's {saved.position} rows",
                                   "the header and the tensors disagree: the file was not written by edgelin",
                                   "save the state again")
        conv = cls(runner, saved.batch, keep, record)
        runner.write_state(conv._state, saved.state)  # names, shapes, dtypes and finiteness checked there
        if saved.tokens is not None and saved.tokens.shape == (saved.batch, saved.position):
            conv._set_tokens(saved.tokens)
        else:
            conv._set_tokens(np.full((saved.batch, saved.position), -1, np.int64))
        return conv
