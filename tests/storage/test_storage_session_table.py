"""The compacted session-status table: exact after status changes, retention, prune and a forged row, read by
DuckDB and pyarrow as outside readers would, and rewritten only where sessions changed."""

from __future__ import annotations

import json
from datetime import datetime, timedelta, timezone

import pyarrow as pa
import pyarrow.dataset as ds
import pyarrow.parquet as pq
import pytest

from loomray.storage import CheckpointInfo, SessionRow, open_store
from loomray.storage.rows import session_rows_table
from loomray.storage.session_table import read_session_table, read_session_tables, session_table_key
from loomray.storage.testing import write_checkpoint, write_index_file

T0 = datetime(2026, 12, 1, tzinfo=timezone.utc)


def _status(store, sid, user, status, minute, error=None, **kw):
    store.sessions.put(SessionRow(session_id=sid, user_id=user, status=status, updated_at=T0 + timedelta(minutes=minute),
                                 run_id="r1", agent_ref=None, spec_json=None, epoch=1, node_id=None, error=error, **kw))


def _table_view(store) -> set[tuple]:
    data = ds.dataset(f"{store.fsspec()[1]}/index/session_table", format="parquet", partitioning="hive").to_table()
    return {(r["user_id"], r["session_id"], r["status"]) for r in data.to_pylist()}


def _listing(store) -> set[tuple]:
    return {(r.user_id, r.session_id, r.status) for r in store.sessions.list()}


@pytest.fixture
def store(tmp_path):
    return open_store(tmp_path / "root")


def test_the_table_holds_the_latest_status_of_every_session(store):
    for i in range(4):
        _status(store, f"s{i}", "alice" if i % 2 else None, "running", i)
    _status(store, "s1", "alice", "completed", 10)
    _status(store, "s2", None, "failed", 11, error="ToolError")
    store.compact()
    assert _table_view(store) == _listing(store) == {
        (None, "s0", "running"), ("alice", "s1", "completed"), (None, "s2", "failed"), ("alice", "s3", "running")}
    duckdb = pytest.importorskip("duckdb")
    root = store.fsspec()[1]
    counts = duckdb.sql(f"select user, status, count(*) from read_parquet('{root}/index/session_table/*/*.parquet', "
                        "hive_partitioning = true) group by all order by all").fetchall()
    assert counts == [("_", "failed", 1), ("_", "running", 1), ("alice", "completed", 1), ("alice", "running", 1)]


def test_exact_after_retention_prune_and_more_status_changes(store):
    for i in range(3):
        _status(store, f"s{i}", "bob", "running", i)
        for n in range(3):
            write_checkpoint(store, b"{}", CheckpointInfo(session_id=f"s{i}", checkpoint_id=f"c{n}", user_id="bob",
                                                       turn=n, created_at=T0, position="after_tools",
                                                       execution_status="active", message_count=n), keep=2)
    store.compact()
    _status(store, "s0", "bob", "cancelled", 20)
    store.prune(session_id="s1", user_id="bob")  # prune compacts its users at once
    assert _table_view(store) == _listing(store)
    assert ("bob", "s0", "cancelled") in _table_view(store)
    _status(store, "s2", "bob", "completed", 30)
    store.compact()
    assert _table_view(store) == _listing(store) == {
        ("bob", "s0", "cancelled"), ("bob", "s1", "running"), ("bob", "s2", "completed")}


def test_a_forged_row_in_another_sessions_partition_never_reaches_the_table(store):
    _status(store, "victim", "carol", "running", 0)
    _status(store, "mallory", "carol", "running", 0)
    forged = session_rows_table([SessionRow(session_id="victim", user_id="carol", status="cancelled",
                                            updated_at=T0 + timedelta(days=1), run_id="x", agent_ref=None,
                                            spec_json=None, epoch=9, node_id=None, error=None)])
    write_index_file(store, "index/sessions/user=carol/session=mallory/", forged)
    store.compact()
    assert ("carol", "victim", "running") in _table_view(store)
    assert ("carol", "victim", "cancelled") not in _table_view(store)


def test_a_compaction_with_no_change_rewrites_nothing(store):
    _status(store, "s0", "dave", "running", 0)
    store.compact()
    key = session_table_key("dave")
    before = store.objects.get(key=key)
    store.compact()
    after = store.objects.get(key=key)
    assert before is not None and after is not None and before.etag == after.etag
    assert read_session_table(store, "dave").num_rows == 1


def test_an_unreadable_table_file_is_rebuilt(store):
    _status(store, "s0", "erin", "running", 0)
    store.compact()
    store.objects.put(key=session_table_key("erin"), data=b"not parquet")
    _status(store, "s0", "erin", "completed", 5)
    store.compact()
    assert _table_view(store) == {("erin", "s0", "completed")}
    assert isinstance(read_session_table(store, "erin"), pa.Table)


def test_change_markers_name_what_the_table_is_behind_on_and_compaction_clears_only_what_it_absorbed(store):
    _status(store, "s0", "fay", "running", 0)
    _status(store, "s1", None, "running", 1)
    assert set(store.sessions.changed()) == {("fay", "s0"), (None, "s1")}
    assert set(store.sessions.changed("fay")) == {("fay", "s0")}
    real = store.sessions.changed

    def listed_then_written(user_id=...):
        out = real(user_id)
        _status(store, "s2", "fay", "running", 2)  # after the compaction's marker LIST, before its row LIST
        return out

    store.sessions.changed = listed_then_written
    store.compact()
    del store.sessions.changed
    assert set(store.sessions.changed()) == {("fay", "s2")}  # its marker was not listed: it stays
    assert _table_view(store) == {("fay", "s0", "running"), (None, "s1", "running"), ("fay", "s2", "running")}
    _status(store, "s0", "fay", "completed", 3)
    assert set(store.sessions.changed()) == {("fay", "s2"), ("fay", "s0")}
    store.compact()
    assert store.sessions.changed() == {}
    assert ("fay", "s0", "completed") in _table_view(store)


def test_a_table_written_before_status_rows_carried_turn_and_cost_still_reads(store):
    _status(store, "s0", "gus", "completed", 0)
    store.compact()
    old = read_session_table(store, "gus").drop_columns(["turn", "cost_usd", "exploration_id"])
    sink = pa.BufferOutputStream()
    pq.write_table(old, sink)
    store.objects.put(key=session_table_key("gus"), data=sink.getvalue().to_pybytes())
    table = read_session_tables(store)
    assert table.num_rows == 1 and table["turn"].to_pylist() == [None]
    _status(store, "s1", "gus", "completed", 1, turn=4, cost_usd=0.5)
    store.compact()
    assert sorted(read_session_tables(store)["turn"].to_pylist(), key=str) == [4, None]


def test_a_change_marker_that_names_another_session_is_not_believed(store):
    _status(store, "victim", "hal", "running", 0)
    store.compact()
    forged = json.dumps({"session_id": "victim", "user_id": "hal", "status": "cancelled",
                         "updated_at": (T0 + timedelta(days=1)).isoformat()}).encode()
    store.objects.put(key="changed/hal/mallory/0000000000000000001-aaaa.json", data=forged)
    store.objects.put(key="changed/hal/victim/0000000000000000001-bbbb.json", data=b"not json")
    rows = {(r.session_id, r.status) for r in store.sessions.changed_rows("hal")}
    assert rows == {("victim", "running")}  # mallory's marker is skipped, victim's row comes from the index


def test_a_table_file_holding_another_users_rows_shows_only_its_own(store):
    _status(store, "s0", "ida", "completed", 0)
    _status(store, "s1", "jon", "completed", 1)
    store.compact()
    mixed = pa.concat_tables([read_session_table(store, "ida"), read_session_table(store, "jon")])
    sink = pa.BufferOutputStream()
    pq.write_table(mixed, sink)
    store.objects.put(key=session_table_key("ida"), data=sink.getvalue().to_pybytes())
    assert read_session_tables(store, "ida")["session_id"].to_pylist() == ["s0"]
    assert sorted(read_session_tables(store)["session_id"].to_pylist()) == ["s0", "s1"]
