"""Every Python snippet in README.md runs, as written, in a fresh directory."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SNIPPETS = re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), flags=re.S)


def test_readme_has_snippets():
    assert SNIPPETS, "README.md lost its Python examples"


@pytest.mark.parametrize("index", range(len(SNIPPETS)))
def test_readme_snippet_runs(index, tmp_path):
    script = tmp_path / f"snippet_{index}.py"
    script.write_text(SNIPPETS[index])
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (tmp_path / "loomray-data" / "sessions").is_dir()  # it really wrote checkpoints


def test_readme_stays_a_guide():
    """The README guides (what it is, quick start, a first agent, Ray, steering, storage, guarantees, limits);
    reference and figures live in docs/."""
    assert len((ROOT / "README.md").read_text().splitlines()) <= 300
