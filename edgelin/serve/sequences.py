"""Many sequences over one runner, each exactly as if alone: what the Triton Python-backend model holds
(edgelin.serve.python_model), testable without a server.

A sequence is a correlation id, its position and its own state. Steps that arrive together are run as one batch:
their states are gathered into one handle, stepped once, and stay there while the same sequences keep stepping
together (the usual case under Triton's oldest-first batcher: no copy per token). When at least half of that
batch steps, the whole batch steps and the absent rows are put back (Runner.read_rows / write_rows: only those rows
are copied); any other call first scatters the batch back into per-sequence states. Rows never share a state,
so nothing can leak from one sequence into another: a row's state is read from and written to its own sequence
only.

A growing KV cache (a hybrid exported without --kv-cache static) cannot hold rows of different lengths in one
handle, and a fixed-capacity cache takes one position per call: for those, only sequences at the same position
are batched. Prefill (a request of several tokens) runs one sequence at a time, in pieces
(edgelin.runtime.prefill). Idle sequences are dropped after `idle_seconds`. A start beyond `capacity` live
sequences is refused, or, with `evict_when_full` (the Triton model), takes the place of the sequence seen least
recently: Triton holds at most max_candidate_sequences (= `capacity`) sequences and queues the rest, so when it
starts one more, one of those held here is a sequence Triton already dropped as idle (its timer ran first).

Run side: reads the artifact contract only.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from edgelin.errors import EdgelinError
from edgelin.export.base import Runner, StateHandle, check_ids
from edgelin.runtime import prefill as prefill_pieces


@dataclass(frozen=True)
class Call:
    """One request of one sequence: `ids` [T] (T == 1 a step, else a prefill), its Triton sequence flags."""

    sequence: int
    ids: np.ndarray
    start: bool = False
    end: bool = False


@dataclass
class Result:
    """The request's answer: the last position's logits [V], or the one-line error that refused it."""

    logits: np.ndarray | None = None
    error: str | None = None


@dataclass
class _Sequence:
    position: int = 0
    state: dict[str, np.ndarray] | None = None  # its own rows [1, ...]; None while it is a row of the batch
    last_seen: float = field(default_factory=time.monotonic)


class SequencePool:
    def __init__(self, runner: Runner, capacity: int, idle_seconds: float,
                 clock: Callable[[], float] = time.monotonic, evict_when_full: bool = False):
        if capacity < 1:
            raise EdgelinError(f"sequence capacity {capacity}", "the pool holds at least one sequence",
                               "set max_candidate_sequences >= 1")
        self.runner, self.capacity, self.idle_seconds, self._clock = runner, capacity, idle_seconds, clock
        self.evict_when_full = evict_when_full
        self._sequences: dict[int, _Sequence] = {}
        self._batch: tuple[tuple[int, ...], StateHandle] | None = None  # resident: (ids in row order, handle)
        manifest = runner.manifest
        # one position per call where the KV cache must line up (module docstring)
        self._same_position = not manifest.constant_memory

    # ---- what the server sees ------------------------------------------------------------------------
    @property
    def live(self) -> tuple[int, ...]:
        return tuple(self._sequences)

    def position(self, sequence: int) -> int:
        return self._sequences[sequence].position

    def run(self, calls: list[Call]) -> list[Result]:
        """Answers for `calls`, in order. A refused call changes nothing of any sequence."""
        self.drop_idle()
        results = [Result() for _ in calls]
        steps: list[int] = []
        for i, call in enumerate(calls):
            error = self._admit(call, calls[:i])
            if error:
                results[i].error = error
            elif len(call.ids) == 1:  # a step (a one-token prompt too: the step graph at position 0)
                steps.append(i)
            else:
                self._answer([results[i]], lambda call=call: self._prefill(call)[None])
        index = {calls[i].sequence: i for i in steps}
        for group in self._groups([calls[i].sequence for i in steps]):
            rows = [index[s] for s in group]  # the calls in the group's row order
            ids = np.array([int(calls[i].ids[0]) for i in rows], np.int64)
            self._answer([results[i] for i in rows], lambda group=group, ids=ids: self._step(group, ids))
        for call, result in zip(calls, results):
            if result.error is None:
                self._sequences[call.sequence].last_seen = self._clock()
                if call.end:
                    self.drop(call.sequence)
        return results

    @staticmethod
    def _answer(results: list[Result], run: Callable[[], np.ndarray]) -> None:
        """Each result's row of run()'s logits, or run()'s refusal for all of them (the runner changes no state
        when it refuses)."""
        try:
            logits = run()
        except EdgelinError as exc:
            for result in results:
                result.error = str(exc)
            return
        for row, result in enumerate(results):
            result.logits = logits[row]

    def drop(self, sequence: int) -> None:
        if self._batch is not None and sequence in self._batch[0]:
            self._scatter()
        self._sequences.pop(sequence, None)

    def drop_idle(self) -> list[int]:
        """Drop (and return) the sequences idle for longer than idle_seconds (a client that died mid-sequence)."""
        now = self._clock()
        stale = [s for s, seq in self._sequences.items() if now - seq.last_seen > self.idle_seconds]
        for sequence in stale:
            self.drop(sequence)
        return stale

    # ---- admission -----------------------------------------------------------------------------------
    def _admit(self, call: Call, earlier: list[Call]) -> str | None:
        """Why `call` is refused, or None; a start (re)creates its sequence at position 0."""
        if call.ids.ndim != 1 or len(call.ids) == 0:
            return f"sequence {call.sequence}: a request carries one or more token ids (got shape {list(call.ids.shape)})"
        try:  # here, not in the batched step: one bad id refuses its own request only
            check_ids(call.ids, self.runner.manifest.vocab_size)
        except EdgelinError as exc:
            return f"sequence {call.sequence}: {exc}"
        if any(c.sequence == call.sequence for c in earlier):
            return (f"sequence {call.sequence}: two requests of one sequence in one batch (send the next token "
                    "after the previous answer)")
        if call.start:
            if call.sequence not in self._sequences and len(self._sequences) >= self.capacity \
                    and self.evict_when_full:
                self.drop(min(self._sequences, key=lambda s: self._sequences[s].last_seen))
            if call.sequence not in self._sequences and len(self._sequences) >= self.capacity:
                return (f"sequence {call.sequence}: the server holds {self.capacity} live sequences, its capacity "
                        "(end one, or raise max_candidate_sequences with the memory it needs)")
            self.drop(call.sequence)
            self._sequences[call.sequence] = _Sequence(last_seen=self._clock())
            return None
        if call.sequence not in self._sequences:
            return (f"sequence {call.sequence} is not live (never started, ended, or dropped after "
                    f"{self.idle_seconds:g} s idle): start it again with the sequence-start flag and replay it")
        capacity = self.runner.manifest.kv_capacity
        held = self._sequences[call.sequence].position
        if capacity is not None and held + len(call.ids) > capacity:
            return (f"sequence {call.sequence}: {held} + {len(call.ids)} tokens exceed the export's KV capacity "
                    f"{capacity} (end the sequence, or re-export with a larger --context)")
        return None

    # ---- state movement --------------------------------------------------------------------------------
    def _groups(self, sequences: list[int]) -> list[tuple[int, ...]]:
        """The step calls for `sequences`: one, or one per position where the KV cache must line up; a group holding
        the resident batch's sequences takes its row order (Triton hands them over in any order)."""
        if not sequences:
            return []
        if not self._same_position:
            groups = [sequences]
        else:
            by_position: dict[int, list[int]] = {}
            for s in sequences:
                by_position.setdefault(self._sequences[s].position, []).append(s)
            groups = list(by_position.values())
        resident = self._batch[0] if self._batch is not None else ()
        return [resident if set(g) == set(resident) and len(g) == len(resident) else tuple(g) for g in groups]

    def _scatter(self) -> None:
        """The resident batch back into per-sequence states (rows of sequences that were dropped are discarded)."""
        assert self._batch is not None
        order, handle = self._batch
        self._batch = None
        values = self.runner.read_state(handle)
        for row, sequence in enumerate(order):
            if sequence in self._sequences:
                # copies, not views: a view would keep the whole batch's arrays alive (measured slower: fresh pages
                # for every gather)
                self._sequences[sequence].state = {k: v[row:row + 1].copy() for k, v in values.items()}

    def _handle_for(self, group: tuple[int, ...]) -> StateHandle:
        """A handle whose rows are `group`'s states, in order (the resident one when it already is)."""
        if self._batch is not None and self._batch[0] == group:
            return self._batch[1]
        if self._batch is not None:
            self._scatter()
        handle = self.runner.new_state(len(group))
        states = [self._sequences[s].state for s in group]
        if any(s is not None for s in states):
            zero = self.runner.manifest.initial_state(1)  # a sequence that has not run yet
            rows = [s if s is not None else zero for s in states]
            self.runner.write_state(handle, {k: np.concatenate([r[k] for r in rows]) for k in rows[0]})
        for s in group:
            self._sequences[s].state = None
        self._batch = (group, handle)
        return handle

    def _step(self, group: tuple[int, ...], ids: np.ndarray) -> np.ndarray:
        if self._within_batch(group):
            return self._step_within(group, ids)
        handle = self._handle_for(group)
        positions = np.array([self._sequences[s].position for s in group], np.int64)
        logits = self.runner.step(ids, handle, positions)
        for s in group:
            self._sequences[s].position += 1
        return logits

    def _within_batch(self, group: tuple[int, ...]) -> bool:
        """Whether `group` steps inside the resident batch: a constant-size state (rows independent), `group` a
        part of the batch, and at least half of it (the absent rows are stepped too, then put back)."""
        if self._batch is None or not self.runner.manifest.constant_memory:
            return False
        resident = set(self._batch[0])
        return set(group) < resident and 2 * len(group) >= len(resident)

    def _step_within(self, group: tuple[int, ...], ids: np.ndarray) -> np.ndarray:
        """Step the whole resident batch and put its absent rows back as they were (read_rows / write_rows copy
        only those rows), instead of scattering the batch and gathering `group`: what keeps a batch that the
        batcher hands over a few requests short from moving every state (docs/serving.md, "Measured")."""
        order, handle = self._batch
        where = {s: row for row, s in enumerate(order)}
        absent = [row for row, s in enumerate(order) if s not in set(group)]
        kept = self.runner.read_rows(handle, absent)
        all_ids = np.zeros(len(order), np.int64)  # an absent row steps on token 0: its result is put back
        all_ids[[where[s] for s in group]] = ids
        positions = np.array([self._sequences[s].position for s in order], np.int64)
        logits = self.runner.step(all_ids, handle, positions)
        self.runner.write_rows(handle, absent, kept)
        for s in group:
            self._sequences[s].position += 1
        return logits[[where[s] for s in group]]

    def _prefill(self, call: Call) -> np.ndarray:
        """One sequence's tokens through the prefill graph, from its state (alone: batch 1). A sequence outside
        the resident batch (a new prompt) is prefilled on a handle of its own, leaving the batch where it is:
        the sequences stepping together go on without a copy (measured at 1.3 B: docs/serving.md)."""
        sequence = self._sequences[call.sequence]
        resident = self._batch is not None and call.sequence in self._batch[0]
        if resident:
            handle = self._handle_for((call.sequence,))
        else:
            handle = self.runner.new_state(1)
            if sequence.state is not None:
                self.runner.write_state(handle, sequence.state)
        logits, _ = prefill_pieces(self.runner, call.ids[None].astype(np.int64), handle, start=sequence.position)
        if not resident:
            sequence.state = self.runner.read_state(handle)
        sequence.position += len(call.ids)
        return logits[0]
