"""The export's quality gate (`export --precision fp16`, `--quantize`): the freshly written artifact measured
against the fp32 reference's figures, refused past the precision's bounds unless --force (README,
"validate: quality figures"). Export side: it runs the target's runner on the export's temp folder.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from edgelin.artifact import reference_vectors
from edgelin.artifact.baselines import BASELINE_SOURCE
from edgelin.artifact.quality import GENTLER, GateResult, evaluate, resolve_bounds
from edgelin.errors import EdgelinError
from edgelin.quality import measure
from edgelin.reference.parity import reference_quality

if TYPE_CHECKING:
    from edgelin.artifact.manifest import Manifest
    from edgelin.devices import ExportSettings
    from edgelin.model.lm import CausalLM


def check_export_quality(model: "CausalLM", folder: Path, manifest: "Manifest",
                         settings: "ExportSettings") -> GateResult | None:
    """The export's quality gate, for fp16 and quantised exports (None for fp32: nothing to check).

    Runs the freshly written artifact in `folder` (the export's temp folder) against the fp32
    reference figures that reference_vectors.record has just written there (computed from `model`,
    which is only re-run if they are absent) and refuses the export with the figures unless
    `settings.force`. A target that cannot run on this machine (Core ML off macOS) is not measured:
    `validate` measures it on the device; nor is the `--baseline kv` model (random weights)."""
    from edgelin.export.base import Artifact
    from edgelin.export.targets import get_target

    key = settings.quantize or settings.precision
    if key == "fp32" or manifest.source.get("path") == BASELINE_SOURCE["path"]:
        return None  # fp32: the logit threshold is the check; a random-weight latency baseline has no quality
    target = get_target(manifest.target)
    if not target.can_run(None).ok:
        return None
    reference = reference_vectors.read_quality(Path(folder) / reference_vectors.REFERENCE_FILE, manifest.vocab_size)
    if reference is None:
        reference = reference_quality(model, manifest.vocab_size)
    files = {kind: entry.file for kind, entry in manifest.graphs.items()}
    runner = target.runner(Artifact(Path(folder), manifest, files), None, settings.threads or None)
    figures = measure(runner, reference)
    result = GateResult(key, figures, tuple(evaluate(figures, resolve_bounds(key))))
    if not result.passed and not settings.force:
        failed = "; ".join(c.describe() for c in result.checks if not c.passed)
        raise EdgelinError(f"the {key} export fails its quality check", f"{failed} (the bound), measured against the "
                           f"fp32 reference on {figures.source}",
                           f"pass --force to export anyway (validate will report the same figures), or export "
                           f"with a gentler precision ({GENTLER.get(key, '--precision fp32')})")
    return result
