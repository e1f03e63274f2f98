"""Output folders of `export` and `train` never lose a user's data: --out may not touch the source,
--force only replaces what edgelin wrote, one writer per folder, leftovers of killed runs are cleaned,
and filesystem faults are one line with exit 2 (edgelin/outputs.py)."""

from __future__ import annotations

import errno
import hashlib
import contextlib
import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import torch

from edgelin.export.onnx import target as onnx_target
from edgelin.outputs import EXPORT, claim_output
from edgelin.reference import parity
from helpers import make_checkpoint
from test_cli import run
from helpers import TINY

FAKE_GRAPH = b"not a real graph"  # the folder handling is under test here, not the graphs


def refused(result, *needles: str, code: int = 2) -> None:
    """Exit 2, no traceback, and exactly one `error: WHAT: WHY. Fix: FIX` line holding every needle."""
    assert result.exit_code == code, (result.exit_code, result.output)
    assert "Traceback" not in result.output
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "Fix:" in errors[0], result.stderr
    for needle in needles:
        assert needle in errors[0], (needle, errors[0])


def tree_hashes(folder: Path) -> dict[str, str]:
    """Every file below `folder` (relative path -> sha256): equal before and after = untouched."""
    return {p.relative_to(folder).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def leftovers(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if ".edgelin-" in p.name or p.name.endswith(".lock"))


def dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()  # reaped: its pid names no process now
    return proc.pid


@pytest.fixture
def fast_graphs(monkeypatch):
    """Replace the ONNX tracer with a file write: an export then takes milliseconds."""
    monkeypatch.setattr(onnx_target, "export_onnx_graph", lambda *a: Path(a[4]).write_bytes(FAKE_GRAPH))
    monkeypatch.setattr(onnx_target, "finish_graphs", lambda *a, **k: {})  # no weights file to share out of fakes


@pytest.fixture
def ckpt(tmp_path):
    return make_checkpoint(tmp_path / "models" / "ckpt", "gla", tokenizer=False)


# ---- 1. --out vs the source checkpoint ------------------------------------------------------------
@pytest.mark.parametrize("where, relation", [
    (lambda ck: ck, "is the source"),
    (lambda ck: ck.parent, "contains the source"),
    (lambda ck: ck / "onnx", "is inside the source"),
    (lambda ck: ck / ".." / ck.name, "is the source"),  # the same folder spelt another way
], ids=["equal", "parent", "inside", "equal-via-dotdot"])
def test_out_touching_the_source_is_refused(ckpt, fast_graphs, where, relation):
    (ckpt.parent / "other-model.txt").write_text("the user's")
    before = tree_hashes(ckpt.parent)
    for force in ((), ("--force",)):
        refused(run("export", ckpt, "--out", where(ckpt), *force), relation, "Fix:")
    assert tree_hashes(ckpt.parent) == before and not (ckpt / "onnx").exists()


def test_out_through_a_symlink_to_the_source_is_refused(ckpt, fast_graphs, tmp_path):
    (tmp_path / "link").symlink_to(ckpt, target_is_directory=True)
    before = tree_hashes(ckpt)
    refused(run("export", ckpt, "--out", tmp_path / "link", "--force"), "is the source")
    assert tree_hashes(ckpt) == before


# ---- --force replaces only our own export ---------------------------------------------------------
def test_force_over_a_foreign_folder_is_refused(ckpt, fast_graphs, tmp_path):
    out = tmp_path / "photos"
    out.mkdir()
    (out / "holiday.jpg").write_bytes(b"\xff\xd8 the user's")
    (out / "album").mkdir()
    before = tree_hashes(out)
    refused(run("export", ckpt, "--out", out, "--force"), "will not replace", "album, holiday.jpg",
                         "no manifest.json")
    assert tree_hashes(out) == before and (out / "album").is_dir() and leftovers(tmp_path) == []


def test_force_over_our_export_with_a_foreign_file_is_refused(ckpt, fast_graphs, tmp_path):
    out = tmp_path / "out"
    assert run("export", ckpt, "--out", out).exit_code == 0
    (out / "notes.md").write_text("my notes")
    before = tree_hashes(out)
    refused(run("export", ckpt, "--out", out, "--force"), "will not replace", "notes.md")
    assert tree_hashes(out) == before


def test_manifest_lists_every_file_written(fast_graphs, tmp_path):
    ckpt = make_checkpoint(tmp_path / "ckpt", "gla", tokenizer=True)  # its tokenizer is copied too
    result = run("export", ckpt, "--out", tmp_path / "out")
    assert result.exit_code == 0, result.output
    manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert manifest["files"] == ["manifest.json", "prefill.onnx", "reference.npz", "step.onnx", "tokenizer.json"]
    assert sorted(os.listdir(tmp_path / "out")) == manifest["files"]


def test_force_replaces_our_own_export(ckpt, fast_graphs, tmp_path):
    out = tmp_path / "out"
    assert run("export", ckpt, "--out", out).exit_code == 0
    (out / "step.onnx").write_bytes(b"the previous export")
    result = run("export", ckpt, "--out", out, "--force")
    assert result.exit_code == 0, result.output
    assert (out / "step.onnx").read_bytes() == FAKE_GRAPH  # the new export is in place
    assert sorted(os.listdir(out)) == ["manifest.json", "prefill.onnx", "reference.npz", "step.onnx"]
    assert leftovers(tmp_path) == []


@pytest.fixture
def fast_serving(monkeypatch):
    """The Triton repository's model.onnx as a file write (fast_graphs' fakes are no ONNX to add inputs to)."""
    from edgelin.serve import triton

    def serving_graph(step: Path, out: Path, *args) -> list[str]:
        out.write_bytes(FAKE_GRAPH)
        return []

    monkeypatch.setattr(triton, "serving_graph", serving_graph)


def test_force_replaces_our_own_export_with_a_triton_repository(ckpt, fast_graphs, fast_serving, tmp_path):
    from edgelin.artifact.manifest import Manifest

    out = tmp_path / "out"
    assert run("export", ckpt, "--out", out, "--serve", "triton").exit_code == 0
    files = json.loads((out / "manifest.json").read_text())["files"]
    assert files == sorted(tree_hashes(out)) and {"triton/ckpt/config.pbtxt", "triton/client.py"} <= set(files)
    assert Manifest.load(out).files == tuple(files)  # paths inside its folders load (validate, bench, generate)
    (out / "triton" / "ckpt" / "config.pbtxt").write_text("edited, still ours")
    result = run("export", ckpt, "--out", out, "--force", "--serve", "triton")
    assert result.exit_code == 0, result.output  # was: "edgelin did not write triton"
    assert (out / "triton" / "ckpt" / "config.pbtxt").read_text().startswith('name: "ckpt"')
    # a file of the user's inside triton/, a folder of theirs there, a link out of it: refused, all kept
    theirs = out / "triton" / "ckpt"

    def relink(path: Path, to: Path) -> None:
        path.unlink()
        path.symlink_to(to)

    for add, undo in ((lambda: (theirs / "notes.md").write_text("mine"), lambda: (theirs / "notes.md").unlink()),
                      (lambda: (theirs / "mine").mkdir(), lambda: (theirs / "mine").rmdir()),
                      (lambda: relink(theirs / "1" / "model.py", ckpt / "config.json"),  # a listed name, a link out
                       lambda: (theirs / "1" / "model.py").unlink())):
        add()
        before = tree_hashes(out)
        refused(run("export", ckpt, "--out", out, "--force", "--serve", "triton"), "will not replace",
                "edgelin did not write triton")
        assert tree_hashes(out) == before and leftovers(tmp_path) == []
        undo()


@pytest.mark.parametrize("listed", [["../outside.txt"], ["model.mlpackage/../notes.md"], ["/tmp/x"]])
def test_a_files_entry_outside_the_folder_owns_nothing_and_does_not_load(tmp_path, listed):
    from edgelin.errors import EdgelinError
    from edgelin.outputs import check_output

    out = tmp_path / "out"
    (out / "model.mlpackage").mkdir(parents=True)
    (out / "model.mlpackage" / "Manifest.json").write_text("{}")
    (out / "notes.md").write_text("mine")
    (out / "manifest.json").write_text(json.dumps({"format": "edgelin-export", "files": ["manifest.json", *listed]}))
    with pytest.raises(EdgelinError, match="edgelin did not write model.mlpackage, notes.md"):
        check_output(out, True, EXPORT)
    with pytest.raises(EdgelinError, match="escapes the export folder"):
        _load_with_files(tmp_path, listed)


def _load_with_files(tmp_path: Path, listed: list[str]):
    """Manifest.load of a valid manifest whose `files` is `listed`."""
    from conftest import family_layers, tiny_config
    from edgelin.artifact.manifest import Manifest
    from edgelin.export.pipeline import build_manifest
    from edgelin.model.lm import CausalLM

    folder = tmp_path / "loaded"
    folder.mkdir()
    manifest = build_manifest(CausalLM(tiny_config(family_layers("gla"))), "onnx", "fp32",
                              {"step": "step.onnx", "prefill": "prefill.onnx"}, {"path": "ckpt"}, None)
    data = {**manifest.to_dict(), "files": ["manifest.json", *listed]}
    (folder / "manifest.json").write_text(json.dumps(data))
    return Manifest.load(folder)


def test_force_replaces_a_core_ml_package_whose_every_file_is_listed(tmp_path):
    """Core ML's model.mlpackage is a folder: its files listed by path make it ours (outputs.py, no export run)."""
    from edgelin.errors import EdgelinError
    from edgelin.outputs import check_output

    out = tmp_path / "out"
    package = ["model.mlpackage/Manifest.json", "model.mlpackage/Data/com.apple.CoreML/model.mlmodel"]
    for name in package:
        (out / name).parent.mkdir(parents=True, exist_ok=True)
        (out / name).write_text("package")
    (out / "manifest.json").write_text(json.dumps({"format": "edgelin-export", "files": ["manifest.json", *package]}))
    assert check_output(out, True, EXPORT) == out.resolve()  # was: "edgelin did not write model.mlpackage"
    (out / "model.mlpackage" / "Data" / "weights.bin").write_text("the user's")
    with pytest.raises(EdgelinError, match="edgelin did not write model.mlpackage"):
        check_output(out, True, EXPORT)


def test_force_replaces_a_target_folder_that_a_later_build_added_to(tmp_path):
    """tensorrt/: its files listed by path at export, then `edgelin build` adds some, recorded in the folder's own
    .edgelin-files.json (outputs.record_written): still ours, unless a file of the user's is in it too."""
    from edgelin.errors import EdgelinError
    from edgelin.outputs import check_output, record_written

    out = tmp_path / "out"
    (out / "tensorrt").mkdir(parents=True)
    (out / "tensorrt" / "COMMANDS.md").write_text("exported")
    record_written(out / "tensorrt", ["COMMANDS.md"])
    listed = ["manifest.json", "tensorrt/.edgelin-files.json", "tensorrt/COMMANDS.md"]
    (out / "manifest.json").write_text(json.dumps({"format": "edgelin-export", "files": listed}))
    record_written(out / "tensorrt", ["build.json"])  # what the build wrote after the manifest
    (out / "tensorrt" / "build.json").write_text("built")
    assert check_output(out, True, EXPORT) == out.resolve()
    (out / "tensorrt" / "my-notes.txt").write_text("the user's")
    with pytest.raises(EdgelinError, match="edgelin did not write tensorrt"):
        check_output(out, True, EXPORT)


def test_force_replaces_an_older_export_without_a_files_list(ckpt, fast_graphs, tmp_path):
    out = tmp_path / "out"
    assert run("export", ckpt, "--out", out).exit_code == 0
    manifest = json.loads((out / "manifest.json").read_text())
    del manifest["files"]  # as written before the list existed: manifest + graphs + tokenizer are ours
    del manifest["extra"]["reference_vectors"]  # nor were reference vectors recorded then
    (out / "reference.npz").unlink()
    (out / "manifest.json").write_text(json.dumps(manifest))
    assert run("export", ckpt, "--out", out, "--force").exit_code == 0
    assert "files" in json.loads((out / "manifest.json").read_text())


def test_files_added_while_a_forced_export_runs_are_kept(ckpt, monkeypatch, tmp_path):
    """--force checked the folder when it started; a file the user adds while the export writes (a
    validate --json > out/val.json in another terminal) must not be deleted by the swap at the end."""
    out = tmp_path / "out"
    monkeypatch.setattr(onnx_target, "finish_graphs", lambda *a, **k: {})

    def graph_then_user_writes(*args):
        Path(args[4]).write_bytes(FAKE_GRAPH)
        (out / "val.json").write_text("the user's")  # into the old export, mid-run

    monkeypatch.setattr(onnx_target, "export_onnx_graph", lambda *a: Path(a[4]).write_bytes(FAKE_GRAPH))
    assert run("export", ckpt, "--out", out).exit_code == 0
    monkeypatch.setattr(onnx_target, "export_onnx_graph", graph_then_user_writes)
    before = set(os.listdir(out))
    refused(run("export", ckpt, "--out", out, "--force"), "will not replace", "val.json", "changed while")
    assert (out / "val.json").read_text() == "the user's" and set(os.listdir(out)) == before | {"val.json"}
    assert leftovers(tmp_path) == []


def test_failed_export_removes_the_parent_folders_it_created(ckpt, monkeypatch, tmp_path):
    def fail(*args):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(onnx_target, "export_onnx_graph", fail)
    (tmp_path / "kept").mkdir()
    result = run("export", ckpt, "--out", tmp_path / "kept" / "a" / "b" / "out")
    assert result.exit_code == 2, result.output
    assert os.listdir(tmp_path / "kept") == []  # a/ and a/b/ went; kept/ (the user's) stayed


@pytest.mark.parametrize("planted", ["symlink", "user-file", "hard-link", "directory", "fifo"])
def test_a_file_at_the_lock_name_is_never_written_or_removed(ckpt, fast_graphs, tmp_path, planted):
    victim = tmp_path / "victim.txt"
    victim.write_text("important user data\n")
    lock = tmp_path / ".out.lock"
    if planted == "symlink":
        lock.symlink_to(victim)
    elif planted == "hard-link":
        os.link(victim, lock)
    elif planted == "directory":
        lock.mkdir()
    elif planted == "fifo":
        os.mkfifo(lock)
    else:
        lock.write_text("my own notes, not a pid\n")
    refused(run("export", ckpt, "--out", tmp_path / "out"), "cannot lock", ".out.lock", "move that file away")
    assert victim.read_text() == "important user data\n"
    assert lock.is_symlink() or not lock.is_file() or lock.read_text()  # still there, as it was
    assert not (tmp_path / "out").exists()


def test_ctrl_c_during_the_swap_waits_until_it_is_done(tmp_path, monkeypatch, request):
    """An interrupt between moving the old output aside and moving the new one in would leave --out
    missing and the old folder (with anything the user kept in it) to the next run's cleanup."""
    from edgelin import outputs

    # Ctrl-C as an interactive run has it (a suite started as a background job inherits SIGINT ignored)
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    request.addfinalizer(lambda: signal.signal(signal.SIGINT, previous))

    out = tmp_path / "out"
    for content in ("old", "new"):
        if content == "new":  # SIGINT arrives right after the old folder was moved aside
            check = outputs._check_owned

            def check_then_interrupt(out, folder, *rest):
                check(out, folder, *rest)
                if ".edgelin-old-" in folder.name:  # the swap's own re-check, not the one at the start
                    os.kill(os.getpid(), signal.SIGINT)
                    time.sleep(0.05)

            monkeypatch.setattr(outputs, "_check_owned", check_then_interrupt)
        with contextlib.ExitStack() as stack:
            if content == "new":
                stack.enter_context(pytest.raises(KeyboardInterrupt))  # delivered, once the swap is done
            with claim_output(out, content == "new", EXPORT) as tmp:
                (tmp / "manifest.json").write_text(json.dumps({"format": "edgelin-export",
                                                               "files": ["manifest.json", "a.txt"]}))
                (tmp / "a.txt").write_text(content)
    assert (out / "a.txt").read_text() == "new" and leftovers(tmp_path) == []


def test_a_fifo_in_an_output_is_unreadable_not_a_hang(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    os.mkfifo(out / "manifest.json")  # reading it would block until a writer opens it: forever
    found: list = []
    reader = threading.Thread(target=lambda: found.append(EXPORT.owned(out)), daemon=True)
    reader.start()
    reader.join(10)
    assert found and found[0][0] == frozenset() and "unreadable" in found[0][1], found


def test_the_lock_names_the_command_holding_it(ckpt, fast_graphs, tmp_path):
    from edgelin.report import REPORT

    with claim_output(tmp_path / "out", False, REPORT):
        refused(run("export", ckpt, "--out", tmp_path / "out"), "another report (pid", "is writing")


def test_a_lock_left_by_a_killed_run_does_not_take_the_name(tmp_path):
    from edgelin.outputs import fresh_folder, lock_held

    (tmp_path / ".r1.lock").write_text(f"{dead_pid()}\n")  # SIGKILL: the file stays, its flock is gone
    assert not lock_held(tmp_path / "r1") and fresh_folder(tmp_path, "r1") == tmp_path / "r1"
    with claim_output(tmp_path / "r2", False, EXPORT):  # a live writer's lock does take it
        assert lock_held(tmp_path / "r2") and fresh_folder(tmp_path, "r2") == tmp_path / "r2-2"


# ---- 3. one writer per folder ---------------------------------------------------------------------
def test_second_export_while_one_is_writing_is_refused(ckpt, fast_graphs, tmp_path):
    out = tmp_path / "out"
    with claim_output(out, False, EXPORT) as tmp:  # the first export, still writing
        (tmp / "first.txt").write_text("first")
        for force in ((), ("--force",)):
            refused(run("export", ckpt, "--out", out, *force), "another export", "is writing")
    assert sorted(p.name for p in out.iterdir()) == ["first.txt"]  # the first one won, untouched
    assert leftovers(tmp_path) == []


def test_lock_left_by_a_killed_export_does_not_block(ckpt, fast_graphs, tmp_path):
    (tmp_path / ".out.lock").write_text(f"{dead_pid()}\n")  # the kernel dropped its flock when it died
    assert run("export", ckpt, "--out", tmp_path / "out").exit_code == 0
    assert leftovers(tmp_path) == []


RACER = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    from edgelin import cli
    from edgelin.export.onnx import target as onnx_target
    from edgelin.reference import parity

    def slow_graph(*args):  # both racers are inside their export at the same time
        time.sleep(1.0)
        Path(args[4]).write_bytes(b"racer")

    onnx_target.export_onnx_graph = slow_graph
    onnx_target.finish_graphs = lambda *args, **kwargs: {}  # no weights to share out of fake graphs
    parity.GREEDY_STEPS = int(sys.argv[5])  # the greedy rollout this file's in-process exports record
    Path(sys.argv[1] + ".ready").touch()
    while not Path(sys.argv[2]).exists():
        time.sleep(0.01)
    sys.argv = ["edgelin", "export", sys.argv[3], "--out", sys.argv[4]]
    cli.main()
""")


def test_two_concurrent_exports_exactly_one_wins(ckpt, tmp_path):
    out, go = tmp_path / "out", tmp_path / "go"
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parent.parent)}
    procs = [subprocess.Popen([sys.executable, "-c", RACER, str(tmp_path / f"racer{i}"), str(go), str(ckpt), str(out),
                               str(parity.GREEDY_STEPS)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env) for i in range(2)]
    deadline = time.monotonic() + 120
    while not all((tmp_path / f"racer{i}.ready").exists() for i in range(2)):  # both imported and waiting
        assert time.monotonic() < deadline and all(p.poll() is None for p in procs)
        time.sleep(0.05)
    go.touch()
    results = [(p.wait(timeout=120), p.stderr.read()) for p in procs]
    assert sorted(code for code, _ in results) == [0, 2], results
    loser = next(err for code, err in results if code == 2)
    assert "another export" in loser or "already exists" in loser, loser
    assert "Traceback" not in loser
    assert (out / "manifest.json").is_file() and leftovers(tmp_path) == []


# ---- 4. leftovers of killed exports ---------------------------------------------------------------
def test_stale_partials_are_removed_live_ones_kept(ckpt, fast_graphs, tmp_path):
    dead, live = dead_pid(), os.getppid()  # the parent (the shell running pytest) is alive
    stale = [tmp_path / f".out.edgelin-partial-{dead}", tmp_path / f".out.edgelin-old-{dead}"]
    kept = [tmp_path / f".out.edgelin-partial-{live}", tmp_path / f".other.edgelin-partial-{dead}",
            tmp_path / ".out.edgelin-partial-x",
            tmp_path / f".out.old-{dead}"]  # a user's folder of a look-alike name, without edgelin's tag
    for folder in stale + kept:
        folder.mkdir()
        (folder / "step.onnx").write_bytes(b"x" * 1000)
    assert run("export", ckpt, "--out", tmp_path / "out").exit_code == 0
    assert [p.exists() for p in stale] == [False, False]
    assert [p.exists() for p in kept] == [True, True, True, True]


# ---- 12. filesystem faults are one line, exit 2 ---------------------------------------------------
def test_out_below_a_regular_file(ckpt, fast_graphs, tmp_path):
    (tmp_path / "notes.txt").write_text("x")
    refused(run("export", ckpt, "--out", tmp_path / "notes.txt" / "out"), "notes.txt is a file")
    assert (tmp_path / "notes.txt").read_text() == "x"


@pytest.mark.parametrize("call", ["mkdir", "rename", "open"])
def test_read_only_filesystem(ckpt, fast_graphs, tmp_path, monkeypatch, call):
    # Tests run as root, where chmod does not stop writes: the OS answer is simulated instead.
    real = getattr(os, call)

    def read_only(path, *args, **kwargs):
        if str(path).startswith(str(tmp_path / "ro")) and (call != "open" or args[0] & os.O_CREAT):
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(path))
        return real(path, *args, **kwargs)

    (tmp_path / "ro").mkdir()
    monkeypatch.setattr(os, call, read_only)
    refused(run("export", ckpt, "--out", tmp_path / "ro" / "out"), "cannot write",
                         "Read-only file system", "writable filesystem")
    monkeypatch.undo()
    assert sorted(os.listdir(tmp_path / "ro")) == []


def test_disk_full_while_writing(ckpt, tmp_path, monkeypatch):
    def full(*args):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(args[4]))

    monkeypatch.setattr(onnx_target, "export_onnx_graph", full)
    refused(run("export", ckpt, "--out", tmp_path / "out"), "cannot write", "No space left on device",
            "free some disk space")
    assert not (tmp_path / "out").exists() and leftovers(tmp_path) == []


def test_out_dot_with_force_in_a_folder_of_other_files(ckpt, fast_graphs, tmp_path, monkeypatch):
    work = tmp_path / "work"
    work.mkdir()
    (work / "thesis.tex").write_text("years of work")
    monkeypatch.chdir(work)
    refused(run("export", ckpt, "--out", ".", "--force"), "--out .", "current folder")
    assert sorted(os.listdir(work)) == ["thesis.tex"] and leftovers(tmp_path) == []


def test_failed_replace_puts_the_previous_checkpoint_back(tmp_path, monkeypatch):
    from edgelin.checkpoint import load_model, save_checkpoint
    from edgelin.errors import EdgelinError

    ckpt = make_checkpoint(tmp_path / "ckpt", "gla", tokenizer=False)
    (ckpt / "training_log.json").write_text("{}")  # as if `edgelin train` wrote it: --force may replace it
    before = tree_hashes(ckpt)
    model, _ = load_model(ckpt)
    with torch.no_grad():  # a different checkpoint, to tell old from new
        next(model.parameters()).add_(1)
    real, failed = os.rename, []

    def fail_once(src, dst, *args, **kwargs):  # the disk fills while the new files move in
        if Path(dst) == ckpt / "model.safetensors" and not failed:
            failed.append(dst)
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(dst))
        return real(src, dst, *args, **kwargs)

    monkeypatch.setattr(os, "rename", fail_once)
    with pytest.raises(EdgelinError, match="No space left on device"):
        save_checkpoint(model, ckpt, force=True)
    assert failed and tree_hashes(ckpt) == before and leftovers(tmp_path) == []


# ---- 2. train never overwrites the checkpoint beside its recipe -----------------------------------
@pytest.fixture(scope="module")
def corpus_cache(tmp_path_factory):
    return tmp_path_factory.mktemp("corpus-cache")  # tokenized once for the module


@pytest.fixture
def recipe(tmp_path, monkeypatch, corpus_cache):
    monkeypatch.setenv("EDGELIN_CACHE", str(corpus_cache))
    folder = tmp_path / "tiny"
    folder.mkdir()
    (folder / "recipe.toml").write_text(TINY)
    (folder / "config.json").write_text('{"model_type": "edgelin"}')  # stand-ins for a shipped model
    (folder / "model.safetensors").write_bytes(b"the shipped weights")
    monkeypatch.chdir(tmp_path)
    return folder / "recipe.toml"


def test_train_writes_a_fresh_folder_never_the_recipes(recipe, tmp_path):
    before = tree_hashes(recipe.parent)
    first = run("train", recipe, "--steps", "1")
    assert first.exit_code == 0, first.output
    second = run("train", recipe, "--steps", "1")
    assert second.exit_code == 0, second.output
    assert tree_hashes(recipe.parent) == before
    assert sorted(os.listdir(tmp_path / "runs")) == ["tiny", "tiny-2"]
    assert "runs/tiny-2" in " ".join(second.stdout.split())  # says where it went
    for run_dir in ("tiny", "tiny-2"):
        names = sorted(os.listdir(tmp_path / "runs" / run_dir))
        assert names == ["config.json", "model.safetensors", "recipe.toml", "tokenizer.json", "training_log.json"]


def test_train_needs_force_for_an_existing_checkpoint(recipe, tmp_path):
    out = tmp_path / "ckpt"
    assert run("train", recipe, "--steps", "1", "--out", out).exit_code == 0
    (out / "README.md").write_text("kept")
    (out / "model.safetensors").write_bytes(b"old weights")  # to see them replaced
    before = tree_hashes(out)
    refused(run("train", recipe, "--steps", "1", "--out", out), "already exists", "--force")
    assert tree_hashes(out) == before
    assert run("train", recipe, "--steps", "1", "--out", out, "--force").exit_code == 0
    assert (out / "README.md").read_text() == "kept" and (out / "model.safetensors").read_bytes() != b"old weights"
    assert leftovers(tmp_path) == []


def test_train_force_refuses_a_checkpoint_it_did_not_train(recipe, tmp_path):
    before = tree_hashes(recipe.parent)  # its config.json and weights are not from edgelin train
    refused(run("train", recipe, "--steps", "1", "--out", recipe.parent, "--force"),
                         "will not replace", "config.json")
    assert tree_hashes(recipe.parent) == before


def test_saved_weights_get_the_umask_mode_not_0600(tmp_path):
    from edgelin.checkpoint import save_safetensors

    umask = os.umask(0o022)
    try:
        save_safetensors({"w": torch.zeros(2)}, tmp_path / "model.safetensors", {"format": "pt"})
    finally:
        os.umask(umask)
    assert (tmp_path / "model.safetensors").stat().st_mode & 0o777 == 0o644
