"""Whose tombstones readers honour (storage.visibility rule 5), at the storage API, on every backend.

A lease holder's retention proves its lease, then writes its tombstones. A
takeover that claims and lists the session in between must make every view
ignore them: the checkpoints they name stay listed, readable and in the
table, and their objects are not deleted. Tombstones written without a lease,
files written before the columns existed and fences written before the rule
are honoured as they always were.
"""

from __future__ import annotations

from datetime import timedelta

import pyarrow as pa
import pytest
from storage_views import table_ids

from loomray.storage import Store, layout
from loomray.storage.errors import LeaseLostError
from loomray.storage.rows import CHECKPOINT_SCHEMA, checkpoint_rows_from_table
from loomray.storage.testing import log_put, put_checkpoint
from loomray.storage.visibility import Visibility, parse_fences


def ids(rows) -> list[str]:
    return [r.checkpoint_id for r in rows]


def objects(store: Store, session_id: str = "s1") -> set[str]:
    prefix = layout.session_prefix(session_id, None) + "checkpoints/"
    return {o.key[len(prefix):-5] for o in store.objects.list(prefix=prefix)}




def take_over_after_the_next_proof(store: Store, monkeypatch, when: int = 1) -> list:
    """A takeover (another process's store) right after this store's ``when``-th lease proof passed."""
    real = store._leases.confirm
    seen: list[int] = []
    taken: list = []

    def confirm(lease, **kw):
        real(lease, **kw)
        seen.append(1)
        if len(seen) == when:
            taken.append(Store(store.objects, "taker").leases.acquire(lease.session_id, owner="taker"))

    monkeypatch.setattr(store._leases, "confirm", confirm)
    return taken


def test_a_logs_tombstones_landing_after_a_takeovers_listing_are_ignored_by_every_view(store, monkeypatch):
    log = store.checkpoints.log(store.leases.acquire("s1", owner="holder"), batch=4, keep=2)
    taken = take_over_after_the_next_proof(store, monkeypatch)
    for i in range(1, 5):
        log_put(log, f"c{i}", turn=i)  # the 4th put proves the lease, the takeover comes, then the batch lands
    assert taken
    monkeypatch.undo()
    with pytest.raises(LeaseLostError):
        log_put(log, "c5", turn=5)
        log.flush()
    cold = Store(store.objects, "reader")
    assert ids(cold.checkpoints.list("s1")) == ["c4", "c3", "c2", "c1"]
    assert all(cold.checkpoints.get("s1", f"c{i}") is not None for i in range(1, 5))
    assert sorted(cold.query(session_id="s1")["checkpoint_id"].to_pylist()) == ["c1", "c2", "c3", "c4"]
    assert {"c1", "c2", "c3", "c4"} <= objects(store)
    cold.compact(tombstone_grace=timedelta(0))
    assert table_ids(cold) == ["c1", "c2", "c3", "c4"]
    # Compaction dropped the fenced writer's tombstones for good: no index file holds one any more.
    _, index = cold._index.read_prefix(layout.index_partition(layout.CHECKPOINT_INDEX, "s1", None),
                                      CHECKPOINT_SCHEMA, cache=False)
    assert not any(index["tombstone"].to_pylist())
    assert ids(Store(store.objects, "again").checkpoints.list("s1")) == ["c4", "c3", "c2", "c1"]


def test_put_checkpoints_retention_racing_a_takeover_retires_nothing(store, monkeypatch):
    lease = store.leases.acquire("s1", owner="holder")
    put_checkpoint(store, "s1", "c1", turn=1, lease=lease, keep=1)
    taken = take_over_after_the_next_proof(store, monkeypatch)  # c2's re-check passes, then the takeover
    put_checkpoint(store, "s1", "c2", turn=2, lease=lease, keep=1)  # its retention's tombstone for c1 lands late
    assert taken
    cold = Store(store.objects, "reader")
    assert ids(cold.checkpoints.list("s1")) == ["c2", "c1"]
    assert cold.checkpoints.get("s1", "c1") is not None and "c1" in objects(store)


def test_a_proven_writers_retention_retires_and_collects_one_batch_later(store):
    log = store.checkpoints.log(store.leases.acquire("s1", owner="w"), batch=2, keep=2)
    for i in range(1, 5):
        log_put(log, f"c{i}", turn=i)  # the second batch retires c1, c2: their objects wait for the next proof
    assert ids(Store(store.objects, "r").checkpoints.list("s1")) == ["c4", "c3"]
    assert objects(store) == {"c1", "c2", "c3", "c4"}
    log_put(log, "c5", turn=5)
    log_put(log, "c6", turn=6)  # its proof settles them
    assert objects(store) == {"c3", "c4", "c5", "c6"}
    assert ids(Store(store.objects, "r").checkpoints.list("s1")) == ["c6", "c5"]


def test_compaction_leaves_tombstones_a_takeover_under_way_may_yet_ignore(store):
    log = store.checkpoints.log(store.leases.acquire("s1", owner="w"), batch=4, keep=2)
    for i in range(1, 5):
        log_put(log, f"c{i}", turn=i)
    store.objects.put(key=layout.epoch_marker_key("s1", None, 2), data=b'{"epoch": 2}')  # claimed, not swapped
    before = sorted(store.index_files())
    store.compact(tombstone_grace=timedelta(0))
    assert sorted(store.index_files()) == before  # the files as they were: neither row nor tombstone dropped
    assert table_ids(store) == ["c3", "c4"]  # the table has the rule's view of now (no fence: honoured)
    cold = Store(store.objects, "reader")
    assert sorted(cold.query(session_id="s1")["checkpoint_id"].to_pylist()) == ["c3", "c4"]
    assert ids(cold.checkpoints.list("s1")) == ["c4", "c3"]


def test_old_files_and_old_fences_honour_tombstones_as_before():
    old_schema = pa.schema([f for f in CHECKPOINT_SCHEMA if f.name not in ("tomb_epoch", "tomb_mark")])
    row = {f.name: None for f in old_schema}
    row.update(session_id="s", checkpoint_id="c1", turn=1, position="p", execution_status="active", message_count=1,
               input_tokens=0, output_tokens=0, epoch=1, key="k", size=1, sha256="x", tombstone=True)
    old = pa.Table.from_pylist([row], schema=old_schema)
    [(_, flag)] = checkpoint_rows_from_table(old)
    assert flag is True  # no writer recorded: always honoured
    no_tombs = Visibility(3, tuple(parse_fences([{"epoch": 2, "top": None}])))
    assert not no_tombs.ignores((1, "c9"))  # a fence from before the rule judges no tombstone
    listed = Visibility(3, tuple(parse_fences([{"epoch": 2, "top": None, "tombs": [1, "c3"]}])))
    assert listed.ignores((1, "c4")) and not listed.ignores((1, "c3")) and not listed.ignores((2, "c9"))
    none_listed = Visibility(3, tuple(parse_fences([{"epoch": 2, "top": None, "tombs": None}])))
    assert none_listed.ignores((1, "c1"))
