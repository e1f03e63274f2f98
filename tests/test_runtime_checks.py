"""Runtime checks: the runner refuses bad ids, positions and states before a runtime sees them; a
manifest whose redundant facts disagree (with itself or with its graph files) is refused when the
folder is opened; a corrupt graph file and impossible bench plans are one-line user errors."""

from __future__ import annotations

import json
import shutil
import time
import warnings
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from conftest import family_layers, tiny_config
from edgelin import bench as bench_module
from edgelin.bench import bench, memory_needed, random_pieces
from edgelin.cli import app
from edgelin.errors import EdgelinError
from edgelin.export.base import Runner, all_finite
from edgelin.export.manifest import Manifest
from edgelin.export.pipeline import build_manifest, export_checkpoint
from edgelin.model.config import AttentionConfig
from edgelin.model.lm import CausalLM
from edgelin.runtime import open_runner, prefill
from helpers import make_checkpoint

cli = CliRunner()


def run(*args) -> object:
    return cli.invoke(app, [str(a) for a in args])


def assert_one_line_error(result, *needles: str, code: int = 2) -> None:
    assert result.exit_code == code, (result.exit_code, result.output)
    assert "Traceback" not in result.stderr + result.stdout
    errors = [ln for ln in result.stderr.splitlines() if ln.strip() and not ln.startswith(("progress:", "warning:"))]
    assert len(errors) == 1, result.stderr
    line = errors[0]
    assert line.startswith("error:") and "Fix:" in line and "internal error" not in line, line
    for needle in needles:
        assert needle in line, (needle, line)


@pytest.fixture(scope="module")
def exported(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("checks")
    ckpt = make_checkpoint(root / "ckpt", "hybrid")  # with a tokenizer: generate runs too
    return export_checkpoint(ckpt, root / "out").folder


def edited_copy(src: Path, dst: Path, edit) -> Path:
    shutil.copytree(src, dst)
    data = json.loads((dst / "manifest.json").read_text())
    edit(data)
    (dst / "manifest.json").write_text(json.dumps(data))
    return dst


# ---- the runner's input checks (no runtime needed: a runner that returns zeros) -----------------
class ZerosRunner(Runner):
    def __init__(self, manifest: Manifest):
        super().__init__(manifest)
        self.calls = 0

    def _step(self, input_ids, state, position):
        self.calls += 1
        return np.zeros((len(input_ids), self.manifest.vocab_size), np.float32), state

    _prefill = _step


def zeros_runner(window: int | None = 8) -> ZerosRunner:
    attention = AttentionConfig(num_heads=2, num_kv_heads=1, head_dim=16, window=window)
    model = CausalLM(tiny_config(family_layers("hybrid"), attention=attention))
    return ZerosRunner(build_manifest(model, "onnx", "fp32", {"step": "s", "prefill": "p"}, {}, None))


def corrupt(name: str, value):
    def edit(state):
        state = dict(state)
        state[name] = value(state[name])
        return state
    return edit


BAD_STEPS = {
    "nan": (corrupt("past_key_values.0.recurrent_state", lambda v: np.where(np.arange(v.size).reshape(v.shape) == 5,
                                                                            np.nan, v).astype(np.float32)),
            "past_key_values.0.recurrent_state contains NaN or Inf"),
    "+inf": (corrupt("past_key_values.2.recurrent_state", lambda v: np.full_like(v, np.inf)), "contains NaN or Inf"),
    "inf-inf": (corrupt("past_key_values.1.key", lambda v: np.concatenate(
        [np.full_like(v[:, :, :1], np.inf), np.full_like(v[:, :, 1:], -np.inf)], 2)),
        "past_key_values.1.key contains NaN or Inf"),
    "last element -inf": (corrupt("past_key_values.0.conv_state",
                                  lambda v: np.where(np.arange(v.size).reshape(v.shape) == v.size - 1, -np.inf,
                                                     v).astype(np.float32)), "contains NaN or Inf"),
    "shape": (corrupt("past_key_values.0.recurrent_state", lambda v: v[..., :-1]),
              "past_key_values.0.recurrent_state has shape [2, 2, 8, 7]"),
    "batch": (corrupt("past_key_values.1.value", lambda v: v[:1]), "past_key_values.1.value has shape [1,"),
    "dtype": (corrupt("past_key_values.0.conv_state", lambda v: v.astype(np.float64)), "has dtype float64"),
    "missing": (lambda s: {k: v for k, v in s.items() if k != "past_key_values.1.key"},
                "state input past_key_values.1.key is missing"),
    "extra": (lambda s: {**s, "past_key_values.9.key": s["past_key_values.1.key"]},
              "unknown state input past_key_values.9.key"),
    "not an array": (corrupt("past_key_values.1.key", lambda v: v.tolist()), "past_key_values.1.key is a list"),
}


@pytest.mark.parametrize("case", list(BAD_STEPS))
def test_step_refuses_a_bad_state(case):
    runner = zeros_runner()
    edit, needle = BAD_STEPS[case]
    state = edit(runner.initial_state(2))
    with pytest.raises(EdgelinError, match=needle.replace("[", r"\[").replace("+", r"\+")):
        runner.step(np.zeros(2, np.int64), state, np.zeros(2, np.int64))
    with pytest.raises(EdgelinError, match="state|past_key_values"):
        runner.prefill(np.zeros((2, 3), np.int64), state, np.zeros(2, np.int64))
    assert runner.calls == 0  # nothing reached the "runtime"


@pytest.mark.parametrize("ids, position, needle", [
    (np.zeros(2, np.float32), np.zeros(2, np.int64), "input_ids has dtype float32"),
    (np.array([0, -1]), np.zeros(2, np.int64), r"token id out of range: ids must be in \[0, 97\), got -1\.\.0"),
    (np.array([0, 97]), np.zeros(2, np.int64), r"got 0\.\.97"),
    (np.zeros((2, 1), np.int64), np.zeros(2, np.int64), r"step input_ids has shape \[2, 1\]"),
    (np.zeros(3, np.int64), np.zeros(3, np.int64), r"has shape \[2, 2, 8, 8\]: .* with batch 3"),  # state's batch
    (np.zeros(2, np.int64), np.zeros(3, np.int64), r"position_ids has shape \[3\]"),
    (np.zeros(2, np.int64), np.zeros(2, np.float64), "dtype float64"),
    (np.zeros(2, np.int64), np.array([0, -4]), "position_ids holds -4"),
    (np.zeros(2, np.int64), None, "step needs position_ids"),
    ([0, 1], np.zeros(2, np.int64), "input_ids is a list"),
])
def test_step_refuses_bad_ids_and_positions(ids, position, needle):
    runner = zeros_runner()
    with pytest.raises(EdgelinError, match=needle):
        runner.step(ids, runner.initial_state(2), position)
    assert runner.calls == 0


def test_prefill_refuses_an_empty_prompt_and_the_helper_a_bad_rank():
    runner = zeros_runner()
    with pytest.raises(EdgelinError, match=r"prefill input_ids has shape \[2, 0\]"):
        runner.prefill(np.zeros((2, 0), np.int64), runner.initial_state(2), np.zeros(2, np.int64))
    with pytest.raises(EdgelinError, match=r"prefill ids have shape \[5\]"):
        prefill(runner, np.zeros(5, np.int64))
    with pytest.raises(EdgelinError, match="out of range"):  # the helper relies on the runner's check
        prefill(runner, np.full((1, 3), 10**6, np.int64))


def test_a_growing_cache_must_agree_on_its_length():
    runner = zeros_runner(window=None)
    state = runner.manifest.initial_state(1, past=5)
    runner.step(np.zeros(1, np.int64), state, np.full(1, 5, np.int64))  # any past length is fine...
    state["past_key_values.1.value"] = np.zeros((1, 1, 4, 16), np.float32)
    with pytest.raises(EdgelinError, match="past_key_values.1.value has shape .* and past_sequence 5"):
        runner.step(np.zeros(1, np.int64), state, np.full(1, 5, np.int64))  # ...but key and value agree


def test_finite_state_with_huge_values_passes_without_a_warning():
    """x·x overflows for |x| ~ 1e20: the check falls back to the exact test (no false refusal, no warning)."""
    runner = zeros_runner()
    state = {k: np.full_like(v, 3e37) for k, v in runner.initial_state(2).items()}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        runner.step(np.zeros(2, np.int64), state, np.zeros(2, np.int64))
    assert runner.calls == 1


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.float16])
@pytest.mark.parametrize("size", [1, 7, 64, 1001, 40_000])
def test_all_finite_is_exact(dtype, size):
    value = np.linspace(-3, 3, size).astype(dtype)
    assert all_finite(value) and all_finite(value.reshape(1, -1)[:, ::2])
    for where in {0, size // 2, size - 1}:
        for bad in (np.nan, np.inf, -np.inf):
            broken = value.copy()
            broken[where] = bad
            assert not all_finite(broken), (where, bad)
    if size > 1:
        both = value.copy()
        both[0], both[-1] = np.inf, -np.inf  # a plain sum would be inf - inf = nan; x·x is inf
        assert not all_finite(both)


def test_check_can_be_switched_off():
    runner = zeros_runner()
    runner.check_inputs = False
    state = {k: np.full_like(v, np.nan) for k, v in runner.initial_state(2).items()}
    runner.step(np.zeros(2, np.int64), state, np.zeros(2, np.int64))
    assert runner.calls == 1


def test_onnx_runner_step_refuses_nan_state_and_bad_ids(exported):
    """Issue 7.10: runner.step itself (not only the prefill() helper) refuses them."""
    runner = open_runner(exported)
    state = runner.initial_state(1)
    state["past_key_values.2.recurrent_state"] = state["past_key_values.2.recurrent_state"] + np.nan
    with pytest.raises(EdgelinError, match="past_key_values.2.recurrent_state contains NaN or Inf"):
        runner.step(np.zeros(1, np.int64), state, np.zeros(1, np.int64))
    with pytest.raises(EdgelinError, match="token id out of range"):
        runner.prefill(np.full((1, 2), 256, np.int64), runner.initial_state(1), np.zeros(1, np.int64))


# ---- manifest consistency ---------------------------------------------------------------------------
def _state(data, name):
    return next(s for s in data["state"] if s["input"] == name)


def _io(data, kind, side, name):
    return next(t for t in data["graphs"][kind][side] if t["name"] == name)


MANIFEST_EDITS = {
    "state[].dims": (lambda d: _state(d, "past_key_values.0.recurrent_state")["dims"].__setitem__(2, 9),
                     'past_key_values.0.recurrent_state dims is ["batch", 2, 9, 8] in state[] but '
                     '["batch", 2, 8, 8] in graphs.step.inputs'),
    "state[].dtype": (lambda d: _state(d, "past_key_values.1.key").__setitem__("dtype", "float16"),
                      'past_key_values.1.key dtype is "float16" in state[] but "float32"'),
    "state[].layer": (lambda d: _state(d, "past_key_values.1.key").__setitem__("layer", 0),
                      "past_key_values.1.key layer is 0 in state[] but 1"),
    "state[].output": (lambda d: _state(d, "past_key_values.1.key").__setitem__("output", "present.1.value"),
                       'past_key_values.1.key output is "present.1.value"'),
    "state[] order": (lambda d: d["state"].reverse(), "the state tensors is"),
    "layers[].state": (lambda d: d["model"]["layers"][1].__setitem__("state", ["key"]),
                       'the state names per layer is [["recurrent_state", "conv_state"], ["key"]'),
    "state_bytes": (lambda d: d["model"].__setitem__("state_bytes_per_sequence", 1),
                    "state_bytes_per_sequence is 1 in model but 2624"),
    "constant_memory": (lambda d: d["model"].__setitem__("constant_memory", False),
                        "constant_memory is false in model but true"),
    "needs_position": (lambda d: d["model"].__setitem__("needs_position", False),
                       "whether the graph takes position_ids is true in graphs.step.inputs but false"),
    "vocab_size": (lambda d: d["model"].__setitem__("vocab_size", 300),
                   'the logits dims is ["batch", 256] in graphs.step.outputs but ["batch", 300] in model.vocab_size'),
    "prefill state dims": (lambda d: [_io(d, "prefill", side, name)["dims"].__setitem__(1, 2) for side, name in
                                      (("inputs", "past_key_values.1.value"), ("outputs", "present.1.value"))],
                           "step and prefill graphs disagree: state input past_key_values.1.value"),
    "output feeds": (lambda d: _io(d, "step", "outputs", "present.0.conv_state").__setitem__(
        "feeds", "past_key_values.0.recurrent_state"), "manifest and step graph disagree: present.0.conv_state "
                                                       "[dims, dtype, feeds]"),
    "input name": (lambda d: _io(d, "step", "inputs", "past_key_values.2.recurrent_state").__setitem__("layer", 0),
                   "the name of state input past_key_values.2.recurrent_state"),
}


@pytest.mark.parametrize("case", list(MANIFEST_EDITS))
def test_every_redundant_manifest_fact_is_checked(exported, tmp_path, case):
    edit, needle = MANIFEST_EDITS[case]
    folder = edited_copy(exported, tmp_path / "edited", edit)
    with pytest.raises(EdgelinError, match="re-run `edgelin export`") as info:
        Manifest.load(folder)
    assert needle in info.value.line(), info.value.line()


def test_edited_state_dims_fail_every_command(exported, tmp_path):
    """Issue 7.9: the top-level state[].dims edit used to pass validate, generate and bench."""
    folder = edited_copy(exported, tmp_path / "edited",
                         lambda d: _state(d, "past_key_values.1.value")["dims"].__setitem__(2, 9))
    needle = "manifest and step graph disagree: past_key_values.1.value dims"
    assert_one_line_error(run("validate", folder, "--steps", "2"), needle)
    assert_one_line_error(run("bench", folder, "--positions", "1"), needle)
    assert_one_line_error(run("generate", folder, "--prompt", "x", "-n", "2"), needle)


def test_graph_file_outputs_are_checked_against_the_manifest(exported, tmp_path):
    """A manifest consistent with itself but not with step.onnx's outputs (the vocab was edited
    everywhere in the manifest): the runner compares outputs too, not only inputs."""
    def edit(data):
        data["model"]["vocab_size"] = 300
        for graph in data["graphs"].values():
            next(t for t in graph["outputs"] if t["name"] == "logits")["dims"][1] = 300

    folder = edited_copy(exported, tmp_path / "edited", edit)
    Manifest.load(folder)  # consistent with itself
    with pytest.raises(EdgelinError, match=r"manifest and (step|prefill) graph disagree: output logits has shape "
                                           r"\['batch', 256\] in the graph but \['batch', 300\]"):
        open_runner(folder)


def test_truncated_graph_is_a_user_error(exported, tmp_path):
    folder = tmp_path / "truncated"
    shutil.copytree(exported, folder)
    data = (folder / "step.onnx").read_bytes()
    (folder / "step.onnx").write_bytes(data[: len(data) // 2])
    assert_one_line_error(run("validate", folder, "--steps", "2"), "step.onnx cannot be loaded by ONNX Runtime",
                          "the file is truncated or corrupt")
    (folder / "step.onnx").write_bytes(b"\x00garbage" * 10)
    assert_one_line_error(run("bench", folder, "--positions", "1"), "step.onnx cannot be loaded by ONNX Runtime")


# ---- bench plans -----------------------------------------------------------------------------------
@pytest.mark.parametrize("kwargs, needle", [
    ({"prefill_tokens": -10}, "--prefill-tokens -10: it must be >= 0"),
    ({"iters": 0}, "--iters 0: it must be >= 1"),
    ({"warmup": -1}, "--warmup -1: it must be >= 0"),
    ({"batch": 0}, "--batch 0: it must be >= 1"),
    ({"prefill_chunk": 0}, "prefill chunk 0: it must be >= 1"),
    ({"positions": [0, 5]}, "--positions 0: a position counts tokens"),
    ({"positions": []}, r"--positions \(none\)"),
])
def test_bench_argument_ranges(exported, kwargs, needle):
    """Checked in the library (the CLI's own option ranges are a second line of defence)."""
    with pytest.raises(EdgelinError, match=needle):
        bench(exported, **{"positions": [1], **kwargs})


def test_bench_negative_prefill_tokens_on_the_command_line(exported):
    assert_one_line_error(run("bench", exported, "--positions", "1", "--prefill-tokens", "-10"), "--prefill-tokens")


def test_bench_refuses_a_position_out_of_reach_quickly(exported):
    """Issue 7.12: --positions 1099511627776 tried to allocate 8 TiB of ids; now the prefill time
    to reach it is estimated from one timed piece and the plan is refused before it starts."""
    started = time.perf_counter()
    result = run("bench", exported, "--positions", "1,1099511627776")
    assert_one_line_error(result, "this bench would take about", "days", "prefill to position 1,099,511,627,776")
    assert time.perf_counter() - started < 15


def test_bench_refuses_a_kv_position_that_does_not_fit(exported, monkeypatch):
    """The KV baseline's cache at 1e5 positions is checked against the memory available (here
    pretended to be 64 MiB) before the baseline is exported."""
    monkeypatch.setattr(bench_module, "available_memory", lambda: 64 << 20)
    monkeypatch.setattr(bench_module, "kv_baseline", lambda *a: pytest.fail("exported before the check"))
    with pytest.raises(EdgelinError, match=r"kv-baseline: position 100000 does not fit in memory: .* need about "
                                           r"[\d.]+ GiB, and 64.0 MiB is available"):
        bench(exported, [1, 100_000], baseline="kv")


def test_memory_estimate_of_a_growing_cache():
    """KV baseline of the tiny hybrid: 3 layers x (key + value) x 2 heads x 8 dims x 4 bytes = 384
    bytes per token; one layer's scores [1, 2, piece, position] float32, twice (scores, softmax)."""
    model = CausalLM(tiny_config(("softmax",) * 3, attention=AttentionConfig(2, 2, 8, window=None)))
    manifest = build_manifest(model, "onnx", "fp32", {"step": "s", "prefill": "p"}, {}, None)
    assert manifest.state_bytes(1, past=1) == 384
    position, chunk = 5000, 1024
    want = 2 * 384 * position + 2 * (2 * chunk * position * 4) + chunk * 8 + 97 * 4
    assert memory_needed(manifest, position, 1, chunk) == want
    constant = build_manifest(CausalLM(tiny_config(family_layers("hybrid"))), "onnx", "fp32",
                              {"step": "s", "prefill": "p"}, {}, None)
    assert memory_needed(constant, 10**12, 1, 2048) == 2 * 2624 + 2048 * 8 + 97 * 4  # no growth


def test_bench_prompt_ids_are_drawn_piecewise():
    pieces = list(random_pieces(3, 97, 2, 1000, 256))
    assert [lo for lo, _ in pieces] == [0, 256, 512, 768]
    assert [ids.shape for _, ids in pieces] == [(2, 256)] * 3 + [(2, 232)]
    again = list(random_pieces(3, 97, 2, 1000, 256))
    assert all(np.array_equal(a, b) for (_, a), (_, b) in zip(pieces, again))
