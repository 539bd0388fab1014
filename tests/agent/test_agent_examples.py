"""Every example runs, as a user would run it, in a subprocess."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def _run(script: str, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run([sys.executable, str(REPO / "examples" / script), *args], capture_output=True, text=True,
                          timeout=120, env=env, cwd=REPO)


def test_quickstart(tmp_path):
    out = _run("quickstart.py", str(tmp_path / "data"))
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0].startswith("run:    10 passes, 10 model calls")
    assert lines[1] == "# Report: durable agent sessions on Ray"
    assert "14 passes in total, 4 new model calls, resumed_from_checkpoint=True" in lines[2]
    assert "forked from research-2026-07-04" in lines[-1]
    assert (tmp_path / "data" / "sessions" / "_" / "research-2026-07-04" / "checkpoints").is_dir()


def test_crash_resume(tmp_path):
    out = _run("crash_resume.py", str(tmp_path / "data"))
    assert out.returncode == 0, out.stderr
    assert "first process exited with -9" in out.stdout
    assert "each pass billed once: True" in out.stdout
    assert "latest checkpoint: turn 10, completed" in out.stdout


def test_loop_bench_smoke(tmp_path):
    """The benchmark still runs (numbers are not asserted: speed lives in bench/, not in tests)."""
    import json

    env = {**os.environ, "PYTHONPATH": str(REPO)}
    out = subprocess.run([sys.executable, str(REPO / "bench" / "loop_bench.py"), "--quick", "--sizes", "10",
                          "--backends", "local", "--out", str(tmp_path / "loop.json")],
                         capture_output=True, text=True, timeout=120, env=env, cwd=REPO)
    assert out.returncode == 0, out.stderr
    data = json.loads((tmp_path / "loop.json").read_text())
    modes = {r["mode"]: r for r in data["rows"]}
    assert set(modes) == {"bare", "off", "sync", "async"}
    assert modes["sync"]["checkpoints"] == 10 and modes["off"]["checkpoints"] == 0
    assert modes["sync"]["bytes_written"] > modes["off"]["bytes_written"] > modes["bare"]["bytes_written"]
