"""docs/cli.md is generated from the CLI's own parameters (docs/cli_reference.py): a flag added, renamed or
re-described in the code without regenerating the page fails here."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _reference():
    spec = importlib.util.spec_from_file_location("cli_reference", ROOT / "docs" / "cli_reference.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_the_committed_cli_page_is_the_rendering_of_the_cli():
    page = (ROOT / "docs" / "cli.md").read_text(encoding="utf-8")
    assert page == _reference().render(), "docs/cli.md is stale: run python docs/cli_reference.py"


def test_the_page_lists_every_command_and_the_export_flags():
    page = (ROOT / "docs" / "cli.md").read_text(encoding="utf-8")
    for command in ("families", "devices", "inspect", "export", "validate", "bench", "generate", "build", "train",
                    "report"):
        assert f"\n## {command}\n" in page
    export = page.split("\n## export\n", 1)[1].split("\n## ", 1)[0]
    for flag in ("--out", "--precision", "--quantize", "--force", "--baseline"):
        assert f"{flag}" in export, flag
