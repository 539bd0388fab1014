"""Details of the write path, leases and retention that the conformance suite does not pin down."""

from __future__ import annotations

from datetime import datetime, timezone

import pytest

from loomray.storage import CheckpointInfo, JournalEntry, Store
from loomray.storage.errors import CorruptObjectError
from loomray.storage.testing import write_checkpoint

NOW = datetime(2026, 7, 4, tzinfo=timezone.utc)


def _put(store, cid, data=b'{"x": 1}', keep=20, session_id="s1"):
    info = CheckpointInfo(session_id=session_id, checkpoint_id=cid, turn=1, created_at=NOW,
                          position="after_tools", execution_status="active", message_count=1)
    return write_checkpoint(store, data, info, keep=keep)


def test_corrupt_lease_is_a_typed_error(store):
    store.leases.acquire("s1", owner="a")
    store.objects.put(key="sessions/_/s1/lease.json", data=b'{"epo')
    with pytest.raises(CorruptObjectError, match="lease.json"):
        store.leases.current_epoch("s1")


def test_naive_journal_time_is_refused():
    with pytest.raises(ValueError):
        JournalEntry(session_id="s", run_id="r", seq=0, step_key="k", kind="model", created_at=datetime(2026, 1, 1))


def test_retention_with_two_store_instances_never_drops_below_keep(store):
    """Another process writes the same session: each instance's retention view misses rows, yet keeps >= keep."""
    other = Store(store.objects, store.url)
    for i in range(12):
        _put(store if i % 2 else other, f"c{i:02d}", keep=3)
        live = store.checkpoints.list("s1", limit=None)
        assert len(live) >= min(3, i + 1)
        assert live[0].checkpoint_id == f"c{i:02d}"
    # A fresh view (full LIST) trims to exactly keep on the next write.
    fresh = Store(store.objects, store.url)
    _put(fresh, "c99", keep=3)
    assert [r.checkpoint_id for r in store.checkpoints.list("s1")][:1] == ["c99"]
    assert len(store.checkpoints.list("s1")) == 3


def test_prune_keeps_retention_view_consistent(store):
    for i in range(3):
        _put(store, f"c{i}", keep=3)
    store.prune(session_id="s1")
    for i in range(3, 6):
        _put(store, f"c{i}", keep=3)
    assert [r.checkpoint_id for r in store.checkpoints.list("s1")] == ["c5", "c4", "c3"]
