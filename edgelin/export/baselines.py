"""The baselines exported next to a model (`edgelin export ... --baseline kv`): the model built (torch) and
exported with the same target and settings. The format (names, folders, the manifest entry) and its
reading are edgelin/artifact/baselines.py's.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

# check_names, BASELINE_SOURCE and MANIFEST_KEY: the export pipeline reads them through this module.
from edgelin.artifact.baselines import BASELINES, check_names

if TYPE_CHECKING:
    from edgelin.model.lm import CausalLM


def kv_baseline_model(model: "CausalLM") -> "CausalLM":
    """A same-size softmax-attention LM with a growing KV cache, seeded random weights."""
    import torch

    from edgelin.model.config import AttentionConfig
    from edgelin.model.lm import CausalLM

    config = model.config
    heads = config.num_heads
    baseline = config.replace(
        layer_types=("softmax",) * config.num_layers, family_overrides={},
        attention=AttentionConfig(heads, heads, config.head_v_dim, window=None),
    )
    with torch.random.fork_rng(devices=[]):  # the caller's random stream stays as it was
        torch.manual_seed(0)
        return CausalLM(baseline).eval()


def export_baselines(model: "CausalLM", folder: Path, names: Sequence[str],
                     export: Callable[["CausalLM", Path], object]) -> dict[str, str]:
    """Export each named baseline of `model` into `folder/<its folder>` through `export(model, out)`
    (the caller's export_model with the same target and settings); returns {name: folder name}."""
    check_names(names)
    written = {}
    for name in dict.fromkeys(names):
        export(kv_baseline_model(model), Path(folder) / BASELINES[name])
        written[name] = BASELINES[name]
    return written
