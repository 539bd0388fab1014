"""The Ray examples and the index example run as a user would run them, in a subprocess, offline.

Each prints what it shows and exits non-zero if what it claims does not hold;
the assertions below also check the printed claims.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def _run(script: str, data_dir: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO), "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}
    out = subprocess.run([sys.executable, str(REPO / "examples" / script), str(data_dir)], capture_output=True,
                         text=True, timeout=150, env=env, cwd=REPO)
    assert out.returncode == 0, f"{script} failed:\n{out.stdout}\n{out.stderr[-3000:]}"
    return out


@pytest.mark.ray
@pytest.mark.timeout(200)
def test_node_loss_example(tmp_path):
    out = _run("node_loss.py", tmp_path / "data").stdout
    assert "killing that node (SIGKILL)" in out
    assert "epoch 2, restarts 1" in out
    assert "model calls journaled: 10 for 10 passes; each once: True" in out
    assert "transcript equals an uninterrupted run: True" in out
    assert "# Report: how Ray detects a lost node" in out


@pytest.mark.ray
@pytest.mark.timeout(200)
def test_fork_fanout_example(tmp_path):
    out = _run("fork_fanout.py", tmp_path / "data").stdout
    assert "forking from turn 3" in out
    assert out.count("forked_from=fanout-demo") == 4
    assert "4 forks, original untouched: True" in out
    # The progress hook printed, and never more than max_concurrent_forks=2 running.
    progress = [line for line in out.splitlines() if line.strip().startswith("forks:")]
    assert progress and all(int(line.split(",")[1].split()[0]) <= 2 for line in progress)
    assert "0 queued, 0 running, 4 done, 0 failed" in progress[-1]


@pytest.mark.timeout(120)
def test_index_query_example(tmp_path):
    out = _run("index_query.py", tmp_path / "data").stdout
    assert "duckdb:  bob    sess-2  turns=10" in out
    assert ("store.query: 3 completed checkpoints; alice has 11 checkpoints in 2 sessions; "
            "same answers as before compaction: True") in out
    assert "pyarrow: alice has 11 checkpoints" in out
