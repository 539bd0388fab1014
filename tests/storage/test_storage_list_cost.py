"""What one cold ``list_checkpoints`` costs, in counts (requests, column-wide Arrow calls), not in time.

A session's own index files hold a row or a batch each; the checks every
file passes (:mod:`storage.index_guard`) once cost a dozen Arrow compute
calls per file, which made a cold listing 1.7x the CPU it was before them.
The small-file path reads the values in Python and must decide exactly as
the column-wide one does.
"""

from __future__ import annotations

import json
import threading
import time
from dataclasses import replace
from datetime import datetime, timezone

import pyarrow as pa
import pyarrow.compute as pc
import pytest

from loomray.storage import CheckpointInfo, index_guard, layout, open_store
from loomray.storage.index_guard import checked, own_rows
from loomray.storage.layout import lease_key
from loomray.storage.objects import ObjectStore
from loomray.storage.rows import CheckpointRow, checkpoint_rows_table
from loomray.storage.store import Store
from loomray.storage.testing import land_row, write_checkpoint

T0 = datetime(2026, 7, 1, tzinfo=timezone.utc)
#: Column-wide calls the per-file checks used to make.
_COMPUTE = ("equal", "is_null", "fill_null", "and_", "binary_join_element_wise", "unique", "all", "min_max",
            "coalesce", "is_in")


def _info(sid: str, j: int) -> CheckpointInfo:
    return CheckpointInfo(session_id=sid, checkpoint_id=f"c{j:04d}", turn=j, created_at=T0, position="after_tools",
                          execution_status="active", message_count=j)


class _Counted:
    """Counts the object store's requests and the Arrow compute calls made while it is on."""

    def __init__(self, store, monkeypatch) -> None:
        self.requests: dict[str, int] = {}
        self.compute = 0
        for op in ("get", "list", "put", "delete"):
            real = getattr(store.objects, op)

            def call(*a, _real=real, _op=op, **kw):
                self.requests[_op] = self.requests.get(_op, 0) + 1
                out = _real(*a, **kw)
                return list(out) if _op == "list" else out
            monkeypatch.setattr(store.objects, op, call)
        for name in _COMPUTE:
            real = getattr(pc, name)

            def compute(*a, _real=real, **kw):
                self.compute += 1
                return _real(*a, **kw)
            monkeypatch.setattr(pc, name, compute)

    def reset(self) -> None:
        self.requests, self.compute = {}, 0


@pytest.mark.parametrize("leased", [False, True], ids=["epoch0", "leased"])
def test_a_cold_listing_makes_one_list_per_prefix_and_no_column_wide_call_per_small_file(tmp_path, monkeypatch,
                                                                                        leased):
    store = open_store(tmp_path / "store")
    lease = store.leases.acquire("s", owner="o") if leased else None
    for j in range(4):  # four index files of one row each
        write_checkpoint(store, b'{"x": 1}', _info("s", j), lease=lease, keep=0)
    counted = _Counted(store, monkeypatch)
    store.drop_caches()
    counted.reset()
    rows = store.checkpoints.list("s")
    assert [r.checkpoint_id for r in rows] == ["c0003", "c0002", "c0001", "c0000"]
    # LIST of the index partition and of checkpoints/; GET of each index file, of lease.json and of the newest
    # checkpoint's object (checked against its sha256, as "latest" checks it); for a leased session, LIST of the
    # kept lease copies and GET of the newest (a lease.json rewritten by hand drops none of their fences).
    assert counted.requests == ({"list": 3, "get": 7} if leased else {"list": 2, "get": 6})
    assert counted.compute == 0
    counted.reset()
    assert [r.checkpoint_id for r in store.checkpoints.list("s")] == ["c0003", "c0002", "c0001", "c0000"]
    # Warm: the newest object's ETag is the one this store verified, and the kept copy is the one it read, so
    # neither is read again: only lease.json.
    assert counted.requests == ({"list": 3, "get": 1} if leased else {"list": 2, "get": 1})
    assert counted.compute == 0


def test_a_leased_session_without_lease_json_also_lists_the_kept_copies(tmp_path, monkeypatch):
    store = open_store(tmp_path / "store")
    lease = store.leases.acquire("s", owner="o")
    for j in range(2):
        write_checkpoint(store, b'{"x": 1}', _info("s", j), lease=lease, keep=0)
    store.objects.delete(keys=[lease_key("s", None)])
    counted = _Counted(store, monkeypatch)
    store.drop_caches()
    counted.reset()
    assert len(store.checkpoints.list("s")) == 2
    # The rule's fences live on in the copy the last swap kept: one LIST and one GET more, only here (and the
    # GET of the newest checkpoint's object, checked against its sha256).
    assert counted.requests == {"list": 3, "get": 5}


def _row(cid: str, **over) -> dict:
    row = CheckpointRow(session_id="s1", checkpoint_id=cid, turn=0, created_at=T0, position="after_tools",
                        execution_status="active", message_count=0, epoch=1,
                        key=f"sessions/_/s1/checkpoints/{cid}.json", size=8, sha256="0" * 64)
    table = checkpoint_rows_table([row], tombstone=False, written_at=T0)
    out = table.to_pylist()[0]
    out.update(over)
    return out


_HOSTILE = {
    "own": [_row("c1"), _row("c2")],
    "other session": [_row("c1"), _row("c2", session_id="s2")],
    "other user": [_row("c1", user_id="u9"), _row("c2")],
    "null session": [_row("c1", session_id=None)],
    "null key": [_row("c1", key=None), _row("c2")],
    "foreign key": [_row("c1", key="sessions/_/s2/checkpoints/c1.json")],
    "swapped keys": [_row("c1", key="sessions/_/s1/checkpoints/c2.json"),
                     _row("c2", key="sessions/_/s1/checkpoints/c1.json")],
    "bad id": [_row("../c1", key="sessions/_/s1/checkpoints/../c1.json"), _row("c2")],
    "null id": [_row(None, key="sessions/_/s1/checkpoints/None.json"), _row("c2")],
}


@pytest.mark.parametrize("case", sorted(_HOSTILE))
@pytest.mark.parametrize("dictionary", [False, True], ids=["plain", "dictionary"])
@pytest.mark.parametrize("key", ["index/checkpoints/user=_/session=s1/f.parquet", "index/table/user=_/f.parquet",
                                 "elsewhere/f.parquet"])
def test_the_small_file_path_keeps_exactly_the_rows_the_column_wide_one_keeps(monkeypatch, case, dictionary, key):
    table = pa.Table.from_pylist(_HOSTILE[case], schema=checkpoint_rows_table([], tombstone=False,
                                                                               written_at=T0).schema)
    if dictionary:
        table = table.set_column(0, "session_id", pc.dictionary_encode(table["session_id"]))
    fast = own_rows(table, key)
    monkeypatch.setattr(index_guard, "_FEW_ROWS", 0)
    wide = own_rows(table, key)
    assert fast.to_pylist() == wide.to_pylist()
    if case != "own" and key.startswith("index/checkpoints/"):
        assert fast.num_rows < table.num_rows or case == "null key"


@pytest.mark.parametrize("few", [64, 0], ids=["small-file path", "column-wide path"])
def test_a_time_past_year_9999_is_refused_on_either_path(monkeypatch, few):
    monkeypatch.setattr(index_guard, "_FEW_ROWS", few)
    ok = pa.table({"t": pa.array([0, None, 1], pa.timestamp("us", tz="UTC"))})
    assert checked(ok) is ok
    for ticks in (2**62, -(2**62)):
        bad = pa.table({"t": pa.array([0, None, ticks], pa.timestamp("us", tz="UTC"))})
        with pytest.raises(pa.ArrowInvalid, match="years 1-9999"):
            checked(bad)


class _Rounds(ObjectStore):
    """An object store whose every call takes ``latency`` (a network round trip) and records its round: one more
    than the deepest call that had answered when it started. The deepest is what a reader waited for in turn."""

    def __init__(self, inner: ObjectStore, latency: float = 0.05) -> None:
        self.inner, self.backend, self.latency = inner, inner.backend, latency
        self.calls: list[tuple[str, str, int]] = []  # (op, key or prefix, round)
        self._ended: list[tuple[float, int]] = []
        self._lock = threading.Lock()

    def _call(self, op: str, fn, **kw):
        start = time.monotonic()
        with self._lock:
            depth = 1 + max((d for end, d in self._ended if end <= start), default=0)
        time.sleep(self.latency)  # the wire, not a wait for another thread: every call pays it
        out = fn(**kw)
        out = list(out) if op == "list" else out
        with self._lock:
            self._ended.append((time.monotonic(), depth))
            self.calls.append((op, kw.get("key") or kw.get("prefix") or "", depth))
        return out

    def rounds(self) -> int:
        return max((d for _, _, d in self.calls), default=0)

    def put(self, **kw):
        return self._call("put", self.inner.put, **kw)

    def get(self, **kw):
        return self._call("get", self.inner.get, **kw)

    def list(self, **kw):
        return iter(self._call("list", self.inner.list, **kw))

    def list_dirs(self, **kw):
        return self._call("list", self.inner.list_dirs, **kw)

    def delete(self, **kw):
        return self._call("delete", self.inner.delete, **kw)

    def describe(self, key=None):
        return self.inner.describe(key)


def test_a_cold_read_of_a_leased_sessions_latest_on_s3_takes_three_round_trips(s3_server):
    """The index LIST; the index files, the objects' LIST and lease.json; the kept lease copies (LIST, and the copy
    lease.json's swap kept) with the latest's chain. Every request the fence needs is still made, in the same order
    (lease.json after the index LIST, the copies after lease.json), only not one round each."""
    writer = s3_server.open_store()
    lease = writer.leases.acquire("s", owner="o")
    for j in range(4):
        write_checkpoint(writer, b'{"x": %d}' % j, _info("s", j), lease=lease, keep=0)
    write_checkpoint(writer, b'{"x": 4}', replace(_info("s", 4), chain=("c0000", "c0001", "c0002", "c0003")),
                     lease=lease, keep=0)
    for read in ("get_chain", "list"):
        rounds = _Rounds(writer.objects)
        reader = Store(rounds, writer.url)  # a new process: nothing cached
        if read == "get_chain":
            chain = reader.checkpoints.get_chain("s") or []
            assert [json.loads(o)["index"]["checkpoint_id"] for o in chain] == [f"c{j:04d}" for j in range(5)]
        else:
            assert [r.checkpoint_id for r in reader.checkpoints.list("s")][:2] == ["c0004", "c0003"]
        assert rounds.rounds() == 3, rounds.calls
        lease_json = {d for op, key, d in rounds.calls if op == "get" and key == lease_key("s", None)}
        copies = {d for _, key, d in rounds.calls if key.startswith(layout.lease_copy_prefix("s", None))}
        objects = {d for op, key, d in rounds.calls
                   if op == "get" and key.startswith(layout.session_prefix("s", None) + "checkpoints/")}
        assert (lease_json, copies, objects) == ({2}, {3}, {3})
        assert sum(op == "list" and key.startswith(layout.lease_copy_prefix("s", None))
                   for op, key, _ in rounds.calls) == 1
        reader.close(keep_objects=True)
    writer.close()


def test_a_lease_json_restored_by_hand_costs_the_cold_reader_a_round_not_the_fence(s3_server):
    """lease.json restored from epoch 1's copy, older than the takeover's (epoch 2) that fenced the zombie's late
    row c0002: the read-ahead is wrong twice (the copy epoch 1's swap kept, and c0002 as "latest"), and the reader
    reads the newest copy, then c0001: two rounds more; c0002 is in no answer."""
    store = s3_server.open_store()
    holder = store.leases.acquire("s1", owner="holder")
    write_checkpoint(store, b'{"x": 1}', _info("s1", 1), lease=holder, keep=0)
    Store(store.objects, store.url).leases.acquire("s1", owner="taker")
    land_row(store, b'{"x": 2}', _info("s1", 2), epoch=holder.epoch)
    copy = store.objects.get(key=layout.lease_copy_key("s1", None, holder.epoch))
    assert copy is not None
    store.objects.put(key=lease_key("s1", None), data=copy.data)
    for read in ("get_chain", "list", "get"):
        rounds = _Rounds(store.objects)
        reader = Store(rounds, store.url)
        if read == "get_chain":
            chain = reader.checkpoints.get_chain("s1") or []
            assert [json.loads(o)["index"]["checkpoint_id"] for o in chain] == ["c0001"]
            depth = {key: d for _, key, d in rounds.calls}
            newest, ahead = layout.lease_copy_key("s1", None, 2), layout.checkpoint_key("s1", None, "c0002")
            # Read ahead with the copies' LIST, then read again once the LIST showed what was newest.
            assert depth[ahead] == depth[layout.lease_copy_prefix("s1", None)] < depth[newest]
            assert depth[newest] + 1 == depth[layout.checkpoint_key("s1", None, "c0001")]
        elif read == "list":
            assert [r.checkpoint_id for r in reader.checkpoints.list("s1")] == ["c0001"]
        else:
            assert reader.checkpoints.get("s1", "c0002") is None
        reader.close(keep_objects=True)
    store.close()
