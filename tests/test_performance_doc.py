"""docs/performance.md is the rendering of the saved results (bench/results/*.json), every table with the command,
commit and machine that produced it: the page cannot drift from the figures it shows."""

from __future__ import annotations

import importlib.util
import json
import re
import shutil
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _performance_doc():
    spec = importlib.util.spec_from_file_location("performance_doc", ROOT / "bench" / "performance_doc.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


doc = _performance_doc()


def test_the_committed_page_is_the_rendering_of_the_saved_results():
    page = (ROOT / "docs" / "performance.md").read_text(encoding="utf-8")
    assert page == doc.render(doc.load()), "docs/performance.md is stale: run python bench/performance_doc.py"


def test_every_table_carries_its_command_commit_and_machine():
    results = doc.load()
    assert len(results) >= 10
    page = (ROOT / "docs" / "performance.md").read_text(encoding="utf-8")
    for result in results:
        assert re.fullmatch(r"[0-9a-f]{7,40}", result["commit"]), result["id"]
        assert re.fullmatch(r"\d{4}-\d{2}-\d{2}", result["date"]), result["id"]
        assert result["machine"].strip() and result["command"].strip(), result["id"]
        section = page.split(f"### {result['title']}\n", 1)[1].split("\n### ", 1)[0]
        assert f"- Command: `{result['command']}`" in section
        assert f"- Commit: `{result['commit']}`" in section and f"- Machine: {result['machine']}" in section
    tables = page.count("\n|---|")
    assert tables == len(results), "a table on the page without a saved result"


def test_every_docs_section_the_code_cites_exists():
    """Code comments cite docs by stable section names (`docs/performance.md#cpu-step-latency`): each cited page
    has a heading with that anchor."""
    cited: set[tuple[str, str]] = set()
    for folder in ("edgelin", "bench", "tests"):
        for path in (ROOT / folder).rglob("*"):
            if path.suffix in {".py", ".c", ".cu", ".h", ".toml", ".md"} and path.is_file():
                cited |= set(re.findall(r"(docs/[\w/.-]+\.md)#([a-z0-9-]+)", path.read_text(errors="replace")))
    assert ("docs/performance.md", "cpu-step-latency") in cited
    missing = []
    for page, anchor in sorted(cited):
        text = (ROOT / page).read_text(encoding="utf-8") if (ROOT / page).is_file() else ""
        if anchor not in {doc.slug(h) for h in re.findall(r"^#+ (.+)$", text, flags=re.M)}:
            missing.append(f"{page}#{anchor}")
    assert not missing, f"cited sections missing from the docs: {missing}"


def test_a_result_without_its_commit_is_refused(tmp_path):
    folder = tmp_path / "results"
    shutil.copytree(ROOT / "bench" / "results", folder)
    path = folder / "gpu-decode-fused.json"
    data = json.loads(path.read_text(encoding="utf-8"))
    data["commit"] = ""
    path.write_text(json.dumps(data), encoding="utf-8")
    with pytest.raises(ValueError, match="gpu-decode-fused.json: missing or empty commit"):
        doc.load(folder)
