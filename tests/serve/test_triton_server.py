"""A real Triton Inference Server (nvidia-pytriton's tritonserver, started by `edgelin serve`'s TritonServer from the
serving environment EDGELIN_SERVE_ENV: `make test-serve`) serving `export --serve triton` repositories to
concurrent clients. Every conversation's logits and tokens are compared with the same conversation run alone in
this process (edgelin.conversation over the local runner); nothing expected is computed by the server side.

The device profile below makes the limits small enough to reach in a test: 6 live sequences (Triton queues the
rest), batches of up to 4, a sequence idle for 3 s dropped."""

from __future__ import annotations

import os
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

from edgelin.conversation import Conversation
from edgelin.errors import EdgelinError
from edgelin.runtime import open_runner
from helpers import assert_close, make_checkpoint, qwen_attention_checkpoint

pytestmark = pytest.mark.server
pytest.importorskip("tritonclient.grpc", reason="tritonclient[grpc] (the dev extra) is not installed")

TOLERANCE = 1e-5  # a row of the server's batch vs the conversation alone here
PROFILE = """title = "serve test"
kind = "server"
targets = ["onnx"]
compute = "cpu"
precision = "fp32"
state_dtype = "float32"
memory_gib = 8

[serving]
max_batch_size = 4
max_candidate_sequences = 6
preferred_batch_sizes = [2, 4]
max_queue_delay_us = 2000
max_sequence_idle_us = 3000000
"""
IDLE_SECONDS = 3.0


def _serve_env() -> Path:
    value = os.environ.get("EDGELIN_SERVE_ENV")
    if not value:
        pytest.skip("needs the serving environment: run `make test-serve` (it sets EDGELIN_SERVE_ENV)")
    return Path(value).resolve()


def _ports() -> tuple[int, int, int]:
    sockets = [socket.socket() for _ in range(3)]
    for s in sockets:
        s.bind(("127.0.0.1", 0))
    ports = tuple(s.getsockname()[1] for s in sockets)
    for s in sockets:
        s.close()
    return ports  # type: ignore[return-value]


@pytest.fixture(scope="module")
def devices(tmp_path_factory):
    folder = tmp_path_factory.mktemp("devices")
    (folder / "serve-test.toml").write_text(PROFILE)
    old = os.environ.get("EDGELIN_DEVICES")
    os.environ["EDGELIN_DEVICES"] = str(folder)  # the export and the server (its environment is this one's) read it
    yield folder
    if old is None:
        os.environ.pop("EDGELIN_DEVICES", None)
    else:
        os.environ["EDGELIN_DEVICES"] = old


@pytest.fixture(scope="module")
def exports(tmp_path_factory, devices):
    from edgelin.devices import get_device
    from edgelin.export.pipeline import export_checkpoint

    root = tmp_path_factory.mktemp("served")
    device = get_device("serve-test")
    window = make_checkpoint(root / "window-ckpt", "hybrid")  # linear + sliding-window softmax, a tokenizer
    growing = qwen_attention_checkpoint(root / "growing-ckpt")  # GLA + full attention: a KV cache that grows
    return {name: export_checkpoint(ckpt, root / name, device=device, serve="triton").folder
            for name, ckpt in (("window", window), ("growing", growing))}


def _server(folder: Path, log: Path):
    from edgelin.serve.server import ServeRequest, TritonServer

    grpc, http, metrics = _ports()
    return TritonServer(ServeRequest(folder, _serve_env(), grpc_port=grpc, http_port=http, metrics_port=metrics,
                                     log=log))


@pytest.fixture(scope="module")
def window_server(exports, tmp_path_factory):
    with _server(exports["window"], tmp_path_factory.mktemp("log") / "window.log") as server:
        yield server


def _model(folder: Path) -> str:
    from edgelin.artifact.manifest import Manifest

    return Manifest.load(folder).extra["serve"]["triton"]["model"]


def _alone(folder: Path, prompt: np.ndarray, tokens: list[int]) -> list[np.ndarray]:
    conv = Conversation(open_runner(folder), keep=0)
    return [conv.prefill(prompt)[0], *[conv.step(t)[0] for t in tokens]]


def _converse(url: str, model: str, prompt: np.ndarray, steps: int, pause: float = 0.0):
    """One client: the prompt in one request, then `steps` greedy tokens, each answered with its logits."""
    from edgelin.serve.client import ServedConversation

    with ServedConversation(url, model) as conv:
        got = [conv.prefill(prompt)[0]]
        tokens = []
        for _ in range(steps):
            tokens.append(int(np.argmax(got[-1])))
            got.append(conv.step(tokens[-1])[0])
            time.sleep(pause)
    return got, tokens


def _check(folder: Path, prompt: np.ndarray, got: list[np.ndarray], tokens: list[int], what: str) -> None:
    want = _alone(folder, prompt, tokens)
    for i, (g, w) in enumerate(zip(got, want)):
        assert_close(g, w, TOLERANCE, f"{what} answer {i}")
        assert int(np.argmax(g)) == int(np.argmax(w)), f"{what} answer {i}: another greedy token"


def _statistics(server) -> tuple[int, int]:
    """(requests, model executions) Triton counted: more requests than executions means batches of several."""
    import tritonclient.grpc as grpc

    stats = grpc.InferenceServerClient(server.grpc_url).get_inference_statistics(server.model, as_json=True)
    model = stats["model_stats"][0]
    return int(model.get("inference_count", 0)), int(model.get("execution_count", 0))


@pytest.mark.parametrize("model", ["window", "growing"])
def test_concurrent_conversations_each_equal_the_conversation_alone(exports, model, window_server, tmp_path):
    """10 clients at once with different prompts (1 to 10 tokens), 12 greedy tokens each: 6 live at a time (Triton
    queues the others until a sequence ends), steps batched by the server: every answer equals the same
    conversation run alone. The growing-cache hybrid serves as it is."""
    folder = exports[model]
    rng = np.random.default_rng(3)
    vocab = open_runner(folder).manifest.vocab_size
    prompts = [rng.integers(0, vocab, size=1 + i) for i in range(10)]
    server = window_server if model == "window" else _server(folder, tmp_path / "growing.log").start()
    try:
        before = _statistics(server)
        with ThreadPoolExecutor(10) as pool:
            answers = list(pool.map(lambda p: _converse(server.grpc_url, server.model, p, 12), prompts))
        requests, executions = (a - b for a, b in zip(_statistics(server), before))
    finally:
        if server is not window_server:
            server.stop()
    for i, (prompt, (got, tokens)) in enumerate(zip(prompts, answers)):
        _check(folder, prompt, got, tokens, f"{model} conversation {i}")
    assert requests == 10 * (1 + 12 + 1) and executions < requests, (requests, executions)  # + each END request


def test_unknown_and_ended_sequences_are_refused(window_server):
    """A step for an id the server never saw, or one already ended: refused by the server in one message."""
    from edgelin.serve.client import ServedConversation

    stranger = ServedConversation(window_server.grpc_url, window_server.model, sequence_id=424242)
    stranger._started = True  # as a client that lost track of its sequence would send
    with pytest.raises(EdgelinError, match="must specify the START flag"):
        stranger.step(1)
    conv = ServedConversation(window_server.grpc_url, window_server.model, sequence_id=777)
    conv.prefill([1, 2, 3])
    conv.close()
    again = ServedConversation(window_server.grpc_url, window_server.model, sequence_id=777)
    again._started = True
    with pytest.raises(EdgelinError, match="must specify the START flag"):
        again.step(4)


def test_a_client_that_dies_frees_its_slot_and_the_others_go_on(exports, window_server):
    """Six sequences fill the server; one client stops sending mid-sequence (its process died). Once idle longer
    than the timeout, its slot serves a new sequence, its id is refused, and the five others, still going,
    answer as if alone."""
    from edgelin.serve.client import ServedConversation

    folder, url, model = exports["window"], window_server.grpc_url, window_server.model
    rng = np.random.default_rng(11)
    prompts = [rng.integers(0, open_runner(folder).manifest.vocab_size, size=3) for _ in range(6)]
    convs = [ServedConversation(url, model) for _ in prompts]
    got: list[list[np.ndarray]] = [[c.prefill(p)[0]] for c, p in zip(convs, prompts)]
    dead = convs.pop(2)
    prompts.pop(2), got.pop(2)
    tokens: list[list[int]] = [[] for _ in convs]
    stop = threading.Event()

    def keep_going(i: int) -> None:  # the live clients step on while the dead one's slot times out
        while not stop.is_set():
            tokens[i].append(int(np.argmax(got[i][-1])))
            got[i].append(convs[i].step(tokens[i][-1])[0])
            time.sleep(0.2)

    threads = [threading.Thread(target=keep_going, args=(i,)) for i in range(len(convs))]
    for t in threads:
        t.start()
    time.sleep(IDLE_SECONDS + 2)
    newcomer = _converse(url, model, prompts[0], 3)  # a seventh sequence is served: the dead one's slot is free
    stop.set()
    for t in threads:
        t.join()
    with pytest.raises(EdgelinError, match="START flag"):
        dead.step(5)
    _check(folder, prompts[0], *newcomer, "the newcomer")
    for i, conv in enumerate(convs):
        conv.close()
        assert len(tokens[i]) >= 10
        _check(folder, prompts[i], got[i], tokens[i], f"live conversation {i}")


def test_after_a_restart_a_replayed_conversation_gives_the_same_tokens(exports, tmp_path):
    """A restarted server holds no state: the next step is refused; replay() sends every token so far in one
    prefill, and the conversation goes on with exactly the tokens of the uninterrupted run."""
    from edgelin.serve.client import ServedConversation

    folder = exports["growing"]
    prompt = np.array([5, 9, 14, 2])
    server = _server(folder, tmp_path / "first.log").start()
    try:
        conv = ServedConversation(server.grpc_url, server.model)
        tokens = [conv.next_token(prompt)]
        for _ in range(5):
            tokens.append(conv.next_token(tokens[-1]))
        server.stop()
        server.start()
        with pytest.raises(EdgelinError, match="START flag"):
            conv.next_token(tokens[-1])
        logits = conv.replay()  # the prompt and the 5 tokens sent before the restart
        assert int(np.argmax(logits[0])) == tokens[-1]
        for _ in range(5):
            tokens.append(conv.next_token(tokens[-1]))
        conv.close()
    finally:
        server.stop()
    want = Conversation(open_runner(folder), keep=0)
    expected = [int(np.argmax(want.prefill(prompt)[0]))]
    for _ in range(10):
        expected.append(int(np.argmax(want.step(expected[-1])[0])))
    assert tokens == expected


def test_generate_on_the_server_gives_the_text_of_local_generate(exports, window_server):
    """`edgelin generate --server` (sampled: temperature, top-k, top-p, a repetition penalty, a seed) prints
    the text of the same command run locally."""
    from typer.testing import CliRunner

    from edgelin.cli import app

    folder = str(exports["window"])
    args = ["generate", folder, "--prompt", "def main(", "-n", "24", "--temperature", "0.9", "--top-k", "20",
            "--repetition-penalty", "1.2", "--seed", "5", "--ignore-eos"]
    here = CliRunner().invoke(app, args)
    there = CliRunner().invoke(app, [*args, "--server", window_server.grpc_url])
    assert here.exit_code == 0 and there.exit_code == 0, (here.output, there.output)
    assert there.stdout == here.stdout and len(here.stdout) > len("def main(") + 10


def test_a_changed_model_py_is_refused_before_the_server_runs_it(exports, tmp_path):
    """Triton imports model.py: `edgelin serve` verifies the folder first, so a changed one never runs."""
    import shutil

    from edgelin.serve.server import ServeRequest, TritonServer

    copy = tmp_path / "copy"
    shutil.copytree(exports["window"], copy)
    model_py = next((copy / "triton").glob("*/1/model.py"))
    model_py.write_text("import os; os.system('echo pwned')\n")
    with pytest.raises(EdgelinError, match=r"model\.py"):
        TritonServer(ServeRequest(copy, _serve_env()))


def test_the_generated_client_streams_the_text_of_greedy_generate(exports, window_server):
    """DIR/triton/client.py (standalone: tritonclient, tokenizers, numpy) prints what `edgelin generate --greedy`
    prints locally."""
    import subprocess
    import sys

    from typer.testing import CliRunner

    from edgelin.cli import app

    folder = exports["window"]
    client = subprocess.run([sys.executable, str(folder / "triton" / "client.py"), "--prompt", "def main(", "-n", "16",
                             "--url", window_server.grpc_url], capture_output=True, text=True, timeout=120)
    assert client.returncode == 0, client.stderr
    here = CliRunner().invoke(app, ["generate", str(folder), "--prompt", "def main(", "-n", "16", "--greedy",
                                    "--ignore-eos"])
    assert here.exit_code == 0 and client.stdout == here.stdout, (client.stdout, here.output)
