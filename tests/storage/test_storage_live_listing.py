"""Listing sessions by a live status reads the live markers, not every session ever run.

``list_sessions(status="running")`` on a store of 2,000 finished sessions read
one index object per session (2,001 GETs), and ``loomray supervise`` paid it
on every start.
"""

import uuid
from datetime import datetime, timedelta, timezone

from loomray.storage import Store, open_store
from loomray.storage.faults import FaultyObjectStore
from loomray.storage.rows import SessionRow

T0 = datetime(2026, 7, 4, tzinfo=timezone.utc)


def _row(session_id, status, minutes, user_id=None):
    return SessionRow(session_id=session_id, user_id=user_id, status=status, updated_at=T0 + timedelta(minutes=minutes))


def test_listing_running_sessions_reads_only_the_live_ones():
    store = open_store(f"memory://{uuid.uuid4().hex}")
    finished = 200
    for i in range(finished):
        store.sessions.put(_row(f"done-{i:04d}", "running", 0))
        store.sessions.put(_row(f"done-{i:04d}", "completed", 1))
    store.sessions.put(_row("live-a", "running", 2))
    store.sessions.put(_row("live-b", "pending", 2, user_id="alice"))
    store.sessions.put(_row("live-c", "running", 3, user_id="alice"))

    cold = Store(FaultyObjectStore(store.objects), store.url)  # a fresh process: nothing cached
    running = cold.sessions.list(status="running")
    counts = cold.objects.counts

    assert [(r.user_id, r.session_id) for r in running] == [("alice", "live-c"), (None, "live-a")]
    # One LIST of the markers, then each marked session's own rows: nothing of the 200 finished ones.
    assert counts["get"] <= 3 * 3 and counts["list"] <= 1 + 3, dict(counts)
    assert [r.session_id for r in cold.sessions.list(status="pending")] == ["live-b"]
    assert [r.session_id for r in cold.sessions.list(status="running", user_id="alice")] == ["live-c"]
    assert cold.sessions.list(status="running", user_id=None)[0].session_id == "live-a"
    # Every other status still reads the whole index, and agrees.
    assert len(cold.sessions.list(status="completed")) == finished


def test_a_marker_is_only_a_hint_the_row_decides(tmp_path):
    store = open_store(tmp_path / "store")
    store.sessions.put(_row("s1", "running", 0))
    store.sessions.put(_row("s1", "failed", 1))
    assert store.sessions.list(status="running") == []
    # A crash between a finished row and its marker's removal leaves a marker: the row still says finished.
    store.objects.put(key="live/_/bad%name", data=b"")
    assert store.sessions.list(status="running") == []
    # A forged marker that names no valid session is skipped, not a crash.
    store.objects.put(key="live/_/bad%name", data=b"")
    store.objects.put(key="live/=x/s2", data=b"")
    assert store.sessions.list(status="running") == []
    store.sessions.put(_row("s1", "running", 2))  # a new run
    assert [r.session_id for r in store.sessions.list(status="running")] == ["s1"]
