"""Red team for issue 22 ("one history for every reader"), storage side: attacks from outside the library.

Actors, on a local directory through the public ``Store`` API and plain writes into the directory (as anyone
who may write the bucket could): a zombie whose late row landed after a takeover, a hand-edited
``lease.json``, hostile or duplicated objects, a deleter racing a writer, pruners racing each other. Every
view (list, "latest", get by id, ``Store.query``, the table read by pyarrow and DuckDB) must show one
history. ``xfail(strict=True)``: a break found, left for the lead (docs/red-team.md).
"""

from __future__ import annotations

import json
import threading
from datetime import timedelta
from pathlib import Path

import pyarrow.dataset as ds
import pytest
from storage_views import query_ids

from loomray.storage import CheckpointInfo, Store, layout, open_store
from loomray.storage.errors import CorruptObjectError, StorageError
from loomray.storage.faults import FaultPlan, FaultyObjectStore
from loomray.storage.testing import T0, land_row, log_put, put_checkpoint


def ids(rows) -> list[str]:
    return [r.checkpoint_id for r in rows]




def table_ids(root: Path, session_id: str) -> dict[str, list[str]]:
    """The compacted table's checkpoint ids of ``session_id`` (of no user) as pyarrow and DuckDB read the
    directory, sorted."""
    import duckdb

    base = root / "index" / "table"
    files = sorted(str(p) for p in base.rglob("*.parquet")) if base.exists() else []
    arrow = ds.dataset(files, format="parquet").to_table(columns=["checkpoint_id"],
                                                         filter=(ds.field("session_id") == session_id)
                                                         & ds.field("user_id").is_null()) if files else None
    duck = duckdb.sql(f"SELECT checkpoint_id FROM read_parquet('{base}/*/*/*.parquet') "
                      f"WHERE session_id = '{session_id}' AND user_id IS NULL").fetchall() if files else []
    return {"pyarrow": sorted(arrow["checkpoint_id"].to_pylist()) if arrow is not None else [],
            "duckdb": sorted(r[0] for r in duck)}


def views(root: Path, session_id: str = "s1") -> dict[str, list[str]]:
    """Every reader's view of ``session_id`` from a cold store on ``root``, after a compaction."""
    reader = open_store(root)
    reader.compact(tombstone_grace=timedelta(0))
    listed = sorted(ids(reader.checkpoints.list(session_id, limit=0)))
    got = sorted(c for c in listed if reader.checkpoints.get(session_id, c) is not None)
    latest = reader.checkpoints.get(session_id)
    out = {"list": listed, "get": got, "query": query_ids(reader, session_id), **table_ids(root, session_id)}
    objects = (root / layout.session_prefix(session_id, None) / "checkpoints").glob("*.json")
    out["latest"] = sorted(p.stem for p in objects if p.read_bytes() == latest) if latest is not None else []
    reader.close()
    return out


def every(ids: list[str], latest: str | None) -> dict[str, list[str]]:
    """What :func:`views` shows when every view agrees on ``ids`` with ``latest`` as "latest"."""
    return {**dict.fromkeys(["list", "get", "query", "pyarrow", "duckdb"], sorted(ids)),
            "latest": [latest] if latest else []}


def fenced_row_lands(root: Path) -> None:
    """Holder (epoch 1) writes c1; a takeover; then the holder's c2 object and index row land at epoch 1 (a writer
    that checked its lease before the takeover and wrote after it: :func:`storage.testing.land_row`), so only
    the takeover's fence hides c2."""
    store = open_store(root)
    holder = store.leases.acquire("s1", owner="holder")
    put_checkpoint(store, "s1", "c1", turn=1, lease=holder)
    Store(store.objects, "taker").leases.acquire("s1", owner="taker")
    land_row(store, json.dumps({"session_id": "s1", "checkpoint_id": "c2", "turn": 2}).encode(),
             CheckpointInfo(session_id="s1", checkpoint_id="c2", turn=2, created_at=T0, position="after_tools",
                            execution_status="active", message_count=4), epoch=holder.epoch)
    store.close()


# --- zombies and lease.json ------------------------------------------------------------------------------------


def test_a_fenced_row_is_in_no_view_of_a_cold_reader(tmp_path):
    """Baseline: the zombie's late row c2 is in no view, before or after compaction (pyarrow and DuckDB too)."""
    fenced_row_lands(tmp_path / "d")
    assert views(tmp_path / "d") == every(["c1"], "c1")


def test_a_fenced_row_stays_hidden_after_ten_more_takeovers(tmp_path):
    """``lease.json`` keeps the fences of the last 8 owners only. Ten takeovers later the first fence is gone from
    the body: the zombie's row must have been retired by then, not shown again."""
    fenced_row_lands(tmp_path / "d")
    store = open_store(tmp_path / "d")
    for i in range(10):
        store.leases.acquire("s1", owner=f"owner{i}")
    store.compact(tombstone_grace=timedelta(0))
    assert views(tmp_path / "d") == every(["c1"], "c1")


def drop_fences(root: Path, session_id: str = "s1") -> None:
    """Rewrite ``lease.json`` by hand, as an operator or a script would: the same epoch and owner, well-formed,
    but without the ``checkpoints`` fence the takeover recorded."""
    path = root / layout.lease_key(session_id, None)
    body = json.loads(path.read_bytes())
    assert "checkpoints" in body  # the takeover recorded its fence here
    body.pop("checkpoints")
    path.write_text(json.dumps(body))


def test_a_hand_rewritten_lease_without_its_fence_shows_no_fenced_row(tmp_path):
    """The fence lives in ``lease.json`` (and its kept copy ``leases/{epoch}.json``). A body rewritten by hand that
    parses but lacks the fence must not resurrect the fenced row: visibility.parse_fences says the worst a forged
    lease does is hide rows, never resurrect one. Readers take the union of the body's fences and its kept
    copy's, and so does the next takeover, so c2, written by a zombie after the takeover, stays hidden."""
    fenced_row_lands(tmp_path / "d")
    drop_fences(tmp_path / "d")
    assert views(tmp_path / "d") == every(["c1"], "c1")
    store = open_store(tmp_path / "d")
    assert store.leases.acquire("s1", owner="next").epoch == 3
    store.close()
    drop_fences(tmp_path / "d")  # the next owner's own fence dropped too: its copy and epoch 2's still hold
    assert views(tmp_path / "d") == every(["c1"], "c1")


def test_an_older_lease_body_restored_by_hand_shows_no_fenced_row(tmp_path):
    """An operator restores ``lease.json`` from a backup: the body epoch 1's swap kept (``leases/1.json``), older
    than the takeover's. Readers must still hide the zombie's late row c2 (they read the newest kept copy's
    fences too), and so must they once the next owner has taken the session (epoch 3, above every marker): the
    takeover carries the newest copy's fences on, and retires c2 instead of recording it as history."""
    root = tmp_path / "d"
    fenced_row_lands(root)
    session = root / layout.session_prefix("s1", None)
    (session / "lease.json").write_bytes((session / "leases" / f"{1:020d}.json").read_bytes())
    assert views(root) == every(["c1"], "c1")
    store = open_store(root)
    assert store.leases.acquire("s1", owner="next").epoch == 3
    store.close()
    assert views(root) == every(["c1"], "c1")


@pytest.mark.parametrize("damage", ["deleted", "garbled"])
def test_repair_of_a_damaged_lease_keeps_the_fence(tmp_path, damage):
    """``lease.json`` deleted or garbled by hand, then ``repair_lease``: the new body is above every epoch, and the
    zombie's row stays hidden (the fence outlives the damaged body through its kept copy and the repair)."""
    fenced_row_lands(tmp_path / "d")
    lease = tmp_path / "d" / layout.lease_key("s1", None)
    if damage == "deleted":
        lease.unlink()
    else:
        lease.write_bytes(b'{"epoch": 2, "owner": ')
    store = open_store(tmp_path / "d")
    assert store.leases.repair("s1").epoch >= 3
    store.close()
    assert views(tmp_path / "d") == every(["c1"], "c1")


# --- hostile objects -------------------------------------------------------------------------------------------


def written(root: Path, n: int = 3) -> Store:
    store = open_store(root)
    lease = store.leases.acquire("s1", owner="w")
    log = store.checkpoints.log(lease, keep=20, batch=1)
    for i in range(1, n + 1):
        log_put(log, f"c{i}", turn=i)
    log.flush()
    return store


def overwrite_newest(root: Path) -> None:
    """c1..c3 written; c3's object replaced by hand with bytes of the same length."""
    written(root).close()
    path = root / layout.checkpoint_key("s1", None, "c3")
    path.write_bytes(b"x" * path.stat().st_size)


def test_a_same_size_overwrite_of_the_newest_object_is_skipped_by_every_view(tmp_path):
    """Anyone who can write the bucket replaces c3's object with bytes of the same length. "latest" skips it (its
    sha256 no longer matches) and get by id raises a typed error; the list must skip it too (the README: "a
    hostile object is a CheckpointException, listings skip it"), so list's head is "latest": sizes alone do not
    tell, so the list reads its newest object and checks its sha256. The list records the damage (a tombstone
    without a lease): from then on c3 is in no view, get by id is None, and ``Store.query`` and the table drop
    it."""
    root = tmp_path / "d"
    overwrite_newest(root)
    reader = open_store(root)
    assert reader.checkpoints.get("s1") == reader.checkpoints.get("s1", "c2")
    with pytest.raises(CorruptObjectError):
        reader.checkpoints.get("s1", "c3")
    assert ids(reader.checkpoints.list("s1")) == ["c2", "c1"]
    assert reader.checkpoints.get("s1", "c3") is None
    reader.close()
    assert views(root) == every(["c1", "c2"], "c2")


def test_a_reader_that_may_not_write_still_skips_a_same_size_overwrite(tmp_path):
    """A reader whose writes fail (read-only credentials) cannot record the damage: it still lists from "latest"
    (c2) on, get by id raises a typed error each time, and the next reader that may write and lists records
    it."""
    root = tmp_path / "d"
    overwrite_newest(root)
    reader = open_store(root)

    def read_only(**kw):
        raise StorageError("read-only")

    reader.objects.put = read_only  # type: ignore[method-assign]
    for _ in range(2):
        assert ids(reader.checkpoints.list("s1")) == ["c2", "c1"]
        assert reader.checkpoints.get("s1") == reader.checkpoints.get("s1", "c2")
        with pytest.raises(CorruptObjectError):
            reader.checkpoints.get("s1", "c3")
    assert query_ids(reader, "s1") == ["c1", "c2", "c3"]  # nothing recorded: the index still names c3
    reader.close()
    writer = open_store(root)
    assert ids(writer.checkpoints.list("s1")) == ["c2", "c1"]
    assert query_ids(writer, "s1") == ["c1", "c2"]
    writer.close()
    assert views(root) == every(["c1", "c2"], "c2")


@pytest.mark.parametrize("damage", ["removed", "truncated"])
def test_an_object_removed_or_truncated_by_hand_leaves_every_view(tmp_path, damage):
    """c3's object is removed (or cut short) by hand. The list skips it, "latest" is c2 and get by id is None
    (or a typed error); ``Store.query`` and the compacted table must not go on counting c3 as a checkpoint of
    the session. They read the index rows only: the first reader that found the damage retired c3's row (a
    tombstone), so both drop it."""
    root = tmp_path / "d"
    written(root).close()
    path = root / layout.checkpoint_key("s1", None, "c3")
    if damage == "removed":
        path.unlink()
    else:
        path.write_bytes(path.read_bytes()[:10])
    reader = open_store(root)
    assert ids(reader.checkpoints.list("s1")) == ["c2", "c1"]
    assert reader.checkpoints.get("s1") == reader.checkpoints.get("s1", "c2")
    reader.close()
    got = views(root)
    assert got["list"] == got["query"] == got["pyarrow"] == got["duckdb"] == ["c1", "c2"]


def test_a_duplicated_index_file_shows_no_row_twice(tmp_path):
    """An index file copied under another name in its partition (a replayed upload, a backup restored beside
    the original): no reader shows a row twice, and the table has each checkpoint once."""
    root = tmp_path / "d"
    written(root).close()
    partition = root / layout.index_partition(layout.CHECKPOINT_INDEX, "s1", None)
    first = sorted(partition.glob("*.parquet"))[0]
    (partition / ("zz-copy-" + first.name)).write_bytes(first.read_bytes())
    assert views(root) == every(["c1", "c2", "c3"], "c3")


def test_a_truncated_index_file_stops_no_compaction_and_loses_no_other_session(tmp_path):
    """One truncated Parquet file in session s1's partition: compaction goes on for every other session (s2's
    rows reach the table), and nothing of s2 is lost."""
    root = tmp_path / "d"
    written(root).close()
    store = open_store(root)
    put_checkpoint(store, "s2", "d1", turn=1)
    store.close()
    partition = root / layout.index_partition(layout.CHECKPOINT_INDEX, "s1", None)
    victim = sorted(partition.glob("*.parquet"))[-1]
    (partition / ("bad-" + victim.name)).write_bytes(victim.read_bytes()[: victim.stat().st_size // 2])
    got = views(root, "s2")
    assert got["list"] == got["query"] == ["d1"]
    assert "d1" in got["pyarrow"] and "d1" in got["duckdb"]


def test_a_tail_object_that_names_another_session_is_not_adopted(tmp_path):
    """A checkpoint object copied from session s2 into s1's ``checkpoints/`` under a fresh id: its header names
    s2 (and another id), so it is no checkpoint of s1 in any view."""
    root = tmp_path / "d"
    written(root).close()
    store = open_store(root)
    lease = store.leases.acquire("s2", owner="w2")
    log = store.checkpoints.log(lease, keep=20, batch=1)
    log_put(log, "zz9", turn=9)
    log.flush()
    store.close()
    src = root / layout.checkpoint_key("s2", None, "zz9")
    (root / layout.checkpoint_key("s1", None, "zz9")).write_bytes(src.read_bytes())
    assert views(root) == every(["c1", "c2", "c3"], "c3")


def test_another_sessions_index_file_dropped_into_a_partition_moves_no_row(tmp_path):
    """A valid index file of session s2 copied into s1's partition (and one of user bob's into the no-user
    partition of s1): s1's views are unchanged, s2's and bob's rows are in the table once, under their own
    session and user, and compaction keeps it so."""
    root = tmp_path / "d"
    written(root).close()
    store = open_store(root)
    put_checkpoint(store, "s2", "d1", turn=1)
    put_checkpoint(store, "s1", "b1", turn=1, user_id="bob")
    store.close()
    target = root / layout.index_partition(layout.CHECKPOINT_INDEX, "s1", None)
    for sid, uid in (("s2", None), ("s1", "bob")):
        src = sorted((root / layout.index_partition(layout.CHECKPOINT_INDEX, sid, uid)).glob("*.parquet"))[0]
        (target / f"zz-{sid}-{uid}.parquet").write_bytes(src.read_bytes())
    assert views(root) == every(["c1", "c2", "c3"], "c3")
    assert views(root, "s2") == every(["d1"], "d1")
    reader = open_store(root)
    assert reader.query(user_id="bob")["checkpoint_id"].to_pylist() == ["b1"]
    assert sorted(reader.query(user_id=None)["checkpoint_id"].to_pylist()) == ["c1", "c2", "c3", "d1"]
    reader.close()


def test_a_table_file_of_another_user_dropped_into_a_users_table_is_not_queried(tmp_path):
    """bob's compacted table file copied into alice's table partition (``index/table/user=alice/...``): alice's
    ``Store.query`` shows alice's rows only, before and after the next compaction."""
    root = tmp_path / "d"
    store = open_store(root)
    put_checkpoint(store, "s1", "a1", turn=1, user_id="alice")
    put_checkpoint(store, "s1", "b1", turn=1, user_id="bob")
    store.compact(tombstone_grace=timedelta(0))
    store.close()
    table = root / "index" / "table"
    bob = sorted((table / "user=bob").rglob("*.parquet"))[0]
    alice_day = sorted((table / "user=alice").glob("day=*"))[0]
    (alice_day / "part-9.parquet").write_bytes(bob.read_bytes())
    for _ in range(2):
        reader = open_store(root)
        assert reader.query(user_id="alice")["checkpoint_id"].to_pylist() == ["a1"]
        assert reader.query(user_id="bob")["checkpoint_id"].to_pylist() == ["b1"]
        reader.compact(tombstone_grace=timedelta(0))
        reader.close()


# --- deleters and pruners --------------------------------------------------------------------------------------


def test_delete_racing_a_tail_that_chains_on_the_deleted_object(tmp_path):
    """A writer's c2 and c3 (incremental, built on c1's object) are not indexed yet when another store deletes c1.
    The delete's snapshot saw the tail, so c1's object stays: c3 remains readable once indexed."""
    root = tmp_path / "d"
    store = open_store(root)
    lease = store.leases.acquire("s1", owner="w")
    log = store.checkpoints.log(lease, keep=20, batch=16)
    log_put(log, "c1", turn=1)
    log.flush()
    log_put(log, "c2", turn=2, chain=("c1",))
    log_put(log, "c3", turn=3, chain=("c1", "c2"))
    deleter = open_store(root)
    assert deleter.checkpoints.delete("s1", "c1")
    log.flush()
    reader = open_store(root)
    assert ids(reader.checkpoints.list("s1")) == ["c3", "c2"]
    assert reader.checkpoints.get_chain("s1", "c3") is not None
    assert views(root) == every(["c2", "c3"], "c3")


def test_delete_landing_between_a_writers_put_and_its_collect(tmp_path):
    """The deleter's snapshot is taken before the writer puts c2 (incremental on c1); c2's object lands while the
    deleter writes its tombstone, before it collects c1's object. c2 must stay readable once indexed: it is the
    writer's acknowledged newest checkpoint, and no rule removed it. It is not: the delete collected c1's object
    on the tails of its snapshot (``also_needed``), so c2's chain is broken and no view can read it."""
    root = tmp_path / "d"
    store = open_store(root)
    lease = store.leases.acquire("s1", owner="w")
    log = store.checkpoints.log(lease, keep=20, batch=16)
    log_put(log, "c1", turn=1)
    log.flush()
    base = open_store(root)
    relay = FaultyObjectStore(base.objects, FaultPlan(rules=[]))
    real_put = relay.put
    fired = threading.Event()

    def put_then_the_writer(*, key, data, **kw):
        etag = real_put(key=key, data=data, **kw)
        if "index/checkpoints/" in key and not fired.is_set():
            fired.set()  # the deleter's tombstone landed: now the writer puts c2 on c1's object
            log_put(log, "c2", turn=2, chain=("c1",))
        return etag

    relay.put = put_then_the_writer  # type: ignore[method-assign]
    assert Store(relay, "deleter").checkpoints.delete("s1", "c1")
    assert fired.is_set()
    log.flush()
    reader = open_store(root)
    assert ids(reader.checkpoints.list("s1")) == ["c2"]
    assert reader.checkpoints.get_chain("s1", "c2") is not None


def test_a_deleted_head_kept_for_its_writer_never_reads_as_live_and_goes_once_the_writer_moved_on(tmp_path):
    """Another store deletes a running writer's newest checkpoint c2: its object stays (the writer's next
    checkpoint builds on it) but no view shows it, before or after a compaction drops its tombstone. The writer's
    c3 on it reads back; once the writer starts a full snapshot c4, deleting c3 collects c2's and c3's objects."""
    root = tmp_path / "d"
    store = open_store(root)
    log = store.checkpoints.log(store.leases.acquire("s1", owner="w"), keep=20, batch=1)
    log_put(log, "c1", turn=1)
    log_put(log, "c2", turn=2, chain=("c1",))
    assert open_store(root).checkpoints.delete("s1", "c2")
    c2 = root / layout.checkpoint_key("s1", None, "c2")
    assert c2.exists()
    assert views(root) == every(["c1"], "c1")  # views() compacts with no grace: the tombstone is dropped
    assert views(root) == every(["c1"], "c1")
    log_put(log, "c3", turn=3, chain=("c1", "c2"))
    assert views(root) == every(["c1", "c3"], "c3")
    assert open_store(root).checkpoints.get_chain("s1", "c3") is not None
    log_put(log, "c4", turn=4)  # a full snapshot: nothing builds on c2 any more
    assert open_store(root).checkpoints.delete("s1", "c3")
    assert not c2.exists() and not (root / layout.checkpoint_key("s1", None, "c3")).exists()
    assert views(root) == every(["c1", "c4"], "c4")


def test_two_concurrent_prunes_with_a_fork_pin_agree(tmp_path):
    """Two stores prune the same session at once while a fork's pin holds c2: both finish without an error, every
    view is empty for the parent, and the pinned fork point's object stays."""
    root = tmp_path / "d"
    written(root, 4).close()
    store = open_store(root)
    store.checkpoints.pin("s1", "c2", dependent="f1")
    errors: list[BaseException] = []
    go = threading.Barrier(2)

    def prune() -> None:
        try:
            go.wait(10)
            open_store(root).prune(session_id="s1")
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=prune) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not errors, errors
    assert (root / layout.checkpoint_key("s1", None, "c2")).exists()
    assert views(root) == every([], None)
    assert open_store(root).checkpoints.get_chain("s1", "c2", pinned_for="f1") is not None


def test_a_file_that_is_not_parquet_in_a_partition_is_skipped(tmp_path):
    """A file with a ``.parquet`` name that is not Parquet, in an index partition: readers and compaction skip
    it with a warning, and nothing is lost."""
    root = tmp_path / "d"
    written(root).close()
    partition = root / layout.index_partition(layout.CHECKPOINT_INDEX, "s1", None)
    (partition / "evil.parquet").write_bytes(b"PAR1 not really")
    assert views(root) == every(["c1", "c2", "c3"], "c3")
