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
from edgelin.bench import bench, memory_needed, random_pieces, time_steps
from edgelin.cli import app
from edgelin.errors import EdgelinError
from edgelin.export.base import NumpyRunner, Phase, StateHandle, all_finite
from edgelin.artifact.manifest import Manifest
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
    # With the KV baseline (`growing` below): test_artifact.py exports the same one, so its graphs are traced once
    return export_checkpoint(ckpt, root / "out", baselines=("kv",)).folder


def edited_copy(src: Path, dst: Path, edit) -> Path:
    shutil.copytree(src, dst)
    data = json.loads((dst / "manifest.json").read_text())
    edit(data)
    (dst / "manifest.json").write_text(json.dumps(data))
    return dst


# ---- the runner's input checks (no runtime needed: a runner that returns zeros) -----------------
class ZerosRunner(NumpyRunner):
    def __init__(self, manifest: Manifest):
        super().__init__(manifest)
        self.calls = 0

    def _graph(self, kind, input_ids, state, position):
        self.calls += 1
        return np.zeros((len(input_ids), self.manifest.vocab_size), np.float32), state


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
def test_write_state_refuses_a_bad_state(case):
    """The state checks live in write_state: a handle's contents come only from the runtime or from
    a checked write, so a bad state never reaches a step."""
    runner = zeros_runner()
    edit, needle = BAD_STEPS[case]
    handle = runner.new_state(2)
    before = runner.read_state(handle)
    with pytest.raises(EdgelinError, match=needle.replace("[", r"\[").replace("+", r"\+")):
        runner.write_state(handle, edit(runner.read_state(handle)))
    after = runner.read_state(handle)  # a refused write leaves the handle as it was
    assert after.keys() == before.keys() and all(np.array_equal(after[k], before[k]) for k in before)
    assert runner.calls == 0  # nothing reached the "runtime"


def test_a_state_dict_is_not_a_handle():
    runner = zeros_runner()
    with pytest.raises(EdgelinError, match="the state is a dict: runners take the StateHandle"):
        runner.step(np.zeros(2, np.int64), runner.manifest.initial_state(2), np.zeros(2, np.int64))
    assert runner.calls == 0


def test_a_handle_from_another_runner_or_batch_is_refused():
    runner, other = zeros_runner(), zeros_runner()
    foreign = other.new_state(2)
    for call in (lambda: runner.step(np.zeros(2, np.int64), foreign, np.zeros(2, np.int64)),
                 lambda: runner.prefill(np.zeros((2, 3), np.int64), foreign, np.zeros(2, np.int64)),
                 lambda: runner.read_state(foreign), lambda: runner.fork(foreign),
                 lambda: runner.write_state(foreign, other.read_state(foreign))):
        with pytest.raises(EdgelinError, match="the state handle belongs to another runner"):
            call()
    three = runner.new_state(3)
    with pytest.raises(EdgelinError, match="the state handle holds batch 3 but the ids have batch 2"):
        runner.step(np.zeros(2, np.int64), three, np.zeros(2, np.int64))
    with pytest.raises(EdgelinError, match="holds batch 3 but the ids have batch 1"):
        runner.prefill(np.zeros((1, 4), np.int64), three, np.zeros(1, np.int64))
    with pytest.raises(EdgelinError, match=r"has shape \[2, 2, 8, 8\]: the graph expects .* with batch 3"):
        runner.write_state(three, runner.read_state(runner.new_state(2)))
    assert runner.calls == 0 and other.calls == 0
    with pytest.raises(EdgelinError, match="new_state batch 0"):
        runner.new_state(0)


def test_fork_and_write_state_copy():
    """A fork is independent of its source, and write_state keeps no reference to the caller's arrays."""
    runner = zeros_runner()
    handle = runner.new_state(2)
    values = {k: np.full_like(v, 0.5) for k, v in runner.read_state(handle).items()}
    runner.write_state(handle, values)
    fork = runner.fork(handle)
    values["past_key_values.0.recurrent_state"][:] = 7.0  # the caller's array, after the write
    runner.write_state(fork, {k: np.full_like(v, 2.0) for k, v in values.items()})
    assert all((v == 0.5).all() for v in runner.read_state(handle).values())
    assert all((v == 2.0).all() for v in runner.read_state(fork).values())
    assert fork.batch == 2 and isinstance(fork, StateHandle)


@pytest.mark.parametrize("ids, position, needle", [
    (np.zeros(2, np.float32), np.zeros(2, np.int64), "input_ids has dtype float32"),
    (np.array([0, -1]), np.zeros(2, np.int64), r"token id out of range: ids must be in \[0, 97\), got -1\.\.0"),
    (np.array([0, 97]), np.zeros(2, np.int64), r"got 0\.\.97"),
    (np.zeros((2, 1), np.int64), np.zeros(2, np.int64), r"step input_ids has shape \[2, 1\]"),
    (np.zeros(3, np.int64), np.zeros(3, np.int64), "the state handle holds batch 2 but the ids have batch 3"),
    (np.zeros(2, np.int64), np.zeros(3, np.int64), r"position_ids has shape \[3\]"),
    (np.zeros(2, np.int64), np.zeros(2, np.float64), "dtype float64"),
    (np.zeros(2, np.int64), np.array([0, -4]), "position_ids holds -4"),
    (np.zeros(2, np.int64), None, "step needs position_ids"),
    ([0, 1], np.zeros(2, np.int64), "input_ids is a list"),
])
def test_step_refuses_bad_ids_and_positions(ids, position, needle):
    runner = zeros_runner()
    with pytest.raises(EdgelinError, match=needle):
        runner.step(ids, runner.new_state(2), position)
    assert runner.calls == 0


def test_prefill_refuses_an_empty_prompt_and_the_helper_a_bad_rank():
    runner = zeros_runner()
    with pytest.raises(EdgelinError, match=r"prefill input_ids has shape \[2, 0\]"):
        runner.prefill(np.zeros((2, 0), np.int64), runner.new_state(2), np.zeros(2, np.int64))
    with pytest.raises(EdgelinError, match=r"prefill ids have shape \[5\]"):
        prefill(runner, np.zeros(5, np.int64))
    with pytest.raises(EdgelinError, match="out of range"):  # the helper relies on the runner's check
        prefill(runner, np.full((1, 3), 10**6, np.int64))


def test_a_growing_cache_must_agree_on_its_length():
    runner = zeros_runner(window=None)
    handle = runner.new_state(1)
    state = runner.manifest.initial_state(1, past=5)
    runner.write_state(handle, state)  # any past length is fine...
    assert runner.read_state(handle)["past_key_values.1.key"].shape == (1, 1, 5, 16)
    state["past_key_values.1.value"] = np.zeros((1, 1, 4, 16), np.float32)
    with pytest.raises(EdgelinError, match="past_key_values.1.value has shape .* and past_sequence 5"):
        runner.write_state(handle, state)  # ...but key and value agree


def test_finite_state_with_huge_values_passes_without_a_warning():
    """x·x overflows for |x| ~ 1e20: the check falls back to the exact test (no false refusal, no warning)."""
    runner = zeros_runner()
    handle = runner.new_state(2)
    state = {k: np.full_like(v, 3e37) for k, v in runner.read_state(handle).items()}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        runner.write_state(handle, state)
    assert (runner.read_state(handle)["past_key_values.1.key"] == np.float32(3e37)).all()


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
    """check_inputs=False skips the id and position checks; the handle is still checked."""
    runner = zeros_runner()
    runner.check_inputs = False
    runner.step(np.array([0, 97]), runner.new_state(2), None)  # out of range, no position: not looked at
    assert runner.calls == 1
    with pytest.raises(EdgelinError, match="holds batch 3 but the ids have batch 2"):
        runner.step(np.zeros(2, np.int64), runner.new_state(3), np.zeros(2, np.int64))


def test_onnx_runner_refuses_nan_state_and_bad_ids(exported):
    """Issue 7.10: the ONNX runner itself (not only the prefill() helper) refuses them."""
    runner = open_runner(exported)
    handle = runner.new_state(1)
    state = runner.read_state(handle)
    state["past_key_values.2.recurrent_state"] = state["past_key_values.2.recurrent_state"] + np.nan
    with pytest.raises(EdgelinError, match="past_key_values.2.recurrent_state contains NaN or Inf"):
        runner.write_state(handle, state)
    with pytest.raises(EdgelinError, match="token id out of range"):
        runner.prefill(np.full((1, 2), 256, np.int64), handle, np.zeros(1, np.int64))
    with pytest.raises(EdgelinError, match="the state handle belongs to another runner"):
        runner.step(np.zeros(1, np.int64), open_runner(exported).new_state(1), np.zeros(1, np.int64))


def plain_rollout(folder: Path, ids: np.ndarray, prompt: int, fork_at: int) -> tuple[list, dict, dict]:
    """The same rollout through ONNX Runtime's plain numpy API (state dicts in and out every call):
    logits per call, the state after `fork_at` tokens, and the final state."""
    import onnxruntime as ort

    manifest = Manifest.load(folder)
    sessions = {k: ort.InferenceSession(str(folder / e.file), providers=["CPUExecutionProvider"])
                for k, e in manifest.graphs.items()}
    names = [t.name for t in manifest.state_inputs]
    outputs = ["logits", *[n.replace("past_key_values.", "present.", 1) for n in names]]
    batch, state, logits, at_fork = ids.shape[0], manifest.initial_state(ids.shape[0]), [], None
    for kind, lo, hi in [("prefill", 0, prompt)] + [("step", t, t + 1) for t in range(prompt, ids.shape[1])]:
        fed = ids[:, lo:hi] if kind == "prefill" else ids[:, lo]
        out = sessions[kind].run(outputs, {"input_ids": fed, "position_ids": np.full(batch, lo, np.int64), **state})
        logits.append(out[0])
        state = dict(zip(names, out[1:]))
        if hi == fork_at:
            at_fork = state
    return logits, at_fork, state


@pytest.fixture(scope="module")
def growing(exported) -> Path:
    """Softmax layers with a growing KV cache, the runner's other state path (outputs ONNX Runtime allocates): the
    export's KV baseline, an export folder of its own."""
    return exported / "baseline-kv"


@pytest.mark.parametrize("which", ["ring buffer", "growing cache"])
def test_onnx_handles_match_plain_runs(exported, growing, which):
    """The state kept in OrtValues (ping-pong buffers rebound each step, or ORT-allocated growing
    caches) gives the logits and state of feeding numpy dicts every call: through a prefill, steps,
    a fork replayed from the middle, a write_state of the middle state, and a prefill on a handle
    whose step bindings already exist (the buffers' roles must stay in step with the bindings)."""
    folder = exported if which == "ring buffer" else growing
    runner = open_runner(folder)
    ids = np.random.default_rng(3).integers(0, runner.manifest.vocab_size, (2, 30))
    want, at_fork, final = plain_rollout(folder, ids, prompt=11, fork_at=20)
    handle = runner.new_state(2)
    got = [runner.prefill(ids[:, :11], handle, np.zeros(2, np.int64))]
    for t in range(11, 30):
        if t == 20:
            fork, middle = runner.fork(handle), runner.read_state(handle)
        got.append(runner.step(ids[:, t], handle, np.full(2, t, np.int64)))
    for a, b in zip(got, want):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)
    for name, value in runner.read_state(handle).items():
        np.testing.assert_allclose(value, final[name], rtol=1e-6, atol=1e-6)
    for name, value in middle.items():
        np.testing.assert_allclose(value, at_fork[name], rtol=1e-6, atol=1e-6)
    rewritten = runner.new_state(2)
    runner.step(ids[:, 0], rewritten, np.zeros(2, np.int64))  # builds its step bindings first
    runner.write_state(rewritten, middle)
    for replay in (fork, rewritten):
        for t in range(20, 30):
            logits = runner.step(ids[:, t], replay, np.full(2, t, np.int64))
        np.testing.assert_allclose(logits, want[-1], rtol=1e-6, atol=1e-6)
    again = runner.new_state(2)
    runner.step(ids[:, 0], again, np.zeros(2, np.int64))
    runner.write_state(again, runner.read_state(runner.new_state(2)))  # back to zeros, bindings kept
    runner.prefill(ids[:, :11], again, np.zeros(2, np.int64))
    for t in range(11, 30):
        logits = runner.step(ids[:, t], again, np.full(2, t, np.int64))
    np.testing.assert_allclose(logits, want[-1], rtol=1e-6, atol=1e-6)


def test_open_runner_names_the_run_phase_and_where_it_runs(exported, monkeypatch):
    """A target whose run phase is not available here: one line naming the phase, why, and where."""
    from edgelin.export.onnx.target import OnnxTarget

    monkeypatch.setattr(OnnxTarget, "can_run", lambda self, device=None: Phase(
        False, "the runtime needs a GPU this machine lacks", "a Jetson Orin (compute cuda)"))
    with pytest.raises(EdgelinError) as info:
        open_runner(exported)
    assert info.value.line() == ("the onnx target cannot run here (run phase): the runtime needs a GPU this "
                                 "machine lacks. Fix: run it on a Jetson Orin (compute cuda)")
    assert_one_line_error(run("bench", exported, "--positions", "1"), "(run phase)", "a Jetson Orin")
    assert_one_line_error(run("generate", exported, "--prompt", "x", "-n", "2"), "(run phase)")


def test_build_names_the_build_phase(exported, monkeypatch):
    """ONNX has no build phase (one line, exit 0); a target whose build phase cannot run here is one error line."""
    from edgelin.export.onnx.target import OnnxTarget

    result = run("build", exported)
    assert result.exit_code == 0 and result.stdout.strip() == (
        f"{exported}: the onnx target has no build phase; the exported files run as they are")
    monkeypatch.setattr(OnnxTarget, "can_build", lambda self, device=None: Phase(
        False, "TensorRT is not installed", "an NVIDIA GPU with TensorRT 10"))
    assert_one_line_error(run("build", exported), "the onnx target cannot build here (build phase): TensorRT is not "
                                                  "installed. Fix: build it on an NVIDIA GPU with TensorRT 10")


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
    assert_one_line_error(run("validate", folder), needle)
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
    # the folder check names the changed file first (tests/test_integrity.py); --no-verify: ONNX Runtime's refusal
    assert_one_line_error(run("validate", folder), "step.onnx does not match its manifest")
    assert_one_line_error(run("validate", folder, "--no-verify"), "step.onnx cannot be loaded by ONNX Runtime",
                          "the file is truncated or corrupt")
    (folder / "step.onnx").write_bytes(b"\x00garbage" * 10)
    assert_one_line_error(run("bench", folder, "--positions", "1", "--no-verify"),
                          "step.onnx cannot be loaded by ONNX Runtime")


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


class RecordingRunner(NumpyRunner):
    """Records the position of every call and adds 1 to every state value."""

    def __init__(self, manifest: Manifest):
        super().__init__(manifest)
        self.seen: list[int] = []

    def _graph(self, kind, input_ids, state, position):
        self.seen.append(int(position[0]))
        return np.zeros((len(input_ids), self.manifest.vocab_size), np.float32), {k: v + 1 for k, v in state.items()}


@pytest.mark.parametrize("window, positions", [(8, [50, 51, 52, 50, 51, 52, 53, 54]), (None, [50] * 8)])
def test_bench_times_steps_on_forks(window, positions):
    """A constant-memory state: warm-up and timed steps on forks advancing from p. A growing cache:
    every step from a fresh fork at exactly p. Either way the state reached stays at p."""
    attention = AttentionConfig(num_heads=2, num_kv_heads=1, head_dim=16, window=window)
    model = CausalLM(tiny_config(family_layers("hybrid"), attention=attention))
    runner = RecordingRunner(build_manifest(model, "onnx", "fp32", {"step": "s", "prefill": "p"}, {}, None))
    state = runner.new_state(1)
    ms = time_steps(runner, state, 50, 1, warmup=3, iters=5)
    assert runner.seen == positions and ms.shape == (5,)
    assert all((v == 0).all() for v in runner.read_state(state).values())


def test_bench_prompt_ids_are_drawn_piecewise():
    pieces = list(random_pieces(3, 97, 2, 1000, 256))
    assert [lo for lo, _ in pieces] == [0, 256, 512, 768]
    assert [ids.shape for _, ids in pieces] == [(2, 256)] * 3 + [(2, 232)]
    again = list(random_pieces(3, 97, 2, 1000, 256))
    assert all(np.array_equal(a, b) for (_, a), (_, b) in zip(pieces, again))


def test_piece_length_bounds_the_attention_scores():
    """piece x (past + piece) <= ATTENTION_PAIRS (2^23): 2048 (the chunk) from an empty cache, 254 at
    32k, 1 token past 8M; never more than the chunk."""
    from edgelin.runtime import ATTENTION_PAIRS, piece_length

    assert ATTENTION_PAIRS == 1 << 23
    assert piece_length(2048, 0) == 2048 and piece_length(4096, 0) == 2896
    assert piece_length(2048, 32768) == 254 and 254 * (32768 + 254) <= 1 << 23 < 255 * (32768 + 255)
    assert piece_length(2048, 1 << 24) == 1


def test_growing_cache_prefill_shrinks_its_pieces_and_keeps_the_logits(growing, monkeypatch):
    """A growing KV cache is prefilled in pieces that shrink with the context (bounded attention
    scores), with the logits and state of one whole-prompt call; a constant-memory export keeps
    whole chunks."""
    import edgelin.runtime as runtime_module

    runner = open_runner(growing)
    ids = np.random.default_rng(5).integers(0, runner.manifest.vocab_size, (2, 40))
    whole = runner.new_state(2)
    want = runner.prefill(ids, whole, np.zeros(2, np.int64))
    pieces = []
    real = runner.prefill
    monkeypatch.setattr(runner, "prefill", lambda piece, *a: pieces.append(piece.shape[1]) or real(piece, *a))
    monkeypatch.setattr(runtime_module, "ATTENTION_PAIRS", 100)  # n (past + n) <= 100
    got, handle = prefill(runner, ids)
    assert pieces == [10, 6, 4, 4, 3, 3, 3, 2, 2, 2, 1]  # the largest n with n (past + n) <= 100, then the rest
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    for name, value in runner.read_state(handle).items():
        np.testing.assert_allclose(value, runner.read_state(whole)[name], rtol=1e-5, atol=1e-5)


def test_only_the_prefill_pool_stops_spinning_when_its_run_returns(exported):
    # Two sessions, two intra-op pools: the prefill's workers spinning after Run() took the cores the steps
    # right after it needed (2 threads: step p99 4-5 ms instead of ~1). The step's pool keeps spinning.
    runner = open_runner(exported, threads=2)
    entry = "session.force_spinning_stop"
    prefill_options = runner.sessions["prefill"].get_session_options()
    step_options = runner.sessions["step"].get_session_options()
    assert prefill_options.get_session_config_entry(entry) == "1"
    with pytest.raises(RuntimeError, match="does not have configuration"):  # unset: ONNX Runtime's default
        step_options.get_session_config_entry(entry)
    assert prefill_options.intra_op_num_threads == step_options.intra_op_num_threads == 2


def test_generate_stops_at_the_end_of_text_unless_told_to_ignore_it(exported, tmp_path):
    """The model's first greedy token made its end-of-text token: generation stops after it, and
    --ignore-eos (llama.cpp's flag, for timing and memory runs) goes on to exactly -n tokens."""
    first = json.loads(run("generate", exported, "--prompt", "x", "-n", "5", "--greedy", "--json").stdout)
    token = first["token_ids"][0]
    folder = edited_copy(exported, tmp_path / "eos", lambda data: data.update(eos_token_id=token))
    stopped = json.loads(run("generate", folder, "--prompt", "x", "-n", "5", "--greedy", "--json").stdout)
    going = json.loads(run("generate", folder, "--prompt", "x", "-n", "5", "--greedy", "--ignore-eos", "--json").stdout)
    assert stopped["token_ids"] == [token] and going["token_ids"] == first["token_ids"]
    assert going["new_tokens"] == 5
