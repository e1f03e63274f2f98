"""Core AI weights (--quantize fp16|int8|int4 through coreai-opt): the export records its weights and quality
figures, replays through Apple's runtime, is smaller than the float32 export, and an int4 program runs as torch
does with the weights coreai-opt's quantiser computed (the int4 packing pitfall); a program that disagrees with
its own weights is refused. int4 in the fast tier; fp16, int8 and the float32 comparison in the slow one."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("coreai_opt")

from edgelin.artifact.manifest import Manifest  # noqa: E402
from edgelin.checkpoint import load_model  # noqa: E402
from edgelin.devices import ExportSettings  # noqa: E402
from edgelin.errors import EdgelinError  # noqa: E402
from edgelin.export.coreai.runner import CoreaiRunner  # noqa: E402
from edgelin.export.coreai.target import CoreaiOptions  # noqa: E402
from edgelin.export.coreai.weights import read_asset, verify  # noqa: E402
from edgelin.export.pipeline import export_checkpoint  # noqa: E402
from edgelin.replay import replay  # noqa: E402
from helpers import make_checkpoint  # noqa: E402

BLOCK = 32


def settings(quantize: str | None, block_size: int = BLOCK) -> ExportSettings:
    return ExportSettings(precision="fp32", state_dtype="float32", quantize=quantize, block_size=block_size)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("coreai-q") / "hybrid", "hybrid")


@pytest.fixture(scope="module")
def exported(ckpt, tmp_path_factory):
    """mode -> the export folder (each exported once per module, on first use)."""
    root, folders = tmp_path_factory.mktemp("coreai-q-out"), {}

    def get(mode: str) -> Path:
        if mode not in folders:
            folders[mode] = export_checkpoint(ckpt, root / mode, "coreai", options=CoreaiOptions((4,)),
                                              settings=settings(None if mode == "fp32" else mode)).folder
        return folders[mode]

    return get


def check_export(folder: Path, mode: str, bits: int) -> None:
    manifest = Manifest.load(folder)
    quantization = manifest.extra["quantization"]
    assert quantization["bits"] == bits and manifest.extra["precision"]["quantized_weights"] == mode
    assert "model.embed_tokens" in quantization["matrices"] and "model.layers.0.mlp.up_proj" in quantization["matrices"]
    gate = manifest.extra["quality"]  # the export's own quality gate ran on Apple's runtime
    assert gate["precision"] == mode and gate["passed"] and 0.9 <= gate["figures"]["top1"] <= 1.0
    report = replay(folder)
    assert report.passed, [m for m in report.metrics if not m.passed]
    assert report.precision == mode and report.reference_weights["unmatched_rows"] == 0
    worst = max(m.max_abs for m in report.metrics if m.check in ("prefill", "rollout"))
    assert 0 < worst < 1e-4  # against the export's own dequantised weights: float32 parity


def asset_bytes(folder: Path) -> int:
    return sum(f.stat().st_size for f in (folder / "model.aimodel").rglob("*") if f.is_file())


def test_int4_export_records_its_weights_and_replays(exported, ckpt):
    folder = exported("int4")
    check_export(folder, "int4", 4)
    model, _ = load_model(ckpt)
    # smaller than its float32 weights alone, which a float32 asset holds besides its program (the tiny model's
    # program is most of its asset; the slow tier compares with the float32 export itself)
    assert asset_bytes(folder) < 4 * sum(p.numel() for p in model.parameters())


def quantiser_weights(model, bits: int) -> dict[str, np.ndarray]:
    """What coreai-opt's quantiser itself computes for each 2-D weight ([1, BLOCK] blocks, asymmetric), dequantised:
    independent of the bytes the asset holds and of edgelin's reading of them."""
    from coreai_opt.coreai_utils import DType, QScheme
    from coreai_opt.coreai_utils._coreai_imports import compression_types
    from coreai_opt.coreai_utils._utils.quantize_utils import _compute_qparams_by_dtype

    found = {}
    for name, param in model.named_parameters():
        if param.ndim != 2 or param.shape[1] % BLOCK:
            continue
        weight = param.detach().numpy()
        codes, scale, zero = _compute_qparams_by_dtype(weight, compression_types.string_to_builtin({4: DType.INT4, 8: DType.INT8}[bits]),
                                                       QScheme.ASYMMETRIC, [1, BLOCK])
        wide = lambda a: np.repeat(a.astype(np.float32), BLOCK, axis=1)  # noqa: E731
        found[name] = (codes.astype(np.float32) - wide(zero)) * wide(scale)
    return found


def test_int4_runs_as_torch_with_the_quantisers_weights(exported, ckpt):
    model, _ = load_model(ckpt)
    model.eval()
    twin = load_model(ckpt)[0].eval()
    with torch.no_grad():
        for name, values in quantiser_weights(model, 4).items():
            twin.get_parameter(name).copy_(torch.from_numpy(values))
    folder = exported("int4")
    runner = CoreaiRunner(folder, Manifest.load(folder))
    ids = np.random.default_rng(1).integers(0, model.config.vocab_size, (1, 9))
    state = runner.new_state(1)
    got = [runner.prefill(ids[:, :4], state, np.zeros(1, np.int64))]
    got += [runner.step(ids[:, t], state, np.full(1, t, np.int64)) for t in range(4, 9)]
    with torch.no_grad():
        want = twin(torch.from_numpy(ids), None, torch.zeros(1, dtype=torch.long))[0].numpy()[0, 3:]
        fp32 = model(torch.from_numpy(ids), None, torch.zeros(1, dtype=torch.long))[0].numpy()[0, 3:]
    got = np.concatenate(got)
    scale = np.abs(want).max()
    assert np.abs(got - want).max() < 1e-4 * scale
    assert np.abs(got - fp32).max() > 1e-2 * scale  # int4 weights change the logits: a comparison that can fail


def test_a_program_that_disagrees_with_its_weights_is_refused(exported, ckpt):
    """The int4 pitfall simulated both ways: weights read as the model's float32 ones (within every half step, so
    they match, but not what the program holds: the runtime disagrees), and codes read with their nibbles
    swapped (every pair of codes exchanged: they match no weight)."""
    folder = exported("int4")
    model, _ = load_model(ckpt)
    manifest = Manifest.load(folder)
    tensors = read_asset(folder, "model.aimodel")
    verify(model, folder, manifest, tensors, 4)  # as written: agrees
    weights = [p.detach().numpy() for p in model.parameters() if p.ndim == 2]
    unrounded = [type(t)(t.name, next(w for w in weights if w.shape == t.rows.shape
                                      and (np.abs(w - t.rows) <= t.bound).all()), t.bound) for t in tensors]
    with pytest.raises(EdgelinError, match="disagrees with its own weights.*packing cannot be verified"):
        verify(model, folder, manifest, unrounded, 4)
    swapped = [type(t)(t.name, t.rows.reshape(t.rows.shape[0], -1, 2)[..., ::-1].reshape(t.rows.shape), t.bound)
               for t in tensors]
    with pytest.raises(EdgelinError, match="weights cannot be verified"):
        verify(model, folder, manifest, swapped, 4)


def test_a_block_size_no_weight_takes_is_refused_before_anything_is_written(ckpt, tmp_path):
    with pytest.raises(EdgelinError, match="--block-size 256"):
        export_checkpoint(ckpt, tmp_path / "out", "coreai", options=CoreaiOptions((4,)), settings=settings("int4", 256))
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
@pytest.mark.parametrize("mode, bits", [("fp16", 16), ("int8", 8)])
def test_fp16_and_int8_exports_record_their_weights_and_replay(exported, mode, bits):
    check_export(exported(mode), mode, bits)


@pytest.mark.slow
def test_compressed_assets_are_smaller_than_the_float32_export(exported):
    sizes = {mode: asset_bytes(exported(mode)) for mode in ("fp32", "fp16", "int8", "int4")}
    assert sizes["fp32"] > sizes["fp16"] > sizes["int8"] > sizes["int4"], sizes
