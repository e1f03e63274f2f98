"""`edgelin report` and the environment block of results: two real `bench --json` runs at 1 and 2 threads
merge into one report; hand-written results (known numbers) check the tables, the grouping of mixed
artifacts, bad results files (one line naming the file, exit 2) and that a foreign folder is never replaced."""

from __future__ import annotations

import hashlib
import json
import os
import platform
from pathlib import Path

import pytest
from typer.testing import CliRunner

from edgelin import __version__
from edgelin.cli import app
from helpers import export_family

pytest.importorskip("matplotlib")

# TTY_COMPATIBLE=1: rich takes stderr for a terminal, so progress bars are drawn (and must stay off stdout).
cli = CliRunner(env={"TTY_COMPATIBLE": "1", "COLUMNS": "120"})
plain = CliRunner(env={"TTY_COMPATIBLE": "0"})  # off a terminal: `progress:` lines, then the error line


def run(*args):
    return cli.invoke(app, [str(a) for a in args])


def run_plain(*args):
    return plain.invoke(app, [str(a) for a in args])


def one_line_error(result, *needles: str) -> str:
    assert result.exit_code == 2, (result.exit_code, result.output)
    lines = [ln for ln in result.stderr.splitlines() if ln.strip() and not ln.startswith("progress:")]
    assert len(lines) == 1 and lines[0].startswith("error:") and "Fix:" in lines[0], result.stderr
    assert "Traceback" not in result.output
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])
    return lines[0]


@pytest.fixture(scope="module")
def benched(tmp_path_factory):
    """One tiny export, benched for real at --threads 1 and --threads 2 (small sizes)."""
    from edgelin.reference import parity

    root = tmp_path_factory.mktemp("report")
    patch = pytest.MonkeyPatch()  # fewer greedy reference steps recorded at export: this test benches only
    patch.setattr(parity, "GREEDY_STEPS", 16)
    try:
        folder = export_family(root, "gla")
    finally:
        patch.undo()
    files = []
    for threads in (1, 2):
        args = ["bench", folder, "--positions", "1,48", "--iters", "3", "--warmup", "1", "--prefill-tokens", "16",
                "--threads", threads, "--json"]
        # the second as `python -m edgelin.cli` names itself: the recorded command still reads `edgelin bench ...`
        result = cli.invoke(app, [str(a) for a in args], prog_name="edgelin" if threads == 1 else "python -m edgelin.cli")
        assert result.exit_code == 0, result.output
        path = root / f"bench-t{threads}.json"
        path.write_text(result.stdout)  # json.loads below: stdout holds the JSON only, progress bars or not
        files.append(path)
    return root, folder, files


@pytest.mark.slow  # the module's one export (~20 s CPU), shared by these two tests
def test_environment_block_says_what_it_ran_on(benched):
    _, folder, files = benched
    import onnxruntime

    # the manifest records every file's sha256 (edgelin.integrity checks them): the hash is manifest.json's alone
    digest = hashlib.sha256((folder / "manifest.json").read_bytes())
    recorded = json.loads((folder / "manifest.json").read_text())["sha256"]
    assert {"prefill.onnx", "step.onnx", "weights.bin"} <= set(recorded)
    for threads, path in zip((1, 2), files):
        env = json.loads(path.read_text())["environment"]
        assert env["format"] == "edgelin-result" and env["format_version"] == 1 and env["kind"] == "bench"
        assert env["threads"] == threads and f"--threads {threads}" in env["command"]
        assert env["command"].startswith(f"edgelin bench {folder} --positions 1,48")
        assert (env["target"], env["precision"], env["quantization"], env["device"]) == ("onnx", "fp32", None, None)
        assert (env["runtime"], env["runtime_version"]) == ("onnxruntime", onnxruntime.__version__)
        assert env["python"] == platform.python_version() and env["cpu_count"] == os.cpu_count()
        assert env["edgelin_version"] == __version__ and env["gpu"] is None and env["cpu"]
        assert env["artifact"] == digest.hexdigest()


@pytest.mark.slow  # the module's one export (~20 s CPU), shared by these two tests
def test_two_thread_counts_merge_into_one_report(benched, tmp_path):
    _, _, files = benched
    out = tmp_path / "rep"
    result = run("report", *files, "--out", out)
    assert result.exit_code == 0, result.output
    md = (out / "report.md").read_text()
    for series in ("edgelin (threads 1)", "edgelin (threads 2)"):
        assert md.count(series) >= 3, series  # latency, memory and prefill tables
    assert "different exports" not in md
    from PIL import Image

    for name in ("latency", "memory", "prefill"):
        with Image.open(out / f"{name}.png") as image:
            image.verify()
        with Image.open(out / f"{name}.png") as image:
            assert image.format == "PNG" and 600 <= image.width <= 2000 and 250 <= image.height <= 1500
        assert f"({name}.png)" in md
    assert not (out / "parity.png").exists()  # no validate result given
    page = (out / "report.html").read_text()
    assert page.count('src="data:image/png;base64,') == 3 and 'src="latency.png"' not in page
    assert json.loads((out / "report.json").read_text())["format"] == "edgelin-report"


# ---- hand-written results: the numbers are known -------------------------------------------------------
ENV = {"format": "edgelin-result", "format_version": 1, "kind": "bench", "command": "edgelin bench x", "device": None,
       "cpu": "Test CPU", "cpu_count": 2, "gpu": None, "os": "Linux", "machine": "x86_64", "python": "3.11",
       "runtime": "onnxruntime", "runtime_version": "1.0", "runner": "onnxruntime", "threads": 1, "target": "onnx",
       "precision": "fp32", "quantization": None, "artifact": "a" * 64, "edgelin_version": __version__}


def bench_result(artifact: str = "a" * 64, threads: int = 1, p50: float = 0.5) -> dict:
    rows = [{"model": model, "position": p, "p50_ms": p50 * (1 + (model != "edgelin") * p / 1024), "p90_ms": 0.6,
             "p99_ms": 0.7, "state_bytes": 1000 if model == "edgelin" else 64 * p, "rss_bytes": 50 << 20}
            for model in ("edgelin", "kv-baseline") for p in (1, 1024, 8192)]
    return {"environment": {**ENV, "artifact": artifact, "threads": threads}, "folder": "x", "target": "onnx",
            "batch": 1, "threads": threads, "positions": rows, "prefill_tokens": 2048,
            "prefill_tokens_per_s": {"edgelin": 12345.0}, "steps_tokens_per_s": {"edgelin": 678.0}}


def validate_result() -> dict:
    return {"environment": {**ENV, "kind": "validate"}, "folder": "x", "target": "onnx", "precision": "fp32",
            "against": "ckpt", "threshold": 1e-4, "steps": 4, "passed": True,
            "metrics": [{"check": "rollout", "output": "logits", "max_rel": 3.25e-07, "passed": True}],
            "quality": None, "step_errors": {"logits": {"steps_per_point": 1, "max_rel": [1e-7, 2e-7, 3.25e-7, 1e-7]},
                                             "state": {"steps_per_point": 1, "max_rel": [2e-7, 2e-7, 2e-7, 2e-7]}}}


def write(folder: Path, name: str, data) -> Path:
    path = folder / name
    path.write_text(data if isinstance(data, str) else json.dumps(data))
    return path


def test_known_numbers_and_parity_reach_the_tables(tmp_path):
    files = [write(tmp_path, "b.json", bench_result(p50=0.5)), write(tmp_path, "v.json", validate_result())]
    result = run("report", *files, "--out", tmp_path / "rep", "--json")
    assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout)  # progress enabled (terminal), yet stdout is the JSON alone
    assert summary["results"] == 2 and summary["artifacts"] == ["a" * 64]
    md = (tmp_path / "rep" / "report.md").read_text()
    assert "| edgelin | 8,192 | 0.5 | 0.6 | 0.7 |" in md and "| KV-cache baseline | 8,192 | 4.5 |" in md
    assert "| edgelin | 2048 | 12,345 | 678 | 18.2x |" in md
    assert "3.25e-07 (rollout/logits)" in md and "(parity.png)" in md


def test_mixed_artifacts_are_grouped_and_said(tmp_path):
    files = [write(tmp_path, "fp32.json", bench_result("a" * 64)), write(tmp_path, "int4.json", bench_result("b" * 64)),
             write(tmp_path, "fp32-t2.json", bench_result("a" * 64, threads=2))]
    result = run("report", *files, "--out", tmp_path / "rep")
    assert result.exit_code == 0, result.output
    md = (tmp_path / "rep" / "report.md").read_text()
    assert "measure 2 different exports" in md and "a" * 12 in md and "b" * 12 in md
    assert f"## Export {'a' * 12}" in md and f"## Export {'b' * 12}" in md
    assert (tmp_path / "rep" / f"latency-{'a' * 12}.png").is_file()
    assert (tmp_path / "rep" / f"latency-{'b' * 12}.png").is_file()
    section_b = md.split(f"## Export {'b' * 12}")[1]
    assert "threads 2" not in section_b and "| edgelin | 1 |" in section_b  # one result: an unlabelled series


@pytest.mark.parametrize("content, needle", [
    ('{"environment": {"format": "edgelin-result", "format_versi', "truncated or corrupt JSON"),
    (json.dumps({"positions": []}), "is not an edgelin result"),
    ("hello, not json", "it is not JSON"),
    ("MALFORMED", "malformed"),
])
def test_bad_results_files_are_one_line_naming_the_file(tmp_path, content, needle):
    if content == "MALFORMED":
        data = bench_result()
        data["positions"][0]["p50_ms"] = "fast"
        content = json.dumps(data)
    good = write(tmp_path, "good.json", bench_result())
    bad = write(tmp_path, "bad.json", content)
    result = run_plain("report", good, bad, "--out", tmp_path / "rep")
    one_line_error(result, str(bad), needle)
    assert not (tmp_path / "rep").exists() and sorted(p.name for p in tmp_path.iterdir()) == ["bad.json", "good.json"]


def test_never_overwrites_a_folder_edgelin_did_not_write(tmp_path):
    good = write(tmp_path, "good.json", bench_result())
    out = tmp_path / "rep"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    one_line_error(run_plain("report", good, "--out", out), "already exists")
    one_line_error(run_plain("report", good, "--out", out, "--force"), "notes.txt")
    assert [p.name for p in out.iterdir()] == ["notes.txt"] and (out / "notes.txt").read_text() == "mine"
    # a report edgelin wrote is replaced with --force (and only with it)
    mine = tmp_path / "mine"
    assert run_plain("report", good, "--out", mine).exit_code == 0
    one_line_error(run_plain("report", good, "--out", mine), "already exists")
    assert run_plain("report", good, "--out", mine, "--force").exit_code == 0
    # an --out that would swallow a results file is refused
    one_line_error(run_plain("report", good, "--out", tmp_path, "--force"), "contains the source")
    assert good.is_file()


def test_labels_name_what_differs():
    from edgelin.report.results import Result, labels

    def result(name: str, **env) -> Result:
        return Result(Path(name), "bench", {**ENV, **env}, bench_result())

    assert labels([result("a.json", threads=1), result("b.json", threads=2)]) == ["threads 1", "threads 2"]
    assert labels([result("a.json", device="jetson-orin", threads=4), result("b.json", device="android", threads=4)]) \
        == ["device jetson-orin", "device android"]
    assert labels([result("a.json"), result("b.json")]) == ["a.json", "b.json"]  # nothing differs: the file
    assert labels([result("a.json")]) == [""]
