"""The parity reference built in the export's own model (edgelin.reference.parity.with_dequantized, in_place; issue
46): the same reference as the copy, the model itself becomes it, and each float weight it replaces takes the
dequantised values in its own storage, no second tensor beside it (a 0.75 B model's reference otherwise holds a
second 3 GB of weights; a whole unpacked table 1 GB)."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

from edgelin.artifact.manifest import Manifest
from edgelin.checkpoint import load_model
from edgelin.reference.parity import parity_reference


@pytest.fixture(scope="module")
def int4_export(tmp_path_factory):
    from edgelin.devices import export_settings
    from edgelin.export.pipeline import export_checkpoint
    from helpers import make_checkpoint

    root = tmp_path_factory.mktemp("in-place")
    # tests/artifact/test_dequantized.py's checkpoint: its graphs are traced once in a test run (tests/graph_cache.py)
    ckpt = make_checkpoint(root / "ckpt", tokenizer=False, layers=("linear_attn",), hidden_size=48)
    folder = export_checkpoint(ckpt, root / "int4", settings=export_settings(None, "onnx", None, "int4")).folder
    return ckpt, folder


def test_in_place_reference_equals_the_copy_and_lets_the_float_weights_go(int4_export):
    ckpt, folder = int4_export
    manifest = Manifest.load(folder)
    copy_twin, copy_account = parity_reference(load_model(ckpt)[0], folder, manifest)

    model = load_model(ckpt)[0]
    floats = {name: weakref.ref(p) for name, p in model.named_parameters() if p.ndim == 2}
    storage = {name: p.data_ptr() for name, p in model.named_parameters() if p.ndim == 2}
    twin, account = parity_reference(model, folder, manifest, in_place=True)
    assert twin is model and account == copy_account and account.complete
    # (its table is 1.5 blocks wide: the tied head is untied, given its own dequantised weight, and the table stays float)
    assert set(account.replaced) - set(floats) == {"lm_head.weight"} and "model.embed_tokens.weight" in floats
    replaced = [name for name in account.replaced if name in floats]
    assert len(replaced) >= 4
    want, got = copy_twin.state_dict(), twin.state_dict()
    assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)
    gc.collect()
    params = dict(twin.named_parameters())
    # each replaced float weight holds its dequantised values itself (the same tensor, the same storage): no float
    # copy is held beside them; the untied head's own weight is the one new tensor
    moved = [name for name in replaced if floats[name]() is not params[name] or params[name].data_ptr() != storage[name]]
    assert not moved, moved
    assert params["lm_head.weight"].data_ptr() not in storage.values()
    kept = [name for name in floats if name not in account.replaced]
    assert all(floats[name]() is params[name] for name in kept)  # what stayed float is still the model's
