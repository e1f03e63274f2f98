"""Core ML exports of a Qwen3.5-style hybrid (issue 45): its full-attention layer's KV cache held as fixed-capacity
state (`--context N`), explicit in/out or MLState, checked on Linux through the MIL program in numpy (a check of
the conversion, not of Apple's runtime) against transformers' own forward; the capacity in the manifest and
coreml.json; a run past it, and a --context the export cannot use, refused in one line.

One checkpoint (transformers' Qwen3.5: linear, full, linear attention; vocab 64) and one explicit fp32 export
through the CLI are shared by the module (~40 s CPU with `edgelin validate` on it); the slow tier adds the iPhone's
MLState export (the profile's default style, ~30 s)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("coremltools")

from typer.testing import CliRunner  # noqa: E402

from edgelin.artifact.manifest import Manifest  # noqa: E402
from edgelin.cli import app  # noqa: E402
from edgelin.devices import export_settings, get_device  # noqa: E402
from edgelin.errors import EdgelinError  # noqa: E402
from edgelin.export.coreml.check import check_folder  # noqa: E402
from edgelin.export.coreml.runner import MilRunner  # noqa: E402
from edgelin.export.coreml.target import CoremlOptions, CoremlTarget  # noqa: E402
from edgelin.export.pipeline import export_checkpoint  # noqa: E402
from helpers import assert_close  # noqa: E402

CONTEXT = 600  # >= what validate feeds one sequence (527)
VOCAB = 64
KV_HEADS, HEAD_DIM = 2, 16  # tiny_qwen35's full-attention layer
IDS = np.random.default_rng(45).integers(0, VOCAB, (2, 12))
# (what the runner is fed, the tokens so far after it): a prefill of 6 (pieces 4, 1, 1), a prefill of 4 that
# continues it (start 6), then two steps
CALLS = (("prefill", 0, 6), ("prefill", 6, 10), ("step", 10, 11), ("step", 11, 12))


@pytest.fixture(scope="module")
def qwen(tmp_path_factory) -> tuple[Path, np.ndarray]:
    """The checkpoint, and transformers' own logits for IDS (no cache: the whole sequence at once)."""
    from upstream_hf import tiny_qwen35

    folder = tmp_path_factory.mktemp("qwen35") / "ckpt"
    model = tiny_qwen35(folder, vocab=VOCAB)
    with torch.no_grad():
        want = model(torch.from_numpy(IDS), use_cache=False).logits.numpy()
    return folder, want


def cli(*args: str) -> str:
    result = CliRunner().invoke(app, list(args), env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    return result.output


@pytest.fixture(scope="module")
def explicit(qwen, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("hybrid") / "explicit"
    cli("export", "coreml", str(qwen[0]), "--out", str(out), "--context", str(CONTEXT), "--prefill-lengths", "4",
        "--precision", "fp32")
    return out


def run_calls(runner: MilRunner, rows: slice) -> tuple[list[np.ndarray], object]:
    """CALLS on a fresh handle for IDS[rows]: the logits after each call, and the handle."""
    ids = IDS[rows]
    state, got = runner.new_state(len(ids)), []
    for kind, start, end in CALLS:
        position = np.full(len(ids), start, np.int64)
        got.append(runner.prefill(ids[:, start:end], state, position) if kind == "prefill"
                   else runner.step(ids[:, start], state, position))
    return got, state


def check_against_transformers(runner: MilRunner, want: np.ndarray, tol: float, label: str) -> float:
    """CALLS at batch 1 and 2 (the runner splits rows: each its own batch-1 call) against transformers' logits;
    returns the largest |logit difference| seen."""
    worst = 0.0
    for rows in (slice(0, 1), slice(0, 2)):
        got, state = run_calls(runner, rows)
        for (kind, _, end), logits in zip(CALLS, got):
            expected = want[rows, end - 1]
            assert_close(logits, expected, tol, f"{label} batch {rows.stop} {kind} to {end}")
            worst = max(worst, float(np.abs(logits - expected).max()))
        held = runner.read_state(state)
        assert held["past_key_values.1.key"].shape == (rows.stop, KV_HEADS, 12, HEAD_DIM)  # the tokens held only
        assert held["past_key_values.0.recurrent_state"].shape[0] == rows.stop
    print(f"{label}: max |logit diff| vs transformers {worst:.2e}")
    return worst


def test_explicit_export_records_the_capacity(explicit):
    manifest = Manifest.load(explicit)
    assert manifest.kv_capacity == CONTEXT and manifest.extra["kv_cache"]["dtype"] == "float32"
    contract = json.loads((explicit / "coreml.json").read_text())
    assert contract["capacity"] == CONTEXT and contract["style"] == "explicit"
    dims = {s["feature"]: s["dims"] for s in contract["states"]}
    assert dims["past_key_values_1_key"] == [1, KV_HEADS, CONTEXT, HEAD_DIM]
    check_folder(explicit, manifest)  # the package's spec agrees (function I/O at the capacity)


def test_the_check_refuses_a_contract_whose_capacity_differs(explicit, tmp_path):
    import shutil

    folder = Path(shutil.copytree(explicit, tmp_path / "copy"))
    contract = json.loads((folder / "coreml.json").read_text())
    contract["capacity"] = CONTEXT - 100
    (folder / "coreml.json").write_text(json.dumps(contract))
    with pytest.raises(EdgelinError, match=f"KV cache of capacity {CONTEXT - 100}.*the manifest says {CONTEXT}"):
        check_folder(folder, Manifest.load(folder))


def test_explicit_conversion_matches_transformers_at_batch_1_and_2(explicit, qwen):
    check_against_transformers(MilRunner(explicit, Manifest.load(explicit)), qwen[1], 1e-4, "explicit fp32")


def test_a_run_past_the_capacity_is_refused_in_one_line(explicit):
    runner = MilRunner(explicit, Manifest.load(explicit))
    state = runner.new_state(1)
    runner.write_state(state, runner.manifest.initial_state(1, CONTEXT - 2))  # a cache of CONTEXT - 2 tokens
    with pytest.raises(EdgelinError, match=rf"prefill of 4 token\(s\) after {CONTEXT - 2}") as err:
        runner.prefill(IDS[:1, :4], state, np.array([CONTEXT - 2]))
    assert f"holds {CONTEXT} tokens" in err.value.why and "--context" in err.value.fix and "\n" not in str(err.value)
    assert runner.read_state(state)["past_key_values.1.key"].shape[2] == CONTEXT - 2  # the handle as it was
    with pytest.raises(EdgelinError, match="positions must continue the cache"):
        runner.step(IDS[:1, 0], state, np.array([3]))
    runner.step(IDS[:1, 0], state, np.array([CONTEXT - 2]))  # the next position fits
    with pytest.raises(EdgelinError, match=f"a state of {CONTEXT + 1} tokens"):
        runner.write_state(state, runner.manifest.initial_state(1, CONTEXT + 1))


@pytest.mark.parametrize("case", ["no-full-attention", "shorter-than-validate"])
def test_a_context_the_export_cannot_use_is_refused_before_tracing(case, qwen, tmp_path):
    if case == "no-full-attention":
        from upstream_hf import tiny_qwen35

        ckpt, context = tmp_path / "linear", CONTEXT
        tiny_qwen35(ckpt, vocab=VOCAB, num_hidden_layers=2, layer_types=["linear_attention"] * 2)
        match = "without full-attention layers"
    else:
        ckpt, context, match = qwen[0], 100, r"pass --context 527 or more"
    with pytest.raises(EdgelinError, match=match) as err:
        export_checkpoint(ckpt, tmp_path / "x", "coreml", options=CoremlOptions("explicit", (4,), context=context),
                          settings=export_settings(None, "coreml", "fp32"))
    assert "\n" not in str(err.value) and not (tmp_path / "x").exists()


def test_the_iphone_profile_defaults_to_mlstate_and_a_flag_wins():
    target = CoremlTarget()
    iphone = export_settings(get_device("iphone"), "coreml")
    assert target.options_from_flags({}, iphone)[0].style == "mlstate"
    assert target.options_from_flags({"style": "explicit"}, iphone)[0].style == "explicit"
    assert target.options_from_flags({}, export_settings(None, "coreml"))[0].style == "explicit"


def test_validate_replays_the_explicit_export(explicit):
    assert "passed" in cli("validate", str(explicit))


@pytest.mark.slow  # ~60 s: the fp16 conversion and its check
def test_iphone_mlstate_export_converts_checks_and_tracks_transformers(qwen, tmp_path):
    """--device iphone: MLState (the profile's default), fp16 compute and state (the KV cache in fp16 model state,
    as Apple's stateful Llama example), padded to 32; the recorded fp16 tolerance (2e-2)."""
    out = tmp_path / "mlstate"
    cli("export", "coreml", str(qwen[0]), "--out", str(out), "--device", "iphone", "--context", str(CONTEXT),
        "--prefill-lengths", "4")
    manifest = Manifest.load(out)
    contract = json.loads((out / "coreml.json").read_text())
    assert (contract["style"], contract["state_dtype"], contract["capacity"]) == ("mlstate", "float16", CONTEXT)
    assert manifest.kv_capacity == CONTEXT and manifest.extra["kv_cache"]["dtype"] == "float16"
    check_folder(out, manifest)
    check_against_transformers(MilRunner(out, manifest), qwen[1], 2e-2, "mlstate fp16")


@pytest.mark.requires_coreml_runtime
def test_prediction_parity_on_apple_runtime(explicit):
    """validate DIR on a Mac: the recorded reference through Core ML itself (CoremlRunner), the KV cache at its
    capacity in explicit state."""
    phase = CoremlTarget().can_run()
    if not phase.ok:
        pytest.skip(phase.reason)
    from edgelin.replay import replay

    report = replay(explicit)
    assert report.runner.startswith("coreml (Apple"), report.runner
    assert report.passed, [m.to_dict() for m in report.failures]
