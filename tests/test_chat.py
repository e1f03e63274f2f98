"""`edgelin chat` (edgelin.chat): each turn prefills only its own text and answers as `edgelin generate` continuing
the saved conversation would; /undo goes back a turn exactly, /save and /load carry it to another session, and a
refused command is one line that leaves the conversation as it was."""

from __future__ import annotations

import numpy as np
import pytest
from typer.testing import CliRunner

from edgelin.artifact import state_file
from edgelin.chat import ChatRequest, ChatSession
from edgelin.cli import app
from edgelin.errors import EdgelinError
from edgelin.export.pipeline import export_checkpoint
from edgelin.generate import Sampling, StateFiles, generate
from helpers import make_checkpoint

GREEDY = Sampling(greedy=True)
TURNS = ("def main(", "    return x", "# and then")


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    root = tmp_path_factory.mktemp("chat")
    return export_checkpoint(make_checkpoint(root / "ckpt", "hybrid"), root / "out").folder


def _answers(session: ChatSession, turns) -> list[str]:
    out = []
    for text in turns:
        pieces: list[str] = []
        assert session.handle(text, pieces.append) is None
        out.append("".join(pieces))
    return out


def test_each_turn_answers_as_generate_continuing_the_conversation(folder, tmp_path):
    session = ChatSession(ChatRequest(folder, 10, GREEDY))
    answers = _answers(session, TURNS)
    state = tmp_path / "c.edgestate"
    want = []
    for i, text in enumerate(TURNS):  # generate's streamed text (its `text` also decodes an unfinished UTF-8 tail)
        pieces: list[str] = []
        generate(folder, text, 10, GREEDY, on_text=pieces.append, states=StateFiles(load=state if i else None,
                                                                                     save=state))
        want.append("".join(pieces))
    assert answers == want and all(want)
    saved = state_file.read(state)  # the same tokens in the same order: each turn's own, none prefilled twice
    assert session.conv.position == saved.position
    np.testing.assert_array_equal(session.conv.tokens, saved.tokens)


def test_undo_save_and_load(folder, tmp_path):
    session = ChatSession(ChatRequest(folder, 8, GREEDY))
    _answers(session, TURNS[:1])
    after_first = session.conv.position
    second, = _answers(session, TURNS[1:2])
    assert session.handle("/undo", print) == f"back to {after_first} tokens"
    assert _answers(session, TURNS[1:2]) == [second]  # the same turn again: the same answer
    path = tmp_path / "chat.edgestate"
    assert session.handle(f"/save {path}", print).startswith(f"saved {session.conv.position} tokens")
    later = ChatSession(ChatRequest(folder, 8, GREEDY, load_state=path))
    assert _answers(later, TURNS[2:]) == _answers(session, TURNS[2:])
    before = session.conv.read_state()
    for line, match in (("/bogus", "unknown command /bogus"), ("/load", "without a file"),
                        (f"/load {tmp_path / 'none.edgestate'}", "does not exist")):
        with pytest.raises(EdgelinError, match=match):
            session.handle(line, print)
    for name, value in session.conv.read_state().items():  # refused commands changed nothing
        np.testing.assert_array_equal(value, before[name])
    fresh = ChatSession(ChatRequest(folder, 8, GREEDY))
    with pytest.raises(EdgelinError, match="no turn to undo"):
        fresh.handle("/undo", print)


def test_the_command_reads_lines_and_goes_on_after_a_refusal(folder, tmp_path):
    path = tmp_path / "c.edgestate"
    result = CliRunner().invoke(app, ["chat", str(folder), "-n", "6", "--greedy"],
                                input=f"{TURNS[0]}\n/bogus\n/save {path}\n{TURNS[1]}\n/quit\nnever read\n")
    assert result.exit_code == 0, result.output
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert errors == ["error: unknown command /bogus: commands are /save, /load, /undo, /reset, /quit. Fix: type "
                      "text to talk, or one of those"]
    assert "saved" in result.stderr and path.is_file()
    answers = result.stdout.split("\n")
    session = ChatSession(ChatRequest(folder, 6, GREEDY))
    assert answers[:2] == _answers(session, TURNS[:2])
