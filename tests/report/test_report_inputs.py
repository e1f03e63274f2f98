"""`edgelin report` distrusts its inputs: text from results files is escaped in report.md (and stays escaped
in report.html); files that are not regular, too large, oddly encoded or malformed in any field the report
reads are one `error:` line naming the file and the field (exit 2) before anything is written; labels and
plot file names stay unambiguous."""

from __future__ import annotations

import codecs
import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Callable

import pytest

from test_report import bench_result, one_line_error, run, run_plain, validate_result, write

pytest.importorskip("matplotlib")
ROOT = Path(__file__).resolve().parents[2]

# What a hostile results file may hold in any text field, and how report.md must show it (written by
# hand: HTML's <>&"' as entities, Markdown's punctuation and $ (GitHub's math) backslash-escaped, the
# newline as a visible \n, so nothing becomes a tag, a link, emphasis, a code span or a new table row).
HOSTILE = "<img src=x onerror=alert(1)>[click](javascript:alert(1)) *b* _i_ `c` #1. {x}+-!|$5 & \"q\" 'a'~\nrow"
ESCAPED = ("&lt;img src=x onerror=alert\\(1\\)&gt;\\[click\\]\\(javascript\\:alert\\(1\\)\\) \\*b\\* \\_i\\_ "
           "\\`c\\` \\#1\\. \\{x\\}\\+\\-\\!\\|\\$5 &amp; &quot;q&quot; &#x27;a&#x27;\\~\\\\nrow")


def hostile(field: str) -> str:
    return field.replace("_", "") + HOSTILE  # the field's name first (no punctuation): which text went where


def escaped(field: str) -> str:
    return field.replace("_", "") + ESCAPED


def _no_plots(monkeypatch, *names: str) -> None:
    """Skip drawing these plots (seconds each on the CI machine) where a test reads the text only."""
    from edgelin.report import plots

    for name in names:
        monkeypatch.setattr(plots, name, lambda *args, **kwargs: False)


def test_text_from_results_files_is_escaped_in_markdown_and_html(tmp_path, monkeypatch):
    _no_plots(monkeypatch, "latency", "memory", "prefill", "parity")
    fields = ("device", "cpu", "os", "runtime", "runtime_version", "command", "target", "precision", "quantization")
    one = bench_result("a" * 64)
    one["environment"].update({key: hostile(key) for key in fields} | {"runner": hostile("runner")})
    for row in one["positions"]:
        row["model"] = hostile("model") if row["model"] == "edgelin" else row["model"]
    one["prefill_tokens_per_s"] = one["steps_tokens_per_s"] = {hostile("model"): 100.0}
    two = json.loads(json.dumps(one))  # the same export on another runner: the labels name the runner
    two["environment"]["runner"] = "onnxruntime"
    check = validate_result()
    check["environment"]["artifact"] = "b" * 64  # a second export: its section's heading names target, precision
    check["environment"].update(target=hostile("target"), precision=hostile("precision"))
    check["against"] = hostile("against")
    check["metrics"][0].update(check=hostile("check"), output=hostile("output"))
    files = [write(tmp_path, "one.json", one), write(tmp_path, "two.json", two), write(tmp_path, "v.json", check)]
    result = run("report", *files, "--out", tmp_path / "rep")
    assert result.exit_code == 0, result.output
    md = (tmp_path / "rep" / "report.md").read_text()
    for field in (*fields, "runner", "model", "against", "check", "output"):
        assert escaped(field) in md, field
    assert f"| {escaped('device')} | {escaped('cpu')} | - | {escaped('os')} | " in md  # one cell each, one row
    assert f"| {escaped('model')} (runner {escaped('runner')}) | 8,192 |" in md  # a series: model and label
    assert f"## Export bbbbbbbbbbbb ({escaped('target')} {escaped('precision')})" in md
    assert f"| 3.25e-07 ({escaped('check')}/{escaped('output')}) |" in md
    for raw in ("<img", "](javascript", "\nrow"):
        assert raw not in md, raw
    page = (tmp_path / "rep" / "report.html").read_text()
    assert "<img src=x" not in page and "&lt;img src=x onerror=alert(1)&gt;[click](javascript:alert(1))" in page


def test_labels_are_plain_text_and_tell_same_named_files_apart(tmp_path, monkeypatch):
    """Two files named `cost_$5_vs_$10.json` in two folders: labelled by their folders; matplotlib draws the
    `$...$` of the latency plot's legend as text (mathtext failed on it: "internal error")."""
    _no_plots(monkeypatch, "memory", "prefill")
    name = "cost_$5_vs_$10.json"
    files = []
    for folder in ("x", "y"):
        (tmp_path / folder).mkdir()
        files.append(write(tmp_path / folder, name, bench_result()))
    result = run("report", *files, "--out", tmp_path / "rep")
    assert result.exit_code == 0, result.output
    md = (tmp_path / "rep" / "report.md").read_text()
    for folder in ("x", "y"):
        assert f"| edgelin ({folder}/cost\\_\\$5\\_vs\\_\\$10\\.json) | 8,192 |" in md


def test_file_names_tell_files_apart():
    from edgelin.report.results import file_names

    paths = [Path("/r/a/x/bench.json"), Path("/r/b/x/bench.json"), Path("/r/c.json"), Path("/r/c.json")]
    assert file_names(paths) == ["a/x/bench.json", "b/x/bench.json", "c.json", "c.json (2)"]


def test_artifacts_sharing_twelve_digits_stay_apart(tmp_path, monkeypatch):
    _no_plots(monkeypatch, "memory", "prefill")  # the latency plots show the file names
    first, second = "c" * 12 + "0" * 52, "c" * 12 + "1" * 52
    files = [write(tmp_path, "p.json", bench_result(first)), write(tmp_path, "q.json", bench_result(second))]
    result = run("report", *files, "--out", tmp_path / "rep")
    assert result.exit_code == 0, result.output
    md = (tmp_path / "rep" / "report.md").read_text()
    assert "## Export cccccccccccc0 (" in md and "## Export cccccccccccc1 (" in md
    for name in ("latency-cccccccccccc0.png", "latency-cccccccccccc1.png"):
        assert (tmp_path / "rep" / name).is_file() and f"({name})" in md


@pytest.mark.parametrize("encoding", ["utf-8-sig", "utf-16-le", "utf-16-be", "utf-32-le", "utf-32-be"])
def test_results_with_a_byte_order_mark_are_read(tmp_path, encoding):
    from edgelin.report.results import load_result

    bom = {"utf-8-sig": b"", "utf-16-le": codecs.BOM_UTF16_LE, "utf-16-be": codecs.BOM_UTF16_BE,
           "utf-32-le": codecs.BOM_UTF32_LE, "utf-32-be": codecs.BOM_UTF32_BE}[encoding]
    path = tmp_path / "r.json"
    path.write_bytes(bom + json.dumps(bench_result("d" * 64)).encode(encoding))
    assert load_result(path).artifact == "d" * 64


def _edit(make: Callable[[], dict], edit: Callable[[dict], object]) -> Callable[[Path], Path]:
    def build(path: Path) -> Path:
        data = make()
        edit(data)
        path.write_text(json.dumps(data))
        return path
    return build


def _raw(content: bytes) -> Callable[[Path], Path]:
    def build(path: Path) -> Path:
        path.write_bytes(content)
        return path
    return build


def _env(**values) -> Callable[[dict], None]:
    return lambda d: d["environment"].update(values)


def _sparse(path: Path) -> Path:
    with open(path, "wb") as fh:
        fh.truncate(1 << 30)  # 1 GiB of holes: no disk used
    return path


GOOD = json.dumps(bench_result())
HOSTILE_INPUTS = {  # id -> (how the file is made, what the error line says)
    "threshold a string": (_edit(validate_result, lambda d: d.update(threshold="x")), 'threshold is "x"'),
    "prefill_tokens a list": (_edit(bench_result, lambda d: d.update(prefill_tokens=[1])), "prefill_tokens is [1]"),
    "metric without output": (_edit(validate_result, lambda d: d["metrics"][0].pop("output")),
                              "metrics[0].output is null"),
    "passed missing": (_edit(validate_result, lambda d: d.pop("passed")), "passed is missing"),
    "steps_per_point 0": (_edit(validate_result, lambda d: d["step_errors"]["logits"].update(steps_per_point=0)),
                          "step_errors.logits.steps_per_point is 0"),
    "batches of text": (_edit(validate_result, lambda d: d.update(batches=["x"])), 'batches[0] is "x"'),
    "an integer of 400 digits": (_raw(GOOD.replace('"p90_ms": 0.6', '"p90_ms": ' + "9" * 400, 1).encode()),
                                 "positions[0].p90_ms is an integer of 400 digits"),
    "an integer of 5000 digits": (_raw(GOOD.replace('"p90_ms": 0.6', '"p90_ms": ' + "9" * 5000, 1).encode()),
                                  "positions[0].p90_ms is an integer of 5,000 digits"),
    "a float overflowing": (_raw(GOOD.replace('"p90_ms": 0.6', '"p90_ms": 1e400', 1).encode()),
                            "positions[0].p90_ms is Infinity"),
    "a NUL in artifact": (_edit(bench_result, _env(artifact="a" * 32 + "\0" + "a" * 31)), "environment.artifact is"),
    "a slash in artifact": (_edit(bench_result, _env(artifact="../" + "a" * 61)), "environment.artifact is"),
    "format_version true": (_edit(bench_result, _env(format_version=True)), "format_version is true, expected 1"),
    "format_version -5": (_edit(bench_result, _env(format_version=-5)), "format_version is -5, expected 1"),
    "format_version 2": (_edit(bench_result, _env(format_version=2)), "result format version 2"),
    "threads as text": (_edit(bench_result, _env(threads="2")), 'environment.threads is "2"'),
    "device a list": (_edit(bench_result, _env(device=["x"])), 'environment.device is ["x"]'),
    "cpu a lone surrogate": (_edit(bench_result, _env(cpu="\ud800")), "environment.cpu holds an unpaired"),
    "command of 20000 characters": (_edit(bench_result, _env(command="x" * 20_000)), "environment.command is"),
    "UTF-16 without a mark": (_raw(GOOD.encode("utf-16-le")), "NUL characters"),
    "Latin-1": (_raw(GOOD.replace("Test CPU", "Test CPU \xe9").encode("latin-1")), "not UTF-8 text"),
    "a UTF-16 mark, then UTF-8": (_raw(codecs.BOM_UTF16_LE + b'{"a":1}'), "not valid UTF-16"),
    "1 GiB (sparse)": (_sparse, "1,073,741,824 bytes"),
    "a folder": (lambda path: (path.mkdir(), path)[1], "is a folder"),
    "/dev/zero": (lambda path: Path("/dev/zero"), "is a character device"),
}


@pytest.mark.parametrize("case", list(HOSTILE_INPUTS))
def test_hostile_inputs_are_one_line_before_anything_is_written(tmp_path, case):
    make, needle = HOSTILE_INPUTS[case]
    good = write(tmp_path, "good.json", bench_result())
    bad = make(tmp_path / "bad.json")
    before = sorted(p.name for p in tmp_path.iterdir())
    line = one_line_error(run_plain("report", good, bad, "--out", tmp_path / "rep"), str(bad), needle)
    assert len(line) < 600, line  # the field named, not the file dumped
    assert sorted(p.name for p in tmp_path.iterdir()) == before  # no report folder, no partial one


def test_a_file_swapped_for_a_fifo_after_the_check_is_refused_without_blocking(tmp_path):
    from edgelin.errors import EdgelinError
    from edgelin.report.inputs import read_text

    fifo = tmp_path / "r.json"
    os.mkfifo(fifo)  # no writer: a blocking open would wait forever
    signal.signal(signal.SIGALRM, lambda *_: pytest.fail("read_text blocked on a FIFO"))
    signal.alarm(10)
    try:
        with pytest.raises(EdgelinError, match="is a FIFO"):
            read_text(fifo)
    finally:
        signal.alarm(0)


def test_cli_refuses_a_fifo_at_once_with_exit_2(tmp_path):
    """A real process (a hang would be one): a FIFO with no writer is refused, nothing written."""
    fifo = tmp_path / "pipe.json"
    os.mkfifo(fifo)
    proc = subprocess.run([sys.executable, "-m", "edgelin.cli", "report", str(fifo), "--out", str(tmp_path / "rep")],
                          capture_output=True, text=True, timeout=60, env={**os.environ, "PYTHONPATH": str(ROOT)})
    lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("error:")]
    assert proc.returncode == 2 and len(lines) == 1 and f"{fifo} is a FIFO" in lines[0], proc.stderr
    assert "Traceback" not in proc.stderr and sorted(p.name for p in tmp_path.iterdir()) == ["pipe.json"]
