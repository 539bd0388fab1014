"""Crash tests: a real process running a session is SIGKILLed at deterministic points; a new one resumes.

Each point runs two child processes (``crash_child.py``, forked by ``crash_procs``) on one LocalRuntime
directory: the first kills itself with SIGKILL at the chosen point, the second
re-issues the same ``run(prompt, session_id=...)``. The transcript must equal
an uninterrupted run's, and the file-backed counter of the scripted model must
show each model reply served once across both processes -- except at the one
point where that is impossible (the model answered but the process died before
the journal write), where exactly one extra call is expected.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from crash_procs import run_child

REPO = Path(__file__).resolve().parents[2]
TURNS = 6  # 5 tool passes + the final answer

# (kill spec, checkpoint position, extra model calls expected, extra full tool effects expected; None: 0 or 1)
# With checkpoints after every pass the journal holds run_start, the six model answers and run_end: a pass's tool
# result is in the checkpoint written right after it (with async durability, a model answer is journaled only
# once the checkpoint before it landed). Without checkpoints the journal holds the tool results too.
POINTS = [
    *[(f"store:journal.append:after:{n}", "both", 0, 0) for n in range(1, 8)],  # the 8th is run_end
    ("store:journal.append:before:2", "both", 1, 0),   # model answered, journal write never happened
    ("store:journal.append:before:3", "both", 1, 0),   # the second answer, likewise
    ("store:journal.append:before:3", "both/async", 1, 0),  # likewise with async uploads
    ("store:journal.append:before:3", "off", 0, 1),    # tool ran, journal write never happened (at-least-once)
    # With "both", odd checkpoint writes follow a model answer, even ones a pass's tool: killed right before the
    # checkpoint that holds its result (the next write after its effect), the tool runs again (at-least-once).
    *[(f"store:checkpoints.log.put:{w}:{n}", "both", 0, 0) for n in (1, 2, 5, 6, 11) for w in ("before", "after")
      if (w, n) not in (("before", 2), ("before", 6))],
    ("store:checkpoints.log.put:before:2", "both", 0, 1),
    ("store:checkpoints.log.put:before:6", "both", 0, 1),
    ("store:leases.acquire:after:1", "both", 0, 0),
    ("store:sessions.put:after:1", "both", 0, 0),
    ("store:sessions.put:before:2", "both", 0, 0),
    ("store:sessions.put:after:2", "both", 0, 0),
    ("event:model_response:1", "both", 0, 0),           # between a model call and its checkpoint
    ("event:model_response:4", "after_tools", 0, 0),
    ("event:model_response:6", "after_tools", 0, 0),
    ("event:tool_result:2", "after_tools", 0, 1),       # its result was not in a checkpoint yet: runs again
    ("event:checkpoint:3", "both", 0, 0),
    ("tool:1", "both", 0, 0),
    ("tool:4", "after_tools", 0, 0),
    ("store:journal.append:after:3", "off", 0, 0),      # journal only, no checkpoints
    ("store:journal.append:after:8", "off", 0, 0),
    ("event:model_response:5", "off", 0, 0),
    ("tool:3", "off", 0, 0),
    # Async durability overlaps the upload with the next pass, so a kill right after an upload may land
    # anywhere in that pass, including the inherent windows (a model answer or a tool effect made but
    # not yet journaled): at most one extra of each, never more.
    ("store:checkpoints.log.put:after:3", "after_tools/async", None, None),
    ("event:model_response:4", "both/async", 0, 0),
]


def _child(data_dir: Path, out: Path, kill: str, position: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "CRASH_POSITION": position, "PYTHONPATH": str(REPO)}
    return run_child([str(data_dir), "sess-crash", str(out), kill], env, out.with_suffix(".log"))


def _scenario(base: Path, index: int, point: tuple) -> dict:
    kill, position, _, _ = point
    d = base / f"p{index:02d}"
    d.mkdir()
    first = _child(d, d / "first.json", kill, position)
    second = _child(d, d / "second.json", "", position)
    calls = [int(x) for x in (d / "model_calls").read_text().split()] if (d / "model_calls").exists() else []
    effects = (d / "effects").read_text().split() if (d / "effects").exists() else []
    result = json.loads((d / "second.json").read_text()) if (d / "second.json").exists() else None
    latest = None
    if not position.startswith("off") and second.returncode == 0:
        from loomray.checkpoint_format import load_checkpoint
        from loomray.storage import open_store

        store = open_store(d / "store")
        ckpt = load_checkpoint(store, "sess-crash")  # read back whole: the object itself holds one pass
        latest = ckpt.model_dump(mode="json") if ckpt is not None else None
        store.close()
    return {"first_rc": first.returncode, "first_err": first.stderr[-2000:], "second_rc": second.returncode,
            "second_err": second.stderr[-2000:], "calls": calls, "effects": effects, "result": result,
            "latest": latest}


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory):
    base = tmp_path_factory.mktemp("crash")
    ref_dir = base / "reference"
    ref_dir.mkdir()
    ref = _child(ref_dir, ref_dir / "out.json", "", "both")
    assert ref.returncode == 0, ref.stderr
    reference = json.loads((ref_dir / "out.json").read_text())
    # Two workers: each scenario is two short sequential processes (forked one at a time) and reads between.
    with ThreadPoolExecutor(max_workers=2) as pool:
        results = list(pool.map(lambda ip: _scenario(base, *ip), enumerate(POINTS)))
    return reference, dict(zip((p[0] + "|" + p[1] for p in POINTS), results, strict=False))


def test_enough_distinct_points():
    assert len({(p[0], p[1]) for p in POINTS}) == len(POINTS) >= 20


@pytest.mark.parametrize("point", POINTS, ids=[f"{p[0]}|{p[1]}" for p in POINTS])
def test_sigkill_then_resume_in_a_new_process(outcomes, point):
    reference, results = outcomes
    kill, position, extra_model, extra_tool = point
    o = results[f"{kill}|{position}"]
    assert o["first_rc"] == -signal.SIGKILL, f"the first process was not killed at {kill}: {o['first_err']}"
    assert o["second_rc"] == 0, o["second_err"]
    result = o["result"]
    assert result["messages"] == reference["messages"]
    assert result["output"] == "report: done" and result["turns"] == TURNS
    assert result["usage"] == reference["usage"]
    # Every model reply was served exactly once across both processes (plus the one unavoidable window).
    if extra_model is None:  # the window may or may not be hit: never more than one reply served twice
        assert len(o["calls"]) - TURNS in (0, 1), o["calls"]
    else:
        assert len(o["calls"]) == TURNS + extra_model, o["calls"]
    assert sorted(set(o["calls"])) == list(range(TURNS))
    full = [e for e in o["effects"] if not e.endswith("-partial")]
    assert sorted(set(full)) == [f"ray-{i}" for i in range(5)]
    if extra_tool is None:
        assert len(full) - 5 in (0, 1), o["effects"]
    else:
        assert len(full) == 5 + extra_tool, o["effects"]
    if not position.startswith("off"):
        assert o["latest"]["execution_status"] == "completed"
        assert o["latest"]["messages"] == reference["messages"]
