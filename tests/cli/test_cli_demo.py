"""``loomray demo --fast`` end to end, as ``make demo`` runs it (its own 3-node cluster, in a subprocess)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.ray, pytest.mark.timeout(240)]

REPO = Path(__file__).resolve().parents[2]
LOOMRAY = Path(sys.executable).with_name("loomray")
CMD = [str(LOOMRAY)] if LOOMRAY.exists() else [sys.executable, "-m", "loomray.cli"]


def test_demo_fast_kills_a_node_recovers_forks_and_queries(tmp_path):
    store = tmp_path / "demo-store"
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "LOOMRAY_STORE")}
    env["COLUMNS"] = "160"
    out = subprocess.run([*CMD, "demo", "--fast", "--store", str(store)], capture_output=True, text=True,
                         timeout=200, env=env, cwd=tmp_path)
    text = out.stdout + out.stderr
    assert out.returncode == 0, text[-3000:]
    assert "Traceback" not in text
    for step in ("step 1", "step 2", "step 3", "step 4", "step 5", "step 6", "step 7", "demo complete"):
        assert step in text, step
    assert "killing worker-" in text and "recovered: a new incarnation took the lease (epoch 2)" in text
    assert "each served exactly once" in text
    assert "had to be killed" not in text  # every cluster process exited on its own
    assert "loomray checkpoints sess" in text and f"--store {store}" in text

    # What the demo says happened is what the store holds.
    from loomray.checkpoint_format import load_checkpoint
    from loomray.cli.demo_agent import RESEARCH_AGENT_REF
    from loomray.cli.demo_steer import SIGNAL
    from loomray.storage import open_store

    st = open_store(store)
    sessions = st.sessions.list()
    main = [s for s in sessions if s.epoch == 2 and s.agent_ref == RESEARCH_AGENT_REF]
    assert len(main) == 1 and main[0].status == "completed"  # the killed session, continued by a 2nd incarnation
    sid = main[0].session_id
    assert st.checkpoints.list(sid, limit=1)[0].turn == 10  # 9 passes + report, --fast
    # Step 5, the steering round: the signal reached the model once; the approved call ran once.
    assert "awaiting_approval" in text and "published once" in text
    others = [s for s in sessions if s.session_id != sid]
    [publisher] = [s for s in others if st.checkpoints.list(s.session_id, limit=1)[0].forked_from is None]
    assert publisher.status == "completed" and publisher.epoch == 2  # stopped to wait, then a new incarnation
    messages = load_checkpoint(st, publisher.session_id).messages
    assert [m.content for m in messages if m.role == "user"].count(SIGNAL) == 1
    assert [m.content for m in messages if m.role == "tool" and m.name == "publish"] == [
        "published as 'Durable agents on Ray'"]
    forks = [s for s in others if s.session_id != publisher.session_id]
    assert len(forks) == 3 and {s.status for s in forks} == {"completed"}
    assert {st.checkpoints.list(s.session_id, limit=1)[0].forked_from for s in forks} == {sid}
