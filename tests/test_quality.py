"""Quality figures (edgelin/quality.py, edgelin/artifact/quality.py, the gate edgelin/export/quality_gate.py): top-1 agreement with the fp32 reference and perplexity on
held-out text, recorded at export, replayed by `validate DIR`, computed live by `validate --against`,
bounded per precision (exit 1 below a bound), `--text` refusals, and the export's quality gate.

One tiny export (with a tokenizer and a recipe.toml, so its held-out text is a recipe validation
split) serves every test; perturbed copies edit the recorded reference, not the export."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path
from typing import Callable

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from edgelin.checkpoint import load_model
from edgelin.cli import app
from edgelin.devices import ExportSettings
from edgelin.errors import EdgelinError
from edgelin.artifact.manifest import Manifest
from edgelin.export.pipeline import export_checkpoint
from edgelin.artifact import quality
from edgelin.export import quality_gate
from edgelin.integrity import sha256_of
from edgelin.replay import replay
from edgelin.tokenizer import TextTokenizer
from edgelin.data import split_files, stdlib_files
from edgelin.train import Recipe
from helpers import make_checkpoint
from helpers import TINY  # the trainer tests' tiny recipe: a 200 kB stdlib corpus, 10% held out

GREEDY, PROMPT, TEXT = 512, 16, 512  # what export records by default (edgelin/quality.py)


def run(*args):
    return CliRunner().invoke(app, [str(a) for a in args])


def one_error_line(result, code: int) -> str:
    assert result.exit_code == code, (result.exit_code, result.output)
    lines = [ln for ln in result.stderr.splitlines() if ln.strip() and not ln.startswith(("progress:", "warning:"))]
    assert len(lines) == 1 and lines[0].startswith("error:") and "Fix:" in lines[0], result.stderr
    assert "Traceback" not in result.output
    return lines[0]


@pytest.fixture(scope="module")
def export(tmp_path_factory):
    root = tmp_path_factory.mktemp("quality")
    ckpt = make_checkpoint(root / "ckpt", "hybrid")  # with a tokenizer (vocab 256)
    (ckpt / "recipe.toml").write_text(TINY)  # a recipe checkpoint: its validation split is the held-out text
    return ckpt, export_checkpoint(ckpt, root / "out").folder


def tampered(folder: Path, dest: Path, change: Callable[[dict[str, np.ndarray]], None]) -> Path:
    """A copy of the export whose recorded reference is edited by `change` (manifest sha256 updated)."""
    shutil.copytree(folder, dest)
    with np.load(dest / "reference.npz") as npz:
        arrays = {key: npz[key] for key in npz.files}
    change(arrays)
    np.savez_compressed(dest / "reference.npz", **arrays)
    manifest = json.loads((dest / "manifest.json").read_text())
    # both digests: the reference vectors' entry and every file's map (checked when the folder is opened)
    manifest["extra"]["reference_vectors"]["sha256"] = manifest["sha256"]["reference.npz"] = \
        sha256_of(dest / "reference.npz")
    (dest / "manifest.json").write_text(json.dumps(manifest))
    return dest


SWAPPED = 51  # recorded text argmaxes changed to another token


def _swap(arrays: dict[str, np.ndarray]) -> None:
    """The last greedy token (never fed back, so no later step's context changes) and the first
    SWAPPED text argmaxes (compared only) become other tokens; every log-prob becomes log(1/4)."""
    arrays["quality/greedy_ids"][-1] = (arrays["quality/greedy_ids"][-1] + 1) % 256
    arrays["quality/text_argmax"][:SWAPPED] = (arrays["quality/text_argmax"][:SWAPPED] + 1) % 256
    arrays["quality/text_logprob"][:] = math.log(0.25)


@pytest.fixture(scope="module")
def swapped(export, tmp_path_factory):
    return tampered(export[1], tmp_path_factory.mktemp("swapped") / "out", _swap)


# ---- what export records ----------------------------------------------------------------------------
def test_export_records_the_recipe_validation_split_and_the_references_figures(export):
    ckpt, folder = export
    with np.load(folder / "reference.npz") as npz:
        meta = json.loads(str(npz["meta"]))["quality"]
        greedy, text = npz["quality/greedy_ids"], npz["quality/text_ids"]
        logprob, argmax = npz["quality/text_logprob"], npz["quality/text_argmax"]
    assert meta["source"].startswith("recipe validation split") and meta["greedy_steps"] == GREEDY
    assert greedy.shape == (PROMPT + GREEDY,) and text.shape == (TEXT,) and logprob.shape == argmax.shape == (TEXT - 1,)
    # the text is the start of the held-out files, as the trainer splits them (not its training files)
    recipe = Recipe.load(ckpt / "recipe.toml")
    train_texts, held_out = split_files(stdlib_files(recipe.data.max_bytes), recipe.data.val_fraction)
    decoded = TextTokenizer(ckpt / "tokenizer.json").decode(text[:100].tolist())
    assert held_out[0].startswith(decoded) and not any(t.startswith(decoded) for t in train_texts)
    # the recorded figures are the checkpoint's: its forward over the text and over prompt + greedy tokens
    model = load_model(ckpt)[0]
    with torch.no_grad():
        logits = model(torch.from_numpy(text[None]))[0][0].double()
        greedy_logits = model(torch.from_numpy(greedy[None]))[0][0]
    want = torch.log_softmax(logits, -1)[torch.arange(TEXT - 1), torch.from_numpy(text[1:])].numpy()
    np.testing.assert_allclose(logprob, want, rtol=0, atol=1e-5)
    assert (argmax == logits[:-1].argmax(-1).numpy()).mean() > 0.99  # a near-tie may flip between forms
    assert (greedy[PROMPT:] == greedy_logits[PROMPT - 1:-1].argmax(-1).numpy()).mean() > 0.99


# ---- validate DIR: the replay -------------------------------------------------------------------------
@pytest.fixture(scope="module")
def own(export):
    return replay(export[1])


def test_replay_agrees_fully_with_its_own_reference(export, own):
    _, folder = export
    report = own
    q = report.quality
    with np.load(folder / "reference.npz") as npz:
        recorded = npz["quality/text_logprob"]
    assert (q.greedy_steps, q.text_tokens) == (GREEDY, TEXT - 1)
    assert q.top1 == 1.0 and q.text_top1 == 1.0
    assert q.reference_perplexity == pytest.approx(math.exp(-recorded.mean()), rel=1e-12)
    assert abs(q.perplexity_change) < 1e-4  # fp32 ONNX vs PyTorch
    assert report.quality_checks == [] and report.passed  # fp32: no default quality bounds


def test_replay_counts_swapped_reference_tokens_exactly(own, swapped):
    q = replay(swapped).quality
    assert q.top1 == (GREEDY - 1) / GREEDY  # exactly the one swapped greedy token
    assert q.text_top1 == (TEXT - 1 - SWAPPED) / (TEXT - 1)
    assert q.reference_perplexity == pytest.approx(4.0, rel=1e-12)  # exp(-mean(log 1/4))
    artifact = own.quality.perplexity  # the artifact is unchanged
    assert q.perplexity == pytest.approx(artifact, rel=1e-12)
    assert q.perplexity_change == pytest.approx(artifact / 4.0 - 1.0, rel=1e-12)


def test_perplexity_is_exp_of_the_mean_negative_log_likelihood():
    assert quality.perplexity(np.log([0.5, 0.25])) == pytest.approx(math.sqrt(8), rel=1e-15)
    assert quality.log_softmax_at(np.array([0.0, math.log(3.0)], np.float32), 1) == pytest.approx(math.log(0.75), 1e-7)


def test_a_violated_bound_fails_validate_with_exit_1(export, swapped):
    ok = run("validate", swapped, "--json")  # fp32: the figures are reported, no default bound
    assert ok.exit_code == 0, ok.output
    reported = json.loads(ok.stdout)["quality"]
    assert reported["top1"] == (GREEDY - 1) / GREEDY and reported["checks"] == []
    line = one_error_line(run("validate", swapped, "--min-top1", "0.999"), 1)
    assert "top-1 agreement 99.80% < 99.90%" in line
    line = one_error_line(run("validate", swapped, "--max-ppl-change", "0.05"), 1)
    assert "perplexity change" in line and "> 5.00%" in line
    human = run("validate", export[1], "--min-top1", "0.999", "--max-ppl-change", "0.05")
    assert human.exit_code == 0, human.output
    assert "top-1 agreement (512 greedy steps)" in human.stdout and "perplexity change" in human.stdout


# ---- validate --against, --text ------------------------------------------------------------------------
def _binary(path: Path) -> None:
    path.write_bytes(bytes(range(256)) * 8)


@pytest.mark.parametrize("make, needles", [
    (lambda p: p.write_text(""), ("is empty",)),
    (lambda p: p.write_text("  \n\t\n"), ("is empty",)),
    (_binary, ("is not text", "NUL")),
    (lambda p: p.write_bytes("caf\xe9 au lait ".encode("latin-1") * 200), ("is not UTF-8 text", "byte 3")),
    (lambda p: p.write_text("def f():\n    return 1\n"), ("is too short", "at least 64")),
    (lambda p: None, ("no such file",)),
    (lambda p: p.mkdir(), ("not a regular file",)),
])
def test_text_that_cannot_be_scored_is_refused_in_one_line(export, tmp_path, make, needles):
    ckpt, folder = export
    path = tmp_path / "held-out.txt"
    make(path)
    line = one_error_line(run("validate", folder, "--against", ckpt, "--steps", "2", "--text", path), 2)
    assert f"--text {path}" in line
    for needle in needles:
        assert needle in line, line


def test_text_applies_to_against_only(export, tmp_path):
    (tmp_path / "t.txt").write_text("x = 1\n" * 100)
    line = one_error_line(run("validate", export[1], "--text", tmp_path / "t.txt"), 2)
    assert "--text applies to --against only" in line


def test_validate_against_measures_any_text_and_the_recipe_split_live(export, tmp_path):
    ckpt, folder = export
    text = tmp_path / "held-out.py"
    text.write_text(Path(json.__file__).read_text())  # any UTF-8 text: the json package's source
    result = run("validate", folder, "--against", ckpt, "--steps", "2", "--prompt-len", "3", "--batch", "1",
                 "--text", text, "--text-tokens", "200", "--json")
    assert result.exit_code == 0, result.output
    q = json.loads(result.stdout)["quality"]
    assert q["source"] == "text held-out.py" and q["text_tokens"] == 199 and q["top1"] == 1.0
    assert 1 < q["perplexity"] < 1e4 and abs(q["perplexity_change"]) < 1e-4
    # without --text: the checkpoint's recipe split, its reference computed here = the one recorded at export
    live = run("validate", folder, "--against", ckpt, "--steps", "2", "--prompt-len", "3", "--batch", "1", "--json")
    assert live.exit_code == 0, live.output
    with np.load(folder / "reference.npz") as npz:
        recorded = math.exp(-npz["quality/text_logprob"].mean())
    assert json.loads(live.stdout)["quality"]["reference_perplexity"] == pytest.approx(recorded, rel=1e-6)


# ---- the export gate -------------------------------------------------------------------------------------
def test_export_gate_refuses_below_the_bound_unless_forced(export, swapped, monkeypatch):
    ckpt, folder = export
    model = load_model(ckpt)[0]
    assert quality_gate.check_export_quality(model, folder, Manifest.load(folder), ExportSettings()) is None  # fp32
    passed = quality_gate.check_export_quality(model, folder, Manifest.load(folder), ExportSettings(precision="fp16"))
    assert passed.passed and passed.figures.top1 == 1.0  # the default fp16 bounds: 95%, +1%

    monkeypatch.setitem(quality.BOUNDS, "fp16", quality.Bounds(min_top1=0.999))
    with pytest.raises(EdgelinError) as refused:
        quality_gate.check_export_quality(model, swapped, Manifest.load(swapped), ExportSettings(precision="fp16"))
    line = refused.value.line()
    assert "the fp16 export fails its quality check" in line and "top-1 agreement 99.80% < 99.90%" in line
    assert "--force" in line and "--precision fp32" in line
    forced = quality_gate.check_export_quality(model, swapped, Manifest.load(swapped),
                                          ExportSettings(precision="fp16", force=True))
    assert not forced.passed and forced.figures.top1 == (GREEDY - 1) / GREEDY


@pytest.mark.parametrize("make, needles", [
    (lambda p: p.write_text(" \n"), ("is empty",)),
    (_binary, ("is not text", "NUL")),
    (lambda p: p.write_bytes("caf\xe9 ".encode("latin-1") * 200), ("is not UTF-8 text",)),
])
def test_export_text_is_checked_before_the_checkpoint_loads(tmp_path, make, needles):
    path = tmp_path / "held-out.txt"
    make(path)
    # the checkpoint does not exist: the refusal is the text's, so it came first
    line = one_error_line(run("export", tmp_path / "no-such-ckpt", "--out", tmp_path / "out", "--quantize", "int4",
                              "--text", path), 2)
    assert f"--text {path}" in line and all(n in line for n in needles), line
    assert not (tmp_path / "out").exists()


@pytest.mark.slow  # its own int4 export: ~25 s
def test_an_int4_export_is_gated_at_export_and_validate_checks_its_figures(export, tmp_path, monkeypatch):
    ckpt, _ = export
    gates: list[quality.GateResult | None] = []
    real_gate = quality_gate.check_export_quality

    def spy(*args):
        gates.append(real_gate(*args))
        return gates[-1]

    monkeypatch.setattr(quality_gate, "check_export_quality", spy)  # the pipeline imports it at each export
    monkeypatch.setitem(quality.BOUNDS, "int4", quality.Bounds(min_top1=1.0, max_ppl_change=-1.0))  # unreachable
    out, text = tmp_path / "int4", tmp_path / "held-out.py"
    text.write_text(Path(json.__file__).read_text())  # --text: any UTF-8 text (the json package's source)
    result = run("export", ckpt, "--out", out, "--quantize", "int4", "--force", "--text", text)  # --force: anyway
    assert result.exit_code == 0, result.output
    (gate,) = gates
    assert gate.key == "int4" and not gate.passed and gate.figures.text_tokens == TEXT - 1
    assert gate.figures.source == "text held-out.py"
    # the failed check is a warning line and is recorded in the manifest, figures, bounds and all
    (warning,) = [ln for ln in result.stderr.splitlines() if ln.startswith("warning:")]
    assert "the int4 export fails its quality check" in warning and "perplexity change" in warning
    assert "> -100.00%" in warning and "--force" in warning  # the failed check, with its bound
    recorded = Manifest.load(out).extra["quality"]
    assert (recorded["precision"], recorded["passed"], recorded["forced"]) == ("int4", False, True)
    assert recorded["bounds"] == {"top-1 agreement": {"bound": 1.0, "kind": "min"},
                                  "perplexity change": {"bound": -1.0, "kind": "max"}}
    assert recorded["figures"]["top1"] == gate.figures.top1 and recorded["figures"]["source"] == "text held-out.py"
    # reference.npz: the --text tokens, and meta says int4 (the quantisation is known before recording)
    with np.load(out / "reference.npz") as npz:
        meta, recorded_text = json.loads(str(npz["meta"])), npz["quality/text_ids"]
    assert (meta["precision"], meta["threshold"], meta["quality"]["source"]) == ("int4", 0.25, "text held-out.py")
    assert TextTokenizer(ckpt / "tokenizer.json").decode(recorded_text[:50].tolist()) in text.read_text()
    monkeypatch.undo()  # validate with the real int4 bounds

    report = run("validate", out, "--json")
    data = json.loads(report.stdout)
    q = data["quality"]
    assert (data["precision"], data["threshold"]) == ("int4", 0.25)
    assert {(c["name"], c["bound"]) for c in q["checks"]} == {("top-1 agreement", 0.90), ("perplexity change", 0.05)}
    assert q["top1"] == pytest.approx(gate.figures.top1) and q["perplexity"] == pytest.approx(gate.figures.perplexity)
    assert report.exit_code == (0 if data["passed"] else 1)
    human = run("validate", out)
    assert "quality vs the fp32 reference (int4 export" in human.stdout and ">= 90.00%" in human.stdout
