"""The core names no target (issue 44): adding a target is one folder under edgelin/export/ (or a plug-in's
package), and no module of the core has to learn its name.

The core: edgelin/*.py and the packages edgelin/devices, serve, report, artifact, and the generic modules
directly in edgelin/export/. What counts as naming a target there:
- a string literal equal to a registered target's name ("onnx", "coreml", ...), however used (a dict key,
  a comparison, a default). The libraries of the same name are not targets: `import torch`, `import onnx`
  are import statements, not literals, and file names (".onnx", "model.onnx") are other strings;
- an import of a target package (`edgelin.export.<target>`, in an import statement or a string such as
  import_module's argument).
The target's own package, the registry's tests and device profile TOMLs (data) may name targets."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from edgelin.export.targets import builtin_targets

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "edgelin"
CORE_PACKAGES = ("devices", "serve", "report", "artifact")


def core_modules() -> list[Path]:
    files = [*PACKAGE.glob("*.py"), *(PACKAGE / "export").glob("*.py")]
    for name in CORE_PACKAGES:
        files += (PACKAGE / name).rglob("*.py")
    return sorted(files)


def namings(path: Path, targets: set[str]) -> list[str]:
    """Where the module at `path` names a target: 'line N: what'."""
    packages = {f"edgelin.export.{t}" for t in targets}

    def a_target_package(module: str) -> bool:
        return any(module == p or module.startswith(p + ".") for p in packages)

    found = []
    tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            if node.value in targets:
                found.append(f"line {node.lineno}: the literal {node.value!r}")
            elif a_target_package(node.value.partition(":")[0]):
                found.append(f"line {node.lineno}: the module name {node.value!r}")
        elif isinstance(node, ast.Import):
            found += [f"line {node.lineno}: import {a.name}" for a in node.names if a_target_package(a.name)]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if a_target_package(node.module):
                found.append(f"line {node.lineno}: from {node.module} import ...")
            elif node.module == "edgelin.export":
                found += [f"line {node.lineno}: from edgelin.export import {a.name}" for a in node.names
                          if a.name in targets]
    return found


def test_the_guard_sees_what_it_guards(tmp_path):
    """The core list is the real one, and the checker finds each kind of naming (so zero below means zero)."""
    names = {p.relative_to(PACKAGE).as_posix() for p in core_modules()}
    assert {"cli.py", "export/pipeline.py", "devices/__init__.py", "serve/triton.py", "export/targets.py"} <= names
    assert not any(n.startswith(("export/onnx/", "export/torch/")) for n in names)
    assert {"onnx", "tensorrt", "coreml", "torch"} <= set(builtin_targets())
    sample = tmp_path / "sample.py"
    sample.write_text('import torch\nimport onnx\nfrom edgelin.export.onnx.runner import X\nfrom edgelin.export '
                      'import coreml\nname = "model.onnx"\nif t == "tensorrt":\n    importlib.import_module('
                      '"edgelin.export.torch.target")\n')
    assert sorted(namings(sample, set(builtin_targets()))) == [
        "line 3: from edgelin.export.onnx.runner import ...", "line 4: from edgelin.export import coreml",
        "line 6: the literal 'tensorrt'", "line 7: the module name 'edgelin.export.torch.target'"]


@pytest.mark.parametrize("path", core_modules(), ids=lambda p: p.relative_to(PACKAGE).as_posix())
def test_no_core_module_names_a_target(path):
    found = namings(path, set(builtin_targets()))
    assert not found, f"{path.relative_to(ROOT)} names a target (ask the target instead): " + "; ".join(found)
