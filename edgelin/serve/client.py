"""Conversations with a model served by `edgelin serve` (the Python-backend repository of `export --serve
triton`), over gRPC with Triton's sequence controls (docs/serving.md, "From Python"):

    with ServedConversation("localhost:8001", "tiny-gdn-hybrid") as conv:
        logits = conv.prefill(prompt_ids)      # the whole prompt in one request
        logits = conv.step(token)              # one token; the server holds the state
        token = conv.next_token(token)         # the same, answered with the argmax only (8 bytes, not 4 V)

The server keeps each sequence's state keyed by its id (random unless given); `close()` (or leaving the `with`)
ends the sequence and frees its slot. After a server restart the state is gone: `replay()` starts the sequence
again and prefills every token so far. Needs tritonclient[grpc] (`edgelin[serve]`).
"""

from __future__ import annotations

import secrets

import numpy as np

from edgelin.errors import EdgelinError

LOGITS, NEXT_TOKEN, INPUT_IDS = "logits", "next_token", "input_ids"  # edgelin.serve.python_model's names


class ServedConversation:
    def __init__(self, url: str, model: str, sequence_id: int | None = None, timeout: float = 60.0):
        try:
            import tritonclient.grpc as grpc
        except ImportError:
            raise EdgelinError("tritonclient is not installed", "the client talks to Triton over gRPC",
                               "pip install 'edgelin[serve]'") from None
        self._grpc, self.url, self.model, self.timeout = grpc, url, model, timeout
        self._client = grpc.InferenceServerClient(url)
        self.sequence_id = sequence_id if sequence_id is not None else secrets.randbits(63) | 1
        self.tokens: list[int] = []  # every token sent, for replay()
        self._started = self._ended = False

    @property
    def position(self) -> int:
        return len(self.tokens)

    def _infer(self, ids: np.ndarray, output: str, end: bool = False) -> np.ndarray:
        if self._ended:
            raise EdgelinError(f"sequence {self.sequence_id}", "it was ended", "start a new ServedConversation")
        ids = np.asarray(ids, np.int64).reshape(1, -1)
        tensor = self._grpc.InferInput(INPUT_IDS, list(ids.shape), "INT64")
        tensor.set_data_from_numpy(ids)
        from tritonclient.utils import InferenceServerException

        try:
            answer = self._client.infer(self.model, [tensor], outputs=[self._grpc.InferRequestedOutput(output)],
                                        sequence_id=self.sequence_id, sequence_start=not self._started,
                                        sequence_end=end, client_timeout=self.timeout)
        except InferenceServerException as exc:
            raise EdgelinError(f"the server at {self.url} refused a request of sequence {self.sequence_id}",
                               exc.message() or str(exc), "see the server's log; after a restart, replay() the "
                               "conversation") from None
        self._started, self._ended = True, end
        self.tokens.extend(int(t) for t in ids[0])
        return answer.as_numpy(output)

    def prefill(self, ids: np.ndarray | list[int]) -> np.ndarray:
        """Advance by `ids` (one request); the last position's logits [1, V]."""
        return self._infer(np.asarray(ids), LOGITS)

    def step(self, token: int) -> np.ndarray:
        """Advance by one token; its logits [1, V]."""
        return self._infer(np.array([token]), LOGITS)

    def next_token(self, ids: np.ndarray | list[int] | int) -> int:
        """Advance by `ids` (one or more tokens); the argmax of the last position's logits."""
        return int(self._infer(np.atleast_1d(np.asarray(ids)), NEXT_TOKEN).reshape(-1)[0])

    def replay(self) -> np.ndarray:
        """Start the sequence again on the server (after a restart: its state is gone) with every token so far in
        one prefill; the last position's logits."""
        tokens, self.tokens, self._started, self._ended = self.tokens, [], False, False
        return self.prefill(tokens)

    def close(self) -> None:
        """End the sequence (one last request: Triton ends a sequence with a request), freeing its slot."""
        if self._started and not self._ended:
            last = self.tokens[-1]
            try:
                self._infer(np.array([last]), NEXT_TOKEN, end=True)
                del self.tokens[-1]  # the closing request's token is not part of the conversation
            except EdgelinError:
                pass  # the server is gone or dropped the sequence: nothing is held
        self._ended = True

    def __enter__(self) -> "ServedConversation":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
