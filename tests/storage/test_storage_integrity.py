"""Storage integrity under races and damage: one regression test (or a few) per path of the durability issue.

Each test is named after its path: 1 compaction vs a cold reader, 3 a deleted
lease, 4 a corrupt lease, 9 two compactors, 10 corrupt checkpoints and
quarantine, 16 unsafe ids, 17 lease races. They run on every backend
(memory, local directory, S3 via moto) through the ``store`` fixture unless a
path is about one backend.
"""

from __future__ import annotations

import hashlib
import json
import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from datetime import datetime, timedelta, timezone

import pytest

import loomray.storage.backoff as backoff_module
import loomray.storage.checkpoint_reads as checkpoints_module
import loomray.storage.checkpoint_rows as checkpoint_rows_module
import loomray.storage.index as index_module
import loomray.storage.maintenance as maintenance_module
import loomray.storage.pruning as pruning_module
from loomray.storage import CheckpointInfo, JournalEntry, SessionRow, Store, errors, layout, open_store
from loomray.storage.errors import CorruptObjectError, InvalidIdError, LeaseLostError, PreconditionFailed
from loomray.storage.faults import ActorCrashed, Fault, FaultPlan, FaultyObjectStore, Rule, current_actor
from loomray.storage.ids import validate_id
from loomray.storage.rows import CHECKPOINT_SCHEMA
from loomray.storage.testing import land_row, write_checkpoint

T0 = datetime(2026, 7, 4, 12, 0, tzinfo=timezone.utc)
LEASE = "sessions/_/s1/lease.json"


def put(store: Store, session_id: str, checkpoint_id: str, *, turn: int = 1, keep: int = 20, lease=None,
        user_id=None, payload: bytes | None = None):
    data = payload if payload is not None else json.dumps({"checkpoint_id": checkpoint_id, "turn": turn}).encode()
    info = CheckpointInfo(session_id=session_id, checkpoint_id=checkpoint_id, user_id=user_id, turn=turn,
                          created_at=T0 + timedelta(minutes=turn), position="after_tools",
                          execution_status="active", message_count=turn)
    return write_checkpoint(store, data, info, lease=lease, keep=keep)


def land(store: Store, checkpoint_id: str, *, turn: int, epoch: int):
    """A fenced writer's checkpoint: object and row land at ``epoch``, no lease check (:func:`land_row`)."""
    data = json.dumps({"checkpoint_id": checkpoint_id, "turn": turn}).encode()
    info = CheckpointInfo(session_id="s1", checkpoint_id=checkpoint_id, turn=turn,
                          created_at=T0 + timedelta(minutes=turn), position="after_tools",
                          execution_status="active", message_count=turn)
    return land_row(store, data, info, epoch=epoch)


def snapshot(store: Store) -> dict[str, str]:
    """Every object's key and ETag: equal snapshots mean nothing was written or deleted."""
    return {o.key: o.etag for o in store.objects.list(prefix="")}


def ids(rows) -> list[str]:
    return [r.checkpoint_id for r in rows]


# -- path 1: compaction vs a cold reader ---------------------------------------------------------------------------

@pytest.mark.parametrize("read", ["latest", "list", "session", "query"])
def test_path01_cold_reader_racing_a_compaction_never_sees_an_empty_session(store, read):
    """A fresh process LISTs the index; a compaction merges and deletes exactly those files before its GETs."""
    for i in range(3):
        put(store, "s1", f"c{i}", turn=i)
    store.sessions.put(SessionRow("s1", None, "running", T0))
    store.sessions.put(SessionRow("s1", None, "completed", T0 + timedelta(seconds=1)))
    newest = store.checkpoints.get("s1", "c2")
    reader = Store(store.objects, store.url)  # nothing cached: a restarted runtime, `loomray resume`, a new actor
    real_list = reader._index.list_files
    compactions = []

    def list_then_compact(prefix):
        keys = real_list(prefix)
        if not compactions:
            compactions.append(store.compact())  # the supervisor's loop, or a `loomray compact` cron
        return keys

    reader._index.list_files = list_then_compact  # type: ignore[method-assign]
    if read == "latest":
        assert reader.checkpoints.get("s1") == newest
    elif read == "list":
        assert ids(reader.checkpoints.list("s1")) == ["c2", "c1", "c0"]
    elif read == "session":
        assert reader.sessions.get("s1").status == "completed"
    else:
        assert sorted(reader.query(session_id="s1")["checkpoint_id"].to_pylist()) == ["c0", "c1", "c2"]
    assert compactions and compactions[0].files_after < compactions[0].files_before  # the race really happened


@pytest.mark.parametrize("read", ["latest", "list"])
def test_path01_retention_racing_a_cold_reader_never_hides_the_successor(store, read):
    """Between the reader's index LIST and its object reads the holder writes c1 and retention (keep=1) retires c0.
    The objects' LIST, made beside the index LIST, is served after that write (on S3 the two are in flight at
    once and may be served in either order; listed before it, c0 is the answer, as of both LISTs)."""
    lease = store.leases.acquire("s1", owner="holder")
    put(store, "s1", "c0", turn=0, keep=1, lease=lease)
    written = threading.Event()

    def objects_list_after_the_write(call, hold):
        if call.op == "list" and (call.key or "").endswith("/checkpoints/") and not written.is_set():
            assert written.wait(30)

    reader = Store(FaultyObjectStore(store.objects, gate=objects_list_after_the_write), store.url)
    real_list = reader._index.list_files
    raced = []

    def list_then_write(prefix):
        keys = real_list(prefix)
        if not raced:
            raced.append(put(store, "s1", "c1", turn=1, keep=1, lease=lease))
            written.set()
        return keys

    reader._index.list_files = list_then_write  # type: ignore[method-assign]
    if read == "latest":
        assert hashlib.sha256(reader.checkpoints.get("s1")).hexdigest() == raced[0].sha256
    else:  # c0's object goes with the writer's next flush: the list may still show it, after c1
        assert ids(reader.checkpoints.list("s1"))[:1] == ["c1"]
    assert store.checkpoints.get("s1", "c0") is None  # c0 really was retired under the reader


def _reader_behind_a_writer(store: Store, rounds: int | None) -> tuple[Store, list]:
    """A cold reader of s1 and the checkpoints the holder writes (keep=1) right before each of the reader's
    object reads: after its index LIST, every time, ``rounds`` times (None: for ever). Two a round: a log deletes
    the objects one flush's retention retired at its next flush, so the second write deletes what the reader saw."""
    written = []
    lease = store.leases.acquire("s1", owner="holder")
    one_writer = threading.Lock()  # the reader reads objects on several threads; the holder is one writer

    def writer_moves_on(call, hold):
        listing = call.op == "list" and call.key == "sessions/_/s1/checkpoints/"
        reading = call.op == "get" and call.key.startswith("sessions/_/s1/checkpoints/")
        with one_writer:
            if (listing or reading) and (rounds is None or len(written) < 2 * rounds):
                for _ in range(2):
                    n = len(written) + 1
                    written.append(put(store, "s1", f"c{n:04d}", turn=n, keep=1, lease=lease))

    return Store(FaultyObjectStore(store.objects, gate=writer_moves_on), store.url), written


@pytest.mark.parametrize("read", ["list", "latest"])
def test_path01_a_writer_outpacing_a_cold_reader_never_makes_the_session_read_as_empty(store, read, monkeypatch):
    """Retention keep=1 and a live writer: each time the reader has listed the index, the holder writes a new
    checkpoint and retires the one the reader saw, five rounds in a row. The reader lists again until it
    catches up, and finds the newest checkpoint, never an empty session. (Found by the durability soak:
    after a bounded number of re-lists, list_checkpoints returned [] while a newer checkpoint existed.)"""
    delays = []
    monkeypatch.setattr(backoff_module, "sleep", delays.append)
    put(store, "s1", "c0000", turn=0, keep=1)
    reader, written = _reader_behind_a_writer(store, rounds=5)
    if read == "list":
        assert ids(reader.checkpoints.list("s1")) == ["c0010"]
    else:
        raw = reader.checkpoints.get("s1")
        assert raw is not None and hashlib.sha256(raw).hexdigest() == written[-1].sha256
    assert len(written) == 10 and ids(store.checkpoints.list("s1")) == ["c0010"]  # every round really raced
    # It listed again after a jittered backoff, at most once per round (a round may also be spent on reading an
    # object the index did not name yet: the holder moved on twice then).
    assert 1 <= len(delays) <= 5 and all(0 <= d <= backoff_module.CAP for d in delays)


@pytest.mark.parametrize("read", ["list", "latest"])
def test_path01_a_reader_that_never_catches_up_raises_a_typed_error(store, read, monkeypatch):
    """A writer that outpaces the reader for good: once its backoff has used up the time budget, the reader
    raises IndexChangedError (transient: try again), never [] or None."""
    now = [0.0]  # a clock that only the reader's backoff moves, so the budget does not depend on machine load

    def wait(seconds):
        now[0] += seconds

    monkeypatch.setattr(backoff_module, "sleep", wait)
    monkeypatch.setattr(backoff_module, "clock", lambda: now[0], raising=False)
    monkeypatch.setattr(checkpoints_module, "READ_TIMEOUT", 2.0, raising=False)
    put(store, "s1", "c0000", turn=0, keep=1)
    reader, written = _reader_behind_a_writer(store, rounds=None)
    with pytest.raises(errors.IndexChangedError, match="s1") as info:
        reader.checkpoints.list("s1") if read == "list" else reader.checkpoints.get("s1")
    assert isinstance(info.value, errors.TransientStorageError)
    assert len(written) >= 5 and checkpoints_module.READ_TIMEOUT - backoff_module.CAP <= now[0]
    assert now[0] <= checkpoints_module.READ_TIMEOUT  # it gave up within its budget


def test_path01_index_files_that_keep_vanishing_raise_instead_of_reading_as_empty(store, monkeypatch):
    put(store, "s1", "c1")
    store.sessions.put(SessionRow("s1", None, "running", T0))
    reader = Store(store.objects, store.url)
    delays = []
    monkeypatch.setattr(index_module, "_sleep", delays.append, raising=False)
    real_get = store.objects.get

    def get_no_index(*, key):  # every listed index file is gone by the time it is read
        return None if key.startswith("index/") else real_get(key=key)

    monkeypatch.setattr(store.objects, "get", get_no_index)
    for call in (lambda: reader.checkpoints.get("s1"), lambda: reader.checkpoints.list("s1"),
                 lambda: reader.sessions.get("s1"), lambda: reader.query()):
        with pytest.raises(errors.IndexChangedError, match="index/"):
            call()
    assert delays and all(0 <= d <= 0.5 for d in delays)  # it re-listed with a (jittered) backoff in between
    monkeypatch.undo()
    assert Store(store.objects, store.url).checkpoints.get("s1") is not None


# -- path 3: a deleted lease.json --------------------------------------------------------------------------------

def test_path03_deleted_lease_epochs_keep_rising(store):
    for _ in range(3):
        old = store.leases.acquire("s1", owner="old")
    assert old.epoch == 3
    for i in range(3):
        put(store, "s1", f"z-old-{i}", turn=i, lease=old, keep=3)
    store.objects.delete(keys=[LEASE])  # a bucket lifecycle rule, an operator's cleanup
    assert store.leases.current_epoch("s1") == 3  # the last acquire, from its epoch marker
    store.leases.check(old)  # nobody took over yet: the holder still owns the session
    new = store.leases.acquire("s1", owner="new")
    assert new.epoch == 4
    with pytest.raises(LeaseLostError):
        store.leases.check(old)
    with pytest.raises(LeaseLostError):
        put(store, "s1", "z-old-9", turn=9, lease=old)  # the zombie is fenced
    # The new owner's id sorts below the old ones, yet its checkpoint is latest and retention keeps it.
    put(store, "s1", "a-new-1", turn=10, lease=new, keep=3)
    assert store.checkpoints.get("s1") == store.checkpoints.get("s1", "a-new-1")
    assert ids(store.checkpoints.list("s1")) == ["a-new-1", "z-old-2", "z-old-1"]
    assert store.leases.acquire("s1", owner="next").epoch == 5


class Interleaving:
    """Runs actors (threads) one storage call at a time: a replayable interleaving.

    Every storage call goes through a :class:`FaultyObjectStore` (``plan`` may crash-stop an actor at a
    chosen call) whose gate parks the calling actor until the driver lets it go: first as ``script`` says,
    then in an order drawn from ``seed``. Its call log is the history a test checks.
    """

    def __init__(self, inner, seed: int, plan: FaultPlan | None = None) -> None:
        self.rng = random.Random(seed)
        self.cv = threading.Condition()
        self.turn: str | None = None
        self.parked: dict[str, object] = {}  # actor -> the storage call it waits to make (None: not started)
        self.live: set[str] = set()
        self.puts: dict[str, int] = {}  # PUTs each actor was let make
        self.faulty = FaultyObjectStore(inner, plan, gate=lambda call, hold: self._park(call.actor, call))

    def _park(self, me: str, call=None) -> None:
        with self.cv:
            self.parked[me] = call
            if self.turn == me:
                self.turn = None
            self.cv.notify_all()
            assert self.cv.wait_for(lambda: self.turn == me, timeout=30), f"{me} was never scheduled again"
            del self.parked[me]

    def _next(self) -> None:
        assert self.cv.wait_for(lambda: self.turn is None and self.live <= set(self.parked), timeout=30), \
            f"stalled: running {self.turn}, parked {sorted(self.parked)}, live {sorted(self.live)}"

    def _release(self, name: str) -> None:
        call = self.parked[name]
        if call is not None and call.op == "put":
            self.puts[name] = self.puts.get(name, 0) + 1
        self.turn = name
        self.cv.notify_all()

    def run(self, actors: dict, script: list[tuple[str, int | None]] = ()) -> tuple[dict, dict]:
        """Run ``actors`` (name -> callable) to the end; returns (results, exceptions) by name.

        ``script``: ``(name, puts)`` steps run first, each letting ``name`` alone go on until it is about to
        make its PUT number ``puts + 1`` (``None``: until it ends).
        """
        results, raised = {}, {}

        def body(name, fn):
            current_actor.set(name)
            self._park(name)
            try:
                results[name] = fn()
            except BaseException as e:  # ActorCrashed included: recorded, checked by the test
                raised[name] = e
            finally:
                with self.cv:
                    self.live.discard(name)
                    self.turn = None
                    self.cv.notify_all()

        self.live = set(actors)
        threads = [threading.Thread(target=body, args=item, daemon=True) for item in actors.items()]
        for t in threads:
            t.start()
        with self.cv:
            for name, puts in script:
                while True:
                    self._next()
                    call = self.parked.get(name, "ended")
                    if call == "ended" or (puts is not None and call is not None and call.op == "put"
                                           and self.puts.get(name, 0) >= puts):
                        break
                    self._release(name)
            while self.live:
                self._next()
                if self.live:
                    self._release(self.rng.choice(sorted(self.live)))
        for t in threads:
            t.join(timeout=30)
        return results, raised


def _lease_writes(calls) -> list[tuple[int, str, int]]:
    """``(call number, actor, epoch)`` of every lease.json write that took effect."""
    return [(c.n, c.actor, json.loads(c.data)["epoch"]) for c in calls
            if c.op == "put" and c.key == LEASE and c.applied and c.outcome in ("ok", "crashed")]


def _race_for_the_lease(inner, seed: int, script=(), *, dies: bool = True) -> tuple[list[tuple[int, int, str]], bool]:
    """Acquirers a, b, c (and ``dies``, crash-stopped right after it claims an epoch marker) race for the
    lease of s1 while a vandal deletes lease.json twice. Checks every grant; returns them by call order, and
    whether ``dies`` did die.

    A grant is the lease.json write that made an acquirer the holder of the epoch it returned: every
    lease.json write before it, by anyone, holds a lower epoch (so grants rise strictly), a marker whose
    acquirer died blocks nobody, and the next acquire goes above every epoch used.
    """
    crash = Rule(Fault("crash", applied=True), ops=frozenset({"put"}), actors=frozenset({"dies"}),
                 key_contains="/epochs/")
    world = Interleaving(inner, seed, FaultPlan(seed=seed, rules=[crash]))

    def acquirer(name):
        return lambda: Store(world.faulty, "x", serial_reads=True).leases.acquire("s1", owner=name)

    def vandal():
        for _ in range(2):  # a lifecycle rule, an operator's cleanup; twice, at two points of the race
            world.faulty.delete(keys=[LEASE])

    actors = {name: acquirer(name) for name in ("a", "b", "c", "dies")[:4 if dies else 3]}
    actors["vandal"] = vandal
    results, raised = world.run(actors, script)
    where = f"seed {seed}"
    assert set(raised) <= {"dies"} and set(results) >= {"a", "b", "c"}, f"{where}: {raised}"
    assert all(isinstance(e, ActorCrashed) for e in raised.values()), raised
    writes = _lease_writes(world.faulty.calls)
    grants = []
    for name in ("a", "b", "c"):
        lease = results[name]
        mine = [n for n, actor, epoch in writes if actor == name and epoch == lease.epoch]
        assert mine, f"{where}: {name} returned epoch {lease.epoch} without writing lease.json"
        grants.append((mine[-1], lease.epoch, name))
    grants.sort()
    for (n1, e1, x), (n2, e2, y) in zip(grants, grants[1:], strict=False):
        assert e2 > e1, f"{where}: {y} was granted epoch {e2} at call {n2}, after {x} was granted {e1} at {n1}"
    for n, epoch, name in grants:
        earlier = [(m, actor, e) for m, actor, e in writes if m < n and e >= epoch]
        assert not earlier, f"{where}: {name} was granted epoch {epoch} at call {n} after lease.json held {earlier}"
    markers = [int(o.key.rsplit("/", 1)[1]) for o in inner.list(prefix=layout.epoch_prefix("s1", None))]
    after = Store(inner, "x").leases.acquire("s1", owner="after")
    assert after.epoch > max(markers + [e for _, _, e in writes]), where
    return grants, "dies" in raised


def _inner(backend: str, tmp_path, name: str):
    return open_store(f"memory://{name}" if backend == "memory" else tmp_path / name).objects


@pytest.mark.parametrize("backend", ["memory", "local"])
def test_path03_a_stale_acquirer_after_a_deleted_lease_is_granted_above_every_epoch(backend, tmp_path, monkeypatch):
    """c reads lease.json missing and lists the markers; a and b each get as far as the PUT that would
    complete their acquire (a on a new session, b on top of a); lease.json is deleted; c goes on. c must not
    be granted an epoch below one a or b were granted before it (the durability soak found c granted
    epoch 1 after b had swapped epoch 2 in)."""
    monkeypatch.setattr(backoff_module, "sleep", lambda s: None)  # backoff without waiting: the script orders
    script = [("c", 0), ("a", 1), ("b", 1), ("vandal", None), ("c", None), ("b", None), ("a", None)]
    grants, _ = _race_for_the_lease(_inner(backend, tmp_path, "s"), 0, script, dies=False)
    assert [name for _, _, name in grants] == ["c", "b", "a"]  # the script really ran c's acquire first


@pytest.mark.parametrize("backend", ["memory", "local"])
@pytest.mark.parametrize("start", ["new", "held"])
def test_path03_epochs_are_granted_strictly_rising_in_every_interleaving(backend, start, tmp_path, monkeypatch):
    """The race of :func:`_race_for_the_lease` in many seeded interleavings, on a new session and on one
    whose lease is held; one acquirer dies between claiming its epoch marker and swapping lease.json."""
    monkeypatch.setattr(backoff_module, "sleep", lambda s: None)
    died = 0
    for seed in range(150 if backend == "memory" else 40):
        inner = _inner(backend, tmp_path, f"{seed}-{start}")
        if start == "held":
            Store(inner, "x").leases.acquire("s1", owner="before")  # epoch 1, outside the log
        died += _race_for_the_lease(inner, seed)[1]
    assert died >= 10  # the claim-then-die interleavings really ran


def test_path03_an_epoch_taken_behind_the_lease_is_never_handed_out_twice(store):
    store.leases.acquire("s1", owner="a")
    # lease.json says 1, yet epochs 2 and 3 were taken (it was deleted and re-created, or restored from a backup).
    for n in (2, 3):
        store.objects.put(key=layout.epoch_marker_key("s1", None, n), data=b"{}", if_none_match=True)
    lease = store.leases.acquire("s1", owner="b")
    assert lease.epoch == 4 and store.leases.current_epoch("s1") == 4
    store.leases.check(lease)
    assert store.leases.acquire("s1", owner="c").epoch == 5


def test_path03_session_from_before_epoch_markers_takes_its_floor_from_what_it_wrote(store):
    """No markers (an older loomray wrote the session) and no lease.json: the epochs its data carries are the floor."""
    for _ in range(5):
        lease = store.leases.acquire("s1", owner="w")
    put(store, "s1", "c1", lease=lease)
    store.journal.append(JournalEntry(session_id="s2", run_id="r1", seq=0, step_key="t0001-model", kind="model",
                                      epoch=7))
    store.sessions.put(SessionRow("s3", None, "running", T0, epoch=4))
    store.objects.put(key="sessions/_/s3/journal/r1/00000000-t0000-run_start.json", data=b'{"epoch": 2}')
    legacy = [k for k in snapshot(store) if "/epochs/" in k or k.endswith("/lease.json")]
    store.objects.delete(keys=legacy)
    assert store.leases.acquire("s1", owner="new").epoch == 6  # checkpoint index rows
    assert store.leases.acquire("s2", owner="new").epoch == 8  # the run's last journal entry
    assert store.leases.acquire("s3", owner="new").epoch == 5  # the session index
    assert store.leases.acquire("fresh", owner="new").epoch == 1


# -- path 4: a corrupt lease.json ------------------------------------------------------------------------------------

CORRUPT_LEASES = [b'{"epo', b'{"epoch": 1e300}', b'{"epoch": 1e999}', b'{"epoch": "7"}', b'{"epoch": -1}',
                  b'{"epoch": true}', b'{"epoch": 9007199254740992}', b'{"epoch": NaN}', b"[]", b"\xff\xfe",
                  b'{"owner": "x"}', b'{"epoch": ' + b"9" * 400 + b"}"]


@pytest.mark.parametrize("body", CORRUPT_LEASES, ids=lambda b: b[:24].decode("latin-1"))
def test_path04_corrupt_lease_is_a_typed_error_before_any_write(store, body):
    lease = store.leases.acquire("s1", owner="a")
    put(store, "s1", "c1", lease=lease)
    store.objects.put(key=LEASE, data=body)
    before = snapshot(store)
    with pytest.raises(errors.LeaseCorruptError, match="lease.json") as info:
        store.leases.acquire("s1", owner="b")
    assert isinstance(info.value, CorruptObjectError) and "lease repair" in str(info.value)
    with pytest.raises(errors.LeaseCorruptError, match="lease.json"):
        put(store, "s1", "c2", turn=2, lease=lease)  # its object lands (one PUT, no lease read); its proof fails
    with pytest.raises(errors.LeaseCorruptError):
        store.leases.current_epoch("s1")
    after = snapshot(store)
    after.pop(layout.checkpoint_key("s1", None, "c2"))
    assert after == before  # nothing indexed, nothing else written, nothing deleted


def test_path04_repair_rewrites_the_lease_above_every_epoch_used(store):
    for _ in range(3):
        old = store.leases.acquire("s1", owner="w")
    put(store, "s1", "c1", lease=old)
    store.objects.put(key=LEASE, data=b'{"epoch": 1e300}')
    repaired = store.leases.repair("s1")
    assert repaired.epoch == 4 and store.leases.current_epoch("s1") == 4
    assert json.loads(store.objects.get(key=LEASE).data)["epoch"] == 4
    with pytest.raises(LeaseLostError):
        store.leases.check(old)  # a writer still holding the old epoch stops at its next check
    assert store.leases.acquire("s1", owner="next").epoch == 5
    store.objects.delete(keys=[LEASE])
    assert store.leases.repair("s1").epoch == 6  # a missing lease.json is repaired the same way


# -- path 9: two compactors ------------------------------------------------------------------------------------------

def _index_rows(store: Store) -> list[tuple[str, bool]]:
    _, table = store._index.read_prefix("index/checkpoints/", CHECKPOINT_SCHEMA, cache=False)
    return sorted(zip(table["checkpoint_id"].to_pylist(), table["tombstone"].to_pylist(), strict=False))


def test_path09_two_compactors_never_resurrect_a_retired_row(store):
    put(store, "s1", "c1", turn=1, keep=0)
    put(store, "s1", "c2", turn=2, keep=0)
    a = Store(store.objects, store.url)  # the supervisor's compaction loop
    b = Store(store.objects, store.url)  # a `loomray compact` cron on another machine
    real = a._index.read_files
    raced = []

    def read_then_race(keys, **kw):
        out = real(keys, **kw)
        if not raced:
            # A holds c1's row; meanwhile c1 is deleted and B compacts the same partition to the end.
            assert store.checkpoints.delete("s1", "c1")
            raced.append(b.compact())
        return out

    a._index.read_files = read_then_race  # type: ignore[method-assign]
    a.compact()  # A writes its merged file (c1 included) after B is done
    assert raced and raced[0].tombstones_dropped == 1
    assert sorted(store.query()["checkpoint_id"].to_pylist()) == ["c2"]
    assert ids(store.checkpoints.list("s1")) == ["c2"] and store.checkpoints.get("s1", "c1") is None
    # Once the tombstone is past the grace period, compaction drops it together with every copy of its row.
    report = Store(store.objects, store.url).compact(tombstone_grace=timedelta(0))
    assert report.rows == 1
    assert _index_rows(store) == [("c2", False)]
    assert sorted(store.query()["checkpoint_id"].to_pylist()) == ["c2"]


def test_path09_young_tombstones_survive_compaction_old_ones_go(store):
    for i in range(4):
        put(store, "s1", f"c{i}", turn=i, keep=2)  # retention retires c0 and c1
    report = store.compact()
    assert (report.rows, report.tombstones_dropped) == (2, 2)
    assert _index_rows(store) == [("c0", True), ("c1", True), ("c2", False), ("c3", False)]
    assert store.compact().files_after == 1  # already compact: the young tombstones stay put
    assert store.compact(tombstone_grace=timedelta(0)).files_after == 1
    assert _index_rows(store) == [("c2", False), ("c3", False)]
    assert ids(store.checkpoints.list("s1")) == ["c3", "c2"]


def test_path09_a_compactor_whose_listed_files_vanished_abandons_the_partition(store):
    for i in range(3):
        put(store, "s1", f"c{i}", turn=i, keep=0)
    a = Store(store.objects, store.url)
    b = Store(store.objects, store.url)
    real = a._index.read_files
    raced = []

    def read_one_at_a_time(keys, **kw):
        out = []
        for i, key in enumerate(keys):
            if i == 2 and not raced:
                raced.append(b.compact())  # B merges and deletes every file A listed; A has read two of them
            out += real([key], **kw)
        return out

    a._index.read_files = read_one_at_a_time  # type: ignore[method-assign]
    a.compact()
    assert raced
    files = store.index_files()
    assert len(files) == 1 and files[0].endswith("-c.parquet")  # B's merged file only: A wrote nothing
    assert sorted(store.query()["checkpoint_id"].to_pylist()) == ["c0", "c1", "c2"]


def test_path09_a_compactor_lagging_past_half_the_grace_writes_nothing(store, monkeypatch):
    put(store, "s1", "c1", turn=1, keep=0)
    put(store, "s1", "c2", turn=2, keep=0)
    clock = [1000.0]
    monkeypatch.setattr(maintenance_module, "_clock", lambda: clock[0], raising=False)
    real = store._index.read_files

    def stalled_read(keys, **kw):
        out = real(keys, **kw)
        clock[0] += 31 * 60  # the compactor stalls for 31 minutes (GC pause, suspended VM)
        return out

    store._index.read_files = stalled_read  # type: ignore[method-assign]
    before = snapshot(store)
    store.compact()  # default grace one hour: a merge may land at most 30 minutes after its LIST
    assert snapshot(store) == before
    store._index.read_files = real  # type: ignore[method-assign]
    assert store.compact().files_after == 1


# -- path 10: corrupt checkpoints and quarantine ---------------------------------------------------------------------

def test_path10_latest_skips_a_truncated_checkpoint_with_a_warning(store, caplog):
    good = put(store, "s1", "c1", turn=1)
    bad = put(store, "s1", "c2", turn=2, payload=b'{"messages": ["a long transcript"]}')
    store.objects.put(key=bad.key, data=b'{"messages": ["a lo')  # truncated in place
    with caplog.at_level("WARNING", logger="storage"):
        data = store.checkpoints.get("s1")
    assert hashlib.sha256(data).hexdigest() == good.sha256  # the newest readable one
    assert "c2.json" in caplog.text  # never silently
    with pytest.raises(CorruptObjectError, match="c2.json"):
        store.checkpoints.get("s1", "c2")  # an explicit id is never substituted
    assert hashlib.sha256(store.checkpoints.get("s1", "c1")).hexdigest() == good.sha256


def test_path10_a_session_whose_checkpoints_are_all_unreadable_never_reads_as_empty(store):
    bad = put(store, "s1", "c1", payload=b'{"a": 1}')
    store.objects.put(key=bad.key, data=b'{"a": 2}')  # same size, other bytes
    with pytest.raises(CorruptObjectError, match="c1.json"):
        store.checkpoints.get("s1")


def test_path10_quarantine_moves_the_object_aside_and_retires_its_row(store, caplog):
    good = put(store, "s1", "c1", turn=1)
    bad = put(store, "s1", "c2", turn=2, payload=b'{"messages": ["a long transcript"]}')
    store.objects.put(key=bad.key, data=b'{"messages": ["a lo')
    moved = store.checkpoints.quarantine("s1", "c2")
    assert moved == "sessions/_/s1/quarantine/c2.json" == layout.quarantine_key("s1", None, "c2")
    assert store.objects.get(key=moved).data == b'{"messages": ["a lo'  # kept for inspection
    assert store.objects.get(key=bad.key) is None
    assert ids(store.checkpoints.list("s1")) == ["c1"]
    assert sorted(store.query()["checkpoint_id"].to_pylist()) == ["c1"]
    caplog.clear()
    with caplog.at_level("WARNING", logger="storage"):
        assert hashlib.sha256(store.checkpoints.get("s1")).hexdigest() == good.sha256
    assert "c2" not in caplog.text  # "latest" no longer trips over it
    assert store.checkpoints.get("s1", "c2") is None
    with pytest.raises(errors.ObjectNotFound, match="nope"):
        store.checkpoints.quarantine("s1", "nope")


# -- path 16: ids --------------------------------------------------------------------------------------------------

UNSAFE_IDS = ["€" * 43, "€" * 128, "é" * 65, "a=b", "session=x", "100%", "a%2Fb", "abc\u202edef", "\u200bzero",
              "bom\ufeff", "\u2066isolate\u2069", "soft\u00adhyphen", "line\u2028break", "lone\ud800"]


@pytest.mark.parametrize("bad", UNSAFE_IDS, ids=ascii)
def test_path16_unsafe_ids_are_refused_and_nothing_is_written(store, bad):
    for field in ("session_id", "checkpoint_id", "user_id"):
        args = {"session_id": "s1", "checkpoint_id": "c1", "user_id": None, field: bad}
        with pytest.raises(InvalidIdError) as info:
            write_checkpoint(store, b"{}", CheckpointInfo(turn=0, created_at=T0, position="after_tools",
                                                       execution_status="active", message_count=0, **args))
        assert isinstance(info.value, ValueError)
    for call in (lambda: store.leases.acquire(bad, owner="x"), lambda: store.checkpoints.get(bad),
                 lambda: store.sessions.put(SessionRow(bad, None, "running", T0)),
                 lambda: store.journal.append(JournalEntry(session_id="s1", run_id=bad, seq=0, step_key="k",
                                                           kind="model"))):
        with pytest.raises(InvalidIdError):
            call()
    assert snapshot(store) == {}


def test_path16_id_length_is_counted_in_utf8_bytes(tmp_path):
    store = open_store(tmp_path / "root")
    longest = "€" * 42 + "ab"  # 128 bytes in UTF-8, 44 characters
    put(store, longest, "é" * 64, user_id="ü" * 64)
    assert store.checkpoints.get(longest, "é" * 64, user_id="ü" * 64) is not None
    with pytest.raises(InvalidIdError, match="129 bytes"):
        put(store, "€" * 43, "c1")  # 43 characters, but 129 bytes
    with pytest.raises(InvalidIdError, match="384 bytes"):
        put(store, "s1", "€" * 128)  # once a raw OSError from the file system (name too long)


def test_path16_ids_print_as_what_they_are():
    with pytest.raises(InvalidIdError) as info:
        validate_id("admin\u202egnp.exe", "session_id")
    assert "U+202E" in str(info.value) and "\u202e" not in str(info.value)


# -- path 17: lease races --------------------------------------------------------------------------------------------

def test_path17_if_match_on_a_deleted_object_is_a_lost_swap(store):
    etag = store.objects.put(key="x/y.json", data=b"1")
    store.objects.delete(keys=["x/y.json"])
    with pytest.raises(PreconditionFailed, match="y.json"):
        store.objects.put(key="x/y.json", data=b"2", if_match=etag)  # S3 answers 404 here
    assert store.objects.get(key="x/y.json") is None


def test_path17_lease_deleted_between_read_and_swap(store):
    store.leases.acquire("s1", owner="a")
    store.leases.acquire("s1", owner="b")
    real_put = store.objects.put
    deleted = []

    def put_after_delete(*, key, data, **kw):
        if key == LEASE and kw.get("if_match") and not deleted:
            deleted.append(key)
            store.objects.delete(keys=[key])  # the lifecycle rule fires between the GET and the swap
        return real_put(key=key, data=data, **kw)

    store.objects.put = put_after_delete  # type: ignore[method-assign]
    try:
        lease = store.leases.acquire("s1", owner="c")
    finally:
        store.objects.put = real_put  # type: ignore[method-assign]
    assert deleted and lease.epoch == 3 and store.leases.current_epoch("s1") == 3


def test_path17_contended_acquire_backs_off_with_full_jitter_until_it_wins(store, monkeypatch):
    delays = []
    monkeypatch.setattr(backoff_module, "sleep", delays.append, raising=False)
    real_put = store.objects.put
    rivals, busy = [], []

    def rival_swaps_first(*, key, data, **kw):
        # Each time "me" is about to claim its epoch, a rival takes that epoch first (claim and swap).
        if "/epochs/" in key and not busy and len(rivals) < 20:  # more rounds than 16 fixed attempts allow
            busy.append(1)
            try:
                rivals.append(store.leases.acquire("s1", owner=f"rival-{len(rivals)}"))
            finally:
                busy.pop()
        return real_put(key=key, data=data, **kw)

    monkeypatch.setattr(store.objects, "put", rival_swaps_first)
    lease = store.leases.acquire("s1", owner="me")
    assert [r.epoch for r in rivals] == list(range(1, 21)) and lease.epoch == 21
    assert len(delays) == 20
    caps = [min(backoff_module.CAP, backoff_module.BASE * 2 ** (i + 1)) for i in range(20)]
    assert all(0 <= d <= cap for d, cap in zip(delays, caps, strict=False))  # exponential bound, capped
    assert len(set(delays)) > 1  # full jitter: random in [0, bound], not a fixed schedule


def test_path17_acquire_gives_up_after_its_time_budget(store, monkeypatch):
    real_put = store.objects.put
    busy = []

    def always_beaten(*, key, data, **kw):
        if key == LEASE and not busy:
            busy.append(1)
            try:
                store.leases.acquire("s1", owner="rival")
            finally:
                busy.pop()
        return real_put(key=key, data=data, **kw)

    monkeypatch.setattr(store.objects, "put", always_beaten)
    started = time.monotonic()
    with pytest.raises(LeaseLostError, match="contended"):
        store.leases.acquire("s1", owner="me", timeout=0.3)
    assert time.monotonic() - started < 10  # bounded by time, whatever the backend's latency


def test_path17_eight_concurrent_acquirers_all_succeed_with_distinct_rising_epochs(store):
    floor, granted = 0, []
    for round_ in range(2):  # a new session (create-only race), then an existing lease (compare-and-swap race)
        barrier = threading.Barrier(8)

        def grab(i, barrier=barrier, round_=round_):
            barrier.wait()
            return store.leases.acquire("s1", owner=f"w{round_}-{i}")

        with ThreadPoolExecutor(8) as pool:
            leases = list(pool.map(grab, range(8)))
        epochs = sorted(lease.epoch for lease in leases)
        # Distinct, and above every epoch granted before. Not necessarily contiguous: an acquirer that waited
        # out a slow rival's claim goes above it, and the rival's swap then loses (its epoch is never used).
        assert len(set(epochs)) == 8 and epochs[0] > floor, (floor, epochs)
        floor = epochs[-1]
        granted += epochs
        assert store.leases.current_epoch("s1") == epochs[-1]
        newest = max(leases, key=lambda lease: lease.epoch)
        store.leases.check(newest)
        for lease in leases:
            if lease is not newest:
                with pytest.raises(LeaseLostError):
                    store.leases.check(lease)
    markers = {k for k in snapshot(store) if "/epochs/" in k}
    assert {layout.epoch_marker_key("s1", None, n) for n in granted} <= markers  # every granted epoch was claimed
    assert all(int(k.rsplit("/", 1)[1]) <= floor for k in markers)  # nothing claimed above the holder's


# -- review: a fenced writer's checkpoint row --------------------------------------------------------------------------

@pytest.mark.parametrize("taker_dies", [False, True])
def test_review_r4_a_fenced_row_whose_writer_died_before_its_recheck_is_retired_by_the_takeover(store, taker_dies):
    """The holder checks its lease and PUTs checkpoint c2's object; a taker lists the index and swaps the lease;
    then the holder's c2 row lands and the holder dies before its re-check.

    The taker lists the checkpoint index right before its swap and again right after it, and retires the rows of
    older epochs that appeared in between. When the taker dies right after its swap too, its lease records what it
    listed, and the next owner retires the row.
    """
    holder_lease = store.leases.acquire("s1", owner="holder")
    put(store, "s1", "c1", turn=1, lease=holder_lease)
    checked, swapped, landed = threading.Event(), threading.Event(), threading.Event()
    taker_calls: list[str] = []

    def gate(call, hold):
        if call.actor == "holder" and call.op == "put" and call.key.startswith("index/checkpoints/"):
            checked.set()  # the holder's lease check and object PUT are done; its row PUT waits for the swap
            assert swapped.wait(30)
        elif call.actor == "taker":
            if taker_calls and taker_calls[-1] == f"put {LEASE}" and not swapped.is_set():
                swapped.set()  # the taker swapped the lease; its next call waits for the holder's row
                assert landed.wait(30)
            taker_calls.append(f"{call.op} {call.key}")

    dies = [Rule(Fault("crash", applied=True), ops=frozenset({"put"}), actors=frozenset({"holder"}),
                 key_contains="index/checkpoints/")]
    if taker_dies:
        dies.append(Rule(Fault("crash", applied=True), ops=frozenset({"put"}), actors=frozenset({"taker"}),
                         key_contains="lease.json"))
    world = FaultyObjectStore(store.objects, FaultPlan(rules=dies), gate=gate)
    raised = {}

    def actor(name, fn, then: threading.Event):
        current_actor.set(name)
        try:
            fn()
        except BaseException as e:  # ActorCrashed: the process died
            raised[name] = e
        finally:
            then.set()

    holder = Store(world, "holder", serial_reads=True)
    taker = Store(world, "taker", serial_reads=True)
    threads = [threading.Thread(target=actor, args=("holder", lambda: land(holder, "c2", turn=2,
                                                                          epoch=holder_lease.epoch), landed))]
    threads[0].start()
    assert checked.wait(30)
    threads.append(threading.Thread(target=actor, args=("taker", lambda: taker.leases.acquire("s1", owner="taker"),
                                                        swapped)))
    threads[1].start()
    for t in threads:
        t.join(30)
    assert isinstance(raised.get("holder"), ActorCrashed), raised
    assert isinstance(raised.get("taker"), ActorCrashed) == taker_dies, raised
    row_puts = [c for c in world.calls if c.actor == "holder" and c.op == "put" and c.key.startswith("index/")]
    assert row_puts and row_puts[0].applied  # the fenced row did land
    if taker_dies:
        assert store.leases.acquire("s1", owner="next").epoch == holder_lease.epoch + 2
    assert json.loads(store.checkpoints.get("s1"))["checkpoint_id"] == "c1"
    assert ids(store.checkpoints.list("s1")) == ["c1"]
    assert store.objects.get(key=layout.checkpoint_key("s1", None, "c2")) is None


def test_review_r4_a_fenced_row_landing_after_the_takeover_is_never_read_as_latest(store):
    """The whole takeover (LIST, swap, LIST) runs between the holder's object PUT and its row PUT; then the row lands
    and the holder dies before its re-check, so nobody has retired it yet. Readers judge rows by the fence the swap
    recorded in lease.json: "latest" and the list skip it; the next owner retires it."""
    holder_lease = store.leases.acquire("s1", owner="holder")
    put(store, "s1", "c1", turn=1, lease=holder_lease)
    taker = Store(store.objects, "taker")
    crash = Rule(Fault("crash", applied=True), ops=frozenset({"put"}), key_contains="index/checkpoints/")
    relay = FaultyObjectStore(store.objects, FaultPlan(rules=[crash]))
    real_put = relay.put

    def takeover_after_the_object(*, key, data, **kw):
        etag = real_put(key=key, data=data, **kw)
        if key.endswith("/checkpoints/c2.json"):
            taker.leases.acquire("s1", owner="taker")
        return etag

    relay.put = takeover_after_the_object
    with pytest.raises(ActorCrashed):
        land(Store(relay, "holder"), "c2", turn=2, epoch=holder_lease.epoch)
    assert ("c2", False) in _index_rows(store)  # landed, and not retired: its writer died
    reader = Store(store.objects, "reader")
    assert json.loads(reader.checkpoints.get("s1"))["checkpoint_id"] == "c1"
    assert ids(reader.checkpoints.list("s1")) == ["c1"]
    store.leases.acquire("s1", owner="next")
    assert ("c2", True) in _index_rows(store)  # retired by the next takeover
    assert store.objects.get(key=layout.checkpoint_key("s1", None, "c2")) is None


def test_review_r4_a_takeover_spares_rows_written_without_a_lease_and_rows_it_listed(store):
    """Only rows of an older, leased epoch that appeared after the pre-swap LIST are retired."""
    first = store.leases.acquire("s1", owner="first")
    put(store, "s1", "c1", turn=1, lease=first)
    land(store, "c2", turn=2, epoch=0)  # no lease: epoch 0, fenced by nothing
    second = store.leases.acquire("s1", owner="second")
    put(store, "s1", "c3", turn=3, lease=second)
    store.leases.acquire("s1", owner="third")
    assert ids(store.checkpoints.list("s1")) == ["c3", "c1", "c2"]
    body = json.loads(store.objects.get(key=LEASE).data)
    assert body["checkpoints"]["top"] == [second.epoch, "c3"]
    assert [c["epoch"] for c in body["checkpoints"]["prev"]] == [second.epoch, first.epoch]


# -- review: tombstone age by the store's clock, a compactor's pause -----------------------------------------------------

def _skewed(monkeypatch, hours: float):
    """Make this process's writes stamp ``written_at`` ``hours`` off (a node whose clock is wrong)."""
    real = checkpoint_rows_module.utcnow
    monkeypatch.setattr(checkpoint_rows_module, "utcnow", lambda: real() + timedelta(hours=hours))
    return lambda: monkeypatch.setattr(checkpoint_rows_module, "utcnow", real)


def test_review_r3_a_tombstone_stamped_by_a_slow_clock_survives_a_concurrent_compaction(store, monkeypatch):
    """Compactor A reads c1's row; a writer whose clock is 2 h behind retires c1 (its tombstone's written_at looks
    2 h old, the grace is 1 h); compactor B merges the partition; then A writes its merge. By the store's clock the
    tombstone is seconds old, so B keeps it and A's copy of c1 stays dead."""
    put(store, "s1", "c1", turn=1, keep=0)
    put(store, "s1", "c2", turn=2, keep=0)
    a = Store(store.objects, store.url)
    b = Store(store.objects, store.url)
    real = a._index.read_files
    raced = []

    def read_then_race(keys, **kw):
        out = real(keys, **kw)
        if not raced:
            restore = _skewed(monkeypatch, -2)
            put(store, "s1", "c3", turn=3, keep=2)  # retention retires c1, stamping the tombstone 2 h early
            restore()
            raced.append(b.compact())
        return out

    a._index.read_files = read_then_race  # type: ignore[method-assign]
    a.compact()
    assert raced
    assert ("c1", True) in _index_rows(store)  # the tombstone outlived B's compaction
    assert sorted(store.query()["checkpoint_id"].to_pylist()) == ["c2", "c3"]
    put(store, "s1", "c4", turn=4, keep=2)  # the writer's next flush deletes what its last retention retired
    objects = sorted(o.key.rsplit("/", 1)[1][:-5] for o in store.objects.list(prefix="sessions/_/s1/checkpoints/"))
    assert objects == ["c2", "c3", "c4"]


def test_review_r3_tombstones_old_by_the_store_and_the_writer_go(store, monkeypatch):
    """Both clocks must say "older than the grace": the writer's written_at and the store's modification time."""
    restore = _skewed(monkeypatch, -2)
    for i in range(4):
        put(store, "s1", f"c{i}", turn=i, keep=2)  # retention retires c0 and c1 (written_at 2 h ago)
    restore()
    store.compact()
    assert ("c0", True) in _index_rows(store)  # store's clock: seconds old, whatever written_at says
    put(store, "s2", "x", turn=1)
    real = store._index.list_infos

    def aged(prefix):  # the store wrote s1's files 2 h ago; s2's file (the store's "now") is fresh
        return [o if "session=s2" in o.key else replace(o, modified=o.modified - timedelta(hours=2))
                for o in real(prefix)]

    monkeypatch.setattr(store._index, "list_infos", aged)
    store.compact()
    assert [r for r in _index_rows(store) if r[0].startswith("c")] == [("c2", False), ("c3", False)]


def test_review_r3_a_merge_that_lands_past_the_lag_limit_is_taken_back(store, monkeypatch):
    """The compactor passes its lag check, then stalls (GC pause, suspended VM) before its PUT lands: the merge
    may hold a row whose tombstone another compaction dropped meanwhile, so it deletes it again and keeps the
    sources."""
    put(store, "s1", "c1", turn=1, keep=0)
    put(store, "s1", "c2", turn=2, keep=0)
    clock = [1000.0]
    monkeypatch.setattr(maintenance_module, "_clock", lambda: clock[0], raising=False)
    real = store._index.write

    def stalled_write(partition, table, **kw):
        clock[0] += 31 * 60  # after the lag check, before the PUT returns
        return real(partition, table, **kw)

    store._index.write = stalled_write  # type: ignore[method-assign]
    before = snapshot(store)
    store.compact()  # default grace one hour: a merge may land at most 30 minutes after its LIST
    assert snapshot(store) == before
    store._index.write = real  # type: ignore[method-assign]
    assert store.compact().files_after == 1
    assert sorted(store.query()["checkpoint_id"].to_pylist()) == ["c1", "c2"]


# -- review: prune keeps the last run the last, and a run's base through a race ---------------------------------------

def _journal(store: Store, run_id: str, kinds, *, epoch: int = 1, created_at=None, output=None) -> None:
    for seq, kind in enumerate(kinds):
        extra = {"created_at": created_at} if created_at is not None else {}
        store.journal.append(JournalEntry(session_id="s1", run_id=run_id, seq=seq, step_key=kind.replace("_", "-"),
                                          kind=kind, epoch=epoch, output=(output or {}) if seq == 0 else {}, **extra))


def test_review_r5_prune_never_changes_which_run_is_last(store):
    """The last run is the highest (epoch, n) among the newest records: a fenced writer's record (epoch 1) that
    landed after the new owner's (epoch 2) is the newest by n. Prune keeps every record the choice depends on,
    and the finished last run's run_end (else that run reads as unfinished)."""
    from loomray.storage.journal import unfinished_last_run

    zombie = store.leases.acquire("s1", owner="zombie")
    taker = store.leases.acquire("s1", owner="taker")
    store.runs.create("s1", run_id="run-t", epoch=taker.epoch, request={"kind": "run", "prompt": "p"})
    _journal(store, "run-t", ("run_start", "run_end"), epoch=taker.epoch)
    store.runs.create("s1", run_id="run-z", epoch=zombie.epoch, request={"kind": "run", "prompt": "p"})
    assert store.runs.last("s1").run_id == "run-t" and unfinished_last_run(store, "s1", None) is None
    report = store.prune(before=datetime.now(timezone.utc) + timedelta(seconds=5), session_id="s1")
    assert report.run_records == 0
    assert store.runs.last("s1").run_id == "run-t"
    assert unfinished_last_run(store, "s1", None) is None  # still finished: nothing to run again


def test_review_r5_prune_still_deletes_records_older_than_the_last_runs_window(store):
    for i in range(7):
        store.runs.create("s1", run_id=f"run-{i}", epoch=1)
        _journal(store, f"run-{i}", ("run_start", "run_end"))
    report = store.prune(before=datetime.now(timezone.utc) + timedelta(seconds=5), session_id="s1")
    assert report.run_records == 3  # the 4 newest are the last run's window
    assert [r.run_id for r in store.runs.list("s1")] == ["run-3", "run-4", "run-5", "run-6"]
    assert store.runs.last("s1").run_id == "run-6"
    # The last run keeps its run_end (it finished); everything else of the journal went.
    assert [(e.run_id, e.kind) for r in ("run-5", "run-6") for e in store.journal.list("s1", r)] == [
        ("run-6", "run_end")]


OLD = datetime.now(timezone.utc) - timedelta(days=2)


def _old_session(store: Store) -> None:
    write_checkpoint(store, b'{"c": "old"}', CheckpointInfo(session_id="s1", checkpoint_id="c-old", turn=1, created_at=OLD,
                                                  position="after_tools", execution_status="completed",
                                                  message_count=1))
    store.runs.create("s1", run_id="run-1", epoch=1)
    _journal(store, "run-1", ("run_start", "model", "run_end"), created_at=OLD)


def _resume_from_old(store: Store) -> None:
    """What resume(from_checkpoint="c-old") records when it starts: the run record, then its run_start."""
    store.runs.create("s1", run_id="run-2", epoch=2, base_session_id="s1", base_checkpoint_id="c-old",
                     replay_from="run-1")
    store.journal.append(JournalEntry(session_id="s1", run_id="run-2", seq=0, step_key="run-start", kind="run_start",
                                      epoch=2, output={"kind": "resume", "base_checkpoint_id": "c-old"}))


def test_review_r6_a_run_recorded_while_prune_works_keeps_its_base_checkpoint(store, monkeypatch):
    """Prune finds nothing unfinished; a resume from the old checkpoint records itself; prune deletes. Prune checks
    again after its deletes and puts back the base checkpoint and the journal the new run replays."""
    from loomray.storage.journal import unfinished_last_run

    _old_session(store)
    real = pruning_module.unfinished_last_run
    raced = []

    def first_look_then_a_resume_starts(st, sid, uid):
        out = real(st, sid, uid)
        if not raced:
            assert out is None  # run-1 finished: nothing to keep
            raced.append(_resume_from_old(store))
        return out

    monkeypatch.setattr(pruning_module, "unfinished_last_run", first_look_then_a_resume_starts)
    report = store.prune(before=datetime.now(timezone.utc) - timedelta(days=1), session_id="s1")
    assert raced and report.checkpoints == 0
    need = unfinished_last_run(store, "s1", None)
    assert (need.run_id, need.base_checkpoint_id, need.replay_from) == ("run-2", "c-old", "run-1")
    assert json.loads(store.checkpoints.get("s1", "c-old"))["c"] == "old"
    assert ids(store.checkpoints.list("s1")) == ["c-old"]
    assert [e.kind for e in store.journal.list("s1", "run-1")] == ["run_start", "model", "run_end"]


def test_review_r6_a_run_recorded_after_prune_checked_again_stops_before_its_first_step(store, monkeypatch):
    """The resume read its base before prune deleted it, but records itself only after prune's second look: it
    finds its base gone right after its record and raises, so it never works from a checkpoint that is gone."""
    _old_session(store)
    assert store.checkpoints.get("s1", "c-old") is not None  # the resume loaded its base
    report = store.prune(before=datetime.now(timezone.utc) - timedelta(days=1), session_id="s1")
    assert report.checkpoints == 1
    with pytest.raises(errors.ObjectNotFound, match="c-old"):
        _resume_from_old(store)


def test_review_r7_a_checkpoint_acknowledged_inside_a_takeovers_listing_window_is_never_retired(store):
    """The taker claims its epoch and lists the checkpoint index; before its swap the holder's c2 lands and the
    holder re-checks its lease (still epoch 1 in lease.json); then the taker swaps and fences what it did not list.

    A write its writer was told is durable must stay readable: the holder's re-check sees the taker's claimed
    epoch and refuses c2 (retiring it), or c2 was listed and is spared. Before the re-check looked at the epoch
    claims, c2 was acknowledged and then retired by the takeover.
    """
    holder_lease = store.leases.acquire("s1", owner="holder")
    put(store, "s1", "c1", turn=1, lease=holder_lease)
    holder = Store(store.objects, "holder")
    relay = FaultyObjectStore(store.objects)
    real_list = relay.list
    outcome: dict[str, object] = {}

    def list_then_let_the_holder_write(*, prefix, **kw):
        listed = list(real_list(prefix=prefix, **kw))
        claimed = store.objects.get(key=layout.epoch_marker_key("s1", None, holder_lease.epoch + 1)) is not None
        if prefix.startswith("index/checkpoints/") and claimed and not outcome:
            try:
                outcome["row"] = put(holder, "s1", "c2", turn=2, lease=holder_lease)  # lands after this LIST
            except LeaseLostError as e:
                outcome["lost"] = e
        return iter(listed)

    relay.list = list_then_let_the_holder_write
    taker = Store(relay, "taker").leases.acquire("s1", owner="taker")
    assert taker.epoch == holder_lease.epoch + 1 and outcome
    latest = json.loads(store.checkpoints.get("s1"))["checkpoint_id"]
    if "row" in outcome:  # acknowledged: it must survive the takeover
        assert "c2" in ids(store.checkpoints.list("s1")) and latest == "c2"
    else:  # refused: acknowledged nothing; its object stays as the takeover found it (readable if it listed it)
        assert ids(store.checkpoints.list("s1"))[-1] == "c1" and latest in ("c1", "c2")
    assert "lost" in outcome  # this interleaving is decided by the claim: the holder learns it was fenced
