"""One visibility rule for every reader (storage.visibility): regression tests for the reader side of issue 22.

Each test is named after its path of the issue: 1 a fenced writer's late row, seen by the views other than the
list (get by id, query, the compacted table); 3 a pruned or deleted checkpoint whose object a fork's pin keeps,
after compaction dropped its tombstone; 4 a fork that crashed before its first checkpoint, resumed after the
parent's retention retired its fork point; 5 delete through the store the run wrote with. The ``lease_deleted``
tests: a deleted or unreadable ``lease.json`` shows no fenced write again (soak seeds 2610 and 2064 on memory,
1980 on a local directory, scenario ``chaos``: readers looked for a takeover's fence in ``lease.json`` only; it
lives on in the copy the swap kept, ``leases/{epoch}.json``). They run on every backend (memory, local
directory, S3 via moto) through the ``store`` fixture.
"""

from __future__ import annotations

import json
from datetime import timedelta

import pytest
from storage_views import query_ids, table_ids

from loomray.storage import CheckpointInfo, Store, layout
from loomray.storage.errors import ObjectNotFound
from loomray.storage.testing import T0, land_row, log_put, put_checkpoint


def ids(rows) -> list[str]:
    return [r.checkpoint_id for r in rows]






def _fenced_row_lands(store: Store) -> None:
    """Holder (epoch 1) writes c1; a takeover; then the holder's c2 object and row land at epoch 1 (a writer
    that checked its lease before the takeover and wrote after it: :func:`storage.testing.land_row`)."""
    holder_lease = store.leases.acquire("s1", owner="holder")
    put_checkpoint(store, "s1", "c1", turn=1, lease=holder_lease)
    Store(store.objects, "taker").leases.acquire("s1", owner="taker")
    land_row(store, json.dumps({"checkpoint_id": "c2", "turn": 2}).encode(),
             CheckpointInfo(session_id="s1", checkpoint_id="c2", turn=2, created_at=T0, position="after_tools",
                            execution_status="active", message_count=4), epoch=holder_lease.epoch)


def test_path01_a_fenced_row_is_in_no_view(store):
    """The fenced row c2 is hidden from the list (it was), and now also from get by id, the query (before and
    after compaction) and the compacted table's files: every view shows c1 alone."""
    _fenced_row_lands(store)
    reader = Store(store.objects, "reader")
    assert ids(reader.checkpoints.list("s1")) == ["c1"]
    assert reader.checkpoints.get("s1", "c2") is None
    assert reader.checkpoints.get_chain("s1", "c2") is None
    assert json.loads(reader.checkpoints.get("s1", "c1"))["checkpoint_id"] == "c1"
    assert query_ids(reader, "s1") == ["c1"]
    with pytest.raises(ObjectNotFound):  # no fork from a fenced write
        reader.checkpoints.pin("s1", "c2", dependent="f1")
    reader.compact(tombstone_grace=timedelta(0))
    assert table_ids(reader) == ["c1"]
    assert query_ids(Store(store.objects, "cold"), "s1") == ["c1"]


def _logged(store: Store, n: int, *, keep: int = 20, batch: int = 1):
    lease = store.leases.acquire("s1", owner="w")
    log = store.checkpoints.log(lease, keep=keep, batch=batch)
    for i in range(1, n + 1):
        log_put(log, f"c{i}", turn=i)
    log.flush()
    return log


def test_path03_a_pruned_checkpoint_a_pin_keeps_never_comes_back_after_compaction(store):
    _logged(store, 4)
    store.checkpoints.pin("s1", "c4", dependent="f1")  # a fork of c4 keeps its object
    store.prune(session_id="s1")
    assert store.objects.get(key=layout.checkpoint_key("s1", None, "c4")) is not None  # the pin keeps it
    assert store.checkpoints.list("s1") == []
    store.compact(tombstone_grace=timedelta(0))  # the tombstones go
    for reader in (store, Store(store.objects, "cold")):
        assert reader.checkpoints.list("s1") == []
        assert reader.checkpoints.get("s1") is None
        assert reader.checkpoints.get("s1", "c4") is None


def test_path03_a_deleted_newest_checkpoint_a_pin_keeps_stays_deleted_after_compaction(store):
    _logged(store, 4)
    store.checkpoints.pin("s1", "c4", dependent="f1")
    assert store.checkpoints.delete("s1", "c4")
    store.compact(tombstone_grace=timedelta(0))
    store.compact(tombstone_grace=timedelta(0))  # a second merge carries the watermark on
    for reader in (store, Store(store.objects, "cold")):
        assert ids(reader.checkpoints.list("s1")) == ["c3", "c2", "c1"]
        assert json.loads(reader.checkpoints.get("s1"))["turn"] == 3


def test_path04_a_fork_resumes_from_a_fork_point_the_parents_retention_retired(store):
    lease = store.leases.acquire("s1", owner="w")
    log = store.checkpoints.log(lease, keep=2, batch=1)
    for i in (1, 2):
        log_put(log, f"c{i}", turn=i)
    # The fork pins c2 and crashes before its first checkpoint; the parent goes on and retention retires c2.
    chain = store.checkpoints.pin("s1", "c2", dependent="f1")
    for i in (3, 4, 5):
        log_put(log, f"c{i}", turn=i)
    assert ids(store.checkpoints.list("s1")) == ["c5", "c4"]
    assert store.objects.get(key=layout.checkpoint_key("s1", None, "c2")) is not None  # pinned
    # The fork's next attempt pins and reads its fork point again.
    assert store.checkpoints.pin("s1", "c2", dependent="f1") == chain
    got = store.checkpoints.get_chain("s1", "c2", pinned_for="f1")
    assert got == [store.objects.get(key=layout.checkpoint_key("s1", None, "c2")).data]
    # Nobody else sees it: not listed, not found by id, not pinnable by another fork.
    assert store.checkpoints.get("s1", "c2") is None
    assert store.checkpoints.get_chain("s1", "c2", pinned_for="f2") is None
    with pytest.raises(ObjectNotFound):
        store.checkpoints.pin("s1", "c2", dependent="f2")


def test_path05_delete_through_the_store_the_run_wrote_with(store):
    """Five checkpoints, each building on the ones before (an incremental chain), written through a log of the
    very store that then deletes: deleting the newest and then a middle one leaves the others readable."""
    lease = store.leases.acquire("s1", owner="w")
    log = store.checkpoints.log(lease, keep=20, batch=1)
    for i in range(1, 6):
        log_put(log, f"c{i}", turn=i, chain=tuple(f"c{j}" for j in range(1, i)))
    assert store.checkpoints.delete("s1", "c5")
    assert ids(store.checkpoints.list("s1")) == ["c4", "c3", "c2", "c1"]
    assert store.checkpoints.delete("s1", "c3")
    assert ids(store.checkpoints.list("s1")) == ["c4", "c2", "c1"]
    for cid in ("c4", "c2", "c1"):
        chain = store.checkpoints.get_chain("s1", cid)
        assert chain is not None and len(chain) == int(cid[1:])
    assert store.checkpoints.get("s1") is not None


def _lease_deleted(store: Store, session_id: str = "s1") -> None:
    store.objects.delete(keys=[layout.lease_key(session_id, None)])


def test_lease_deleted_a_zombies_late_checkpoint_stays_hidden_after_lease_json_is_deleted(store):
    """Holder (epoch 1) acknowledges c1; a taker takes epoch 2 and dies before its first checkpoint; the holder,
    a zombie now, lands c2 (its log has not re-checked its lease yet); then ``lease.json`` is deleted. No reader
    may show c2: it was written after the takeover, and its writer is told it was fenced."""
    holder = store.checkpoints.log(store.leases.acquire("s1", owner="holder"), batch=1)
    log_put(holder, "c1", turn=1)
    Store(store.objects, "taker").leases.acquire("s1", owner="taker")  # epoch 2; then the taker dies
    holder.batch = 8  # c2 is one put, no proof yet: an unindexed object of epoch 1
    log_put(holder, "c2", turn=2)
    for reader in (store, Store(store.objects, "before")):
        assert ids(reader.checkpoints.list("s1")) == ["c1"]
    _lease_deleted(store)
    for reader in (store, Store(store.objects, "cold")):
        assert ids(reader.checkpoints.list("s1")) == ["c1"]
        assert json.loads(reader.checkpoints.get("s1"))["turn"] == 1
        assert reader.checkpoints.get("s1", "c2") is None


def test_lease_deleted_a_fenced_row_stays_hidden_after_lease_json_is_deleted(store):
    """An indexed fenced row (its writer died before its re-check) is in no view once ``lease.json`` is gone,
    nor after a compaction publishes the table."""
    _fenced_row_lands(store)
    _lease_deleted(store)
    reader = Store(store.objects, "cold")
    assert ids(reader.checkpoints.list("s1")) == ["c1"]
    assert reader.checkpoints.get("s1", "c2") is None
    assert query_ids(reader, "s1") == ["c1"]
    reader.compact(tombstone_grace=timedelta(0))
    assert table_ids(reader) == ["c1"]


def test_lease_deleted_a_fenced_row_stays_hidden_when_lease_json_is_unreadable(store):
    _fenced_row_lands(store)
    store.objects.put(key=layout.lease_key("s1", None), data=b"\x00 not json")
    reader = Store(store.objects, "cold")
    assert ids(reader.checkpoints.list("s1")) == ["c1"]
    assert query_ids(reader, "s1") == ["c1"]


def test_lease_deleted_no_lease_copy_is_read_for_a_session_written_without_a_lease(store):
    """The fallback costs nothing where no lease was ever taken: no LIST of ``leases/``."""
    put_checkpoint(store, "s1", "c1", turn=1)
    listed: list[str] = []
    real_list = store.objects.list

    def counting_list(*, prefix, **kw):
        listed.append(prefix)
        return real_list(prefix=prefix, **kw)

    store.objects.list = counting_list  # type: ignore[method-assign]
    try:
        assert ids(Store(store.objects, "cold").checkpoints.list("s1")) == ["c1"]
    finally:
        del store.objects.list
    assert listed and not any(p.endswith("/leases/") for p in listed)
