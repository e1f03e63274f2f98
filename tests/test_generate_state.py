"""`edgelin generate --save-state / --load-state / --prompt-cache` (edgelin.generate.StateFiles): a conversation
continued in a later run gives the tokens of one uninterrupted run, a prompt cache prefills only what is new, and
every refusal comes before anything runs or is written."""

from __future__ import annotations

import json

import numpy as np
import pytest
from typer.testing import CliRunner

from edgelin.artifact import state_file
from edgelin.cli import app
from edgelin.errors import EdgelinError
from edgelin.export.pipeline import export_checkpoint
from edgelin.generate import Sampling, StateFiles, generate
from edgelin.runtime import open_runner, prefill
from edgelin.tokenizer import TextTokenizer
from helpers import export_family, make_checkpoint, qwen_attention_checkpoint

GREEDY = Sampling(greedy=True)
FIRST, SECOND = "the cat sat on the mat", " and then it slept"


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    root = tmp_path_factory.mktemp("generate-state")
    return export_checkpoint(make_checkpoint(root / "ckpt", "hybrid"), root / "out").folder


def _greedy(runner, logits, state, position, count):
    """`count` greedy tokens by runner.step alone (not edgelin.conversation): the reference."""
    out = []
    for _ in range(count):
        token = int(np.argmax(logits[0]))
        out.append(token)
        logits = runner.step(np.array([token]), state, np.array([position], np.int64))
        position += 1
    return out, logits, position


def test_a_conversation_continued_in_a_later_run_is_one_uninterrupted_run(folder, tmp_path):
    path = tmp_path / "chat.edgestate"
    first = generate(folder, FIRST, 20, GREEDY, stop_at_eos=False, states=StateFiles(save=path))
    second = generate(folder, SECOND, 12, GREEDY, stop_at_eos=False, states=StateFiles(load=path, save=path))
    tokenizer = TextTokenizer(folder / "tokenizer.json")
    a, b = tokenizer.encode(FIRST), tokenizer.encode(SECOND)
    assert (second.reused_tokens, second.prefilled_tokens) == (len(a) + 20, len(b))
    runner = open_runner(folder)
    logits, state = prefill(runner, np.array([a]))
    want_first, _, position = _greedy(runner, logits, state, len(a), 20)
    logits, state = prefill(runner, np.array([b]), state, start=position)
    want_second, _, position = _greedy(runner, logits, state, position + len(b), 12)
    assert (first.token_ids, second.token_ids) == (want_first, want_second)
    saved = state_file.read(path)  # the file after the second run: every token of both turns
    assert saved.position == position
    assert saved.tokens[0].tolist() == a + want_first + b + want_second


def test_a_prompt_cache_prefills_only_what_is_new(folder, tmp_path):
    cache = tmp_path / "system.edgestate"
    tokenizer = TextTokenizer(folder / "tokenizer.json")
    ids = tokenizer.encode(FIRST)
    miss = generate(folder, FIRST, 8, GREEDY, stop_at_eos=False, states=StateFiles(prompt_cache=cache))
    assert (miss.reused_tokens, miss.prefilled_tokens) == (0, len(ids))
    assert state_file.read(cache).tokens[0].tolist() == ids[:-1]  # all but the last: any prompt extending it hits
    hit = generate(folder, FIRST, 8, GREEDY, stop_at_eos=False, states=StateFiles(prompt_cache=cache))
    assert (hit.reused_tokens, hit.prefilled_tokens, hit.token_ids) == (len(ids) - 1, 1, miss.token_ids)
    longer = generate(folder, FIRST + SECOND, 8, GREEDY, stop_at_eos=False, states=StateFiles(prompt_cache=cache))
    whole = tokenizer.encode(FIRST + SECOND)
    assert whole[:len(ids) - 1] == ids[:-1]
    assert (longer.reused_tokens, longer.prefilled_tokens) == (len(ids) - 1, len(whole) - len(ids) + 1)
    other = generate(folder, SECOND, 4, GREEDY, stop_at_eos=False, states=StateFiles(prompt_cache=cache))
    assert other.reused_tokens == 0 and state_file.read(cache).tokens[0].tolist() == tokenizer.encode(SECOND)[:-1]


def test_another_models_cache_is_refused_and_kept(folder, tmp_path):
    from edgelin.conversation import Conversation

    other = export_family(tmp_path, "mamba2")
    cache = tmp_path / "theirs.edgestate"
    conv = Conversation(open_runner(other))
    conv.prefill(np.arange(5))
    conv.save(cache)
    before = cache.read_bytes()
    with pytest.raises(EdgelinError, match="another model"):
        generate(folder, FIRST, 4, GREEDY, states=StateFiles(prompt_cache=cache))
    assert cache.read_bytes() == before


def _cli(*args):
    return CliRunner().invoke(app, ["generate", *[str(a) for a in args]])


def test_the_cli_continues_a_conversation_and_refuses_before_running(folder, tmp_path):
    path = tmp_path / "chat.edgestate"
    result = _cli(folder, "-p", FIRST, "-n", "6", "--greedy", "--ignore-eos", "--save-state", path, "--json")
    assert result.exit_code == 0, result.output
    again = _cli(folder, "-p", SECOND, "-n", "6", "--greedy", "--ignore-eos", "--load-state", path, "--json")
    assert again.exit_code == 0, again.output
    report = json.loads(again.stdout)
    assert report["reused_tokens"] == state_file.read(path).position
    mine = tmp_path / "notes.txt"
    mine.write_text("keep me")
    for args, needle in (((folder, "-p", FIRST, "--save-state", mine), "is not an edgelin state file"),
                         ((folder, "-p", FIRST, "--load-state", tmp_path / "none.edgestate"), "does not exist"),
                         ((folder, "-p", FIRST, "--load-state", path, "--prompt-cache", tmp_path / "c.edgestate"),
                          "--load-state with --prompt-cache"),
                         ((folder, "-p", FIRST, "--save-state", tmp_path / "no" / "x.edgestate"), "does not exist")):
        refused = _cli(*args)
        assert refused.exit_code == 2, refused.output
        errors = [line for line in refused.stderr.splitlines() if line.startswith("error:")]
        assert len(errors) == 1 and needle in errors[0], refused.stderr
        assert refused.stdout.strip() == ""  # refused before the prompt was echoed or a token generated
    assert mine.read_text() == "keep me" and not (tmp_path / "c.edgestate").exists()


def test_a_growing_kv_cache_travels_in_the_file(tmp_path):
    """A hybrid whose KV cache grows: the second run continues from the saved rows (no tokenizer: by ids)."""
    from edgelin.conversation import Conversation

    folder = export_checkpoint(qwen_attention_checkpoint(tmp_path / "ckpt"), tmp_path / "out").folder
    runner = open_runner(folder)
    rng = np.random.default_rng(0)
    ids = rng.integers(0, runner.manifest.vocab_size, (1, 40))
    conv = Conversation(runner)
    conv.prefill(ids[:, :30])
    conv.save(tmp_path / "kv.edgestate")
    resumed = Conversation.load(open_runner(folder), tmp_path / "kv.edgestate")
    np.testing.assert_array_equal(resumed.prefill(ids[:, 30:]), conv.prefill(ids[:, 30:]))
    kv = {k: v.shape for k, v in resumed.read_state().items() if k.endswith(("key", "value"))}
    assert kv and all(shape[1] == 40 or shape[2] == 40 for shape in kv.values()), kv
