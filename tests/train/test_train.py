"""The generic trainer: recipes parse strictly, a tiny recipe learns, and its checkpoint reloads exactly."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from edgelin.checkpoint import load_model
from edgelin.errors import EdgelinError
from edgelin.train import Recipe, TrainResult, train
from helpers import TINY


SNIPPET = 'def f(x: int) -> str:\n\tif x > 0:\n        return f"{x!r} \u00e9\u4e2d\U0001f600"\n\n\n'


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> TrainResult:
    root = tmp_path_factory.mktemp("recipe")
    (root / "recipe.toml").write_text(TINY)
    return train(root / "recipe.toml", out_dir=root / "out")


def test_loss_decreases(trained: TrainResult) -> None:
    losses = trained.train_losses
    assert len(losses) == 30
    assert sum(losses[-5:]) / 5 < losses[0] - 0.5, losses
    log = json.loads((trained.out_dir / "training_log.json").read_text())
    assert [p["step"] for p in log["curve"]] == [10, 20, 30]
    assert log["sample"].startswith("def main(") and log["final_val_loss"] == trained.final_val_loss


def test_checkpoint_reloads_exactly(trained: TrainResult) -> None:
    for name in ("config.json", "model.safetensors", "tokenizer.json", "training_log.json", "recipe.toml"):
        assert (trained.out_dir / name).is_file(), name
    loaded, info = load_model(trained.out_dir)
    assert info.tokenizer is not None
    ids = torch.randint(0, loaded.config.vocab_size, (2, 48), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected, _ = trained.model(ids)
        actual, _ = loaded(ids)
    assert (expected - actual).abs().max().item() < 1e-5


def test_tokenizer_round_trips(trained: TrainResult) -> None:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(trained.out_dir / "tokenizer.json"))
    assert tok.get_vocab_size() == trained.model.config.vocab_size == 300
    assert tok.decode(tok.encode(SNIPPET, add_special_tokens=False).ids) == SNIPPET


def test_training_is_deterministic(trained: TrainResult, tmp_path: Path) -> None:
    out = train(trained.out_dir / "recipe.toml", out_dir=tmp_path / "again", steps=3)
    assert out.train_losses[0] == trained.train_losses[0]  # same init, same first batch
    again = train(trained.out_dir / "recipe.toml", out_dir=tmp_path / "again", steps=3, force=True)
    assert again.train_losses == out.train_losses


@pytest.mark.parametrize("section, line", [
    ("[train]", "learning_rate = 0.1"),
    ("[model]", "hiden_size = 3"),
    ("[model.attention]", "windw = 3"),
    ("[optimizer]", "beta = 0.9"),
])
def test_unknown_key_is_refused(tmp_path: Path, section: str, line: str) -> None:
    path = tmp_path / "recipe.toml"
    path.write_text(TINY.replace(f"{section}\n", f"{section}\n{line}\n") if section in TINY
                    else TINY + f"\n{section}\n{line}\n")
    with pytest.raises(EdgelinError, match="unknown key") as err:
        Recipe.load(path)
    assert "\n" not in err.value.line()


def test_wrong_type_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "recipe.toml"
    path.write_text(TINY.replace("steps = 30", 'steps = "30"'))
    with pytest.raises(EdgelinError, match="expected int"):
        Recipe.load(path)


def test_seed_override_is_the_recipe_seed(trained: TrainResult, tmp_path: Path) -> None:
    # --seed 5 trains exactly what a copy of the recipe with `seed = 5` trains, and not seed 0's run.
    (tmp_path / "seed5").mkdir()
    (tmp_path / "seed5" / "recipe.toml").write_text(TINY.replace("seed = 0", "seed = 5"))
    written = train(tmp_path / "seed5" / "recipe.toml", out_dir=tmp_path / "written", steps=2)
    override = train(trained.out_dir / "recipe.toml", out_dir=tmp_path / "override", steps=2, seed=5)
    assert override.train_losses == written.train_losses
    assert override.train_losses[0] != trained.train_losses[0]  # another init and other batches than seed 0
    log = json.loads((tmp_path / "override" / "training_log.json").read_text())
    assert (log["seed"], log["device"]) == (5, "cpu")


@pytest.mark.parametrize("device, needle", [("meta", "cpu or cuda only"), ("gpu0", "unknown training device"),
                                            ("cuda:7", "CUDA device")])
def test_unusable_device_is_refused_before_anything_is_written(tmp_path: Path, device: str, needle: str) -> None:
    if device.startswith("cuda") and torch.cuda.device_count() > 7:
        pytest.skip("this machine has 8 GPUs")
    (tmp_path / "recipe.toml").write_text(TINY)
    with pytest.raises(EdgelinError, match=needle) as err:
        train(tmp_path / "recipe.toml", out_dir=tmp_path / "out", device=device)
    assert "\n" not in err.value.line()
    assert not (tmp_path / "out").exists() and not (tmp_path / ".edgelin-cache").exists()


def test_cli_train_takes_seed_and_device(tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from edgelin.cli import app

    (tmp_path / "recipe.toml").write_text(TINY)
    result = CliRunner().invoke(app, ["train", str(tmp_path / "recipe.toml"), "--out", str(tmp_path / "out"),
                                      "--seed", "3", "--device", "cuda:7"])
    if torch.cuda.device_count() > 7:
        pytest.skip("this machine has 8 GPUs")
    assert result.exit_code == 2, result.output
    lines = [ln for ln in result.stderr.splitlines() if ln.strip() and not ln.startswith("progress:")]
    assert len(lines) == 1 and lines[0].startswith("error: training device 'cuda:7'") and "Fix:" in lines[0], lines
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("section, old, new, allowed", [
    ("train", "lr = 1e-2", "lr = nan", "> 0"),  # TOML has nan and inf: torch's "Invalid learning rate"
    ("train", "lr = 1e-2", "lr = inf", "> 0"),  # trained into "training diverged"
    ("train", "warmup = 5", "warmup = 5\ngrad_clip = nan", "> 0"),  # a NaN norm bound: "training diverged"
    ("train", "warmup = 5", "warmup = 5\ngrad_clip = -1.0", "> 0"),  # a negative bound flips the gradients
    ("train", "warmup = 5", "warmup = 5\nweight_decay = nan", ">= 0"),
    ("train", "warmup = 5", "warmup = 5\nweight_decay = -0.5", ">= 0"),  # trained, growing the weights
    ("train", "threads = 1 ", "threads = 100000 ", ">= 1 and <= 1024"),  # libgomp failed or crashed
    ("train", "threads = 1 ", "threads = 0 ", ">= 1 and <= 1024"),
    ("train", "warmup = 5", "warmup = -3", ">= 0"),
    ("data", "val_fraction = 0.1", "val_fraction = nan", "> 0 and < 0.5"),
    ("data", "max_bytes = 200_000", "max_bytes = 0", ">= 1"),
    ("tokenizer", "vocab_size = 300", "vocab_size = 0", ">= 257"),  # the byte-level alphabet and the separator
])
def test_out_of_range_numbers_are_refused_by_name_before_any_work(tmp_path: Path, section: str, old: str,
                                                                   new: str, allowed: str) -> None:
    assert old in TINY
    path = tmp_path / "recipe.toml"
    path.write_text(TINY.replace(old, new))
    key, value = new.splitlines()[-1].split(" = ")
    with pytest.raises(EdgelinError) as err:
        Recipe.load(path)
    line = err.value.line()
    assert line.startswith(f"{path}: [{section}] {key} = {value.strip()}: {key} ("), line
    assert f"must be a finite number {allowed}" in line and "Fix: set " in line and "\n" not in line, line


def test_cli_train_refuses_a_nan_lr_in_one_line_before_any_work(tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from edgelin.cli import app

    (tmp_path / "recipe.toml").write_text(TINY.replace("lr = 1e-2", "lr = nan"))
    result = CliRunner().invoke(app, ["train", str(tmp_path / "recipe.toml"), "--out", str(tmp_path / "out")])
    assert result.exit_code == 2, result.output
    lines = [ln for ln in result.stderr.splitlines() if ln.strip() and not ln.startswith("progress:")]
    assert len(lines) == 1 and lines[0].startswith("error: ") and "[train] lr = nan" in lines[0], lines
    assert "internal error" not in result.output and "diverged" not in result.output
    assert not (tmp_path / "out").exists() and not (tmp_path / ".edgelin-cache").exists()
