"""A cold reader racing a takeover: a zombie's object must not become the session's tail for it alone.

A cold read looks at a session in rounds: the index LIST, then ``lease.json``
(and the index files), then the kept lease copies. The ``checkpoints/`` LIST
that finds the tail must come before the ``lease.json`` GET, as the index
LIST does: otherwise a zombie's object that lands after a takeover's swap
can be in that LIST while the reader holds the lease body from before the
swap, which has no fence for it, and the reader takes it for the writer's
tail ("latest") when no later reader ever will.

The zombie's put is possible: a checkpoint log reads no lease per put (it
proves its lease once a batch), and the takeover's listing, made before its
swap, does not see an object landing after it. The kept copy of the new body
(``leases/{epoch}.json``, listed in the reader's last round) hides it too, so
the schedule here is the one it does not cover: the taker's copy PUT fails
(a warning; the lease is taken), as it may, or has not landed yet.
"""

from __future__ import annotations

import json
import threading

import pytest

from loomray.storage import Store, layout, open_store
from loomray.storage.errors import ObjectNotFound, StorageError
from loomray.storage.objects import ObjectStore
from loomray.storage.testing import log_put

#: Seconds the ``checkpoints/`` LIST waits for a ``lease.json`` GET in its own round: longer than a round of
#: in-memory calls on threads takes to start; a reader that LISTs first only pays this wait, never a wrong answer.
_SAME_ROUND = 0.5


class _Through(ObjectStore):
    """Every call passed to ``inner``; subclasses change the ones a schedule needs."""

    def __init__(self, inner: ObjectStore) -> None:
        self.inner, self.backend = inner, inner.backend

    def put(self, **kw):
        return self.inner.put(**kw)

    def get(self, **kw):
        return self.inner.get(**kw)

    def list(self, **kw):
        return self.inner.list(**kw)

    def list_dirs(self, **kw):
        return self.inner.list_dirs(**kw)

    def delete(self, **kw):
        return self.inner.delete(**kw)

    def describe(self, key=None):
        return self.inner.describe(key)


class _Ordered(_Through):
    """``inner`` read on threads, as a remote store is, with one schedule forced on the first look at ``s1``: when
    the reader's GET of ``lease.json`` has returned, ``then`` runs (the takeover and the zombie's put), and a
    ``checkpoints/`` LIST in flight in the same round is served only after it."""

    def __init__(self, inner: ObjectStore, then) -> None:
        super().__init__(inner)
        self.backend = "remote"  # not "memory": the reads of one round run at once, on the index's threads
        self.then = then
        self.asked, self.done = threading.Event(), threading.Event()
        self.armed = True
        self.order: list[str] = []  # "lease" and "tail LIST", in the order they were served

    def get(self, *, key):
        if key != layout.lease_key("s1", None) or not self.armed:
            return self.inner.get(key=key)
        self.asked.set()
        out = self.inner.get(key=key)
        self.order.append("lease")
        self.armed = False
        self.then()
        self.done.set()
        return out

    def list(self, *, prefix):
        if prefix == layout.session_prefix("s1", None) + "checkpoints/" and self.armed:
            if self.asked.wait(_SAME_ROUND):  # lease.json is read in this LIST's round: serve it after the hook
                assert self.done.wait(30)
            self.order.append("tail LIST")
        return iter(list(self.inner.list(prefix=prefix)))


class _CopyFails(_Through):
    """``inner`` whose PUT of a kept lease copy fails: the takeover logs it and holds the lease all the same."""

    def put(self, *, key, **kw):
        if key.startswith(layout.lease_copy_prefix("s1", None)):
            raise StorageError(f"{self.inner.describe(key)}: injected: the copy's PUT failed")
        return self.inner.put(key=key, **kw)


def _race(store: Store) -> _Ordered:
    """Holder (epoch 1) acknowledges c1. The reader's hook: a taker takes epoch 2 (its copy's PUT fails), then the
    holder, a zombie now whose log has not re-checked its lease, lands c2: an unindexed object of epoch 1."""
    holder = store.checkpoints.log(store.leases.acquire("s1", owner="holder"), batch=1)
    log_put(holder, "c1", turn=1)

    def takeover_then_zombie() -> None:
        Store(_CopyFails(store.objects), "taker").leases.acquire("s1", owner="taker")
        holder.batch = 8  # c2 is one put, no proof yet
        log_put(holder, "c2", turn=2)
        assert store.objects.get(key=layout.checkpoint_key("s1", None, "c2")) is not None

    return _Ordered(store.objects, takeover_then_zombie)


def _look(reader: Store, view: str) -> object:
    """What ``view`` shows of s1: the list's ids, latest's turn, c2's bytes, or whether a fork from c2 starts."""
    if view == "list":
        return [r.checkpoint_id for r in reader.checkpoints.list("s1")]
    if view == "latest":
        return json.loads(reader.checkpoints.get("s1") or b"null")["turn"]
    if view == "latest chain":
        return [json.loads(o)["turn"] for o in reader.checkpoints.get_chain("s1") or []]
    if view == "get c2":
        return reader.checkpoints.get("s1", "c2")
    try:
        reader.checkpoints.pin("s1", "c2", dependent="f1")
    except ObjectNotFound:
        return "no fork"
    return "forked"


_LATER = {"list": ["c1"], "latest": 1, "latest chain": [1], "get c2": None, "fork c2": "no fork"}


@pytest.mark.parametrize("view", list(_LATER))
def test_a_reader_racing_a_takeover_never_shows_the_zombies_late_object(view):
    """The reader's lease.json is the one before the takeover; the zombie's c2 lands before its ``checkpoints/``
    LIST would be served. It shows what every later reader shows: c1 is the newest, c2 is in no view."""
    store = open_store("memory://tail-race-" + view.replace(" ", "-"))
    ordered = _race(store)
    reader = Store(ordered, "reader")  # a cold reader: nothing cached
    seen = _look(reader, view)
    assert not ordered.armed  # the hook ran: the takeover and c2 happened during this read
    assert seen == _LATER[view]
    assert ordered.order == ["tail LIST", "lease"]  # every LIST of the look came before lease.json's GET
    assert _look(Store(store.objects, "later"), view) == _LATER[view]
    reader.close(keep_objects=True)
    store.close()
