"""A scripted hostile pass: the real CLI, as a subprocess, over a table of bad inputs.

Each case gets a sandbox folder holding copies of what it needs (a checkpoint, an export, a recipe),
runs one `edgelin` command in it and must:
  - exit with the expected code (2 for bad input, 1 for a failed validation),
  - print exactly one `error: WHAT: WHY. Fix: FIX` line on stderr (warnings aside), no traceback,
  - leave the sandbox exactly as it was (nothing deleted, changed or left behind: no partial folder,
    no lock), unless the case says which new path it may create.
The commands run concurrently (they are independent processes) so the table costs about
its longest member, not the sum.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import stat
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import pytest

from helpers import make_checkpoint

ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Case:
    id: str
    setup: Callable[[Path, "Assets"], list[str]]  # builds the sandbox, returns the CLI arguments
    code: int = 2
    needles: tuple[str, ...] = ()  # words the error line must contain (case-insensitive)
    may_create: tuple[str, ...] = ()  # sandbox-relative paths a successful run may add
    env: Callable[[Path], dict[str, str]] | None = None  # extra environment for the command, from the sandbox


@dataclass
class Outcome:
    code: int
    stdout: str
    stderr: str
    before: dict[str, str]
    after: dict[str, str]
    sandbox: Path
    created: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class Assets:
    ckpt: Path
    export: Path
    recipe: Path


# ---- sandbox helpers -----------------------------------------------------------------------------
def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _edit_config(ckpt: Path, **changes) -> None:
    data = json.loads((ckpt / "config.json").read_text())
    for key, value in changes.items():
        if "." in key:
            outer, inner = key.split(".")
            data[outer][inner] = value
        else:
            data[key] = value
    (ckpt / "config.json").write_text(json.dumps(data))


def _bad_config(**changes) -> Callable[[Path, Assets], list[str]]:
    def setup(box: Path, a: Assets) -> list[str]:
        ckpt = _copy(a.ckpt, box / "ckpt")
        _edit_config(ckpt, **changes)
        return ["export", str(ckpt), "--out", str(box / "out")]

    return setup


def _bad_config_inspect(**changes) -> Callable[[Path, Assets], list[str]]:
    def setup(box: Path, a: Assets) -> list[str]:
        ckpt = _copy(a.ckpt, box / "ckpt")
        _edit_config(ckpt, **changes)
        return ["inspect", str(ckpt)]

    return setup


def _int_weight(box: Path, a: Assets) -> list[str]:
    from safetensors.torch import load_file, save_file

    ckpt = _copy(a.ckpt, box / "ckpt")
    tensors = load_file(str(ckpt / "model.safetensors"))
    name = sorted(k for k in tensors if k.endswith("weight"))[0]
    tensors[name] = tensors[name].to(__import__("torch").int32)
    save_file(tensors, str(ckpt / "model.safetensors"), metadata={"format": "pt"})
    return ["export", str(ckpt), "--out", str(box / "out")]


def _corrupt_tokenizer(box: Path, a: Assets) -> list[str]:
    ckpt = _copy(a.ckpt, box / "ckpt")
    (ckpt / "tokenizer.json").write_text('{"version": "1.0", "model": {"type": "BPE", "vocab": ')
    return ["export", str(ckpt), "--out", str(box / "out")]


def _edited_manifest(command: str) -> Callable[[Path, Assets], list[str]]:
    def setup(box: Path, a: Assets) -> list[str]:
        out = _copy(a.export, box / "out")
        data = json.loads((out / "manifest.json").read_text())
        data["state"][0]["dims"][1] = data["state"][0]["dims"][1] + 1
        (out / "manifest.json").write_text(json.dumps(data))
        extra = {"validate": [], "generate": ["--prompt", "def", "-n", "4"],
                 "bench": ["--positions", "1", "--iters", "2", "--warmup", "0", "--prefill-tokens", "0"]}[command]
        return [command, str(out), *extra]

    return setup


def _truncated_graph(box: Path, a: Assets) -> list[str]:
    out = _copy(a.export, box / "out")
    data = (out / "step.onnx").read_bytes()
    (out / "step.onnx").write_bytes(data[: len(data) // 3])
    return ["validate", str(out)]


def _export_args(out: Callable[[Path, Assets], Path], *extra: str) -> Callable[[Path, Assets], list[str]]:
    def setup(box: Path, a: Assets) -> list[str]:
        ckpt = _copy(a.ckpt, box / "ckpt")
        return ["export", str(ckpt), "--out", str(out(box, a)), *extra]

    return setup


def _foreign_folder(box: Path, a: Assets) -> Path:
    folder = box / "photos"
    folder.mkdir()
    (folder / "holiday.jpg").write_bytes(b"\xff\xd8 not really a jpeg")
    return folder


def _own_export_plus_foreign_file(box: Path, a: Assets) -> Path:
    out = _copy(a.export, box / "out")
    (out / "notes.txt").write_text("the user's own notes, kept next to the export")
    return out


def _below_file(box: Path, a: Assets) -> Path:
    (box / "afile").write_text("a regular file")
    return box / "afile" / "out"


def _dot_with_force(box: Path, a: Assets) -> list[str]:
    ckpt = _copy(a.ckpt, box / "ckpt")
    (box / "thesis.tex").write_text("\\documentclass{article}")
    return ["export", str(ckpt), "--out", ".", "--force"]  # cwd is the sandbox


def _on_export(*args: str) -> Callable[[Path, Assets], list[str]]:
    def setup(box: Path, a: Assets) -> list[str]:
        out = _copy(a.export, box / "out")
        return [args[0], str(out), *args[1:]]

    return setup


def _train_over_existing(force: bool) -> Callable[[Path, Assets], list[str]]:
    def setup(box: Path, a: Assets) -> list[str]:
        recipe = _copy(a.recipe, box / "recipe")
        target = _copy(a.ckpt, box / "trained")  # an existing checkpoint the user cares about
        return ["train", str(recipe / "recipe.toml"), "--out", str(target), "--steps", "1",
                *(["--force"] if force else [])]

    return setup


def _train_default_out(box: Path, a: Assets) -> list[str]:
    _copy(a.ckpt, box / "recipe")  # the recipe's folder holds a trained checkpoint (like the shipped one)
    shutil.copyfile(a.recipe / "recipe.toml", box / "recipe" / "recipe.toml")
    return ["train", str(box / "recipe" / "recipe.toml"), "--steps", "1"]


# ---- issue 51's surfaces: what edgelin loads (weights, its kernel cache), report inputs, serving configs ----------
def _flipped_weights(command: str) -> Callable[[Path, Assets], list[str]]:
    def setup(box: Path, a: Assets) -> list[str]:
        out = _copy(a.export, box / "out")
        weights = bytearray((out / "weights.bin").read_bytes())
        for i in range(64, len(weights), max(1, len(weights) // 51)):  # ~51 bytes, each one bit flipped
            weights[i] ^= 0x10
        (out / "weights.bin").write_bytes(bytes(weights))
        extra = {"validate": [], "generate": ["--prompt", "def", "-n", "4"],
                 "bench": ["--positions", "1", "--iters", "2", "--warmup", "0", "--prefill-tokens", "0"]}[command]
        return [command, str(out), *extra]

    return setup


def _tampered_kernel_cache(box: Path, a: Assets) -> list[str]:
    """The cached CPU kernel library replaced by one whose constructor writes box/ran-planted-code: validate must
    not load it (no marker) and still pass, on ONNX Runtime's own kernels."""
    from edgelin import ortops

    xdg = box / "xdg"
    xdg.mkdir()
    saved = os.environ.get("XDG_CACHE_HOME")
    os.environ["XDG_CACHE_HOME"] = str(xdg)
    try:
        library = ortops.build()
    finally:
        os.environ.pop("XDG_CACHE_HOME") if saved is None else os.environ.__setitem__("XDG_CACHE_HOME", saved)
    source = box / "planted.c"
    source.write_text('#include <stdio.h>\n__attribute__((constructor)) static void planted(void) {\n'
                      f'  FILE* f = fopen("{box / "ran-planted-code"}", "w"); if (f) fclose(f);\n}}\n')
    subprocess.run(["cc", "-shared", "-fPIC", "-o", str(library), str(source)], check=True)
    source.unlink()
    return ["validate", str(_copy(a.export, box / "out"))]


def _report_input(make: Callable[[Path], None]) -> Callable[[Path, Assets], list[str]]:
    def setup(box: Path, a: Assets) -> list[str]:
        make(box / "results.json")
        return ["report", str(box / "results.json"), "--out", str(box / "report")]

    return setup


def _sparse(path: Path) -> None:
    with open(path, "wb") as fh:
        fh.truncate(1 << 30)  # 1 GiB that costs no disk: refused by its size before a byte is read


def _serving_profile(box: Path, a: Assets) -> list[str]:
    ckpt = _copy(a.ckpt, box / "ckpt")
    (box / "profiles").mkdir()
    (box / "profiles" / "big-server.toml").write_text(
        'title = "A server with limits Triton cannot hold"\nkind = "desktop"\ntargets = ["onnx"]\ncompute = "cpu"\n'
        'precision = "fp32"\nstate_dtype = "float32"\nmemory_gib = 16\nthreads = 0\n\n[serving]\n'
        "max_batch_size = 4294967296\nmax_candidate_sequences = 4294967296\n")
    return ["export", str(ckpt), "--out", str(box / "out"), "--serve", "triton", "--device", "big-server"]


CASES = [
    # -- data loss -------------------------------------------------------------------------------
    Case("export-out-is-the-checkpoint", _export_args(lambda box, a: box / "ckpt", "--force")),
    Case("export-out-is-the-checkpoint-parent", _export_args(lambda box, a: box, "--force")),
    Case("export-out-inside-the-checkpoint", _export_args(lambda box, a: box / "ckpt" / "export", "--force")),
    Case("export-force-over-a-foreign-folder", _export_args(_foreign_folder, "--force")),
    Case("export-force-over-an-export-with-a-user-file", _export_args(_own_export_plus_foreign_file, "--force")),
    Case("export-without-force-over-an-export", _export_args(lambda box, a: _copy(a.export, box / "out"))),
    Case("export-out-dot-with-force", _dot_with_force),
    Case("export-out-below-a-regular-file", _export_args(_below_file)),
    Case("train-over-an-existing-checkpoint", _train_over_existing(force=False)),
    # -- input validation ------------------------------------------------------------------------
    Case("config-negative-heads", _bad_config(num_heads=-2), needles=("num_heads",)),
    Case("config-zero-hidden", _bad_config(hidden_size=0), needles=("hidden_size",)),
    Case("config-vocab-string", _bad_config(vocab_size="300"), needles=("vocab_size",)),
    Case("config-vocab-float", _bad_config(vocab_size=300.5), needles=("vocab_size",)),
    Case("config-layers-disagree", _bad_config(num_hidden_layers=7), needles=("num_hidden_layers",)),
    Case("config-eps-string", _bad_config(rms_norm_eps="1e-6"), needles=("rms_norm_eps",)),
    Case("config-window-zero", _bad_config(**{"attention.window": 0}), needles=("window",)),
    Case("inspect-config-window-zero", _bad_config_inspect(**{"attention.window": 0}), needles=("window",)),
    Case("inspect-config-negative-heads", _bad_config_inspect(num_heads=-2), needles=("num_heads",)),
    Case("weights-int32", _int_weight, needles=("int32",)),
    Case("tokenizer-corrupt", _corrupt_tokenizer, needles=("tokenizer",)),
    Case("manifest-state-dims-validate", _edited_manifest("validate")),
    Case("manifest-state-dims-generate", _edited_manifest("generate")),
    Case("manifest-state-dims-bench", _edited_manifest("bench")),
    Case("graph-truncated", _truncated_graph),
    # -- numeric options -------------------------------------------------------------------------
    Case("bench-huge-position", _on_export("bench", "--positions", "1099511627776", "--iters", "2")),
    Case("bench-negative-prefill-tokens", _on_export("bench", "--prefill-tokens", "-10", "--iters", "2")),
    Case("validate-rtol-zero", _on_export("validate", "--rtol", "0")),
    Case("validate-rtol-nan", _on_export("validate", "--rtol", "nan")),
    Case("validate-rtol-inf", _on_export("validate", "--rtol", "inf")),
    Case("bench-negative-warmup", _on_export("bench", "--warmup", "-1")),
    Case("bench-negative-threads", _on_export("bench", "--threads", "-1")),
    Case("generate-negative-n", _on_export("generate", "--prompt", "def", "-n", "-1")),
    Case("validate-impossible-threshold", _on_export("validate", "--rtol", "1e-30"), code=1),
    # -- what edgelin loads, report inputs, serving configs (issue 51) -----------------------------
    Case("validate-flipped-weight-bits", _flipped_weights("validate"), needles=("weights.bin", "sha256")),
    Case("generate-flipped-weight-bits", _flipped_weights("generate"), needles=("weights.bin", "sha256")),
    Case("bench-flipped-weight-bits", _flipped_weights("bench"), needles=("weights.bin", "sha256")),
    Case("report-fifo", _report_input(lambda p: os.mkfifo(p)), needles=("results.json", "fifo")),
    Case("report-sparse-1gib", _report_input(_sparse), needles=("results.json",)),
    Case("report-nan-threshold", _report_input(lambda p: p.write_text('{"format": "edgelin-result", '
                                                                      '"threshold": "x"}')),
         needles=("results.json",)),
    Case("export-serve-triton-limits-triton-cannot-hold", _serving_profile, needles=("max_batch_size",),
         env=lambda box: {"EDGELIN_DEVICES": str(box / "profiles")}),
    # -- must succeed, and touch nothing it was not asked to ---------------------------------------
    Case("validate-never-loads-a-tampered-kernel-cache", _tampered_kernel_cache, code=0, may_create=("xdg",),
         env=lambda box: {"XDG_CACHE_HOME": str(box / "xdg")}),
    Case("train-default-out-never-touches-the-recipe-folder", _train_default_out, code=0, may_create=("runs",)),
]


def _snapshot(folder: Path) -> dict[str, str]:
    """Every path below folder -> content hash (files) or 'dir'."""
    found = {}
    for path in sorted(folder.rglob("*")):
        rel = str(path.relative_to(folder))
        mode = path.lstat().st_mode
        if stat.S_ISREG(mode):
            with open(path, "rb") as fh:  # streamed: a case's 1 GiB sparse file
                found[rel] = hashlib.file_digest(fh, "sha256").hexdigest()
        else:  # never opened: a FIFO would block
            found[rel] = "dir" if stat.S_ISDIR(mode) else f"mode {stat.S_IFMT(mode):o}"
    return found


def _run_case(case: Case, box: Path, assets: Assets, cache: Path) -> Outcome:
    box.mkdir()
    args = case.setup(box, assets)
    before = _snapshot(box)
    # The trainer's corpus cache lives outside the sandboxes (shared, so the corpus is built once).
    env = {**os.environ, "COLUMNS": "80", "PYTHONPATH": str(ROOT), "EDGELIN_CACHE": str(cache),
           **(case.env(box) if case.env else {})}
    env.pop("EDGELIN_DEBUG", None)
    proc = subprocess.run([sys.executable, "-m", "edgelin.cli", *args], cwd=box, env=env, capture_output=True,
                          text=True, timeout=600, stdin=subprocess.DEVNULL)
    after = _snapshot(box)
    created = sorted(set(after) - set(before))
    return Outcome(proc.returncode, proc.stdout, proc.stderr, before, after, box, created)


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory) -> dict[str, Outcome]:
    from edgelin.export.pipeline import export_checkpoint

    root = tmp_path_factory.mktemp("hostile")
    (root / "assets").mkdir()
    ckpt = make_checkpoint(root / "assets" / "ckpt", "hybrid")
    export = export_checkpoint(ckpt, root / "assets" / "export").folder
    recipe = root / "assets" / "recipe"
    recipe.mkdir()
    from helpers import TINY

    (recipe / "recipe.toml").write_text(TINY.replace("max_bytes = 200_000", "max_bytes = 60_000"))
    assets = Assets(ckpt, export, recipe)
    with ThreadPoolExecutor(max_workers=4) as pool:
        futures = {c.id: pool.submit(_run_case, c, root / c.id, assets, root / "cache") for c in CASES}
        return {name: f.result() for name, f in futures.items()}


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_hostile_input(outcomes, case: Case):
    got = outcomes[case.id]
    context = f"exit {got.code}\nstdout:\n{got.stdout[-2000:]}\nstderr:\n{got.stderr[-2000:]}"
    assert got.code == case.code, context
    assert "Traceback" not in got.stderr + got.stdout, context
    if case.code != 0:
        # Besides the one error line, stderr may hold only warnings and plain progress lines.
        lines = [line for line in got.stderr.splitlines() if line.strip()]
        errors = [line for line in lines if line.startswith("error:")]
        others = [line for line in lines if not line.startswith(("error:", "warning:", "progress:"))]
        assert len(errors) == 1 and not others, context
        line = errors[0]
        assert line.startswith("error: ") and ". Fix: " in line, context
        assert "internal error" not in line, context
        for needle in case.needles:
            assert needle.lower() in line.lower(), (needle, context)
    # Nothing the user had is gone or changed; nothing is left behind but what the case allows.
    changed = sorted(p for p in got.before if got.after.get(p) != got.before[p])
    assert not changed, (changed, context)
    leftovers = [p for p in got.created if not p.startswith(case.may_create or ("\0",))]
    assert not leftovers, (leftovers, context)
    if case.may_create:
        assert any(p.startswith(case.may_create) for p in got.created), context
