"""`edgelin generate`: tokenizer + sampling over an exported folder, streaming tokens as they come.

Memory stays flat: the loop holds the state (constant size), the last logits, a streaming
detokenizer and (for the repetition penalty) one seen/unseen flag per vocabulary entry; generated ids
are not accumulated unless asked for."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Iterator

import numpy as np

from edgelin.errors import EdgelinError
from edgelin.runtime import check_room, open_runner, rss_bytes, runner_label
from edgelin.tokenizer import TOKENIZER, TextTokenizer

if TYPE_CHECKING:
    from edgelin.conversation import Conversation
    from edgelin.devices import DeviceProfile
    from edgelin.serve.client import ServedConversation


SETTLE_STEPS = 16  # the runtime allocates its buffers in the first steps; growth is measured after


@dataclass(frozen=True)
class Sampling:
    temperature: float = 0.8
    top_k: int = 50
    top_p: float = 0.95
    greedy: bool = False
    seed: int = 0
    repetition_penalty: float = 1.0  # as transformers' RepetitionPenaltyLogitsProcessor; 1: off

    def __post_init__(self) -> None:
        if not (math.isfinite(self.temperature) and self.temperature > 0) and not self.greedy:
            raise EdgelinError("--temperature must be > 0", "it divides the logits", "use --greedy for argmax")
        if not 0 < self.top_p <= 1 or self.top_k < 0:
            raise EdgelinError("bad --top-p/--top-k", "top-p must be in (0, 1], top-k >= 0 (0 = off)",
                               "pass valid values")
        if not (math.isfinite(self.repetition_penalty) and self.repetition_penalty > 0):
            raise EdgelinError(f"--repetition-penalty {self.repetition_penalty:g} is invalid",
                               "the penalty divides or multiplies logits, so it must be finite and > 0",
                               "pass 1 (off) or a value such as 1.1-1.3")


def penalize(logits: np.ndarray, seen: np.ndarray, penalty: float) -> np.ndarray:
    """The repetition penalty (Keskar et al. 2019, as transformers and llama.cpp apply it): every token
    already in the context gets logit / P if the logit is positive, else logit * P."""
    if penalty == 1.0:
        return logits
    return np.where(seen, np.where(logits > 0, logits / penalty, logits * penalty), logits)


def sample(logits: np.ndarray, cfg: Sampling, rng: np.random.Generator, seen: np.ndarray | None = None) -> int:
    """One token from logits [V]: the repetition penalty over the `seen` mask [V] (bool), then greedy,
    or temperature + top-k + top-p (nucleus)."""
    if seen is not None:
        logits = penalize(logits, seen, cfg.repetition_penalty)
    if cfg.greedy:
        return int(np.argmax(logits))
    scaled = logits.astype(np.float64) / cfg.temperature
    order = np.argsort(-scaled)
    if cfg.top_k:
        order = order[: cfg.top_k]
    probs = np.exp(scaled[order] - scaled[order[0]])
    probs /= probs.sum()
    keep = int(np.searchsorted(np.cumsum(probs), cfg.top_p) + 1)
    probs = probs[:keep] / probs[:keep].sum()
    return int(order[rng.choice(keep, p=probs)])


def check_finite(logits: np.ndarray, token: int, folder: Path) -> None:
    """Refuse NaN/inf logits before sampling from them (sampling would crash, argmax pick garbage). The
    weights are not hashed on every load, so corrupt ones (zeroed, bit-flipped) first show up here."""
    if not np.isfinite(logits.max()):  # one reduction, no mask per token: NaN and +inf propagate to the max
        raise EdgelinError(f"the model produced NaN/inf logits at new token {token}",
                           "the export's weights or graphs are likely corrupt (sampling needs finite logits)",
                           f"run `edgelin validate {folder}` to check the folder (the weights may be corrupt), "
                           "or re-export")


def no_tokenizer(folder: Path, source: object) -> EdgelinError:
    """generate's refusal of an export without a tokenizer. The manifest does not say why it has none
    (exported with --no-tokenizer, or from a checkpoint without tokenizer.json): the fix names the
    checkpoint's tokenizer where it is there now."""
    checkpoint = Path(source) if isinstance(source, str) and source else None
    if checkpoint is not None and (checkpoint / TOKENIZER).is_file():
        fix = f"re-export from {checkpoint} (it has {TOKENIZER}) without --no-tokenizer"
    else:
        fix = f"re-export without --no-tokenizer from a checkpoint with {TOKENIZER}"
    return EdgelinError(f"{folder} has no tokenizer", "the export has no tokenizer (exported with --no-tokenizer, "
                        "or the checkpoint had none)", fix)


def check_length(manifest, prompt_tokens: int, max_new_tokens: int) -> None:
    """A fixed-capacity KV cache (`export --kv-cache static --context N`) must hold the whole run, checked
    before the prefill: the prompt, then a step for each new token (the loop steps after every token it
    samples), prompt_tokens + max_new_tokens positions in all."""
    capacity, need = manifest.kv_capacity, prompt_tokens + max_new_tokens
    if capacity is None or need <= capacity:
        return
    if prompt_tokens < capacity:
        fix = (f"pass -n {capacity - prompt_tokens} or fewer, shorten the prompt, or re-export with "
               f"{manifest.kv_flag(need)} or more")
    elif max_new_tokens < capacity:
        fix = (f"shorten the prompt to at most {capacity - max_new_tokens} tokens, or re-export with "
               f"{manifest.kv_flag(need)} or more")
    else:
        fix = (f"shorten the prompt and lower -n (prompt tokens + -n at most {capacity}), or re-export with "
               f"{manifest.kv_flag(need)} or more")
    check_room(manifest, need, f"a prompt of {prompt_tokens} tokens with -n {max_new_tokens}", fix)


@dataclass(frozen=True)
class StateFiles:
    """generate's state files (edgelin.artifact.state_file): `load` continues a saved conversation (the prompt is
    the next turn: only its tokens are prefilled); `save` writes the conversation after the last token; a
    `prompt_cache` holds the state of a prompt's tokens but its last: a prompt that starts with them prefills only
    the rest (a long system prompt, once), any other prompt prefills in full and rewrites the cache."""

    load: Path | None = None
    save: Path | None = None
    prompt_cache: Path | None = None

    def check(self) -> None:
        """Refuse, before the model loads, what could not be done: a file to read that is not there, a save that
        would overwrite a file edgelin did not write, --load-state with --prompt-cache."""
        from edgelin.artifact import state_file

        if self.load is not None and self.prompt_cache is not None:
            raise EdgelinError("--load-state with --prompt-cache", "a loaded conversation already holds its prompt",
                               "pass one of them")
        if self.load is not None and not Path(self.load).is_file():
            raise EdgelinError(f"state file {self.load} does not exist", "there is nothing to load",
                               "pass the path --save-state wrote")
        for path in (self.save, self.prompt_cache):
            if path is not None:
                state_file.check_writable(Path(path))


def _start(runner, states: StateFiles, ids: list[int]) -> tuple["Conversation", int, list[int]]:
    """(the conversation to continue, the tokens it already holds that were not prefilled now, the ids to prefill)."""
    from edgelin.artifact import state_file
    from edgelin.conversation import Conversation

    record = states.save is not None  # the tokens go into the saved file; else memory stays flat
    if states.load is not None:
        conv = Conversation.load(runner, states.load, keep=0, record=record)
        return conv, conv.position, ids
    cache = states.prompt_cache
    if cache is None:
        return Conversation(runner, keep=0, record=record), 0, ids
    if Path(cache).is_file():
        saved = state_file.read(Path(cache))
        state_file.check_fits(saved, runner.manifest, cache)  # another model's cache: refused, not replaced
        held = saved.tokens[0].tolist() if saved.tokens is not None and saved.batch == 1 else None
        if held is not None and len(held) < len(ids) and ids[:len(held)] == held:
            return Conversation.load(runner, cache, keep=0, record=record), len(held), ids[len(held):]
    conv = Conversation(runner, keep=0)  # records the prompt's tokens for the cache file

    if len(ids) > 1:
        conv.prefill(np.asarray(ids[:-1]))
        conv.save(cache)
    return conv, 0, ids[-1:]


@dataclass(frozen=True)
class GenerateResult:
    prompt_tokens: int
    new_tokens: int
    prefill_seconds: float
    decode_seconds: float
    rss_start_bytes: int
    rss_end_bytes: int
    token_ids: list[int] | None
    text: str | None
    runner: str = ""  # which runtime ran it (edgelin.runtime.runner_label)
    reused_tokens: int = 0  # tokens a loaded state or the prompt cache held: not prefilled by this run
    prefilled_tokens: int = 0  # tokens this run prefilled

    @property
    def tokens_per_second(self) -> float:
        return self.new_tokens / max(self.decode_seconds, 1e-9)

    @property
    def rss_settled(self) -> bool:
        """Whether the RSS figures measure decoding: the start is read after SETTLE_STEPS tokens, once the
        runtime's buffers exist; a shorter run's start predates them (its "growth" is that allocation)."""
        return self.new_tokens > SETTLE_STEPS

    def to_dict(self) -> dict:
        return {**self.__dict__, "tokens_per_second": self.tokens_per_second,
                "rss_growth_bytes": self.rss_end_bytes - self.rss_start_bytes if self.rss_settled else None}


def sampled_tokens(conv: "Conversation", logits: np.ndarray, sampling: Sampling, rng: np.random.Generator,
                   seen: np.ndarray, limit: int, folder: Path) -> Iterator[int]:
    """Up to `limit` tokens of batch row 0, each sampled from the logits (checked finite; `logits`: the prefill's,
    checked by the caller), marked in `seen`, yielded, then stepped: a caller that stops on a token (an end of
    text) breaks before it is stepped, so the conversation ends where the text does. generate's and chat's loop."""
    for produced in range(limit):
        if produced:
            check_finite(logits[0], produced + 1, folder)
        token = sample(logits[0], sampling, rng, seen)
        seen[token] = True
        yield token
        logits = conv.step(token)


def generate(
    folder: Path,
    prompt: str,
    max_new_tokens: int = 200,
    sampling: Sampling = Sampling(),
    on_text: Callable[[str], None] | None = None,
    keep_ids: bool = True,
    stop_at_eos: bool = True,
    threads: int | None = None,
    on_start: Callable[[], None] | None = None,
    device: "DeviceProfile | None" = None,
    states: StateFiles = StateFiles(),
    server: str | None = None,
) -> GenerateResult:
    """`on_start` is called once the folder, tokenizer and prompt prefill have succeeded, before the
    first token: the CLI echoes the prompt there, so a failure never prints the prompt first. The
    state stays in the runner's handle (advanced in place); only the logits come back each step.
    `server`: a running `edgelin serve` (gRPC HOST:PORT) does the prefill and steps, holding the state; the folder
    gives the tokenizer and the model's name (edgelin.serve.client)."""
    if any("\ud800" <= char <= "\udfff" for char in prompt):  # the tokenizer takes Unicode text only
        raise EdgelinError("the prompt is not valid text", "it holds surrogate code points (bytes that were not "
                           "UTF-8, decoded with errors='surrogateescape')", "pass the prompt as UTF-8 text")
    states.check()
    if server is not None:
        runner, manifest = None, served_manifest(folder, states)
    else:
        runner = open_runner(folder, threads, device)
        manifest = runner.manifest
    if manifest.tokenizer is None:
        raise no_tokenizer(folder, manifest.source.get("path"))
    tokenizer = TextTokenizer(Path(folder) / manifest.tokenizer)
    ids = tokenizer.encode(prompt)
    if not ids and manifest.bos_token_id is not None:
        ids = [manifest.bos_token_id]
    if not ids:
        raise EdgelinError("the prompt is empty", "there is no token to start from", "pass --prompt TEXT")
    rng = np.random.default_rng(sampling.seed)
    feed = tokenizer.stream()
    for token in ids:  # prime the streaming decoder so the first new token decodes in context
        feed(token)

    from edgelin.artifact.state_file import position_of

    check_length(manifest, (position_of(states.load) if states.load is not None else 0) + len(ids), max_new_tokens)
    started = time.perf_counter()
    conv, reused, fresh = _start(runner, states, ids) if server is None else (_served(server, manifest), 0, ids)
    logits = conv.prefill(np.asarray(fresh, np.int64))
    prefilled = conv.position - reused  # a missed prompt cache's prompt in two calls, both counted
    prefill_seconds = time.perf_counter() - started
    check_finite(logits[0], 1, folder)  # before on_start: a model that cannot continue echoes no prompt
    # Constant memory: one flag per vocabulary entry, however long the generation (not a list of ids).
    seen = np.zeros(logits.shape[-1], dtype=bool)
    seen[[t for t in ids if 0 <= t < seen.size]] = True
    if reused:  # and the tokens a loaded conversation holds, where it kept them (-1: not kept)
        held = conv.tokens[0]
        seen[held[(held >= 0) & (held < seen.size)]] = True
    if on_start is not None:
        on_start()
    rss_start = rss_bytes()  # re-read once the step session's buffers exist (see below)
    kept: list[int] | None = [] if keep_ids else None
    produced = 0
    started = time.perf_counter()
    for token in sampled_tokens(conv, logits, sampling, rng, seen, max_new_tokens, folder):
        produced += 1
        if kept is not None:
            kept.append(token)
        if on_text is not None:
            on_text(feed(token))
        if stop_at_eos and token == manifest.eos_token_id:
            break
        if produced == SETTLE_STEPS:
            rss_start = rss_bytes()
    decode_seconds = time.perf_counter() - started
    if states.save is not None:
        conv.save(states.save)
    if server is not None:
        conv.close()  # ends the sequence: the server frees its slot
    text = tokenizer.decode(kept) if kept is not None else None
    label = runner_label(runner) if runner is not None else f"triton server {server} (model {conv.model})"
    return GenerateResult(len(ids), produced, prefill_seconds, decode_seconds, rss_start, rss_bytes(), kept, text,
                          label, reused, prefilled)


def served_manifest(folder: Path, states: StateFiles):
    """The manifest of an export served by `edgelin serve` (generate --server), checked: the server holds the
    state, so state files are refused."""
    from edgelin.serve.server import served_manifest as checked

    if states != StateFiles():
        raise EdgelinError("--server with a state file option", "the server holds the conversation's state",
                           "drop --load-state, --save-state and --prompt-cache, or generate locally")
    return checked(folder)


def _served(server: str, manifest) -> "ServedConversation":
    from edgelin.serve.client import ServedConversation

    return ServedConversation(server, manifest.extra["serve"]["triton"]["model"])
