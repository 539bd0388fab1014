"""The compacted index table (storage/table.py): outside readers, table + tail queries, incremental and concurrent
compaction, tenancy."""

from __future__ import annotations

import json
from datetime import datetime, timedelta, timezone

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import loomray.storage.table as table_module
from loomray.storage import CheckpointInfo, Store, layout, open_store
from loomray.storage.table import Manifest, staleness
from loomray.storage.testing import write_checkpoint

T0 = datetime(2026, 7, 4, 22, 0, tzinfo=timezone.utc)  # rows of a session cross midnight: two day partitions
#: Ids a hive path treats specially, or that a glob or a URL would: spaces, non-ASCII, glob and quote characters.
#: (``=``, ``%`` and ``/`` are refused by storage.ids for every id, so they never reach a key.)
USERS = [None, "alice smith", "Zoë Ωμέγα", "b*[x]?#'&+"]
SESSIONS = ["sess one", "séance 東京", "s'q\"uote*"]


def put(store: Store, session_id: str, checkpoint_id: str, *, user_id=None, turn: int = 1, keep: int = 20,
        minutes: int | None = None, cost: float | None = None):
    data = json.dumps({"checkpoint_id": checkpoint_id, "turn": turn}).encode()
    info = CheckpointInfo(session_id=session_id, checkpoint_id=checkpoint_id, user_id=user_id, turn=turn,
                          created_at=T0 + timedelta(minutes=30 * turn if minutes is None else minutes),
                          position="after_tools", execution_status="completed" if turn % 2 else "active",
                          message_count=turn, cost_usd=0.1 * turn if cost is None else cost)
    return write_checkpoint(store, data, info, keep=keep)


def fill(store: Store, *, turns: int = 5, keep: int = 3) -> None:
    for u in USERS:
        for s in SESSIONS:
            for t in range(turns):
                put(store, s, f"c{t} ü", user_id=u, turn=t, keep=keep)


def live(store: Store) -> set[tuple]:
    rows = store.query(columns=["user_id", "session_id", "checkpoint_id", "cost_usd"]).to_pylist()
    return {(r["user_id"], r["session_id"], r["checkpoint_id"], r["cost_usd"]) for r in rows}


def _rows(table) -> set[tuple]:
    d = table.to_pydict() if hasattr(table, "to_pydict") else table
    return set(zip(d["user_id"], d["session_id"], d["checkpoint_id"], d["cost_usd"], strict=False))


def outside_reads(store: Store) -> dict[str, set[tuple]]:
    """The table as DuckDB, polars and pyarrow read it with no loomray code (the README's one-liners)."""
    import duckdb
    import polars as pl

    fs, root = store.fsspec()
    cols = "user_id, session_id, checkpoint_id, cost_usd"
    out = {}
    if store.objects.backend == "file":
        glob = f"{root}/index/table/*/*/*.parquet"
        out["pyarrow"] = _rows(pq.read_table(f"{root}/index/table", partitioning=None))
        out["duckdb"] = _rows(duckdb.sql(f"select {cols} from read_parquet('{glob}', hive_partitioning=false)")
                              .to_arrow_table())
        out["polars"] = _rows(pl.scan_parquet(glob, hive_partitioning=False).collect().to_arrow())
    else:
        out["pyarrow"] = _rows(pq.read_table(f"{root}/index/table", filesystem=fs, partitioning=None))
        con = duckdb.connect()
        con.register_filesystem(fs)  # DuckDB reads s3:// through fsspec (s3fs): no httpfs extension download
        out["duckdb"] = _rows(con.sql(f"select {cols} from read_parquet('s3://{root}/index/table/*/*/*.parquet', "
                                      "hive_partitioning=false)").to_arrow_table())
        con.close()
        o = store.objects._fs_options
        opts = {"aws_endpoint_url": o["endpoint_url"], "aws_access_key_id": o["key"],
                "aws_secret_access_key": o["secret"], "aws_region": o["region"] or "us-east-1",
                "aws_allow_http": "true"}
        out["polars"] = _rows(pl.scan_parquet(f"s3://{root}/index/table/*/*/*.parquet", hive_partitioning=False,
                                              storage_options=opts).collect().to_arrow())
    return out


def assert_outside_readers_see(store: Store, expected: set[tuple]) -> None:
    for reader, rows in outside_reads(store).items():
        assert rows == expected, (reader, sorted(rows ^ expected)[:5])


@pytest.fixture(params=["local", "s3"])
def bucket_store(request, tmp_path):
    if request.param == "local":
        st = open_store(tmp_path / "store")
    else:
        st = request.getfixturevalue("s3_server").open_store()
    yield st
    st.close()


def test_outside_readers_get_exactly_the_live_rows_after_retention_delete_and_prune(bucket_store):
    store = bucket_store
    fill(store)  # keep=3: retention retires two of five rows per session
    store.checkpoints.delete(SESSIONS[0], "c4 ü", user_id=USERS[1])
    store.compact()
    expected = live(store)
    assert len(expected) == len(USERS) * len(SESSIONS) * 3 - 1
    assert staleness(store.query()).tail_files == 0
    assert_outside_readers_see(store, expected)

    # prune refreshes the table of the users it touched: the bucket never shows pruned rows again
    store.prune(before=T0 + timedelta(minutes=30 * 4), user_id=USERS[2])
    expected = live(store)
    assert not any(u == USERS[2] and c != "c4 ü" for u, _, c, _ in expected)
    assert_outside_readers_see(store, expected)
    store.prune(session_id=SESSIONS[1], user_id=USERS[3])
    expected = live(store)
    assert not any(u == USERS[3] and s == SESSIONS[1] for u, s, _, _ in expected)
    assert_outside_readers_see(store, expected)

    # more writes (and retention) land in the tail until the next compaction
    for t in range(5, 8):
        put(store, SESSIONS[2], f"c{t} ü", user_id=None, turn=t, keep=3)
    assert staleness(store.query()).tail_sessions == 1
    stale = outside_reads(store)["pyarrow"]
    assert stale == expected  # the table is as of the last compaction: consistent, not torn
    store.compact()
    assert_outside_readers_see(store, live(store))


def test_query_reads_the_table_plus_the_tail_and_says_how_stale_the_table_is(store):
    for s in ("a", "b"):
        for t in range(4):
            put(store, s, f"c{t}", user_id="u1", turn=t)
    first = store.query(user_id="u1")
    st = staleness(first)
    assert st.table_as_of is None and st.tail_sessions == 2 and st.tail_files == 8
    assert "no compacted table yet" in st.describe()
    report = store.compact()
    assert report.table_users == 1 and report.table_rows == 8
    after = store.query(user_id="u1")
    assert after.sort_by("key").equals(first.sort_by("key"))
    st = staleness(after)
    assert st.tail_files == 0 and st.table_as_of is not None and "compacted table as of" in st.describe()
    put(store, "a", "c9", user_id="u1", turn=9, keep=3)  # a new row and a retention tombstone: tail
    rows = store.query(user_id="u1")
    assert sorted(rows.filter(pa.compute.equal(rows["session_id"], "a"))["checkpoint_id"].to_pylist()) == \
        ["c2", "c3", "c9"]
    assert staleness(rows).tail_sessions == 1
    # filters apply to both parts
    assert store.query(user_id="u1", session_id="b").num_rows == 4
    assert store.query(session_id="a").num_rows == 3
    assert store.query(user_id="u1", since=T0 + timedelta(minutes=60), until=T0 + timedelta(minutes=91)).num_rows == 4
    assert store.query(user_id="u1", min_cost=0.25).num_rows == 3
    assert store.query(user_id="nobody").num_rows == 0


def test_incremental_compaction_rewrites_only_the_days_of_changed_sessions(store):
    for s in range(6):
        for t in range(4):
            put(store, f"s{s}", f"c{t}", user_id=f"u{s % 2}", turn=t, minutes=t * 24 * 60)  # one day per turn
    full = store.compact()
    assert full.table_users == 2 and full.table_partitions == 8
    etags = {o.key: o.etag for o in store.objects.list(prefix="index/table/")}
    assert store.compact().table_partitions == 0  # nothing changed: nothing read, nothing written
    assert {o.key: o.etag for o in store.objects.list(prefix="index/table/")} == etags
    put(store, "s2", "c9", user_id="u0", turn=9, minutes=3 * 24 * 60 + 5)
    inc = store.compact()
    assert (inc.table_users, inc.table_partitions) == (1, 1)  # the new row's day, u0 only
    changed = {k for k, e in {o.key: o.etag for o in store.objects.list(prefix="index/table/")}.items()
               if etags.get(k) != e}
    assert changed == {layout.table_partition_key("u0", "2026-07-07"), layout.table_manifest_key("u0")}
    assert store.query(user_id="u0", session_id="s2").num_rows == 5
    store.checkpoints.delete("s4", "c0", user_id="u0")
    assert store.compact().table_partitions == 1  # the day of the retired row
    assert store.query(user_id="u0", session_id="s4").num_rows == 3
    assert_outside_readers_see(store, live(store)) if store.objects.backend != "memory" else None


def test_incremental_compaction_reads_only_changed_sessions(tmp_path):
    store = open_store(tmp_path / "root")
    for s in range(20):
        put(store, f"s{s}", "c1", turn=1)
        put(store, f"s{s}", "c2", turn=2)
    store.compact()
    put(store, "s7", "c3", turn=3)
    gets = []
    real = store.objects.get

    def counting_get(*, key):
        gets.append(key)
        return real(key=key)

    store.objects.get = counting_get  # type: ignore[method-assign]
    fresh = Store(store.objects, store.url)
    report = fresh.compact()
    index_gets = [k for k in gets if k.startswith("index/checkpoints/")]
    # s7's new file only: its compacted file is not read again (the new file is merged on its own)
    assert all("session=s7/" in k and not k.endswith("-c.parquet") for k in index_gets) and len(index_gets) == 1
    assert report.table_partitions == 1 and report.rows == 41


def test_a_concurrent_compactor_never_resurrects_a_row_in_the_table(store):
    put(store, "s1", "c1", turn=1, keep=0)
    put(store, "s1", "c2", turn=2, keep=0)
    a = Store(store.objects, store.url)
    b = Store(store.objects, store.url)
    real = a._index.read_files
    raced = []

    def read_then_race(keys, **kw):
        out = real(keys, **kw)
        if not raced:
            assert store.checkpoints.delete("s1", "c1")  # A holds c1 as live; B applies its retirement
            raced.append(b.compact())
        return out

    a._index.read_files = read_then_race  # type: ignore[method-assign]
    report = a.compact()
    assert raced and raced[0].table_users == 1
    assert report.table_skipped == 1 and report.table_users == 0  # B committed since A read the manifest
    assert sorted(store.query()["checkpoint_id"].to_pylist()) == ["c2"]
    if store.objects.backend != "memory":
        assert {c for _, _, c, _ in outside_reads(store)["pyarrow"]} == {"c2"}
    assert Store(store.objects, store.url).compact().table_partitions in (0, 1)
    assert sorted(store.query()["checkpoint_id"].to_pylist()) == ["c2"]


def test_a_stalled_write_phase_is_taken_over_and_its_late_writes_fail(store, monkeypatch):
    """Compactor A starts its write phase, stalls past the intent's lifetime; B takes the table over and rebuilds
    it (a row was retired meanwhile); A's partition PUT then fails on the ETag it expected, and nothing returns."""
    for t in range(3):
        put(store, "s1", f"c{t}", turn=t, keep=0)
    store.compact()  # a table exists: A's next run is incremental
    put(store, "s1", "c3", turn=3, keep=0)
    a = Store(store.objects, store.url)
    b = Store(store.objects, store.url)
    real_put = store.objects.put
    later = [timedelta(0)]
    monkeypatch.setattr(table_module, "utcnow", lambda: datetime.now(timezone.utc) + later[0])
    stalled = []

    def put_stalling_in_the_write_phase(*, key, data, **kw):
        if key.endswith("part-0.parquet") and not stalled:
            stalled.append(key)
            later[0] = timedelta(minutes=11)  # A's intent (10 min) expires while A is paused here
            assert store.checkpoints.delete("s1", "c0")
            assert b.compact().table_users == 1  # takes the expired intent over and rebuilds
            later[0] = timedelta(0)
        return real_put(key=key, data=data, **kw)

    monkeypatch.setattr(store.objects, "put", put_stalling_in_the_write_phase)
    report = a.compact()
    assert stalled and report.table_users == 0 and report.table_skipped == 1
    monkeypatch.setattr(store.objects, "put", real_put)
    assert sorted(store.query()["checkpoint_id"].to_pylist()) == ["c1", "c2", "c3"]
    if store.objects.backend != "memory":
        assert {c for _, _, c, _ in outside_reads(store)["pyarrow"]} == {"c1", "c2", "c3"}


def test_a_partition_the_manifest_does_not_record_makes_the_next_compaction_rebuild(store, caplog):
    for t in range(3):
        put(store, "s1", f"c{t}", turn=t)
    store.compact()
    key = layout.table_partition_key(None, "2026-07-04")
    sink = pa.BufferOutputStream()
    pq.write_table(pq.read_table(pa.BufferReader(store.objects.get(key=key).data)), sink, compression="gzip")
    store.objects.put(key=key, data=sink.getvalue().to_pybytes())  # rewritten behind the manifest's back
    report = store.compact()
    assert report.table_users == 1
    assert any("rebuilt from the per-session index" in r.message for r in caplog.records)
    assert store.query().num_rows == 3 and staleness(store.query()).tail_files == 0


def test_an_unreadable_manifest_reads_as_tail_and_is_rebuilt(store):
    for t in range(3):
        put(store, "s1", f"c{t}", turn=t)
    store.compact()
    store.objects.put(key=layout.table_manifest_key(None), data=b"not gzip")
    fresh = Store(store.objects, store.url)
    assert fresh.query().num_rows == 3 and staleness(fresh.query()).tail_sessions == 1
    assert fresh.compact().table_users == 1
    assert staleness(fresh.query()).tail_files == 0


def test_every_object_of_a_user_lives_under_prefixes_naming_the_user(tmp_path):
    store = open_store(tmp_path / "root")
    for u in ("alice", "bob"):
        for t in range(4):
            put(store, "s", f"c{t}", user_id=u, turn=t, keep=2)
    store.compact()
    allowed = {u: (f"sessions/{u}/", f"index/checkpoints/user={u}/", f"index/sessions/user={u}/",
                   f"index/table/user={u}/", f"active/{u}/") for u in ("alice", "bob")}
    for o in store.objects.list(prefix=""):
        owners = [u for u, prefixes in allowed.items() if o.key.startswith(prefixes)]
        assert len(owners) == 1, o.key
        if o.key.startswith("index/table/") and o.key.endswith(".parquet"):
            users = set(pq.read_table(pa.BufferReader(store.objects.get(key=o.key).data))["user_id"].to_pylist())
            assert users == {owners[0]}


def test_a_query_after_compaction_makes_few_requests_on_s3(s3_server):
    store = s3_server.open_store()
    for s in range(30):
        for t in range(4):
            put(store, f"s{s}", f"c{t}", user_id=f"u{s % 10}", turn=t)
    store.compact()
    calls = {"get": 0, "list": 0}
    objects = store.objects
    real_get, real_list = objects.get, objects.list

    def get(*, key):
        calls["get"] += 1
        return real_get(key=key)

    def list_(*, prefix):
        calls["list"] += 1
        return real_list(prefix=prefix)

    objects.get, objects.list = get, list_  # type: ignore[method-assign]
    cold = Store(objects, store.url)
    rows = cold.query(user_id="u3", since=T0, until=T0 + timedelta(hours=2), min_cost=0.1)
    assert rows.num_rows == 3 * 3
    assert calls["get"] <= 3 and calls["list"] == 2, calls


def test_manifest_round_trips():
    m = Manifest("Zoë", 3, T0, T0, {"2026-07-04": {"etag": '"x"', "rows": 2}},
                 {"séance 東京": table_module.SessionState(("a.parquet",), ("2026-07-04",), True, 2)}, None)
    assert Manifest.decode(m.encode(), "here") == m


def test_appends_are_merged_without_rereading_the_sessions_compacted_file(store):
    for t in range(40):
        put(store, "s1", f"c{t:02d}", turn=t, minutes=t, keep=1000)
    store.compact()
    (base,) = store.index_files()
    gets = []
    real = store.objects.get

    def counting_get(*, key):
        gets.append(key)
        return real(key=key)

    put(store, "s1", "c40", turn=40, minutes=40, keep=38)  # a new row; retention retires c00-c02 (in the base)
    store.objects.get = counting_get  # type: ignore[method-assign]
    report = store.compact()
    assert base not in gets  # only what came after the compacted file was read and merged
    files = store.index_files()
    assert base in files and len(files) == 2 and report.rows == 38
    rows = sorted(store.query()["checkpoint_id"].to_pylist())
    assert rows == [f"c{t:02d}" for t in range(3, 41)] and staleness(store.query()).tail_files == 0
    if store.objects.backend != "memory":
        assert_outside_readers_see(store, live(store))
    store.objects.get = real  # type: ignore[method-assign]
    store.compact(tombstone_grace=timedelta(0))  # tombstones may go: everything is merged again
    assert len(store.index_files()) == 1
    assert sorted(store.query()["checkpoint_id"].to_pylist()) == rows
    assert [r.checkpoint_id for r in store.checkpoints.list("s1", limit=3)] == ["c40", "c39", "c38"]


def test_a_row_a_tombstone_in_the_unread_compacted_file_retires_stays_out_of_the_table(store):
    for t in range(40):
        put(store, "s1", f"c{t:02d}", turn=t, minutes=t, keep=1000)
    assert store.checkpoints.delete("s1", "c05")
    store.compact()  # the young tombstone of c05 stays in the compacted file
    put(store, "s1", "c05", turn=5, minutes=5, keep=1000)  # the id again: its tombstone retires this row too
    expected = sorted(store.query()["checkpoint_id"].to_pylist())
    assert "c05" not in expected
    base = max(store.index_files(), key=lambda k: k.endswith("-c.parquet"))
    store.compact()
    assert base in store.index_files()  # merged without the compacted file
    assert sorted(store.query()["checkpoint_id"].to_pylist()) == expected
    assert staleness(store.query()).tail_files == 0
    if store.objects.backend != "memory":
        assert_outside_readers_see(store, live(store))


def test_a_partition_written_before_a_column_existed_reads_it_as_null():
    """A compacted partition from before ``spend_usd`` existed reads like a per-session file of that age."""
    from loomray.storage.rows import CheckpointRow, checkpoint_rows_table

    row = CheckpointRow(session_id="s", checkpoint_id="c1", turn=1, created_at=T0, position="after_tools",
                        execution_status="active", message_count=1, epoch=0, key="k", size=1, sha256="0" * 64,
                        spend_usd=0.5)
    rows = checkpoint_rows_table([row], tombstone=False, written_at=T0).select(table_module.TABLE_SCHEMA.names)
    old = table_module.decode_partition(table_module.encode_partition(rows.drop_columns(["spend_usd"]), 1, "t"))
    assert old.schema.equals(table_module.TABLE_SCHEMA) and old["spend_usd"].to_pylist() == [None]
    assert table_module.decode_partition(table_module.encode_partition(rows, 1, "t"))["spend_usd"].to_pylist() == [0.5]
