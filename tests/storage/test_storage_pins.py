"""Pins against prune and retention from another store while a fork's writer runs (storage API, every backend).

A fork writes its pin on the parent's chain, then its first checkpoint, which
no index row names until its batch is flushed (a tail). Another store (an
operator's prune) works meanwhile. Whatever it retires, the fork's writer goes
on building on its head, and every checkpoint it acknowledges must load from
a cold store (docs/design.md "Checkpoints: incremental objects in chains").
"""

from __future__ import annotations

import pytest

from loomray.storage import Store, layout
from loomray.storage.testing import log_put


def cold(store: Store) -> Store:
    return Store(store.objects, "cold")


def objects(store: Store, session_id: str) -> set[str]:
    prefix = layout.session_prefix(session_id, None) + "checkpoints/"
    return {o.key[len(prefix):-5] for o in store.objects.list(prefix=prefix)}


def parent_and_fork(store: Store, *, keep: int = 20):
    """Parent ``p`` (p1, p2 on it) and fork ``f`` pinned on p2 with its first checkpoint f1 put but not indexed
    (batch 16), its run recorded and unfinished; returns the fork's log and the chain f1 names."""
    parent = store.checkpoints.log(store.leases.acquire("p", owner="w"), batch=1)
    log_put(parent, "p1", turn=1)
    log_put(parent, "p2", turn=2, chain=("p1",))
    chain = store.checkpoints.pin("p", "p2", dependent="f")
    store.runs.create("f", run_id="run1", base_session_id="p", base_checkpoint_id="p2")
    fork = store.checkpoints.log(store.leases.acquire("f", owner="w"), batch=16, keep=keep)
    log_put(fork, "f1", turn=3, chain=chain)
    assert [r.checkpoint_id for r in cold(store).checkpoints.list("f")] == ["f1"]  # a tail
    assert cold(store).query(user_id=None, session_id="f").num_rows == 0  # no index row names it yet
    return fork, chain


@pytest.mark.parametrize("order", ["parent-then-fork", "fork-then-parent"])
def test_prune_of_a_forks_tail_keeps_its_pin_while_its_writer_runs(store, order):
    """Another store prunes the parent and the fork (no ``before``), in either order, while the fork's first
    checkpoint is a tail. The fork's writer then puts f2 on f1: f2 names p1, p2 and f1 and must load."""
    fork, chain = parent_and_fork(store)
    pruner = Store(store.objects, "pruner")
    for sid in (["p", "f"] if order == "parent-then-fork" else ["f", "p"]):
        pruner.prune(session_id=sid)
    assert objects(store, "p") == {"p1", "p2"}
    assert cold(store).checkpoints.list("f") == []
    log_put(fork, "f2", turn=4, chain=(*chain, "f1"))
    fork.flush()
    reader = cold(store)
    assert [r.checkpoint_id for r in reader.checkpoints.list("f")] == ["f2"]
    got = reader.checkpoints.get_chain("f")
    assert got is not None and len(got) == 4


def test_a_forks_retention_after_its_parent_is_pruned_keeps_the_pin_until_it_moves_past(store):
    """The parent is pruned while the fork runs with retention keeping 1: each flush retires the fork's older
    rows, yet its newest names the parent's objects, so the pin stays and every listed checkpoint loads. Once
    the fork writes a full snapshot and moves on, the pin goes and so do the parent's objects."""
    fork, chain = parent_and_fork(store, keep=1)
    fork.flush()
    Store(store.objects, "pruner").prune(session_id="p")
    prev = ("f1",)
    for turn in range(4, 8):
        cid = f"f{turn - 2}"
        log_put(fork, cid, turn=turn, chain=(*chain, *prev))
        fork.flush()
        prev = (*prev, cid)
        reader = cold(store)
        assert [r.checkpoint_id for r in reader.checkpoints.list("f")] == [cid]
        assert reader.checkpoints.get_chain("f") is not None
        assert objects(store, "p") == {"p1", "p2"}
    for cid, turn in (("g1", 8), ("g2", 9), ("g3", 10)):  # a full snapshot, then two on it
        log_put(fork, cid, turn=turn, chain=() if cid == "g1" else ("g1",) if cid == "g2" else ("g1", "g2"))
        fork.flush()
    assert objects(store, "p") == set()
    assert not [o.key for o in store.objects.list(prefix=layout.pin_prefix("p", None))]
    assert cold(store).checkpoints.get_chain("f") is not None


def pins_of(store: Store, session_id: str) -> list[str]:
    return sorted(o.key.rsplit("/", 1)[1] for o in store.objects.list(prefix=layout.pin_prefix(session_id, None)))


def test_a_writer_pin_holds_what_a_prune_kept_for_a_running_writer_until_its_run_ends(store):
    """A prune without ``before`` of the running fork deletes the run's record and keeps its head f1 for its
    writer, in a writer pin (``f/pins/f.json``) that also keeps the fork's pin on the parent. The writer dies
    there. A second prune finds no record, yet deletes nothing the pin holds. A later run of the fork ends
    (``run_end``): the next prune drops the writer pin, the fork's pin on the parent, and every object."""
    from loomray.storage.rows import JournalEntry
    from loomray.storage.testing import T0

    parent_and_fork(store)
    pruner = Store(store.objects, "pruner")
    pruner.prune(session_id="p")
    pruner.prune(session_id="f")
    assert pins_of(store, "f") == ["f.json"] and pins_of(store, "p") == ["f.json"]
    assert objects(store, "f") == {"f1"} and objects(store, "p") == {"p1", "p2"}
    pruner.prune(session_id="f")  # nothing tells the run goes on: the writer pin does
    assert objects(store, "f") == {"f1"} and objects(store, "p") == {"p1", "p2"}
    store.runs.create("f", run_id="run2")
    store.journal.append(JournalEntry(session_id="f", user_id=None, run_id="run2", seq=1, step_key="run-end",
                                      kind="run_end", input_hash="", output={}, created_at=T0))
    pruner.prune(session_id="f")
    assert objects(store, "f") == set() and objects(store, "p") == set()
    assert pins_of(store, "f") == [] and pins_of(store, "p") == []
