"""The limits of a fixed-capacity KV cache (`edgelin export --kv-cache static --context N`), checked where the
user meets them, in one line whose fix works when followed: export refuses an N its own `validate DIR` cannot
replay (and an export at the least N it names validates); generate checks the whole prompt + -n up front;
bench checks --positions (at most N - 1) and --prefill-tokens (at most N) up front, runs at the largest
position that fits, and reports the state as allocated; a folder without a tokenizer says both causes."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
from typer.testing import CliRunner

from helpers import make_checkpoint
from edgelin.bench import bench
from edgelin.errors import EdgelinError
from edgelin.export.onnx.options import OnnxOptions
from edgelin.export.pipeline import export_checkpoint
from edgelin.artifact.reference_vectors import positions_needed
from edgelin.generate import Sampling, generate
from edgelin.model.config import AttentionConfig
from edgelin.artifact.quality import GREEDY_PROMPT, GREEDY_STEPS
from edgelin.runtime import open_runner, prefill

NEED = positions_needed()  # the least --context an export takes: what validate DIR replays
GREEDY = Sampling(greedy=True)


def cli(*args: str):
    from edgelin.cli import app

    return CliRunner().invoke(app, [str(a) for a in args])


def one_error(result) -> str:
    errors = [ln for ln in result.stderr.splitlines() if ln.startswith("error:")]
    assert result.exit_code == 2 and len(errors) == 1 and "Fix:" in errors[0], result.output
    return errors[0]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """A tiny hybrid whose attention layer has a growing (full-context) KV cache, with a tokenizer."""
    attention = AttentionConfig(num_heads=2, num_kv_heads=1, head_dim=16, window=None)
    return make_checkpoint(tmp_path_factory.mktemp("static-limits") / "ckpt", layers=("gla", "softmax"),
                           attention=attention)


@pytest.fixture(scope="module")
def static(ckpt):
    """The one static-cache export of this module, at the least capacity export takes."""
    return export_checkpoint(ckpt, ckpt.parent / "static", options=OnnxOptions(kv_cache="static", context=NEED)).folder


def test_the_least_context_is_what_the_replay_feeds():
    # the quality figures' greedy rollout: a 16-token prompt prefilled, then a step for each greedy token but the last
    assert NEED == GREEDY_PROMPT + GREEDY_STEPS - 1 == 527


@pytest.mark.slow
def test_export_refuses_a_context_its_own_validate_cannot_replay(ckpt, tmp_path):
    with pytest.raises(EdgelinError, match=f"up to {NEED} tokens.*Fix: pass --context {NEED} or more"):
        export_checkpoint(ckpt, tmp_path / "out", options=OnnxOptions(kv_cache="static", context=NEED - 1))
    assert not (tmp_path / "out").exists()
    line = one_error(cli("export", ckpt, "--out", tmp_path / "cli", "--kv-cache", "static", "--context", "512"))
    assert "--context 512" in line and f"pass --context {NEED} or more" in line
    assert not (tmp_path / "cli").exists()


@pytest.mark.slow
def test_an_export_at_the_least_context_validates(static):
    result = cli("validate", static, "--json")
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["passed"] and report["quality"]["greedy_steps"] == GREEDY_STEPS  # the figures were measured


@pytest.mark.slow
def test_validate_against_checks_its_plan_against_the_capacity(static):
    from edgelin.validate import validate

    with pytest.raises(EdgelinError, match=f"feeds {32 + 512} tokens.*holds {NEED} tokens.*Fix: pass --steps "
                                           f"{NEED - 32} or fewer"):
        validate(static)  # the defaults: --prompt-len 32 --steps 512
    report = validate(static, steps=NEED - 32, prompt_len=32, batch=1)  # the fix, followed
    assert report.passed, [m.to_dict() for m in report.failures]


@pytest.mark.slow
def test_generate_checks_the_whole_prompt_and_n_up_front(static):
    runner = open_runner(static)
    from edgelin.tokenizer import TextTokenizer

    tokenizer = TextTokenizer(static / runner.manifest.tokenizer)
    long_prompt = "def main(): return x + y\n" * 400
    prompt_tokens = len(tokenizer.encode(long_prompt))
    assert prompt_tokens > 2 * 256 + NEED  # several 256-token prefill pieces past the capacity
    with pytest.raises(EdgelinError) as caught:
        generate(static, long_prompt, max_new_tokens=20, sampling=GREEDY)
    line = str(caught.value)
    assert f"a prompt of {prompt_tokens} tokens with -n 20" in line and f"needs {prompt_tokens + 20}" in line
    assert f"shorten the prompt to at most {NEED - 20} tokens" in line and "prefill of" not in line

    short = "def main("
    short_tokens = len(tokenizer.encode(short))
    line = one_error(cli("generate", static, "-p", short, "-n", "600", "--greedy"))
    assert f"needs {short_tokens + 600}" in line and f"pass -n {NEED - short_tokens} or fewer" in line
    # the fix, followed: the longest run the cache holds, every position of it used
    result = generate(static, short, max_new_tokens=NEED - short_tokens, sampling=GREEDY, stop_at_eos=False)
    assert result.new_tokens == NEED - short_tokens


@pytest.mark.slow
def test_prefill_checks_the_whole_prompt(static):
    runner = open_runner(static)
    ids = np.zeros((1, NEED + 600), np.int64)
    with pytest.raises(EdgelinError, match=f"prefill of {NEED + 600} token\\(s\\) after 0.*at least {NEED + 600}"):
        prefill(runner, ids, chunk=256)
    logits, _ = prefill(runner, ids[:, :NEED], chunk=256)  # the whole capacity, in pieces
    assert np.isfinite(logits).all()


@pytest.mark.slow
def test_bench_refuses_what_the_cache_cannot_hold_and_runs_what_it_can(static):
    line = one_error(cli("bench", static))  # the defaults: positions to 32768, --prefill-tokens 2048
    assert "--positions 1024,8192,32768 and --prefill-tokens 2048" in line
    assert f"pass --positions up to {NEED - 1} (e.g. --positions 1,{NEED // 2},{NEED - 1})" in line
    assert f"--prefill-tokens {NEED} or fewer" in line
    line = one_error(cli("bench", static, "--positions", f"1,{NEED}", "--prefill-tokens", "0"))
    assert f"--positions {NEED} on" in line and "and --prefill-tokens" not in line and "or fewer" not in line
    # the fix, followed: the largest position that fits and the longest prefill pass
    report = bench(static, [1, NEED // 2, NEED - 1], warmup=1, iters=2, prefill_tokens=NEED)
    assert [r.position for r in report.positions] == [1, NEED // 2, NEED - 1]
    assert report.prefill_tokens == NEED and report.prefill_tokens_per_s["edgelin"] > 0
    assert report.peak_rss_bytes >= max(r.rss_bytes for r in report.positions)  # a peak below a row read wrong
    # the state as allocated: the capacity from new_state on, whatever the position
    runner = open_runner(static)
    allocated = sum(a.nbytes for a in runner.new_state(1)._value.arrays[0])
    assert allocated == runner.manifest.state_bytes(1, past=NEED) > runner.manifest.state_bytes(1, past=NEED - 1)
    assert {(r.state_bytes, r.state_capacity) for r in report.positions} == {(allocated, NEED)}
    assert report.to_dict()["positions"][0]["state_capacity"] == NEED
    assert f"allocated at the fixed KV cache capacity ({NEED} tokens)" in report.footprint_line()


@pytest.mark.slow
def test_generate_without_a_tokenizer_names_both_causes(ckpt, tmp_path):
    copy = shutil.copytree(ckpt, tmp_path / "ckpt").resolve()
    bare = export_checkpoint(copy, tmp_path / "bare", include_tokenizer=False).folder
    line = one_error(cli("generate", bare, "-p", "def main("))
    assert "exported with --no-tokenizer, or the checkpoint had none" in line
    assert f"re-export from {copy} (it has tokenizer.json) without --no-tokenizer" in line
    # the fix, followed: the same checkpoint exported with its tokenizer generates
    shutil.rmtree(bare)
    export_checkpoint(copy, bare)
    assert cli("generate", bare, "-p", "def main(", "-n", "4", "--greedy").exit_code == 0
    # a checkpoint without one: the fix says to re-export from one that has it
    (copy / "tokenizer.json").unlink()
    shutil.rmtree(bare)
    export_checkpoint(copy, bare)
    line = one_error(cli("generate", bare, "-p", "def main("))
    assert "Fix: re-export without --no-tokenizer from a checkpoint with tokenizer.json" in line


# ---- an N too large to write or hold: refused from the config, before anything is traced ----------------------
# The module's model: one full-context attention layer, 1 kv head of 16 channels, rotary over the whole head. Per
# position: K and V 2 x 16 float32 = 128 bytes; the step graph's cos and sin tables 2 x 8 float32 = 64 bytes.
KV_PER_POSITION, TABLES_PER_POSITION = 2 * 1 * 16 * 4, 2 * 8 * 4


@pytest.fixture
def no_tracing(monkeypatch):
    """Tracing is where the old code spent its minutes: here it fails at once, so a refusal must come before it."""
    from edgelin.export.onnx.target import OnnxTarget

    def traced(*args, **kwargs):
        raise AssertionError("the export traced the graphs: the size was not checked before")

    monkeypatch.setattr(OnnxTarget, "export", traced)


def test_a_context_past_the_protobuf_limit_is_refused_before_tracing(ckpt, tmp_path, no_tracing):
    largest = (2**31 - 1 - (64 << 20)) // TABLES_PER_POSITION  # the tables inline in step.onnx, below 2 GiB
    with pytest.raises(EdgelinError, match=f"rotary cos/sin tables would be 128.0 GiB.*2 GiB protobuf limit.*"
                                           f"Fix: pass --context {largest} or less"):
        export_checkpoint(ckpt, tmp_path / "out", options=OnnxOptions(kv_cache="static", context=2**31 - 1))
    assert not (tmp_path / "out").exists() and list(tmp_path.iterdir()) == []


def test_a_context_past_the_available_memory_is_refused_with_the_largest_that_fits(ckpt, tmp_path, monkeypatch,
                                                                                     no_tracing):
    import edgelin.bench

    monkeypatch.setattr(edgelin.bench, "available_memory", lambda: 64 << 20)
    # --step-ops standard: no tables, the cache alone (one sequence)
    with pytest.raises(EdgelinError, match=r"needs about 128.0 MiB \(the K/V cache of one sequence 128.0 MiB\), "
                                           r"more than the 64.0 MiB of memory available.*Fix: pass --context "
                                           f"{(64 << 20) // KV_PER_POSITION} or less"):
        export_checkpoint(ckpt, tmp_path / "out", options=OnnxOptions(kv_cache="static", context=1 << 20,
                                                                     step_ops="standard"))
    # with the tables (the default step ops): the cache and the tables' copies while written
    per_position = KV_PER_POSITION + 5 * TABLES_PER_POSITION  # (the tables: about 5 copies at the peak)
    with pytest.raises(EdgelinError, match=f"Fix: pass --context {(64 << 20) // per_position} or less"):
        export_checkpoint(ckpt, tmp_path / "out", options=OnnxOptions(kv_cache="static", context=1 << 20))
    # memory below what the least context needs: the fix cannot be a smaller --context
    monkeypatch.setattr(edgelin.bench, "available_memory", lambda: 32 << 10)
    with pytest.raises(EdgelinError, match=f"Fix: free memory, or export on a machine with more \\(--context {NEED}, "
                                           "the least the export takes"):
        export_checkpoint(ckpt, tmp_path / "out", options=OnnxOptions(kv_cache="static", context=1 << 20))
    assert list(tmp_path.iterdir()) == []


def test_the_estimate_follows_the_config():
    from conftest import tiny_config
    from edgelin.export.static_cache import static_cache_size

    attention = AttentionConfig(num_heads=4, num_kv_heads=2, head_dim=16, window=None, rotary_dim=8)
    config = tiny_config(("gla", "softmax", "softmax"), attention=attention)
    size = static_cache_size(config, 1000, "float16")
    assert size.kv_bytes == 2 * 2 * 2 * 16 * 1000 * 2  # layers x (K, V) x kv heads x head_dim x N x fp16
    assert size.rotary_bytes == 2 * 2 * 1000 * 4 * 4  # layers x (cos, sin) x N x rotary_dim / 2 x float32
    assert static_cache_size(config, 1000, rotary_tables=False).rotary_bytes == 0
    assert static_cache_size(config, 1000, "float32").kv_bytes == 2 * size.kv_bytes
    windowed = tiny_config(("gla", "softmax"))  # a sliding window: constant state, nothing sized by N
    assert static_cache_size(windowed, 1000).kv_bytes == static_cache_size(windowed, 1000).rotary_bytes == 0


def test_cli_refuses_a_context_too_large_in_one_line_before_writing(ckpt, tmp_path, no_tracing):
    line = one_error(cli("export", ckpt, "--out", tmp_path / "out", "--kv-cache", "static", "--context", 2**31 - 1))
    assert line.startswith(f"error: --kv-cache static --context {2**31 - 1}: ") and "protobuf limit" in line
    assert not (tmp_path / "out").exists()
