"""The sessions list's rows, filters and pages, read from the store's index (no browser)."""

from __future__ import annotations

import uuid
from datetime import datetime, timedelta, timezone

import pytest

from loomray.ui.listing import ListQuery, Snapshots, list_sessions
from storage import CheckpointInfo, open_store
from storage.sessions import ANY

T0 = datetime(2026, 7, 1, tzinfo=timezone.utc)


@pytest.fixture
def store():
    st = open_store(f"memory://{uuid.uuid4().hex}")
    for s in range(120):  # session s: 2 checkpoints, its latest at T0 + s minutes; every 10th one completed
        for turn in (1, 2):
            st.put_checkpoint(b"{}", CheckpointInfo(
                session_id=f"s{s:03d}", user_id="bob" if s % 3 == 0 else "alice", checkpoint_id=f"c{s:03d}-{turn}",
                turn=turn, created_at=T0 + timedelta(minutes=s, seconds=turn - 2), position="after_tools",
                execution_status="completed" if turn == 2 and s % 10 == 0 else "active", message_count=2 * turn,
                cost_usd=0.01 * s * turn))
    yield st
    st.close()


def test_one_row_per_session_from_its_latest_checkpoint_newest_first_in_pages(store):
    first = list_sessions(store, ListQuery())
    assert first.total == 120 and len(first.rows) == 50
    assert [r.session_id for r in first.rows[:3]] == ["s119", "s118", "s117"]
    top = first.rows[0]
    assert (top.turns, top.spend_usd, top.user_id, top.status) == (2, pytest.approx(2.38), "alice", "active")
    last = list_sessions(store, ListQuery(offset=100))
    assert [r.session_id for r in last.rows] == [f"s{s:03d}" for s in range(19, -1, -1)]


def test_filters_apply_to_each_sessions_latest_row(store):
    done = list_sessions(store, ListQuery(status="completed"))
    assert sorted(r.session_id for r in done.rows) == [f"s{s:03d}" for s in range(0, 120, 10)]
    assert {r.stop_reason for r in done.rows} == {"completed"}
    bob = list_sessions(store, ListQuery(user="bob"))
    assert bob.total == 40 and {r.user_id for r in bob.rows} == {"bob"}
    rich = list_sessions(store, ListQuery(min_spend=2.0))  # running total 0.02 * s
    assert rich.total == 20
    window = list_sessions(store, ListQuery(since=T0 + timedelta(minutes=10), until=T0 + timedelta(minutes=20)))
    assert window.total == 10
    assert [r.session_id for r in list_sessions(store, ListQuery(search="s11")).rows] == [
        f"s{s}" for s in range(119, 109, -1)]


def test_a_view_is_read_once_while_fresh(store, monkeypatch):
    snapshots = Snapshots(ttl_s=60)
    reads = []
    real = store.query
    monkeypatch.setattr(store, "query", lambda **kw: reads.append(kw) or real(**kw))
    for q in (ListQuery(), ListQuery(offset=50), ListQuery(status="completed"), ListQuery(search="s0")):
        list_sessions(store, q, snapshots)
    assert len(reads) == 1 and reads[0]["user_id"] is ANY
    list_sessions(store, ListQuery(user="bob"), snapshots)  # another view: its own read
    assert len(reads) == 2
