"""The sessions list's rows, filters and pages, read from the session-status table and its tail (no browser)."""

from __future__ import annotations

import uuid
from datetime import datetime, timedelta, timezone

import pytest
from ui_harness import bound

from loomray.storage import CheckpointInfo, SessionRow, open_store
from loomray.storage.testing import write_checkpoint
from loomray.ui.listing import ListQuery, TableCache, list_sessions

T0 = datetime(2026, 7, 1, tzinfo=timezone.utc)


def _status(store, s: int, status: str, **kw) -> None:
    store.sessions.put(SessionRow(session_id=f"s{s:03d}", user_id="bob" if s % 3 == 0 else "alice", status=status,
                                 updated_at=T0 + timedelta(minutes=s), run_id="r1", **kw))


@pytest.fixture(scope="module")
def store():
    """120 sessions, the latest change of session s at T0 + s minutes, its running total 0.02 * s after 2 turns;
    every 10th one failed, every 7th one a branch of exploration x1; compacted, then 3 more sessions and a
    status change that only the tail holds."""
    st = open_store(f"memory://{uuid.uuid4().hex}")
    for s in range(117):
        _status(st, s, "running")
        _status(st, s, "failed" if s % 10 == 0 else "completed", turn=2, cost_usd=0.02 * s,
                exploration_id="x1" if s % 7 == 0 else None)
    st.compact()
    for s in range(117, 120):
        _status(st, s, "completed", turn=2, cost_usd=0.02 * s, exploration_id="x1" if s % 7 == 0 else None)
    _status(st, 5, "cancelled", turn=2, cost_usd=0.1)  # at T0 + 5 min, as before: only its status changed
    yield st
    st.close()


def test_one_row_per_session_newest_first_in_pages_table_and_tail(store):
    assert len(store.sessions.changed()) == 4  # the tail: what the table does not hold yet
    first = list_sessions(store, ListQuery())
    assert first.total == 120 and len(first.rows) == 50
    assert [r.session_id for r in first.rows[:4]] == ["s119", "s118", "s117", "s116"]  # tail, then table
    top = first.rows[0]
    assert (top.turns, top.spend_usd, top.user_id, top.status, top.stop_reason) == (
        2, pytest.approx(2.38), "alice", "completed", "completed")
    last = list_sessions(store, ListQuery(offset=100))
    assert [r.session_id for r in last.rows] == [f"s{s:03d}" for s in range(19, -1, -1)]
    assert next(r for r in last.rows if r.session_id == "s005").status == "cancelled"  # the tail's row wins


def test_filters_apply_to_each_sessions_latest_row(store):
    failed = list_sessions(store, ListQuery(status="failed"))
    assert sorted(r.session_id for r in failed.rows) == [f"s{s:03d}" for s in range(0, 120, 10)]
    assert list_sessions(store, ListQuery(status="cancelled")).total == 1
    bob = list_sessions(store, ListQuery(user="bob"))
    assert bob.total == 40 and {r.user_id for r in bob.rows} == {"bob"}
    rich = list_sessions(store, ListQuery(min_spend=2.0))  # running total 0.02 * s
    assert rich.total == 20
    window = list_sessions(store, ListQuery(since=T0 + timedelta(minutes=10), until=T0 + timedelta(minutes=20)))
    assert window.total == 10
    assert [r.session_id for r in list_sessions(store, ListQuery(search="s11")).rows] == [
        f"s{s}" for s in range(119, 109, -1)]
    branches = list_sessions(store, ListQuery(exploration="x1"))
    assert [r.session_id for r in branches.rows] == [f"s{s:03d}" for s in range(119, -1, -1) if s % 7 == 0]
    assert {r.exploration_id for r in branches.rows} == {"x1"}


def test_a_page_reads_the_table_and_the_tail_not_every_session(store, monkeypatch):
    """What a first page GETs: one file per user of the table, the tail's status files, nothing per session
    beyond that (120 sessions here; the 100,000-session figure is bench/ui_bench.py's)."""
    gets: list[str] = []
    real = store.objects.get
    monkeypatch.setattr(store.objects, "get", lambda *, key: gets.append(key) or real(key=key))
    tables = TableCache()
    list_sessions(store, ListQuery(), tables)
    assert sorted(k for k in gets if k.startswith("index/session_table/")) == [
        "index/session_table/user=alice/part-0.parquet", "index/session_table/user=bob/part-0.parquet"]
    assert len(gets) <= 2 + 4 + 1, gets  # the table, the tail's 4 sessions (s005's merged file and its new row)
    gets.clear()
    list_sessions(store, ListQuery(offset=50), tables)  # table files and markers unchanged: nothing read again
    assert gets == []


def test_a_kept_view_is_current_after_a_status_change_and_a_compaction(store):
    tables = TableCache()
    assert list_sessions(store, ListQuery(), tables).rows[0].session_id == "s119"
    store.sessions.put(SessionRow(session_id="s050", user_id="alice", status="paused", run_id="r2",
                                 updated_at=T0 + timedelta(hours=9), turn=3, cost_usd=1.0))
    top = list_sessions(store, ListQuery(), tables).rows[0]
    assert (top.session_id, top.status, top.turns) == ("s050", "paused", 3)
    store.compact()
    assert store.sessions.changed() == {}
    after = list_sessions(store, ListQuery(), tables)
    assert (after.total, after.rows[0].session_id, after.rows[0].status) == (120, "s050", "paused")
    assert next(r for r in list_sessions(store, ListQuery(offset=100), tables).rows
                if r.session_id == "s005").status == "cancelled"


def test_a_running_sessions_turns_and_spend_come_from_its_latest_checkpoint():
    store = open_store(f"memory://{uuid.uuid4().hex}")
    store.sessions.put(SessionRow(session_id="live", user_id="alice", status="running", updated_at=T0 + timedelta(
        hours=5), run_id="r2", turn=0, cost_usd=0.0))
    for turn in (1, 2, 3):
        write_checkpoint(store, b"{}", CheckpointInfo(
            session_id="live", user_id="alice", checkpoint_id=f"c{turn}", turn=turn,
            created_at=T0 + timedelta(hours=5, minutes=turn), position="after_tools", execution_status="active",
            message_count=2 * turn, cost_usd=0.5 * turn))
    top = list_sessions(store, ListQuery()).rows[0]
    assert (top.session_id, top.status, top.stop_reason, top.turns, top.spend_usd) == (
        "live", "running", None, 3, pytest.approx(1.5))
    assert top.last_activity == T0 + timedelta(hours=5, minutes=3)


def test_a_runs_status_rows_carry_its_turns_spend_and_exploration(tmp_path):
    url = str(tmp_path / "store")
    chatty = bound(url, "chatty_agent")
    result = chatty.run_sync("Tell me a story.", session_id="s-branch", user_id="alice",
                             metadata={"exploration_id": "x-7"})
    chatty.run_sync("Another one.", session_id="s-plain", user_id="alice", metadata={"exploration_id": "../bad"})
    store = open_store(url)
    row = store.sessions.get("s-branch", user_id="alice")
    assert (row.status, row.turn, row.exploration_id) == ("completed", result.turns, "x-7")
    assert store.sessions.get("s-plain", user_id="alice").exploration_id is None  # not an id: not carried
    page = list_sessions(store, ListQuery(exploration="x-7"))
    assert [(r.session_id, r.turns, r.spend_usd) for r in page.rows] == [("s-branch", result.turns, row.cost_usd)]
