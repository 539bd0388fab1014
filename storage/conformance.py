"""The storage conformance suite: what every :class:`~storage.objects.ObjectStore` backend must do under a Store.

Everything above the object store is one code path for every backend, so a
backend conforms when these tests pass on it. A backend registers by
subclassing :class:`ObjectStoreConformance` (a class name starting with
``Test``) and giving it ``make_store(tmp_path)``, a fresh, empty ``Store``; a
backend that needs a server takes its fixture in an autouse fixture of its
class. The registration in full: docs/contracts.md, "The storage conformance
suite" (``tests/storage/test_storage_conformance.py`` registers three).
"""

from __future__ import annotations

import hashlib
import io
import json
import threading
from collections.abc import Iterator
from datetime import datetime, timedelta
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from .conformance_log import CheckpointLogConformance
from .errors import CorruptObjectError, LeaseLostError, PreconditionFailed
from .rows import CheckpointRow, JournalEntry, Lease, SessionRow
from .store import Store
from .testing import T0, all_keys, fill_sessions, journal_entry, put_checkpoint


class ObjectStoreConformance(CheckpointLogConformance):
    """The conformance tests; subclass it as ``Test...`` and define :meth:`make_store` (module docstring)."""
    #: False where conditional writes are not atomic (moto checks, then puts): racing writers then go one at a time.
    atomic_conditional_writes = True

    def make_store(self, tmp_path: Path) -> Store:
        """A fresh, empty Store on the backend under test (``tmp_path``: a directory of this test's own)."""
        raise NotImplementedError("a conformance class defines make_store(tmp_path)")

    @pytest.fixture
    def store(self, tmp_path: Path) -> Iterator[Store]:
        st = self.make_store(tmp_path)
        yield st
        st.close()

    # -- checkpoints ------------------------------------------------------------
    def test_put_get_roundtrip_and_row(self, store):
        data = "{\"msg\": \"héllo ✓\"}".encode()
        row = put_checkpoint(store, "s1", "ckpt001", turn=3, payload=data)
        assert row.key == "sessions/_/s1/checkpoints/ckpt001.json"
        stored = store.checkpoints.get("s1") or b""
        assert json.loads(stored)["msg"] == "héllo ✓" and row.size == len(stored)  # the caller's members, enveloped
        assert row.sha256 == hashlib.sha256(stored).hexdigest()
        assert row.turn == 3 and row.epoch == 0 and row.created_at.tzinfo is not None
        assert store.checkpoints.get("s1", "ckpt001") == stored
        assert store.checkpoints.get("s1", "nope") is None
        assert store.checkpoints.get("other") is None
        assert store.checkpoints.list("other") == []

    def test_list_newest_first_with_limit(self, store):
        for i in range(5):
            put_checkpoint(store, "s1", f"c{i}", turn=i)
        rows = store.checkpoints.list("s1")
        assert [r.checkpoint_id for r in rows] == ["c4", "c3", "c2", "c1", "c0"]
        assert [r.checkpoint_id for r in store.checkpoints.list("s1", limit=2)] == ["c4", "c3"]
        assert store.checkpoints.get("s1") == store.checkpoints.get("s1", "c4")

    def test_retention_keeps_newest_and_tombstones(self, store):
        for i in range(6):
            put_checkpoint(store, "s1", f"c{i}", turn=i, keep=3)
        assert [r.checkpoint_id for r in store.checkpoints.list("s1")] == ["c5", "c4", "c3"]
        assert store.checkpoints.get("s1", "c0") is None
        assert not [k for k in all_keys(store) if k.endswith("/c0.json")]
        assert sorted(store.query(user_id=None)["checkpoint_id"].to_pylist()) == ["c3", "c4", "c5"]

    def test_retention_below_one_is_unbounded(self, store):
        for i in range(25):
            put_checkpoint(store, "s1", f"c{i:02d}", turn=i, keep=0)
        assert len(store.checkpoints.list("s1", limit=100)) == 25

    def test_default_retention_is_twenty(self, store):
        for i in range(22):
            put_checkpoint(store, "s1", f"c{i:02d}", turn=i)
        rows = store.checkpoints.list("s1", limit=100)
        assert len(rows) == 20 and rows[-1].checkpoint_id == "c02"

    def test_users_are_isolated(self, store):
        put_checkpoint(store, "s1", "a1", user_id="alice")
        assert store.checkpoints.get("s1", user_id="bob") is None
        assert store.checkpoints.get("s1") is None
        assert store.checkpoints.list("s1") == [] and store.checkpoints.list("s1", user_id="bob") == []
        assert store.checkpoints.get("s1", "a1", user_id="bob") is None
        assert [r.checkpoint_id for r in store.checkpoints.list("s1", user_id="alice")] == ["a1"]
        assert store.query(user_id="bob").num_rows == 0
        assert store.query(user_id="alice").num_rows == 1

    def test_delete_checkpoint(self, store):
        put_checkpoint(store, "s1", "c1", turn=1)
        put_checkpoint(store, "s1", "c2", turn=2)
        assert store.checkpoints.delete("s1", "c2") is True
        assert store.checkpoints.delete("s1", "c2") is False
        assert store.checkpoints.get("s1") == store.checkpoints.get("s1", "c1")
        assert [r.checkpoint_id for r in store.checkpoints.list("s1")] == ["c1"]

    def test_put_rejects_non_bytes(self, store):
        with pytest.raises(TypeError):
            put_checkpoint(store, "s1", "c1", payload="a str")

    def test_naive_datetime_is_refused(self, store):
        with pytest.raises(ValueError):
            put_checkpoint(store, "s1", "c1", created_at=datetime(2026, 1, 1))
        assert all_keys(store) == []

    # -- leases and fencing -------------------------------------------------------
    def test_lease_epochs_increase(self, store):
        assert store.leases.current_epoch("s1") == 0
        a = store.leases.acquire("s1", owner="a")
        b = store.leases.acquire("s1", owner="b")
        assert (a.epoch, b.epoch) == (1, 2)
        assert store.leases.current_epoch("s1") == 2
        store.leases.check(b)
        with pytest.raises(LeaseLostError, match="epoch"):
            store.leases.check(a)
        assert store.leases.current_epoch("s1", user_id="alice") == 0

    def test_two_writers_newer_epoch_wins(self, store):
        old = store.leases.acquire("s1", owner="old")
        row = put_checkpoint(store, "s1", "z-old-1", turn=1, lease=old)
        assert row.epoch == 1
        new = store.leases.acquire("s1", owner="new")
        # The old writer wakes up: refused, and nothing of it lands.
        with pytest.raises(LeaseLostError):
            put_checkpoint(store, "s1", "z-old-2", turn=2, lease=old)
        with pytest.raises(LeaseLostError):
            store.journal.append(JournalEntry(session_id="s1", run_id="r1", seq=0, step_key="t1", kind="model"), lease=old)
        # The new writer's id sorts *below* the old one's, yet it is latest: epoch first.
        put_checkpoint(store, "s1", "a-new-1", turn=2, lease=new)
        assert store.checkpoints.get("s1") == store.checkpoints.get("s1", "a-new-1")
        assert [r.checkpoint_id for r in store.checkpoints.list("s1")] == ["a-new-1", "z-old-1"]
        assert store.checkpoints.get("s1", "z-old-2") is None

    def test_write_racing_a_takeover_is_never_latest(self, store):
        """The old writer passes its lease check, then a takeover lands before its PUT."""
        old = store.leases.acquire("s1", owner="old")
        put_checkpoint(store, "s1", "c1", turn=1, lease=old)
        real_put = store.objects.put
        taken: list[Lease] = []

        def put_with_takeover(*, key, data, **kw):
            if key.endswith("/c2-late.json") and not taken:
                taken.append(store.leases.acquire("s1", owner="new"))
            return real_put(key=key, data=data, **kw)

        store.objects.put = put_with_takeover
        try:
            with pytest.raises(LeaseLostError):
                put_checkpoint(store, "s1", "c2-late", turn=2, lease=old)
        finally:
            store.objects.put = real_put
        assert taken and taken[0].epoch == 2
        assert store.checkpoints.get("s1") == store.checkpoints.get("s1", "c1")
        assert [r.checkpoint_id for r in store.checkpoints.list("s1")] == ["c1"]

    def test_concurrent_acquires_get_distinct_epochs(self, store):
        epochs, errors = [], []

        def grab(i):
            try:
                epochs.append(store.leases.acquire("s1", owner=f"w{i}").epoch)
            except Exception as e:  # pragma: no cover - reported below
                errors.append(e)

        threads = [threading.Thread(target=grab, args=(i,)) for i in range(6)]
        for t in threads:
            t.start()
            t.join(0 if self.atomic_conditional_writes else None)  # not atomic: one acquirer at a time
        for t in threads:
            t.join()
        assert errors == []
        assert sorted(epochs) == [1, 2, 3, 4, 5, 6]
        assert store.leases.current_epoch("s1") == 6

    def test_lease_of_another_session_is_refused(self, store):
        lease = store.leases.acquire("s1", owner="a")
        with pytest.raises(LeaseLostError):
            put_checkpoint(store, "s2", "c1", lease=lease)

    # -- journal ------------------------------------------------------------------
    def test_journal_append_list_runs(self, store):
        for seq, step in [(2, "t0001-tool-call_1"), (0, "t0000-run_start"), (1, "t0001-model")]:
            store.journal.append(journal_entry(seq, step))
        store.journal.append(journal_entry(0, "t0000-run_start", run="run0"))
        got = store.journal.list("s1", "run1")
        assert [(e.seq, e.step_key) for e in got] == [(0, "t0000-run_start"), (1, "t0001-model"), (2, "t0001-tool-call_1")]
        assert got[1].output == {"text": "out 1", "n": [1]} and got[1].created_at.tzinfo is not None
        assert store.journal.runs("s1") == ["run0", "run1"]
        assert store.journal.list("s1", "missing") == [] and store.journal.runs("nobody") == []
        with pytest.raises(PreconditionFailed):
            store.journal.append(journal_entry(1, "t0001-model"))
        raw = store.objects.get(key="sessions/_/s1/journal/run1/00000001-t0001-model.json").data
        assert json.loads(raw)["type"] == "journal_entry"

    def test_journal_entry_records_lease_epoch(self, store):
        lease = store.leases.acquire("s1", owner="a")
        store.journal.append(journal_entry(0, "t0"), lease=lease)
        assert store.journal.list("s1", "run1")[0].epoch == 1

    def test_corrupt_journal_entry_is_skipped_with_warning(self, store, caplog):
        store.journal.append(journal_entry(0, "t0"))
        store.journal.append(journal_entry(1, "t1"))
        store.objects.put(key="sessions/_/s1/journal/run1/00000001-t1.json", data=b'{"type": "journal_en')
        with caplog.at_level("WARNING"):
            got = store.journal.list("s1", "run1")
        assert [e.seq for e in got] == [0]
        assert "00000001-t1.json" in caplog.text

    # -- session index ------------------------------------------------------------
    def test_session_rows(self, store):
        store.sessions.put(SessionRow("s1", None, "pending", T0, run_id="r1", spec_json='{"prompt": "x"}'))
        store.sessions.put(SessionRow("s1", None, "running", T0 + timedelta(seconds=1), run_id="r1", epoch=1, node_id="n1"))
        store.sessions.put(SessionRow("s2", "alice", "completed", T0 + timedelta(seconds=2)))
        got = store.sessions.get("s1")
        assert got.status == "running" and got.epoch == 1 and got.node_id == "n1" and got.updated_at.tzinfo
        assert store.sessions.get("s2") is None and store.sessions.get("s2", user_id="alice").status == "completed"
        assert {r.session_id for r in store.sessions.list()} == {"s1", "s2"}
        assert [r.session_id for r in store.sessions.list(status="running")] == ["s1"]
        assert [r.session_id for r in store.sessions.list(user_id="alice")] == ["s2"]
        assert [r.session_id for r in store.sessions.list(user_id=None)] == ["s1"]
        report = store.compact()
        assert report.files_after < report.files_before
        assert store.sessions.get("s1").status == "running"
        assert len(store.index_files("sessions")) == 2

    # -- Parquet index: query and compaction ------------------------------------------
    def test_query_filters(self, store):
        fill_sessions(store)
        t = store.query()
        assert isinstance(t, pa.Table) and t.num_rows == 18
        assert "tombstone" not in t.column_names and "epoch" in t.column_names
        assert store.query(user_id="alice").num_rows == 6
        assert store.query(user_id=None, session_id="s2").num_rows == 3
        assert store.query(session_id="s2").num_rows == 9
        assert store.query(status="completed").num_rows == 6
        assert store.query(min_cost=0.5, max_cost=0.5).num_rows == 6
        assert store.query(since=T0 + timedelta(minutes=1), until=T0 + timedelta(minutes=2)).num_rows == 6
        assert store.query(user_id="bob", columns=["checkpoint_id", "turn"]).column_names == ["checkpoint_id", "turn"]
        store.checkpoints.delete("s1", "c0", user_id="bob")
        assert store.query(user_id="bob").num_rows == 5

    def test_compact_merges_and_drops_tombstones(self, store):
        fill_sessions(store)
        for i in range(3, 6):
            put_checkpoint(store, "s1", f"c{i}", user_id="alice", turn=i, keep=3)  # retention writes tombstones
        before = store.query().sort_by("key")
        files_before = len(store.index_files())
        report = store.compact()
        assert report.files_before == files_before
        assert report.files_after == 6 == len(store.index_files())
        assert report.tombstones_dropped == 3 and report.rows == 18
        assert store.query().sort_by("key").equals(before)
        assert [r.checkpoint_id for r in store.checkpoints.list("s1", user_id="alice")] == ["c5", "c4", "c3"]
        again = store.compact()
        assert again.files_after == again.files_before == 6 and again.tombstones_dropped == 0

    def test_compact_keeps_a_file_written_during_compaction(self, store):
        """Another process appends to a partition after compact() listed it: the new row survives."""
        put_checkpoint(store, "s1", "c1", turn=1)
        put_checkpoint(store, "s1", "c2", turn=2)
        other = Store(store.objects, store.url)  # a second process's view of the same bucket/root
        real = store._index.read_files
        done: list[CheckpointRow] = []

        def read_then_race(keys, **kw):
            out = real(keys, **kw)
            if not done:
                done.append(put_checkpoint(other, "s1", "c3", turn=3))
            return out

        store._index.read_files = read_then_race
        try:
            store.compact()
        finally:
            store._index.read_files = real
        assert done
        assert [r.checkpoint_id for r in store.checkpoints.list("s1")] == ["c3", "c2", "c1"]
        assert sorted(store.query()["checkpoint_id"].to_pylist()) == ["c1", "c2", "c3"]
        assert len(store.index_files()) == 2

    # -- prune ------------------------------------------------------------------------
    def test_prune_deletes_matching_and_nothing_else(self, store):
        for u in (None, "alice"):
            for s in ("s1", "s2"):
                for i in range(3):
                    put_checkpoint(store, s, f"c{i}", user_id=u, turn=i)
                store.journal.append(JournalEntry(session_id=s, user_id=u, run_id="r", seq=0, step_key="old", kind="model",
                                                  created_at=T0))
                store.journal.append(JournalEntry(session_id=s, user_id=u, run_id="r", seq=1, step_key="new", kind="model",
                                                  created_at=T0 + timedelta(hours=1)))
        store.leases.acquire("s1", owner="x")
        store.sessions.put(SessionRow("s1", None, "completed", T0))
        # Only checkpoints created before minute 2 (c0, c1) of session s1, any user.
        report = store.prune(before=T0 + timedelta(minutes=2), session_id="s1")
        assert report.checkpoints == 4 and report.journal_entries == 2
        for u in (None, "alice"):
            assert [r.checkpoint_id for r in store.checkpoints.list("s1", user_id=u)] == ["c2"]
            assert len(store.checkpoints.list("s2", user_id=u)) == 3
            assert [e.step_key for e in store.journal.list("s1", "r", user_id=u)] == ["new"]
            assert len(store.journal.list("s2", "r", user_id=u)) == 2
        assert store.leases.current_epoch("s1") == 1 and store.sessions.get("s1").status == "completed"
        # Everything of alice.
        report = store.prune(user_id="alice")
        assert report.checkpoints == 4 and report.journal_entries == 3
        assert store.checkpoints.list("s2", user_id="alice") == [] and store.journal.runs("s2", user_id="alice") == []
        assert len(store.checkpoints.list("s2")) == 3
        assert store.query(user_id="alice").num_rows == 0 and store.query().num_rows == 4

    # -- corruption -------------------------------------------------------------------
    def test_corrupt_object_raises_naming_the_key(self, store, caplog):
        row = put_checkpoint(store, "s1", "c1", payload=b'{"a": 1}')
        data = store.objects.get(key=row.key).data
        store.objects.put(key=row.key, data=data.replace(b'"a": 1', b'"a": 2'))  # same size, other bytes (bit rot)
        with pytest.raises(CorruptObjectError, match="c1.json"):
            store.checkpoints.get("s1")
        # The listing reads its newest object too: skipped, as "latest" skips it. Nothing readable is left, so
        # nothing is retired: "latest" goes on raising, never reads as a session without a checkpoint.
        assert store.checkpoints.list("s1") == []
        with pytest.raises(CorruptObjectError, match="c1.json"):
            store.checkpoints.get("s1")

    def test_truncated_object_raises_and_listing_skips_it(self, store, caplog):
        put_checkpoint(store, "s1", "c1", turn=1)
        row = put_checkpoint(store, "s1", "c2", turn=2, payload=b'{"messages": ["a long transcript"]}')
        store.objects.put(key=row.key, data=b'{"messages": ["a lo')
        with pytest.raises(CorruptObjectError, match="c2.json"):
            store.checkpoints.get("s1", "c2")
        with caplog.at_level("WARNING"):
            # "latest" falls back to the newest readable checkpoint, never silently: it warns naming the bad one.
            assert store.checkpoints.get("s1") == store.checkpoints.get("s1", "c1")
        assert "c2.json" in caplog.text
        caplog.clear()
        with caplog.at_level("WARNING"):
            assert [r.checkpoint_id for r in store.checkpoints.list("s1")] == ["c1"]
        assert "c2.json" in caplog.text

    def test_corrupt_index_file_is_skipped_with_warning(self, store, caplog):
        put_checkpoint(store, "s1", "c1", turn=1)
        store.objects.put(key="index/checkpoints/user=_/session=s1/0000000000000000001-deadbeef.parquet",
                          data=b"PAR1 this is not parquet")
        with caplog.at_level("WARNING"):
            assert [r.checkpoint_id for r in store.checkpoints.list("s1")] == ["c1"]
            assert store.query().num_rows == 1
        assert "deadbeef" in caplog.text

    def test_missing_object_is_not_latest(self, store):
        put_checkpoint(store, "s1", "c1", turn=1)
        row = put_checkpoint(store, "s1", "c2", turn=2)
        store.objects.delete(keys=[row.key])  # deleted behind the index's back
        assert store.checkpoints.get("s1") == store.checkpoints.get("s1", "c1")
        assert [r.checkpoint_id for r in store.checkpoints.list("s1")] == ["c1"]

    @pytest.mark.timeout(60)
    def test_compact_many_partitions(self, store):
        """More partitions than reader threads: compaction must not starve its own pool."""
        for s in range(40):
            put_checkpoint(store, f"s{s:02d}", "c1", turn=1, keep=0)
            put_checkpoint(store, f"s{s:02d}", "c2", turn=2, keep=0)
        report = store.compact()
        assert (report.files_before, report.files_after, report.rows) == (80, 40, 80)
        assert store.query().num_rows == 80

    def test_index_file_of_a_foreign_schema_is_skipped(self, store, caplog):
        put_checkpoint(store, "s1", "c1", turn=1)
        sink = io.BytesIO()
        pq.write_table(pa.table({"something": [1, 2]}), sink)
        store.objects.put(key="index/checkpoints/user=_/session=s1/0000000000000000002-cafebabe.parquet",
                          data=sink.getvalue())
        with caplog.at_level("WARNING"):
            assert store.query().num_rows == 1
            assert [r.checkpoint_id for r in store.checkpoints.list("s1")] == ["c1"]
        assert "cafebabe" in caplog.text
