"""Session leases: strictly rising epochs taken with conditional writes, and the checks that fence writers.

``lease.json`` holds the session's current epoch. An acquire first claims
epoch ``n`` with the create-only marker ``epochs/{n}``, then swaps
``lease.json`` to ``n`` (compare-and-swap on the ETag it read, or
create-only when it read none), so every epoch that ever reached
``lease.json`` has its marker and the highest marker is a safe floor when
``lease.json`` is missing. The protocol, its costs and its guarantees are
in docs/design.md "Taking the lease".
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from . import backoff, layout
from .checkpoint_rows import CheckpointRows
from .errors import LeaseCorruptError, LeaseLostError, PreconditionFailed, StorageError
from .fencing import CheckpointFences, kept_lease_body, lease_body
from .journal.fences import carried_note
from .objects import ObjectStore, StoredObject
from .rows import SESSION_SCHEMA, Lease, utcnow

log = logging.getLogger("storage")
#: Seconds an acquire keeps retrying a contended lease (backoff: :mod:`storage.backoff`).
LEASE_TIMEOUT = 30.0
#: Backoff rounds an acquire waits for another acquirer's claimed epoch to reach lease.json before it goes
#: above that claim (whose acquirer may have died): counted in rounds, not seconds, so the storage calls an
#: acquire makes depend only on what it reads.
_CLAIM_PATIENCE = 8
#: What a lease swap's ``note`` callback gets (the body being replaced) and returns (stored under "note").
LeaseNote = Callable[[dict[str, Any] | None], Any]


def parse_epoch(data: bytes, where: str, what: str) -> int:
    """The ``epoch`` of a lease document: an int in [0, 2**53), else :class:`LeaseCorruptError` naming ``where``."""
    try:
        doc = json.loads(data)
    except (ValueError, RecursionError) as e:  # UnicodeDecodeError is a ValueError
        raise LeaseCorruptError(f"{where}: unreadable {what} ({e}); repair it with store.leases.repair "
                                "(CLI: loomray lease repair SESSION)") from e
    epoch = doc.get("epoch") if isinstance(doc, dict) else None
    if not layout.is_epoch(epoch):
        raise LeaseCorruptError(f"{where}: {what} epoch must be an integer in [0, 2**53), got {epoch!r:.40}; "
                                "repair it with store.leases.repair (CLI: loomray lease repair SESSION)")
    return epoch


def _epoch_of(body: dict[str, Any]) -> int:
    """A lease body's epoch (-1 when it has none)."""
    epoch = body.get("epoch")
    return epoch if layout.is_epoch(epoch) else -1


def _member(obj: StoredObject | None, name: str) -> Any:
    """Member ``name`` of a stored JSON object (None when missing or unreadable)."""
    try:
        return json.loads(obj.data).get(name) if obj is not None else None
    except (ValueError, AttributeError, RecursionError):
        return None


@dataclass
class _Acquire:
    """One acquire's progress through its retries."""

    session_id: str
    user_id: str | None
    owner: str
    deadline: float
    taken: int = 0  #: the highest epoch marker known to exist (claimed by anyone, this acquire included)
    mine: int = 0  #: the highest marker this acquire claimed: an epoch nobody else can take
    blocked: tuple[str | None, int] | None = None  #: (lease ETag, marker) when a claim found the marker taken
    waiting: tuple[str | None, int] | None = None  #: the other acquirer's claim being waited for
    patience: int = 0
    attempt: int = 0
    again: bool = False  #: retry at once (our created lease.json must go above a marker found after it)


@dataclass(frozen=True)
class _Read:
    """``lease.json`` as one attempt read it: the epoch to go above, its ETag, why it is unreadable, its body."""

    epoch: int
    etag: str | None
    corrupt: LeaseCorruptError | None
    body: bytes | None


class LeaseKeeper:
    """Takes and checks session leases through an :class:`ObjectStore` (one code path for every backend)."""

    def __init__(self, objects: ObjectStore, rows: CheckpointRows, snapshot: Callable[[str, str | None], Any]) -> None:
        self.objects = objects
        self.rows = rows
        self.fences = CheckpointFences(objects, rows, snapshot)

    # -- reading -------------------------------------------------------------
    def read(self, session_id: str, user_id: str | None) -> _Read:
        """``lease.json``: epoch 0 and no ETag when missing; ``corrupt`` set when unreadable."""
        key = layout.lease_key(session_id, user_id)
        obj = self.objects.get(key=key)
        if obj is None:
            return _Read(0, None, None, None)
        try:
            return _Read(parse_epoch(obj.data, self.objects.describe(key), "lease"), obj.etag, None, obj.data)
        except LeaseCorruptError as e:
            return _Read(0, obj.etag, e, obj.data)

    def marker_epoch(self, key: str, prefix: str) -> int | None:
        """The epoch an epoch marker's key names; None (with a warning) for a foreign object."""
        name = key[len(prefix):]
        if not (name.isascii() and name.isdigit()):
            log.warning("ignoring a foreign object among epoch markers: %s", self.objects.describe(key))
            return None
        epoch = int(name)
        if epoch > layout.MAX_EPOCH:
            raise LeaseCorruptError(f"{self.objects.describe(key)}: epoch marker {epoch} is beyond 2**53-1; no "
                                    "lease can go above it (delete the marker if it was not written by this store)")
        return epoch

    def max_marker(self, session_id: str, user_id: str | None) -> int:
        """The highest epoch marker of the session (one LIST); 0 when there is none."""
        prefix = layout.epoch_prefix(session_id, user_id)
        epochs = (self.marker_epoch(o.key, prefix) for o in self.objects.list(prefix=prefix))
        return max((e for e in epochs if e is not None), default=0)

    def epoch_floor(self, session_id: str, user_id: str | None) -> tuple[int, int]:
        """``(floor, marker)``: the highest epoch the session ever used, for when ``lease.json`` is missing or
        unreadable, and the highest epoch marker (0 when there is none).

        One LIST of the session's prefix: the highest epoch marker. A session
        whose objects predate markers (none, but checkpoints or a journal) falls
        back to the epochs its index rows and the last journal entry of each run
        carry; a session with no objects at all has used no epoch.
        """
        markers = layout.epoch_prefix(session_id, user_id)
        journal_prefix = layout.journal_prefix(session_id, user_id)
        top, any_marker, any_object = 0, False, False
        last_entry: dict[str, str] = {}
        for info in self.objects.list(prefix=layout.session_prefix(session_id, user_id)):
            any_object = True
            if info.key.startswith(markers):
                epoch = self.marker_epoch(info.key, markers)
                if epoch is not None:
                    any_marker, top = True, max(top, epoch)
            elif info.key.startswith(journal_prefix):
                run = info.key[len(journal_prefix):].split("/", 1)[0]
                last_entry[run] = max(last_entry.get(run, ""), info.key)  # zero-padded seq: key order is seq order
        if any_marker or not any_object:
            return top, top
        return max(top, self._epoch_in_index(session_id, user_id), *map(self._entry_epoch, last_entry.values())), 0

    def _epoch_in_index(self, session_id: str, user_id: str | None) -> int:
        """The highest epoch the session's checkpoint and session index rows carry."""
        top = max((r.epoch for rows in self.rows.partition_rows(session_id, user_id) for r, _ in rows), default=0)
        _, sessions = self.rows.index.read_prefix(layout.index_partition(layout.SESSION_INDEX, session_id, user_id),
                                                  SESSION_SCHEMA, cache=False)
        return max([top, *(e for e in sessions["epoch"].to_pylist() if e is not None)])

    def _entry_epoch(self, key: str) -> int:
        """The epoch a journal entry carries (0 when missing or unreadable)."""
        epoch = _member(self.objects.get(key=key), "epoch")
        return epoch if layout.is_epoch(epoch) else 0

    def claimed_above(self, session_id: str, user_id: str | None, n: int, etag: str) -> int:
        """The highest epoch marker above ``n`` whose acquirer did not claim it on top of lease.json at ETag
        ``etag`` (0 when there is none): one LIST, and one GET per marker above ``n``."""
        prefix = layout.epoch_prefix(session_id, user_id)
        top = 0
        for info in self.objects.list(prefix=prefix):
            epoch = self.marker_epoch(info.key, prefix)
            if epoch is None or epoch <= n or epoch <= top:
                continue
            obj = self.objects.get(key=info.key)
            if obj is None or _member(obj, "base") != etag:
                top = epoch
        return top

    # -- taking --------------------------------------------------------------
    def take(self, session_id: str, user_id: str | None, owner: str, timeout: float, *, repair: bool,
             note: LeaseNote | None = None) -> Lease:
        """Take the session's next epoch (see :meth:`storage.leasing.Leases.acquire`); with ``repair``, also
        over a corrupt ``lease.json``."""
        acq = _Acquire(session_id, user_id, owner, backoff.clock() + timeout)
        try:
            # Parse the checkpoint index now, so the LIST right before the swap reads only files that are
            # newer (the shorter that LIST-to-swap window, the fewer rows land in it; see storage.fencing).
            self.rows.partition_rows(session_id, user_id)
        except StorageError as e:
            log.info("lease of session %r: checkpoint index not read ahead (%s); read right before the swap",
                     session_id, e)
        while True:
            acq.again = False
            read = self.read(session_id, user_id)
            if read.corrupt is not None and not repair:
                raise read.corrupt
            epoch, top = read.epoch, 0
            if read.etag is None or read.corrupt is not None:
                epoch, top = self.epoch_floor(session_id, user_id)  # one LIST
                acq.taken = max(acq.taken, top)
            if not self._wait_for_claim(acq, read.etag, top):
                lease = self._attempt(acq, epoch, read, note)
                if lease is not None:
                    return lease
                if acq.again and backoff.clock() < acq.deadline:
                    continue
            acq.attempt += 1
            if not backoff.wait(acq.attempt, acq.deadline):
                raise LeaseLostError(f"{self.objects.describe(layout.lease_key(session_id, user_id))}: lease of "
                                     f"session {session_id!r} is contended; gave up after {acq.attempt} attempts "
                                     f"in {timeout:g} s")

    def _wait_for_claim(self, acq: _Acquire, etag: str | None, top: int) -> bool:
        """True to back off for another acquirer's claim that lease.json does not show yet: it is about to swap
        it in (or died: after ``_CLAIM_PATIENCE`` rounds of a lease.json that did not move, go above it)."""
        claim: tuple[str | None, int] | None = None
        if etag is None and top > acq.mine:
            claim = (None, top)  # the highest marker is someone else's, and lease.json is missing
        elif acq.blocked is not None and acq.blocked[0] == etag:
            claim = acq.blocked  # our claim found its marker taken, and lease.json has not moved since
        acq.blocked = None
        if claim is None:
            return False
        if claim != acq.waiting:
            acq.waiting, acq.patience = claim, _CLAIM_PATIENCE
        if acq.patience > 0:
            acq.patience -= 1
            return True
        if etag is not None:
            # lease.json did not move: that acquirer died or lost its swap. Go above every marker.
            acq.taken = max(acq.taken, self.max_marker(acq.session_id, acq.user_id))
        return False

    def _attempt(self, acq: _Acquire, epoch: int, read: _Read, note: LeaseNote | None) -> Lease | None:
        """Claim the next epoch's marker (unless this acquire holds it already) and swap lease.json to it."""
        n = max(epoch, acq.taken) + 1
        if read.etag is None and acq.mine and acq.mine == acq.taken:
            n = acq.mine  # our claim is still the highest (our create lost to a lease deleted meanwhile)
        if n > layout.MAX_EPOCH:
            raise LeaseCorruptError(f"{self.objects.describe(layout.lease_key(acq.session_id, acq.user_id))}: "
                                    f"session {acq.session_id!r} has used epoch {n - 1}; no lease can go above 2**53-1")
        now = utcnow().isoformat()
        if n != acq.mine:
            marker = json.dumps({"type": "epoch", "v": 1, "session_id": acq.session_id, "user_id": acq.user_id,
                                 "epoch": n, "owner": acq.owner, "acquired_at": now, "base": read.etag}).encode()
            try:
                self.objects.put(key=layout.epoch_marker_key(acq.session_id, acq.user_id, n), data=marker,
                                 if_none_match=True)
                acq.mine = acq.taken = n
            except PreconditionFailed:
                acq.taken, acq.blocked = max(acq.taken, n), (read.etag, n)  # wait for its acquirer, or go above it
        if n != acq.mine:
            return None
        return self._swap(acq, n, read, now, note)

    def _swap(self, acq: _Acquire, n: int, read: _Read, now: str, note: LeaseNote | None) -> Lease | None:
        """Swap lease.json to epoch ``n`` (claimed); the lease, or None to try again."""
        fields: dict[str, Any] = {"type": "lease", "v": 1, "session_id": acq.session_id, "user_id": acq.user_id,
                                  "epoch": n, "owner": acq.owner, "acquired_at": now}
        previous = lease_body(read.body) if read.corrupt is None else None
        # The fences the last swap recorded (the journal's listing, the checkpoints') survive in its copy, so
        # they reach the new body although lease.json is missing, unreadable, or older than the copy (restored
        # by hand); the checkpoint fences of both are carried on (a body rewritten without them drops none).
        kept = kept_lease_body(self.objects, acq.session_id, acq.user_id, n)
        if kept is not None and (previous is None or _epoch_of(kept) > _epoch_of(previous)):
            previous = kept
        carried = note(previous) if note is not None else carried_note(previous)
        if carried is not None:
            fields["note"] = carried
        # Listed last, right before the swap: a fenced writer's rows that land after it are retired.
        seen, fields["checkpoints"] = self.fences.view(acq.session_id, acq.user_id, previous, kept)
        try:
            new_etag = self.objects.put(key=layout.lease_key(acq.session_id, acq.user_id),
                                        data=json.dumps(fields).encode(), if_none_match=read.etag is None,
                                        if_match=read.etag)
        except PreconditionFailed:
            return None  # another acquirer swapped first, or lease.json vanished meanwhile: read again
        lease = Lease(acq.session_id, acq.user_id, n, acq.owner)
        if read.etag is None:
            # We created a missing lease.json. An epoch above n may have been granted after our floor was
            # listed, its lease.json deleted again before our create: its marker exists. Markers claimed on
            # top of our own lease are our successors, not that.
            above = self.claimed_above(acq.session_id, acq.user_id, n, new_etag)
            if above:
                acq.taken, acq.again = max(acq.taken, above), True  # our lease.json goes above it next round
                return None
        # Else the swap replaced exactly what we read: no epoch was granted since, and n is above it and above
        # every marker claimed before ours.
        self._keep_copy(lease, fields)
        return self.fences.retire_fenced(lease, seen, fields["checkpoints"])

    def _keep_copy(self, lease: Lease, body: dict[str, Any]) -> None:
        """Keep a create-only copy of the body this swap wrote: a deleted ``lease.json`` then loses no fence."""
        try:
            self.objects.put(key=layout.lease_copy_key(lease.session_id, lease.user_id, lease.epoch),
                             data=json.dumps(body).encode(), if_none_match=True)
        except PreconditionFailed:
            pass  # written by an earlier attempt of this very epoch
        except StorageError as e:
            log.warning("session %r: the copy of lease epoch %d was not written (%s); only a deleted lease.json "
                        "would need it", lease.session_id, lease.epoch, e)

    # -- checking ------------------------------------------------------------
    def current_epoch(self, session_id: str, user_id: str | None) -> int:
        """The session's epoch: lease.json's, else the highest marker (see ``store.leases.current_epoch``)."""
        read = self.read(session_id, user_id)
        if read.corrupt is not None:
            raise read.corrupt
        return read.epoch if read.etag is not None else self.max_marker(session_id, user_id)

    def check(self, lease: Lease) -> None:
        """Raise :class:`LeaseLostError` if a newer epoch has taken the session."""
        current = self.current_epoch(lease.session_id, lease.user_id)
        if current != lease.epoch:
            raise LeaseLostError(
                f"{self.objects.describe(layout.lease_key(lease.session_id, lease.user_id))}: session "
                f"{lease.session_id!r} is at epoch {current}; this writer ({lease.owner}) holds epoch {lease.epoch}")

    def confirm(self, lease: Lease, *, read_lease: bool = False) -> None:
        """The re-check after a fenced write landed: :class:`LeaseLostError` if an acquire has claimed an epoch
        above ``lease``'s, even one not swapped in yet (one LIST of the markers); with ``read_lease`` also one
        GET of ``lease.json``, a full proof of ownership (:class:`LeaseCorruptError` when unreadable).

        An acquire claims its marker before it lists the index for its fence,
        so a write this re-check acknowledges is spared by the takeover. With no
        marker for ``lease``'s epoch (markers removed), ``lease.json`` decides.
        """
        prefix = layout.epoch_prefix(lease.session_id, lease.user_id)
        epochs = {self.marker_epoch(o.key, prefix) for o in self.objects.list(prefix=prefix)}
        top = max((e for e in epochs if e is not None), default=0)
        if top > lease.epoch:
            raise LeaseLostError(
                f"{self.objects.describe(layout.epoch_marker_key(lease.session_id, lease.user_id, top))}: session "
                f"{lease.session_id!r} has claimed epoch {top}; this writer ({lease.owner}) holds epoch {lease.epoch}")
        if read_lease or lease.epoch not in epochs:
            self.check(lease)

    def fence(self, lease: Lease | None, session_id: str, user_id: str | None) -> int:
        """The epoch a write of the session under ``lease`` carries (0 without a lease), after checking it."""
        if lease is None:
            return 0
        if lease.session_id != session_id or lease.user_id != user_id:
            raise LeaseLostError(f"lease for session {lease.session_id!r}/user {lease.user_id!r} used to write "
                                 f"session {session_id!r}/user {user_id!r}")
        self.check(lease)
        return lease.epoch
