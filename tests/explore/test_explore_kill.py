"""A driver SIGKILLed in round 2 of 3; a new driver continues the exploration by its id.

Each driver is a real process (``explore_child.py``). The one continuing must
finish with the uninterrupted run's winner and scores, and the file-backed
counters of the branch model and of the model judge must show, across both
drivers, exactly the calls of an uninterrupted run: no finished branch ran
again, no unfinished one repeated a journaled call, no judge call was paid twice.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]


def _drive(data: Path, out: Path, *extra: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), str(HERE)])}
    return subprocess.run([sys.executable, str(HERE / "explore_child.py"), str(data), "xpl-kill", str(out), *extra],
                          env=env, capture_output=True, text=True, timeout=180)


def _calls(data: Path, name: str) -> int:
    path = data / name
    return len(path.read_text().split()) if path.exists() else 0


def test_a_killed_driver_resumes_without_repeating_a_model_call(tmp_path):
    reference, crashed = tmp_path / "reference", tmp_path / "crashed"
    reference.mkdir(), crashed.mkdir()
    done = _drive(reference, tmp_path / "reference.json")
    assert done.returncode == 0, done.stderr
    expected = json.loads((tmp_path / "reference.json").read_text())

    killed = _drive(crashed, tmp_path / "killed.json", "kill")
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    assert not (tmp_path / "killed.json").exists()
    # Killed in round 2: round 1 decided, round 2 planned, none of its branches judged.
    record = crashed / "store" / "sessions" / "_" / "base" / "explorations" / "xpl-kill"
    names = sorted(p.stem for p in record.iterdir())
    assert "r001-keep" in names and "r002-plan" in names
    assert not any(n.startswith(("r002-score", "r002-done", "r003")) for n in names)
    calls_before = _calls(crashed, "model_calls")
    assert 0 < calls_before < _calls(reference, "model_calls")

    resumed = _drive(crashed, tmp_path / "resumed.json")
    assert resumed.returncode == 0, resumed.stderr
    got = json.loads((tmp_path / "resumed.json").read_text())
    assert got == expected
    assert _calls(crashed, "model_calls") == _calls(reference, "model_calls")
    assert _calls(crashed, "judge_calls") == _calls(reference, "judge_calls") == 9


def test_a_driver_killed_inside_a_model_judges_call_resumes_without_paying_the_judge_twice(tmp_path):
    reference, crashed = tmp_path / "reference", tmp_path / "crashed"
    reference.mkdir(), crashed.mkdir()
    assert _drive(reference, tmp_path / "reference.json").returncode == 0
    expected = json.loads((tmp_path / "reference.json").read_text())

    killed = _drive(crashed, tmp_path / "killed.json", "killjudge")
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    assert (crashed / "judge_killed").exists() and _calls(crashed, "judge_calls") == 0  # its one call never answered
    record = crashed / "store" / "sessions" / "_" / "base" / "explorations" / "xpl-kill"
    assert not any(p.stem.startswith("r001-score") for p in record.iterdir())

    resumed = _drive(crashed, tmp_path / "resumed.json", "killjudge")  # the marker is there: no second kill
    assert resumed.returncode == 0, resumed.stderr
    assert json.loads((tmp_path / "resumed.json").read_text()) == expected
    # The call in flight was never answered, so never journaled: asked once more, and every judge call answered
    # once; the branches ran no model call twice.
    assert _calls(crashed, "judge_calls") == _calls(reference, "judge_calls") == 9
    assert _calls(crashed, "model_calls") == _calls(reference, "model_calls")
    # The judge session the kill interrupted holds one question and one answer, like the others.
    from loomray.checkpoint_format import load_checkpoint
    from loomray.storage import open_store

    store = open_store(crashed / "store")
    judged = [s for s in store.objects.list_dirs(prefix="sessions/_/") if "-j" in s]
    assert len(judged) == 9
    for sid in judged:
        messages = load_checkpoint(store, sid, "latest").messages
        assert [m.role for m in messages if m.role in ("user", "assistant")] == ["user", "assistant"], sid
