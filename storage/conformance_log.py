"""Conformance tests of batched checkpoint writes (:mod:`storage.checkpoint_log`), chains and pins.

Part of :class:`storage.conformance.ObjectStoreConformance`: every backend runs them.
"""

from __future__ import annotations

import json

import pytest

from . import envelope
from .errors import CorruptObjectError, LeaseLostError, ObjectNotFound
from .store import Store
from .testing import all_keys, log_put


def _ids(rows) -> list[str]:
    return [r.checkpoint_id for r in rows]


def _objects(store: Store, session: str = "s1") -> set[str]:
    prefix = f"sessions/_/{session}/checkpoints/"
    return {k[len(prefix):-5] for k in all_keys(store) if k.startswith(prefix)}


def _some(value):
    """``value``, which the test expects to exist."""
    assert value is not None
    return value


def _latest_id(store: Store, session: str = "s1") -> str:
    return json.loads(_some(store.checkpoints.get(session)))["index"]["checkpoint_id"]


def _cold(store: Store) -> Store:
    """A reader in a new process: no parsed index file, no parsed tail."""
    return Store(store.objects, store.url)


class CheckpointLogConformance:
    """Batched checkpoint writes, tails, chains and pins (mixed into ObjectStoreConformance)."""

    def test_log_checkpoints_are_readable_before_they_are_indexed(self, store):
        log = store.checkpoints.log(store.leases.acquire("s1", owner="w"), batch=4)
        assert log_put(log, "c1", turn=1) == [] and log_put(log, "c2", turn=2, chain=("c1",)) == []
        assert store.index_files() == []  # nothing indexed yet: one PUT per checkpoint so far
        reader = _cold(store)
        assert _ids(reader.checkpoints.list("s1")) == ["c2", "c1"]
        latest = _some(reader.checkpoints.get("s1"))
        assert envelope.intact(latest) and _some(envelope.header_of(latest))["checkpoint_id"] == "c2"
        assert json.loads(latest)["text"] == "pass 2" and json.loads(latest)["index"]["chain"] == ["c1"]
        chain = _some(reader.checkpoints.get_chain("s1"))
        assert [json.loads(b)["index"]["checkpoint_id"] for b in chain] == ["c1", "c2"]

    def test_log_indexes_one_file_per_batch_and_acknowledges_it(self, store):
        log = store.checkpoints.log(store.leases.acquire("s1", owner="w"), batch=3, keep=0)
        assert log_put(log, "c1") == [] and log_put(log, "c2", turn=2) == []
        acked = log_put(log, "c3", turn=3)
        assert _ids(acked) == ["c1", "c2", "c3"] and log.pending == []
        assert len(store.index_files()) == 1  # one index file for the batch
        rows = _cold(store).checkpoints.list("s1")
        assert _ids(rows) == ["c3", "c2", "c1"] and {r.epoch for r in rows} == {1}
        assert log_put(log, "c4", turn=4) == [] and _ids(log.flush()) == ["c4"] and log.flush() == []

    def test_retention_keeps_what_a_live_chain_needs_then_collects_it(self, store):
        log = store.checkpoints.log(store.leases.acquire("s1", owner="w"), batch=1, keep=1)
        log_put(log, "c1", turn=1)
        log_put(log, "c2", turn=2, chain=("c1",))
        log_put(log, "c3", turn=3, chain=("c1", "c2"))
        assert _ids(store.checkpoints.list("s1")) == ["c3"]  # retention kept one row ...
        assert _objects(store) == {"c1", "c2", "c3"}  # ... and the objects its chain needs
        assert len(_some(_cold(store).checkpoints.get_chain("s1"))) == 3
        log_put(log, "c4", turn=4)  # self-contained: nothing needs c1..c3 any more ...
        assert _ids(_cold(store).checkpoints.list("s1")) == ["c4"]
        assert _objects(store) == {"c1", "c2", "c3", "c4"}  # ... once a proof settled c3's tombstone: the next
        log_put(log, "c5", turn=5)
        assert _objects(store) == {"c4", "c5"} and _ids(_cold(store).checkpoints.list("s1")) == ["c5"]

    def test_a_takeover_indexes_the_old_owners_tail_and_hides_what_it_lands_later(self, store):
        old = store.checkpoints.log(store.leases.acquire("s1", owner="old"), batch=8)
        log_put(old, "a1", turn=1)
        log_put(old, "a2", turn=2, chain=("a1",))
        new = store.leases.acquire("s1", owner="new")
        assert len(store.index_files()) == 1  # the takeover indexed the tail it found
        log_put(old, "a3", turn=3, chain=("a1", "a2"))  # the zombie does not know yet
        reader = _cold(store)
        assert _ids(reader.checkpoints.list("s1")) == ["a2", "a1"]  # a3 is never a candidate
        assert _latest_id(reader) == "a2"
        with pytest.raises(LeaseLostError):
            old.flush()
        mine = store.checkpoints.log(new, batch=8)
        log_put(mine, "b1", turn=3, chain=("a1", "a2"))  # builds on what the takeover listed
        assert _ids(_cold(store).checkpoints.list("s1"))[:1] == ["b1"]
        assert len(_some(_cold(store).checkpoints.get_chain("s1"))) == 3

    def test_a_corrupt_tail_checkpoint_is_skipped_for_latest(self, store, caplog):
        log = store.checkpoints.log(store.leases.acquire("s1", owner="w"), batch=8)
        log_put(log, "c1", turn=1)
        log_put(log, "c2", turn=2)
        key = "sessions/_/s1/checkpoints/c2.json"
        data = _some(store.objects.get(key=key)).data
        store.objects.put(key=key, data=data.replace(b"pass 2", b"pass 9"))  # same size, other bytes
        reader = _cold(store)
        assert _latest_id(reader) == "c1"
        assert _ids(reader.checkpoints.list("s1")) == ["c1"]  # an object whose digest fails is no tail
        store.objects.put(key=key, data=data[:-10])  # truncated
        assert _ids(_cold(store).checkpoints.list("s1")) == ["c1"]

    def test_a_chain_with_a_missing_object_falls_back_for_latest_and_raises_for_its_id(self, store, caplog):
        log = store.checkpoints.log(store.leases.acquire("s1", owner="w"), batch=1, keep=0)
        log_put(log, "c0", turn=0)
        log_put(log, "c1", turn=1)
        log_put(log, "c2", turn=2, chain=("c1",))
        store.objects.delete(keys=["sessions/_/s1/checkpoints/c1.json"])  # behind the store's back
        reader = _cold(store)
        assert json.loads(_some(reader.checkpoints.get_chain("s1"))[-1])["index"]["checkpoint_id"] == "c0"
        with pytest.raises(CorruptObjectError, match="c1"):
            reader.checkpoints.get_chain("s1", "c2")

    def test_a_fork_pins_its_parents_chain_through_retention_and_prune(self, store):
        parent = store.checkpoints.log(store.leases.acquire("p", owner="w"), batch=1, keep=1)
        log_put(parent, "p1", turn=1)
        log_put(parent, "p2", turn=2, chain=("p1",))
        chain = store.checkpoints.pin("p", "p2", dependent="f")
        assert chain == ("p/p1", "p/p2")
        fork = store.checkpoints.log(store.leases.acquire("f", owner="w"), batch=1, keep=1)
        log_put(fork, "f1", turn=3, chain=chain)
        log_put(parent, "p3", turn=3)  # self-contained: the parent itself needs p1, p2 no more
        assert _objects(store, "p") >= {"p1", "p2", "p3"}  # pinned for the fork
        store.prune(session_id="p")
        assert _objects(store, "p") == {"p1", "p2"}  # prune deletes all but what the fork needs
        assert len(_some(_cold(store).checkpoints.get_chain("f"))) == 3
        log_put(fork, "f2", turn=4)  # the fork moves past its parent's chain: the pin goes, and what it kept,
        log_put(fork, "f3", turn=5)  # once the next proof settled the tombstone of f1
        assert _objects(store, "p") == set() and not [k for k in all_keys(store) if "/pins/" in k]

    def test_pinning_a_retired_checkpoint_fails_and_leaves_no_pin(self, store):
        log = store.checkpoints.log(store.leases.acquire("p", owner="w"), batch=1, keep=1)
        log_put(log, "p1", turn=1)
        log_put(log, "p2", turn=2)
        with pytest.raises(ObjectNotFound):
            store.checkpoints.pin("p", "p1", dependent="f")
        assert not [k for k in all_keys(store) if "/pins/" in k]

    def test_envelope_round_trip_and_tamper_detection(self, store):
        wrapped = envelope.wrap(b'{"a": 1, "messages": []}', {"checkpoint_id": "c1", "epoch": 3})
        assert json.loads(wrapped) == {"index": {"checkpoint_id": "c1", "epoch": 3}, "a": 1, "messages": [],
                                       "sha256": json.loads(wrapped)["sha256"]}
        assert envelope.header_of(wrapped) == {"checkpoint_id": "c1", "epoch": 3} and envelope.intact(wrapped)
        assert not envelope.intact(wrapped.replace(b'"a": 1', b'"a": 2'))
        assert envelope.header_of(b'{"schema_version": "1.0"}') is None
        assert json.loads(envelope.wrap(b"{}", {"x": 1})) == {"index": {"x": 1},
                                                             "sha256": json.loads(envelope.wrap(b"{}", {"x": 1}))["sha256"]}

    def test_a_checkpoint_whose_write_seemed_to_fail_is_never_taken_for_the_tail(self, store):
        """Its PUT landed but its writer saw an error: the writer goes on without it (a full snapshot next) and
        retention collects what it built on. A later takeover must not index it: its chain is gone."""
        log = store.checkpoints.log(store.leases.acquire("s1", owner="w"), batch=1, keep=1)
        log_put(log, "c1", turn=1)
        real_put = store.objects.put

        def put_then_fail(*, key, data, **kw):
            real_put(key=key, data=data, **kw)
            if key.endswith("/c2.json"):
                raise OSError("reply lost (injected)")
            return "etag"

        store.objects.put = put_then_fail
        try:
            with pytest.raises(OSError):
                log_put(log, "c2", turn=2, chain=("c1",))
        finally:
            del store.objects.put
        log_put(log, "c3", turn=3)  # the writer's next checkpoint is whole; retention retires c1 ...
        log_put(log, "c4", turn=4)  # ... and collects it after the next proof
        assert "c1" not in _objects(store) and "c2" in _objects(store)
        store.leases.acquire("s1", owner="taker")  # indexes the old owner's tail: c2 is not part of it
        rows = _cold(store).checkpoints.list("s1")
        assert _ids(rows) == ["c4"]
        assert all(_cold(store).checkpoints.get_chain("s1", r.checkpoint_id) for r in rows)
