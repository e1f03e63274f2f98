"""Adding a target is one folder (issue 44): a toy target written outside edgelin, registered through a real
entry point (a `*.dist-info/entry_points.txt` on sys.path, as `pip install` leaves it), exports a tiny hybrid
checkpoint and validates it through the ordinary CLI, without a line of edgelin changed.

The toy writes the weights as one numpy .npz "graph" that both graphs of the manifest name, and its runner
steps the reference model (edgelin.model) on numpy state arrays: enough to run the whole contract (manifest,
reference vectors, state handles, validate's replay)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from cached_cli import GREEDY_ENV
from edgelin.reference import parity
from helpers import make_checkpoint

ROOT = Path(__file__).resolve().parents[2]

TOY = '''
"""A toy edgelin target: the model's weights in one .npz, run by the reference model on numpy state."""
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from edgelin.export.base import NumpyRunner, Phase, Target

WEIGHTS = "toy.npz"


@dataclass(frozen=True)
class ToyOptions:
    pass


class ToyTarget(Target):
    name = "toy"
    extra = "toy"
    options_type = ToyOptions
    precisions = ("fp32",)
    in_device_profiles = False
    runtime = "numpy"

    def can_export(self):
        return Phase(True)

    def can_run(self, device=None):
        return Phase(True)

    def export(self, model, device, settings, options, folder):
        import json

        np.savez(Path(folder) / WEIGHTS, **{k: v.detach().numpy() for k, v in model.state_dict().items()})
        (Path(folder) / "toy.json").write_text(json.dumps(model.config.to_dict()))
        return {"step": WEIGHTS, "prefill": WEIGHTS}

    def runner(self, artifact, device=None, threads=None):
        return ToyRunner(artifact.folder, artifact.manifest)


class ToyRunner(NumpyRunner):
    label = "numpy (the toy target)"

    def __init__(self, folder, manifest):
        import json

        import torch

        from edgelin.model.config import ModelConfig
        from edgelin.model.lm import CausalLM

        super().__init__(manifest)
        self.model = CausalLM(ModelConfig.from_dict(json.loads((Path(folder) / "toy.json").read_text()))).eval()
        with np.load(Path(folder) / WEIGHTS) as weights:
            self.model.load_state_dict({k: torch.from_numpy(weights[k]) for k in weights.files})
        self.layout = [(t.layer, t.state_name, t.name) for t in manifest.state_inputs]

    def _graph(self, kind, input_ids, state, position):
        import torch

        layers = self.model.initial_state(len(input_ids))
        for layer, name, key in self.layout:
            layers[layer][name] = torch.from_numpy(np.array(state[key]))
        start = None if position is None else torch.from_numpy(np.asarray(position, np.int64))
        with torch.no_grad():
            ids = torch.from_numpy(np.asarray(input_ids, np.int64)).view(len(input_ids), -1)
            logits, new = self.model(ids, layers, start, mode="recurrent" if kind == "step" else "chunked",
                                     last_only=True)
        return logits.float().numpy(), {key: new[layer][name].float().numpy() for layer, name, key in self.layout}
'''


@pytest.fixture(scope="module")
def plugin(tmp_path_factory) -> Path:
    """A folder on sys.path holding the toy target's package and the dist-info pip would write for it."""
    site = tmp_path_factory.mktemp("site")
    (site / "edgelin_toy").mkdir()
    (site / "edgelin_toy" / "__init__.py").write_text("")
    (site / "edgelin_toy" / "target.py").write_text(textwrap.dedent(TOY))
    info = site / "edgelin_toy-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: edgelin-toy\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[edgelin.targets]\ntoy = edgelin_toy.target:ToyTarget\n")
    return site


def test_the_registry_finds_the_toy_through_its_entry_point(plugin, monkeypatch):
    from edgelin.export.targets import builtin_targets, get_target, target_names

    assert "toy" not in target_names()
    monkeypatch.syspath_prepend(str(plugin))
    assert "toy" in target_names() and "toy" not in builtin_targets()
    target = get_target("toy")
    assert type(target).__module__ == "edgelin_toy.target" and target.name == "toy"


def edgelin(plugin: Path, *args: str) -> subprocess.CompletedProcess:
    """`edgelin ARGS` in a process of its own (tests/cached_cli.py: edgelin.cli.main), its export recording the
    greedy rollout this file's in-process exports record (tests/conftest.py: SHORT_GREEDY_STEPS)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(plugin)]), GREEDY_ENV: str(parity.GREEDY_STEPS)}
    return subprocess.run([sys.executable, str(ROOT / "tests" / "cached_cli.py"), *args], capture_output=True,
                          text=True, env=env, cwd=ROOT, timeout=900)


def test_the_toy_target_exports_and_validates_through_the_cli(plugin, tmp_path):
    # a tiny hybrid in the real checkpoint format (the toy runner steps the reference model token by token in
    # Python: the shipped model's 512-step reference rollout took minutes on the 2-core CI machine)
    model = make_checkpoint(tmp_path / "ckpt", "hybrid")
    out = tmp_path / "toy-export"
    exported = edgelin(plugin, "export", "toy", str(model), "--out", str(out), "--json")
    assert exported.returncode == 0, exported.stderr
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["target"] == "toy" and {g["file"] for g in manifest["graphs"].values()} == {"toy.npz"}
    validated = edgelin(plugin, "validate", str(out))
    assert validated.returncode == 0, validated.stdout + validated.stderr
    assert "checks passed" in validated.stdout and "runner: numpy (the toy target)" in validated.stdout
    # a target the registry does not know is one line with its closest name, the plug-in's among them
    unknown = edgelin(plugin, "export", "tox", str(model), "--out", str(tmp_path / "x"))
    assert unknown.returncode == 2 and "unknown target 'tox' (closest: 'toy')" in unknown.stderr
