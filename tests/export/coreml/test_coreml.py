"""Core ML target (issue 10): conversion, the Linux contract check, the MIL numeric check of the
conversion (numpy, not Apple's runtime), refusals. Predictions on Apple's runtime: the
`requires_coreml_runtime` tests at the end run only on macOS (.github/workflows/apple-macos.yml).

Two conversions of one tiny hybrid (gated_deltanet + sliding-window softmax + gla) are shared by the
module: explicit style at fp32 with prefill lengths 4 and 19 (19 > the chunk size 16: two chunks, the
second partial), and MLState at fp16 with the state padded to multiples of 32."""

from __future__ import annotations

import importlib.util
import json
import math
import platform
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("coremltools")

from edgelin.checkpoint import load_model  # noqa: E402
from edgelin.devices import ExportSettings, export_settings, get_device  # noqa: E402
from edgelin.errors import EdgelinError  # noqa: E402
from edgelin.export.coreml.check import check_folder  # noqa: E402
from edgelin.export.static_chunks import StaticChunkEngine  # noqa: E402
from edgelin.export.coreml.runner import MilRunner, pieces  # noqa: E402
from edgelin.export.coreml.target import RUN_REFUSAL, CoremlOptions, CoremlTarget  # noqa: E402
from edgelin.artifact.manifest import Manifest  # noqa: E402
from edgelin.export.pipeline import export_checkpoint  # noqa: E402
from edgelin.reference import recurrence  # noqa: E402
from helpers import assert_close, make_checkpoint  # noqa: E402

PASSING = {"max_rel_error": 1e-3, "final_rel_error": 1e-3, "top1_agreement": 1.0, "steps": 4096, "weights": "trained"}


def verdict_table(**rows: dict) -> dict:
    """A state-precision table (edgelin.precision's format) with these fp16 rows per family."""
    return {"meta": {}, "families": {family: {"float16": row} for family, row in rows.items()}}


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("coreml") / "hybrid", "hybrid", tokenizer=False)


@pytest.fixture(scope="module")
def explicit(ckpt, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("explicit") / "out"
    return export_checkpoint(ckpt, out, "coreml", options=CoremlOptions("explicit", (4, 19)),
                             settings=ExportSettings(precision="fp32", state_dtype="float32")).folder


@pytest.fixture(scope="module")
def mlstate(ckpt, tmp_path_factory) -> Path:
    # edgelin.precision's measured table is not in the tree yet (stream S): a passing table stands in.
    import edgelin.precision as precision

    out = tmp_path_factory.mktemp("mlstate") / "out"
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(precision, "load_table", lambda: verdict_table(gated_deltanet=PASSING, gla=PASSING))
        return export_checkpoint(ckpt, out, "coreml", options=CoremlOptions("mlstate", (4,)),
                                 settings=ExportSettings(precision="fp16", state_dtype="float16",
                                                         state_dim_multiple=32)).folder


def spec_of(folder: Path):
    import coremltools as ct

    return ct.models.MLModel(str(folder / "model.mlpackage"), skip_model_load=True).get_spec()


def features(fdesc, which: str) -> dict[str, tuple[list[int], int]]:
    out = {}
    for f in getattr(fdesc, which):
        kind = f.type.WhichOneof("Type")
        array = f.type.stateType.arrayType if kind == "stateType" else f.type.multiArrayType
        out[f.name] = (list(array.shape), array.dataType)
    return out


FLOAT32, FLOAT16, INT32 = 65568, 65552, 131104  # ArrayFeatureType.ArrayDataType


# ---- the static chunk loop (lowering("coreml")) --------------------------------------------------
@pytest.mark.parametrize("gate", [None, 1, 8], ids=["no-decay", "scalar-decay", "per-key-decay"])
@pytest.mark.parametrize("rule", ["additive", "delta", "erase"])
def test_static_chunk_engine_matches_the_token_loop(gate, rule):
    gen = torch.Generator().manual_seed(0)
    b, t, h, dk, dv = 2, 37, 3, 8, 5  # 37 = two full chunks of 16 and a partial one
    q, k, v = torch.randn(b, t, h, dk, generator=gen), torch.randn(b, t, h, dk, generator=gen) * 0.3, \
        torch.randn(b, t, h, dv, generator=gen)
    g = None if gate is None else -torch.rand(b, t, h, gate, generator=gen) * 0.5
    beta = torch.rand(b, t, h, generator=gen) if rule != "additive" else None
    erase = torch.rand(b, t, h, dk, generator=gen) if rule == "erase" else None  # Gated DeltaNet-2's gate
    s0 = torch.randn(b, h, dk, dv, generator=gen)
    engine = StaticChunkEngine()
    out, state = engine.chunked(s0, q, k, v, g, beta, 16, erase=erase)
    want_out, want_state = recurrence.recurrent(s0, q, k, v, g, beta, erase)
    assert_close(out, want_out, 1e-6, "o")
    assert_close(state, want_state, 1e-6, "state")
    if erase is not None:  # the gate matters here: the plain delta rule is far off
        plain, _ = recurrence.recurrent(s0, q, k, v, g, beta)
        assert (plain - want_out).abs().max() > 0.05 * want_out.abs().max()
    z0 = torch.rand(b, h, dk, generator=gen)
    den, z = engine.normalizer_chunked(z0, q.abs(), k.abs(), g, 16)
    want_den, want_z = recurrence.normalizer_recurrent(z0, q.abs(), k.abs(), g)
    assert_close(den, want_den, 1e-6, "normaliser denominators")
    assert_close(z, want_z, 1e-6, "normaliser state")


def test_prompt_pieces():
    assert pieces(15, [4, 19]) == [4, 4, 4, 1, 1, 1]
    assert pieces(42, [19, 4]) == [19, 19, 4]
    assert pieces(3, [16, 64]) == [1, 1, 1]


# ---- the Linux contract check ---------------------------------------------------------------------
def test_explicit_package_contract(explicit):
    manifest = Manifest.load(explicit)
    report = check_folder(explicit, manifest)
    assert report.functions == ["prefill_19", "prefill_4", "step"]
    spec = spec_of(explicit)
    assert spec.specificationVersion == 9  # iOS 18: a multifunction package (shared weights)
    assert spec.description.defaultFunctionName == "step"
    functions = {f.name: f for f in spec.description.functions}
    assert sorted(functions) == ["prefill_19", "prefill_4", "step"]
    step_in = features(functions["step"], "input")
    assert step_in["input_ids"] == ([1], INT32) and step_in["position_ids"] == ([1], INT32)
    assert step_in["past_key_values_0_recurrent_state"] == ([1, 2, 8, 8], FLOAT32)
    assert step_in["past_key_values_1_key"] == ([1, 1, 8, 16], FLOAT32)  # window 8, head_dim 16
    assert features(functions["prefill_19"], "input")["input_ids"] == ([1, 19], INT32)
    out = features(functions["step"], "output")
    assert out["logits"] == ([1, 97], FLOAT32) and out["present_2_recurrent_state"] == ([1, 2, 8, 8], FLOAT32)
    assert not len(functions["step"].state)
    meta = dict(spec.description.metadata.userDefined)
    assert meta["source_sha256"] == manifest.source["sha256"] and meta["edgelin_style"] == "explicit"
    assert [t.dtype for t in manifest.state_inputs] == ["float32"] * 5 and manifest.precision == "fp32"
    assert {f.split("/")[0] for f in manifest.files} == {"coreml.json", "manifest.json", "model.mlpackage",
                                                         "reference.npz"}
    assert "model.mlpackage/Manifest.json" in manifest.files  # the package's files by path: --force knows them


def test_mlstate_package_contract(mlstate):
    manifest = Manifest.load(mlstate)
    check_folder(mlstate, manifest)
    spec = spec_of(mlstate)
    assert spec.specificationVersion == 9
    functions = {f.name: f for f in spec.description.functions}
    assert sorted(functions) == ["prefill_4", "step"]
    step = functions["step"]
    assert sorted(features(step, "input")) == ["input_ids", "position_ids"]
    assert sorted(features(step, "output")) == ["logits"]
    states = features(step, "state")
    # padded to multiples of 32 in the innermost dim (coremltools#2631); fp16 (Core ML's only state dtype)
    assert states["past_key_values_0_recurrent_state"] == ([1, 2, 8, 32], FLOAT16)
    assert states["past_key_values_0_conv_state"] == ([1, 48, 32], FLOAT16)  # 48 channels, conv 4 - 1 = 3 -> 32
    assert states["past_key_values_1_value"] == ([1, 1, 8, 32], FLOAT16)
    assert [t.dtype for t in manifest.state_inputs] == ["float16"] * 5 and manifest.precision == "fp16"
    from edgelin.export.coreml.mil import load_program

    ops = [op.op_type for op in load_program(mlstate / "model.mlpackage").functions["step"].operations]
    assert ops.count("read_state") == 5 and ops.count("coreml_update_state") == 5


def test_contract_check_finds_a_tampered_folder(explicit, tmp_path):
    """The check fails where the package and its description disagree (so its passes mean something)."""
    copy = tmp_path / "copy"
    shutil.copytree(explicit, copy)
    manifest = Manifest.load(copy)
    contract = json.loads((copy / "coreml.json").read_text())
    contract["states"][0]["dims"][-1] = 32  # the package keeps 8
    (copy / "coreml.json").write_text(json.dumps(contract))
    with pytest.raises(EdgelinError, match=r"mlpackage:\w+ inputs are"):
        check_folder(copy, manifest)
    contract["states"][0]["dims"][-1] = 8
    contract["functions"]["prefill_7"] = {"kind": "prefill", "length": 7, "package": "model.mlpackage"}
    (copy / "coreml.json").write_text(json.dumps(contract))
    with pytest.raises(EdgelinError, match="holds functions"):
        check_folder(copy, manifest)
    del contract["functions"]["prefill_7"]
    (copy / "coreml.json").write_text(json.dumps(contract))
    import dataclasses

    with pytest.raises(EdgelinError, match="metadata source_sha256"):
        check_folder(copy, dataclasses.replace(manifest, source={**manifest.source, "sha256": "0" * 64}))


# ---- the numeric check of the conversion (MIL program in numpy) ------------------------------------
def _reference(ckpt: Path, ids: np.ndarray, start: int, steps: np.ndarray):
    """The PyTorch reference: prefill logits and state after `ids`, then logits after each step."""
    model, _ = load_model(ckpt)
    with torch.no_grad():
        logits, state = model(torch.from_numpy(ids), None, torch.tensor([start]), last_only=True)
        prefill = (logits.numpy(), [{k: v.numpy() for k, v in layer.items()} for layer in state])
        rollout = []
        for t, token in enumerate(steps):
            out, state = model(torch.tensor([[token]]), state, torch.tensor([start + ids.shape[1] + t]),
                               mode="recurrent")
            rollout.append(out[:, -1].numpy())
    return prefill, np.stack(rollout)


@pytest.mark.parametrize("length", [4, 19])
def test_explicit_fp32_conversion_matches_the_reference(explicit, ckpt, length):
    """Each prefill function (one chunk; two chunks, the second partial) and then a step rollout, at
    batch 1 (static on the Neural Engine), against PyTorch: a check of the conversion, not of Apple's runtime."""
    runner = MilRunner(explicit, Manifest.load(explicit))
    rng = np.random.default_rng(length)
    ids, steps = rng.integers(0, 97, (1, length)), rng.integers(0, 97, 6)
    (want_logits, want_state), want_rollout = _reference(ckpt, ids, 0, steps)
    state = runner.new_state(1)
    got = runner.prefill(ids, state, np.zeros(1, np.int64))
    assert_close(got, want_logits, 1e-5, f"prefill_{length} logits")
    arrays = runner.read_state(state)
    for layer, tensors in enumerate(want_state):
        for name, want in tensors.items():
            assert_close(arrays[f"past_key_values.{layer}.{name}"], want, 1e-5, f"prefill_{length} {layer}.{name}")
    for t, token in enumerate(steps):
        got = runner.step(np.array([token]), state, np.array([length + t]))
        assert_close(got, want_rollout[t], 1e-5, f"step {t} after prefill_{length}")


def test_mlstate_fp16_conversion_tracks_the_reference(mlstate, ckpt):
    """fp16 compute, fp16 padded MLState: the recorded tolerance for fp16 graphs (2e-2)."""
    runner = MilRunner(mlstate, Manifest.load(mlstate))
    rng = np.random.default_rng(1)
    ids, steps = rng.integers(0, 97, (1, 9)), rng.integers(0, 97, 4)  # 9 = 4 + 4 + one step
    (want_logits, _), want_rollout = _reference(ckpt, ids, 0, steps)
    state = runner.new_state(1)
    assert_close(runner.prefill(ids, state, np.zeros(1, np.int64)), want_logits, 2e-2, "prefill logits")
    for t, token in enumerate(steps):
        assert_close(runner.step(np.array([token]), state, np.array([9 + t])), want_rollout[t], 2e-2, f"step {t}")
    padded = runner._row_arrays(state._value.rows[0])["past_key_values_0_recurrent_state"]
    assert padded.shape == (1, 2, 8, 32) and not padded[..., 8:].any()  # the padding stays zero


# ---- families beyond the hybrid (every family: bench/coreml_families.py, docs/performance.md#core-ml) -------------
def _family_checkpoint(folder: Path, family: str) -> Path:
    """Tiny random checkpoint, chunk size 8: prefill_12 is a full chunk and a partial one, and the
    replay's 15-token prompt is prefill_12 + 3 steps. Gated DeltaNet-2's zero-initialised erase/write
    gates are moved off their constant start (test_gdn2_clvr.jitter), so the gate varies per channel."""
    from conftest import tiny_config
    from edgelin.checkpoint import save_checkpoint
    from edgelin.model.lm import CausalLM
    from helpers import jitter

    torch.manual_seed(0)
    model = CausalLM(tiny_config((family, family), chunk_size=8)).eval()
    return save_checkpoint(jitter(model) if family == "gated_deltanet2" else model, folder)


@pytest.mark.parametrize("family", ["gated_deltanet2", "linear_attn"])
def test_family_explicit_fp32_replays_through_the_mil_program(family, tmp_path):
    """Gated DeltaNet-2 (the erase gate in the static chunk loop) and the linear transformer (the
    normaliser's chunk loop; the hybrid fixture has none): the recorded reference (prefill, 24 steps,
    batch 1 and 3, states) through the converted MIL program."""
    from edgelin.replay import replay

    ckpt = _family_checkpoint(tmp_path / "ckpt", family)
    folder = export_checkpoint(ckpt, tmp_path / "out", "coreml", options=CoremlOptions("explicit", (12,)),
                               settings=ExportSettings(precision="fp32", state_dtype="float32")).folder
    report = replay(folder)
    assert report.passed, [m.to_dict() for m in report.failures]
    assert {m.check for m in report.metrics} >= {"prefill", "rollout", "prefill-vs-steps"}
    assert max(m.max_rel for m in report.metrics) < 1e-5  # fp32 rounding (figures: docs/performance.md#core-ml)


def test_mlstate_refused_for_a_family_whose_measured_fp16_drift_fails(tmp_path):
    """The real verdict table (edgelin/precision/state_precision.toml): linear_attn's fp16 state drifts
    0.106 (> its bound), so MLState is refused with the figure before anything is converted."""
    ckpt = _family_checkpoint(tmp_path / "ckpt", "linear_attn")
    with pytest.raises(EdgelinError, match="fp16 state for linear_attn layers") as err:
        export_checkpoint(ckpt, tmp_path / "x", "coreml", options=CoremlOptions("mlstate", (12,)),
                          settings=ExportSettings(precision="fp16", state_dtype="float16"))
    assert "0.11" in err.value.why and "explicit" in err.value.fix and not (tmp_path / "x").exists()


# ---- upstream checkpoints (fla, transformers) -------------------------------------------------------
UPSTREAM_STYLES = {"explicit": ("fp32", "float32", 1e-5), "mlstate": ("fp16", "float16", 2e-2)}


@pytest.fixture(scope="module")
def upstream(tmp_path_factory):
    """Tiny upstream checkpoints built by the upstream libraries (no hub): fla's GLA (its forward under
    the Triton interpreter, tests/upstream_fla.py) and transformers' Qwen3.5 text model with linear
    layers only (with full-attention layers: test_coreml_hybrid.py). Each with 13 ids and the upstream
    library's own logits for them."""
    root = tmp_path_factory.mktemp("upstream")
    ids = np.random.default_rng(0).integers(0, 100, (1, 13))
    built = {}

    def build(source: str):
        if source in built:
            return built[source]
        folder = root / source
        if source == "fla-gla":
            if importlib.util.find_spec("fla") is None:
                pytest.skip("flash-linear-attention is not installed (pip install 'edgelin[dev]')")
            from test_convert_fla import jitter
            from upstream_fla import tiny_fla_model

            model, _ = tiny_fla_model("gla")
            jitter(model)
            kwargs = {}
        else:
            from upstream_hf import tiny_qwen35

            model = tiny_qwen35(folder, num_hidden_layers=2, layer_types=["linear_attention"] * 2)
            kwargs = {"use_cache": False}  # transformers' cache needs an attention layer
        threads = torch.get_num_threads()
        torch.set_num_threads(1)  # interpreted kernels between tiny matmuls: threads only add stalls
        try:
            if source == "fla-gla":
                model.save_pretrained(folder, safe_serialization=True)
            with torch.no_grad():
                want = model(torch.from_numpy(ids), **kwargs).logits.numpy()
        finally:
            torch.set_num_threads(threads)
        built[source] = (folder, ids, want)
        return built[source]

    return build


@pytest.mark.slow  # ~45 s CPU for the four exports and fla's interpreted forward (2-core machine)
@pytest.mark.parametrize("style", list(UPSTREAM_STYLES))
@pytest.mark.parametrize("source", ["fla-gla", "hf-qwen3_5_text"])
def test_upstream_checkpoint_exports_and_matches_the_upstream_forward(upstream, source, style, tmp_path):
    """fla GLA and transformers Qwen3.5 (linear layers) -> Core ML (explicit fp32; MLState fp16, which
    the measured fp16-state verdicts of gla and gated_deltanet allow) -> contract check -> MIL program
    against the upstream library's own logits (prefill_8, then 5 steps), and the recorded replay."""
    from edgelin.replay import replay

    folder, ids, want = upstream(source)
    precision, state_dtype, tol = UPSTREAM_STYLES[style]
    out = export_checkpoint(folder, tmp_path / "out", "coreml", options=CoremlOptions(style, (8,)),
                            settings=ExportSettings(precision=precision, state_dtype=state_dtype)).folder
    manifest = Manifest.load(out)
    check_folder(out, manifest)
    assert manifest.source["format"] in ("fla", "transformers")
    runner = MilRunner(out, manifest)
    state = runner.new_state(1)
    got = [runner.prefill(ids[:, :8], state, np.zeros(1, np.int64))]
    got += [runner.step(ids[:, t], state, np.array([t])) for t in range(8, 13)]
    assert_close(np.stack(got, 1), want[:, 7:], tol, f"{source} {style} vs the upstream forward")
    report = replay(out)
    assert report.passed, [m.to_dict() for m in report.failures]


# ---- refusals ---------------------------------------------------------------------------------------
def test_mlstate_below_ios18_is_refused():
    with pytest.raises(EdgelinError, match="MLState with deployment target iOS17") as err:
        CoremlOptions("mlstate", (16,), "iOS17").checked()
    assert "iOS 18" in err.value.why and "explicit" in err.value.fix


def test_mlstate_with_a_float32_state_is_refused(ckpt, tmp_path):
    with pytest.raises(EdgelinError, match="MLState with a float32 state") as err:
        export_checkpoint(ckpt, tmp_path / "x", "coreml", options=CoremlOptions("mlstate", (4,)),
                          settings=ExportSettings(precision="fp16", state_dtype="float32"))
    assert "fp16 only" in err.value.why and not (tmp_path / "x").exists()


def test_mlstate_with_a_failing_precision_verdict_is_refused_unless_forced(ckpt, tmp_path, monkeypatch):
    # The measured table is not in the tree yet (stream S): a table whose gla row fails stands in.
    import edgelin.precision as precision

    failing = {**PASSING, "max_rel_error": 0.3, "top1_agreement": 0.9}
    monkeypatch.setattr(precision, "load_table", lambda: verdict_table(gated_deltanet=PASSING, gla=failing))
    with pytest.raises(EdgelinError, match="fp16 state for gla layers") as err:
        export_checkpoint(ckpt, tmp_path / "x", "coreml", options=CoremlOptions("mlstate", (4,)),
                          settings=ExportSettings(precision="fp16", state_dtype="float16"))
    assert "0.3" in err.value.why and "--force" in err.value.fix and not (tmp_path / "x").exists()
    # --force passes the precision check (the conversion itself is the fixture's; not repeated here)
    from edgelin.export.coreml.target import check_settings

    model, _ = load_model(ckpt)
    check_settings(model, ExportSettings(precision="fp16", state_dtype="float16", force=True),
                   CoremlOptions("mlstate", (4,)))


def test_device_profiles_and_coreml():
    with pytest.raises(EdgelinError, match="does not list target coreml"):
        export_settings(get_device("jetson-orin"), "coreml")
    iphone = export_settings(get_device("iphone"), "coreml")
    assert (iphone.precision, iphone.state_dtype, iphone.state_dim_multiple) == ("fp16", "float16", 32)


def test_run_phase_is_refused_off_macos_in_one_line(explicit):
    if platform.system() == "Darwin":
        pytest.skip("this machine is a Mac: the run phase is the macOS workflow's")
    phase = CoremlTarget().can_run()
    assert not phase.ok and phase.reason.startswith(RUN_REFUSAL)
    from edgelin.runtime import open_runner

    with pytest.raises(EdgelinError, match="cannot run here") as err:
        open_runner(explicit)
    assert "macOS 13+" in err.value.why and "\n" not in str(err.value)


def test_cli_refuses_coreml_options_in_one_line(ckpt, tmp_path):
    from test_cli import assert_clean_failure, run

    assert_clean_failure(run("export", ckpt, "--target", "coreml", "--coreml-style", "mlstate",
                             "--deployment-target", "iOS16", "--out", tmp_path / "a"), "MLState", "iOS16")
    assert_clean_failure(run("export", ckpt, "--target", "onnx", "--prefill-lengths", "4", "--out", tmp_path / "b"),
                         "--prefill-lengths applies to --target coreai or coreml only")
    assert_clean_failure(run("export", ckpt, "--target", "coreml", "--prefill-lengths", "4,x", "--out",
                             tmp_path / "c"), "--prefill-lengths 4,x")
    assert not any(tmp_path.iterdir())


def _files(folder: Path) -> dict[str, tuple[bytes, int]]:
    return {p.relative_to(folder).as_posix(): (p.read_bytes(), p.stat().st_mtime_ns)
            for p in sorted(folder.rglob("*")) if p.is_file()}


def test_validate_writes_nothing_into_the_folder(explicit):
    """coremltools' package loader rewrites the Manifest.json of a package it opens (the same bytes, a new mtime):
    validate reads the packages through a private view, so every file keeps its bytes and its mtime."""
    from typer.testing import CliRunner

    from edgelin.cli import app

    before = _files(explicit)
    result = CliRunner().invoke(app, ["validate", str(explicit)])
    assert result.exit_code == 0, result.output
    assert _files(explicit) == before


def test_validate_stderr_holds_only_edgelin_lines(explicit):
    """In a fresh process (coremltools' noise comes with its import; off macOS eight "Failed to load _MLModelProxy"
    lines and a torch-version warning): stderr holds error/warning/progress lines only."""
    import os
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-m", "edgelin.cli", "validate", str(explicit)],
                          env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[3])},
                          capture_output=True, text=True, timeout=600, stdin=subprocess.DEVNULL)
    assert done.returncode == 0, done.stderr
    other = [ln for ln in done.stderr.splitlines()
             if ln.strip() and not ln.startswith(("error:", "warning:", "progress:"))]
    assert not other, other


# ---- Apple's runtime (macOS only: .github/workflows/apple-macos.yml) --------------------------------
def _macos_at_least(major: int) -> bool:
    from edgelin.export.coreml.target import macos_major

    found = macos_major()
    return found is not None and found >= major


@pytest.mark.requires_coreml_runtime
@pytest.mark.parametrize("fixture, needs", [("explicit", 13), ("mlstate", 15)])
def test_prediction_parity_on_apple_runtime(fixture, needs, request):
    """validate DIR on a Mac: the recorded reference (prefill, 24-step rollout, batch 1 and 3)
    through Core ML itself."""
    if not _macos_at_least(needs):
        pytest.skip(f"Core ML predictions need macOS {needs}+ (this is {platform.system()})")
    from edgelin.replay import replay

    folder = request.getfixturevalue(fixture)
    report = replay(folder)
    assert report.runner.startswith("coreml (Apple"), report.runner
    assert report.passed, [m.to_dict() for m in report.failures]
    assert math.isfinite(report.seconds)
