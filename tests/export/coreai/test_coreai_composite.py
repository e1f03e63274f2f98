"""Core AI's lowering through Apple's GatedDeltaUpdate composite (edgelin.export.coreai.lowering): which layers
take it (the engine against the torch reference, per family's tensors), the composite in the converted program
(three Gated DeltaNet layers: one call site each, a GLA layer beside them on edgelin's forms; none for a GLA
model), and an export through it run by Apple's runtime against the torch reference (prompt pieces and steps,
batch 1 and 2)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("coreai_torch")

from edgelin.artifact.manifest import Manifest  # noqa: E402
from edgelin.checkpoint import load_model  # noqa: E402
from edgelin.devices import ExportSettings  # noqa: E402
from edgelin.export.coreai import convert  # noqa: E402
from edgelin.export.coreai.lowering import CoreaiEngine, composite_module  # noqa: E402
from edgelin.export.coreai.runner import CoreaiRunner  # noqa: E402
from edgelin.export.coreai.target import CoreaiOptions  # noqa: E402
from edgelin.export.pipeline import export_checkpoint  # noqa: E402
from edgelin.reference import recurrence  # noqa: E402
from helpers import make_checkpoint  # noqa: E402
from test_coreai import TOL, reference_run, runner_run  # noqa: E402

LAYERS = ("gated_deltanet", "gla", "gated_deltanet", "gated_deltanet")
DECLARED = 'composite_declaration<"gated_delta_update"'
CALL = "coreai.invoke @gated_delta_update"


class Refuses(torch.nn.Module):
    """A composite that must not be called (a layer that does not match it)."""

    def forward(self, *args):
        raise AssertionError("the composite was called for a layer it does not match")


def tensors(decay: str, erase: bool = False, length: int = 5, seed: int = 0) -> dict:
    """Random inputs in the engines' layout (B=2, H=3, d_k=16, d_v=8), q and k L2-normalised, q scaled."""
    gen = torch.Generator().manual_seed(seed)
    b, h, d_k, d_v = 2, 3, 16, 8
    q, k = (torch.nn.functional.normalize(torch.randn(b, length, h, d_k, generator=gen), dim=-1) for _ in "qk")
    width = {"none": 0, "scalar": 1, "per_key": d_k}[decay]
    g = -torch.rand(b, length, h, width, generator=gen) if width else None
    return dict(state=torch.randn(b, h, d_k, d_v, generator=gen), q=q * d_k**-0.5, k=k,
                v=torch.randn(b, length, h, d_v, generator=gen), g=g, beta=torch.rand(b, length, h, generator=gen),
                erase=torch.rand(b, length, h, d_k, generator=gen) if erase else None)


@pytest.mark.parametrize("decay", ["scalar", "none"])
def test_matching_layers_run_the_composite_as_the_reference(decay):
    """Gated DeltaNet's tensors (and DeltaNet's, no decay): every form through the composite equals the token loop."""
    x = tensors(decay)
    want, want_state = recurrence.recurrent(**x)
    engine = CoreaiEngine(composite=composite_module())
    for form in ("recurrent", "chunked"):
        got, state = getattr(engine, form)(**x)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(state, want_state, rtol=1e-5, atol=1e-6)
    first = {name: (t[:, 0] if name not in ("state",) and t is not None else t) for name, t in x.items()}
    got, state = engine.step(**first)
    want_one, want_one_state = recurrence.recurrent_step(**first)
    torch.testing.assert_close(got, want_one, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(state, want_one_state, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("decay, erase", [("per_key", False), ("scalar", True)])
def test_other_layers_keep_edgelins_forms(decay, erase):
    """GLA / KDA (per-key decay) and Gated DeltaNet-2 (erase gate) never reach the composite."""
    x = tensors(decay, erase)
    want, want_state = recurrence.recurrent(**x)
    got, state = CoreaiEngine(composite=Refuses()).chunked(**x, chunk_size=4)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(state, want_state, rtol=1e-4, atol=1e-5)
    additive = tensors("scalar") | {"beta": None}  # the additive rule (no beta)
    CoreaiEngine(composite=Refuses()).chunked(**additive)


def test_a_kernel_that_normalises_again_agrees():
    """The composite is declared use_qk_l2_norm=false; Apple's Qwen3.5 declares no attribute and normalises in the
    op. For L2-normalised q and k (fed as the engine feeds them), normalising again changes nothing that matters."""
    x = tensors("scalar", length=6)
    feed = (x["q"] * 16**0.5, x["k"], x["v"], x["g"].squeeze(-1), x["beta"])
    heads_first = [t.transpose(1, 2) for t in feed]
    declared, _ = composite_module()(*heads_first, x["state"])
    again, _ = type(composite_module())(use_qk_l2_norm=True)(*heads_first, x["state"])
    torch.testing.assert_close(again, declared, rtol=1e-5, atol=1e-5)


@pytest.fixture(scope="module")
def mixed(tmp_path_factory) -> tuple[Path, Path, list[str]]:
    """(checkpoint, export, the converted program's text): three Gated DeltaNet layers and a GLA layer, prefill
    entry point of 4 tokens."""
    root = tmp_path_factory.mktemp("coreai-composite")
    ckpt = make_checkpoint(root / "ckpt", tokenizer=False, layers=LAYERS)
    texts: list[str] = []
    convert_program = convert.convert_program

    def recorded(*args, **kwargs):
        program = convert_program(*args, **kwargs)
        texts.append(str(program))
        return program

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(convert, "convert_program", recorded)
        out = export_checkpoint(ckpt, root / "out", "coreai", options=CoreaiOptions((4,)), include_tokenizer=False,
                                settings=ExportSettings(precision="fp32", state_dtype="float32")).folder
    return ckpt, out, texts


def test_composite_in_the_program_for_gated_deltanet_layers_only(mixed):
    _, _, (text,) = mixed
    assert DECLARED in text and "use_qk_l2_norm = false" in text
    # one call per Gated DeltaNet layer in each entry point (step, prefill_4); the GLA layer has none
    assert text.count(CALL) == 3 * 2


def test_gla_model_has_no_composite(tmp_path):
    model, _ = load_model(make_checkpoint(tmp_path / "gla", "gla", tokenizer=False, layers=("gla",)))
    request = convert.ConvertRequest((convert.EntryPoint("step", "step", 1),), "float32", None)
    text = str(convert.convert_program(model.eval(), request))
    assert "coreai.graph @step" in text and "gated_delta_update" not in text


@pytest.mark.parametrize("batch", [1, 2])
def test_composite_export_matches_the_torch_reference(mixed, batch):
    """Prompt of 7 tokens (one prefill piece of 4, three steps), then 4 steps, through Apple's runtime."""
    ckpt, folder, _ = mixed
    model, _ = load_model(ckpt)
    model.eval()
    rng = np.random.default_rng(batch)
    ids, steps = rng.integers(0, model.config.vocab_size, (batch, 7)), rng.integers(0, model.config.vocab_size,
                                                                                    (batch, 4))
    want_logits, want_state = reference_run(model, ids, steps)
    runner = CoreaiRunner(folder, Manifest.load(folder))
    got_logits, handle = runner_run(runner, ids, steps)
    assert 0 < np.abs(got_logits - want_logits).max() < TOL * max(1.0, np.abs(want_logits).max())
    for (name, got), want in zip(runner.read_state(handle).items(), want_state):
        assert np.abs(got - want).max() < TOL, name
