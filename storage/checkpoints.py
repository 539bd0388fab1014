"""The :class:`~storage.store.Store`'s checkpoint operations: write, read, list, quarantine, delete.

A checkpoint is one object (``sessions/{u}/{s}/checkpoints/{id}.json``) plus
one index row carrying its size and sha256; "latest" is the highest
``(epoch, checkpoint_id)``. Readers never fall back to an older checkpoint,
or to none, because a LIST went stale: a row whose object is missing is
looked up again in a fresh LIST (retention writes a row's successor before it
deletes the row's object), for up to ``READ_TIMEOUT`` seconds.
"""

from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass, field

from storage import backoff, layout
from storage.checkpoint_rows import CheckpointRows
from storage.errors import CorruptObjectError, IndexChangedError, LeaseLostError, ObjectNotFound
from storage.ids import validate_id
from storage.leases import Leases
from storage.objects import ObjectStore
from storage.rows import CheckpointInfo, CheckpointRow, Lease, as_utc

log = logging.getLogger("storage")
#: Seconds a reader keeps listing again while writers keep changing what it lists (then IndexChangedError).
READ_TIMEOUT = 10.0


def _relist_pause(attempt: int, deadline: float, what: str) -> None:
    """Back off before a reader's next LIST (full jitter); :class:`IndexChangedError` past ``deadline``."""
    if not backoff.wait(attempt, deadline):
        raise IndexChangedError(f"{what}; listed {attempt} times in {READ_TIMEOUT:g} s while writers kept "
                                "changing it; try again")


def _row_for(data: bytes, info: CheckpointInfo, epoch: int) -> CheckpointRow:
    """The index row of ``data`` written as ``info`` at ``epoch``: values normalized, size and sha256 computed
    once over the caller's buffer (the same buffer is the PUT body)."""
    return CheckpointRow(
        **{**info.__dict__, "turn": int(info.turn), "created_at": as_utc(info.created_at),
           "position": str(info.position), "execution_status": str(info.execution_status),
           "message_count": int(info.message_count), "input_tokens": int(info.input_tokens),
           "output_tokens": int(info.output_tokens),
           "cost_usd": None if info.cost_usd is None else float(info.cost_usd),
           "spend_usd": None if info.spend_usd is None else float(info.spend_usd)},
        epoch=epoch, key=layout.checkpoint_key(info.session_id, info.user_id, info.checkpoint_id),
        size=len(data), sha256=hashlib.sha256(data).hexdigest())


@dataclass
class _Reading:
    """One ``get_checkpoint``: what it asked for and what its LISTs met so far."""

    session_id: str
    checkpoint_id: str
    #: Keys whose object was missing although a fresh LIST still showed their row.
    gone: set[str] = field(default_factory=set)
    warned: set[str] = field(default_factory=set)
    first_error: CorruptObjectError | None = None
    relist: bool = False


class CheckpointMethods:
    """Checkpoint operations of :class:`~storage.store.Store` (over its object store, index rows and leases)."""

    objects: ObjectStore
    _rows: CheckpointRows
    _leases: Leases

    def put_checkpoint(self, data: bytes, info: CheckpointInfo, *, lease: Lease | None = None,
                       keep: int = 20) -> CheckpointRow:
        """One PUT of ``data`` plus one index row, then retention; see docs/contracts.md.

        ``info`` is what the caller says about the checkpoint; the row returned
        adds the writer's epoch (``lease.epoch``, 0 without a lease), the
        object key, size and sha256. ``keep`` < 1 keeps every checkpoint.
        """
        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise TypeError(f"checkpoint data must be bytes, got {type(data).__name__}")
        if not isinstance(info, CheckpointInfo):
            raise TypeError(f"checkpoint info must be a CheckpointInfo, got {type(info).__name__}")
        layout.checkpoint_key(info.session_id, info.user_id, info.checkpoint_id)  # validates the ids
        for name in ("parent_checkpoint_id", "forked_from", "agent_id"):
            if getattr(info, name) is not None:
                validate_id(getattr(info, name), name)
        epoch = self._leases.fence(lease, info.session_id, info.user_id)
        row = _row_for(data, info, epoch)
        # The index row is encoded before the PUT: a value Arrow refuses (an int beyond int64) fails
        # here, never after the object landed without a row.
        table = self._rows.encode([row], tombstone=False)
        self.objects.put(key=row.key, data=data)
        try:
            self._rows.write(row.session_id, row.user_id, [row], tombstone=False, table=table)
        except Exception:
            # The row may have landed though its PUT raised (the reply was lost): if a takeover raced this
            # write, retire it as below, so it can never be "latest". The write's own error is the caller's.
            if lease is not None:
                self._retire_if_fenced(lease, row)
            raise
        if lease is not None:
            try:
                self._leases.confirm(lease)
            except LeaseLostError:
                # A takeover raced this write: retire it so it can never be "latest".
                self._rows.retire(row.session_id, row.user_id, [row])
                raise
        if keep >= 1:
            self._rows.apply_retention(row, keep)
        return row

    def _retire_if_fenced(self, lease: Lease, row: CheckpointRow) -> None:
        """Retire ``row`` if ``lease`` was lost; never raises (the caller is already failing).

        When the lease cannot be read either, the row stays: if it was fenced,
        the next owner's takeover retires it (see :mod:`storage.fencing`).
        """
        try:
            self._leases.confirm(lease)
        except LeaseLostError:
            try:
                self._rows.retire(row.session_id, row.user_id, [row])
            except Exception as e:
                log.warning("could not retire checkpoint %r written after a takeover (the next takeover "
                            "retires it): %s", row.checkpoint_id, e)
        except Exception as e:
            log.warning("could not check the lease after a failed index write of checkpoint %r (the next "
                        "takeover retires it if it was fenced): %s", row.checkpoint_id, e)

    def list_checkpoints(self, session_id: str, *, user_id: str | None = None,
                         limit: int | None = 50) -> list[CheckpointRow]:
        """Newest first by (epoch, checkpoint_id); rows whose object is missing or truncated are skipped.

        The index and the objects are two LISTs, the index first. When the
        newest rows have no object, they were retired after the index LIST
        (retention writes a row's successor before it deletes the row's object,
        so a fresh index LIST shows the successor) or deleted for good: the
        index is listed again, after a short jittered backoff. A row a fresh
        LIST still shows, whose object is still missing, was deleted for good
        and is skipped. So a writer moving on between the two LISTs never makes
        the list start at an older checkpoint, or come out empty; if the newest
        rows keep being retired before they are read for ``READ_TIMEOUT``
        seconds, :class:`IndexChangedError`.
        """
        objects_prefix = layout.session_prefix(session_id, user_id) + "checkpoints/"
        deadline = backoff.clock() + READ_TIMEOUT
        gone: set[str] = set()  # keys whose object was missing although a fresh LIST still showed their row
        attempt = 0
        while True:
            rows = self._leases.fences.unfenced(session_id, user_id, self._rows.live(session_id, user_id))
            present = {o.key: o.size for o in self.objects.list(prefix=objects_prefix) if o.key.endswith(".json")}
            above: set[str] = set()  # rows newer than the newest one whose object exists, their objects gone
            for row in sorted(rows.values(), key=lambda r: r.order, reverse=True):
                if row.key in present:
                    break
                above.add(row.key)
            if not above - gone:
                break
            # The retirement of a row comes after its successor's row is written, so a fresh LIST shows that
            # successor; a row it still shows, whose object is still missing, was deleted without one.
            gone |= above
            attempt += 1
            _relist_pause(attempt, deadline, f"{self.objects.describe(objects_prefix)}: the newest checkpoints of "
                                             f"session {session_id!r} kept being retired before they were read")
        return self._present(rows, present, limit)

    def _present(self, rows: dict[str, CheckpointRow], present: dict[str, int],
                 limit: int | None) -> list[CheckpointRow]:
        """``rows`` whose object was listed at its written size, newest first, at most ``limit`` (< 1: all)."""
        out = []
        for row in sorted(rows.values(), key=lambda r: r.order, reverse=True):
            size = present.get(row.key)
            if size is None:
                continue
            if size != row.size:
                log.warning("skipping checkpoint: %s is %d bytes, %d were written (truncated or replaced)",
                            self.objects.describe(row.key), size, row.size)
                continue
            out.append(row)
            if limit is not None and limit > 0 and len(out) >= limit:
                break
        return out

    def get_checkpoint(self, session_id: str, checkpoint_id: str = "latest", *,
                       user_id: str | None = None) -> bytes | None:
        """The checkpoint's bytes, verified against the size and sha256 recorded at write time.

        An explicit id whose object is corrupt or truncated raises
        :class:`CorruptObjectError` naming the key. ``"latest"`` skips such a
        checkpoint with a warning and returns the newest readable one (the
        journal replays what followed it); it raises only when no checkpoint
        is readable and at least one is corrupt. ``None``: no such checkpoint.
        A "latest" whose object was retired after the index LIST (a writer's
        retention) is looked up again in a fresh LIST, never replaced by an
        older one or by ``None``; if that keeps happening for ``READ_TIMEOUT``
        seconds, :class:`IndexChangedError`.
        """
        if checkpoint_id != "latest":
            layout.checkpoint_key(session_id, user_id, checkpoint_id)  # validates the id
        read = _Reading(session_id, checkpoint_id)
        deadline = backoff.clock() + READ_TIMEOUT
        attempt = 0
        while True:
            rows = self._rows.live(session_id, user_id)
            if checkpoint_id == "latest":
                candidates = sorted(self._leases.fences.unfenced(session_id, user_id, rows).values(),
                                    key=lambda r: r.order, reverse=True)
            else:
                candidates = [rows[checkpoint_id]] if checkpoint_id in rows else []
            data = self._read_first(read, candidates)
            if not read.relist:
                break
            attempt += 1
            _relist_pause(attempt, deadline, f"{self.objects.describe(layout.session_prefix(session_id, user_id))}: "
                                             f"the latest checkpoints of session {session_id!r} kept being retired "
                                             "before they were read")
        if data is None and read.first_error is not None:
            raise read.first_error  # a session whose checkpoints are all unreadable never reads as "no checkpoint"
        return data

    def _read_first(self, read: _Reading, candidates: list[CheckpointRow]) -> bytes | None:
        """The bytes of the first of ``candidates`` that is readable and intact; sets ``read.relist`` when a
        "latest" candidate's object is gone and a fresh LIST must decide."""
        read.relist = False
        for row in candidates:
            obj = self.objects.get(key=row.key)
            if obj is None:
                if read.checkpoint_id == "latest" and row.key not in read.gone:
                    # Retired since our LIST (retention, prune): its successor was written first, so a fresh
                    # LIST shows it. Never fall back to an older checkpoint, or to none, on a stale LIST; a
                    # row whose object is still missing after a fresh LIST was deleted for good.
                    read.gone.add(row.key)
                    read.relist = True
                    return None
                continue  # deleted behind the index's back; the next newest is the latest that exists
            if len(obj.data) != row.size or hashlib.sha256(obj.data).hexdigest() != row.sha256:
                error = CorruptObjectError(
                    f"{self.objects.describe(row.key)}: checkpoint {row.checkpoint_id!r} of session "
                    f"{read.session_id!r} is corrupt or truncated ({len(obj.data)} bytes, {row.size} written; "
                    "sha256 mismatch)")
                if read.checkpoint_id != "latest":
                    raise error
                if row.key not in read.warned:  # once, though a re-LIST may meet it again
                    read.warned.add(row.key)
                    log.warning("skipping an unreadable checkpoint for 'latest', falling back to the next "
                                "newest (quarantine it with Store.quarantine_checkpoint): %s", error)
                read.first_error = read.first_error or error
                continue
            return obj.data
        return None

    def quarantine_checkpoint(self, session_id: str, checkpoint_id: str, *, user_id: str | None = None) -> str | None:
        """Move a checkpoint (typically a corrupt one) aside and retire its index row.

        The object's bytes are copied to ``sessions/{u}/{s}/quarantine/{id}.json``
        (kept for inspection; nothing reads or prunes them), then the object is
        deleted and its row tombstoned, so neither "latest" nor listings see it.
        Returns the quarantine key, or ``None`` when the object was already gone
        (the row is still retired). :class:`ObjectNotFound` when the session has
        neither a row nor an object of that id. Crash-safe in that order: a rerun
        finishes the job.
        """
        key = layout.checkpoint_key(session_id, user_id, checkpoint_id)
        row = self._rows.live(session_id, user_id).get(checkpoint_id)
        obj = self.objects.get(key=key)
        if row is None and obj is None:
            raise ObjectNotFound(f"{self.objects.describe(key)}: session {session_id!r} has no checkpoint "
                                 f"{checkpoint_id!r}")
        moved = None
        if obj is not None:
            moved = layout.quarantine_key(session_id, user_id, checkpoint_id)
            self.objects.put(key=moved, data=obj.data)
        if row is not None:
            self._rows.retire(session_id, user_id, [row])
        else:
            self.objects.delete(keys=[key])  # an object without a row (its index write was lost)
        log.warning("quarantined checkpoint %r of session %r: %s", checkpoint_id, session_id,
                    self.objects.describe(moved) if moved else "object already gone, row retired")
        return moved

    def delete_checkpoint(self, session_id: str, checkpoint_id: str, *, user_id: str | None = None) -> bool:
        """Delete one checkpoint (object + tombstone); False when it does not exist."""
        layout.checkpoint_key(session_id, user_id, checkpoint_id)
        row = self._rows.live(session_id, user_id).get(checkpoint_id)
        if row is None:
            return False
        self._rows.retire(session_id, user_id, [row])
        return True

    def index_rows(self, session_id: str, *, user_id: str | None = None) -> dict[str, CheckpointRow]:
        """The session's live checkpoint index rows by id, from a fresh LIST of its partition.

        Objects are not looked at and fenced rows are included: what
        maintenance (prune) decides with, not what readers see (that is
        :meth:`list_checkpoints`).
        """
        return self._rows.live(session_id, user_id)

    def retire_checkpoints(self, session_id: str, rows: list[CheckpointRow], *, user_id: str | None = None) -> None:
        """Delete the objects of ``rows`` (of this session), then tombstone the rows."""
        self._rows.retire(session_id, user_id, rows)
