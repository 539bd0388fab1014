"""The session browser is an application: nothing but its own package and the ``ui`` command imports it."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_only_the_ui_command_imports_the_browser():
    importers = []
    for path in [*(ROOT / "loomray").rglob("*.py"), *(ROOT / "storage").rglob("*.py")]:
        rel = path.relative_to(ROOT).as_posix()
        if rel.startswith("loomray/ui/"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            if any(n == "loomray.ui" or n.startswith("loomray.ui.") for n in names):
                importers.append(rel)
    assert importers == ["loomray/cli/ui_command.py"]
