"""The Python in docs/ stays current with the code.

Each ```python block of a page under docs/ is one of three kinds, chosen by an
HTML comment on the line before its fence (none means "runs"):

- runs: the block runs as written in a fresh directory and exits 0;
- ``<!-- snippet: compile -->``: a fragment (names defined elsewhere, a top-level
  ``await``) or one that needs what a test machine has not (a key, a bucket, a
  Spark session): it must still be valid Python;
- ``<!-- signature: dotted.name -->``: a listing of that callable's signature: the
  parameter names it lists are exactly the callable's, so a renamed or added
  parameter fails here until the page says so; ``<!-- signature -->`` alone marks
  a listing of many members, read by people only.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
_BLOCK = re.compile(r"(?:<!-- (snippet: compile|signature(?:: ([\w.]+))?) -->\n)?```python\n(.*?)```", re.S)


def _blocks() -> list[tuple[str, str, str | None, str]]:
    found = []
    for page in sorted((ROOT / "docs").glob("*.md")):
        for n, match in enumerate(_BLOCK.finditer(page.read_text())):
            marker, target, code = match.groups()
            kind = "run" if marker is None else "compile" if marker.startswith("snippet") else "signature"
            found.append((f"{page.name}#{n}", kind, target, code))
    return found


BLOCKS = _blocks()


def _resolve(dotted: str):
    module_name, _, attr = dotted.rpartition(".")
    return getattr(importlib.import_module(module_name), attr)


def _listed_parameters(code: str) -> set[str]:
    """Parameter names of a ``Name(a: T = 1, *, b=..., **rest)`` listing."""
    inside = code[code.index("(") + 1:code.rindex(")")]
    depth, names, current = 0, set(), ""
    for char in inside + ",":
        depth += char in "([{"
        depth -= char in ")]}"
        if char == "," and depth == 0:
            name = re.match(r"\s*\**(\w+)", current)
            if name:
                names.add(name.group(1))
            current = ""
        else:
            current += char
    return names


def test_docs_have_runnable_snippets():
    assert any(kind == "run" for _, kind, _, _ in BLOCKS), "docs/ lost its runnable Python examples"


@pytest.mark.parametrize(("where", "kind", "target", "code"), BLOCKS, ids=[b[0] for b in BLOCKS])
def test_docs_snippet(where, kind, target, code, tmp_path):
    if kind == "signature":
        if target is not None:
            real = set(inspect.signature(_resolve(target)).parameters)
            assert _listed_parameters(code) == real, f"{where} lists the parameters of {target} wrongly"
        return
    compile(code, where, "exec", flags=ast.PyCF_ALLOW_TOP_LEVEL_AWAIT)
    if kind == "compile":
        return
    script = tmp_path / "snippet.py"
    script.write_text(code)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, f"{where}:\n{proc.stderr[-3000:]}"
