"""``store.checkpoints``: write checkpoints through a batched log, read, list, pin, quarantine, delete, retire.

A checkpoint is one object (``sessions/{u}/{s}/checkpoints/{id}.json``) plus
one index row carrying its size and sha256; "latest" is the highest
``(epoch, checkpoint_id)``. A writer opens a
:class:`~storage.checkpoint_log.CheckpointLog` with :meth:`Checkpoints.log`
(one PUT per checkpoint; rows, retention and the lease re-check in
batches); that is the one write path. Reads are in
:mod:`storage.checkpoint_reads`. Retiring a checkpoint tombstones its row;
its object goes once no live row's chain and no fork's pin needs it
(:mod:`storage.chains`).
"""

from __future__ import annotations

import functools
import hashlib
import logging

from storage import chains, layout
from storage.checkpoint_log import INDEX_BATCH, CheckpointLog
from storage.checkpoint_reads import CheckpointReads
from storage.checkpoint_rows import CheckpointRows
from storage.errors import LeaseLostError, ObjectNotFound
from storage.ids import validate_id
from storage.leases import LeaseKeeper
from storage.objects import ObjectStore
from storage.rows import CheckpointInfo, CheckpointRow, Lease, as_utc
from storage.tails import Snapshot, TailReader

log = logging.getLogger("storage")


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


class Checkpoints(CheckpointReads):
    """A store's checkpoints (``store.checkpoints``); see docs/contracts.md. Thread-safe."""

    def __init__(self, objects: ObjectStore, rows: CheckpointRows, tails: TailReader, leases: LeaseKeeper, *,
                 batch: int | None = None) -> None:
        self.objects = objects
        self._rows = rows
        self._tails = tails
        self._leases = leases
        #: Checkpoints a log indexes at once (None: ``storage.checkpoint_log.INDEX_BATCH``).
        self.batch = batch

    def put(self, data: bytes, info: CheckpointInfo, *, lease: Lease | None = None,
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
        if keep >= 1 and lease is None:
            self._rows.apply_retention(row, keep)
        elif keep >= 1:
            # A leased retention's tombstones are ignored if a takeover claims an epoch before they land
            # (storage.visibility rule 5): their objects go only once a proof after them says none did.
            self._rows.apply_retention(row, keep, retired_by=row.order, proven=functools.partial(self._proven, lease))
        return row

    def _proven(self, lease: Lease | None) -> bool:
        """Whether no epoch above ``lease``'s is claimed (one LIST of the epoch markers); never raises."""
        if lease is None:
            return True
        try:
            self._leases.confirm(lease)
        except Exception as e:
            log.warning("session %r: checkpoints retention retired keep their objects for now (lease not "
                        "proven after the tombstones: %s)", lease.session_id, e)
            return False
        return True

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

    def log(self, lease: Lease, *, keep: int = 20, batch: int | None = None) -> CheckpointLog:
        """A batched writer of ``lease``'s session (see :mod:`storage.checkpoint_log`): one PUT per checkpoint;
        rows, retention (``keep`` newest live; < 1 keeps every checkpoint) and the lease re-check every
        ``batch`` puts (default: :attr:`batch`, ``open_store(..., checkpoint_batch=n)``, else ``INDEX_BATCH``)
        and on ``flush``."""
        if batch is None:
            batch = self.batch or INDEX_BATCH
        return CheckpointLog(self._rows, self._leases, lease, keep=keep, batch=batch)

    def pin(self, session_id: str, checkpoint_id: str, *, user_id: str | None = None,
                       dependent: str) -> tuple[str, ...]:
        """Pin checkpoint ``checkpoint_id`` of ``session_id`` and its chain for session ``dependent`` (a fork of
        the same user that will build on them); returns the chain ``dependent``'s first checkpoint names.

        The pins are written first, then the checkpoint is checked to be live
        (:class:`ObjectNotFound` if it is not, and the pins are released): so
        a collector either sees the pin or the fork never starts from the
        checkpoint (:mod:`storage.chains`). A checkpoint ``dependent``'s pin
        already holds is pinned again even if its row was retired since (the
        fork resumes from its fork point). Pins go in every session the
        chain reaches (a fork of a fork builds on its grandparent's objects too).
        """
        validate_id(dependent, "session_id")
        snap = self._tails.snapshot(session_id, user_id)
        row = snap.live.get(checkpoint_id)
        # A fork point this fork pinned before (it crashed before its first checkpoint, say) is still its to
        # build on after the parent retired its row: that pin kept its objects from every collector since.
        held = row is None and (row := self._tails.pinned_row(snap, checkpoint_id, dependent)) is not None
        if row is None:
            raise ObjectNotFound(f"{self.objects.describe(layout.checkpoint_key(session_id, user_id, checkpoint_id))}: "
                                 f"session {session_id!r} has no checkpoint {checkpoint_id!r}")
        links = [*chains.expand(row.chain, session_id), (session_id, checkpoint_id)]
        needs: dict[str, set[str]] = {}
        for sid, cid in links:
            needs.setdefault(sid, set()).add(cid)
        pins = chains.Pins(self.objects)
        for sid, ids in needs.items():
            if sid != dependent:
                pins.write(sid, user_id, dependent, ids)
        if not held and checkpoint_id not in self._tails.snapshot(session_id, user_id).live:
            for sid in needs:
                if sid != dependent:
                    pins.release(sid, user_id, dependent)
            raise ObjectNotFound(f"session {session_id!r}: checkpoint {checkpoint_id!r} was retired while it was "
                                 "being pinned")
        return chains.compress(chains.ref_of(sid, cid, dependent) for sid, cid in links)

    def quarantine(self, session_id: str, checkpoint_id: str, *, user_id: str | None = None) -> str | None:
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
            self._rows.retire(session_id, user_id, [row], collect=False)
        self.objects.delete(keys=[key])  # moved aside; a chain through it was broken by its corruption already
        log.warning("quarantined checkpoint %r of session %r: %s", checkpoint_id, session_id,
                    self.objects.describe(moved) if moved else "object already gone, row retired")
        return moved

    def delete(self, session_id: str, checkpoint_id: str, *, user_id: str | None = None) -> bool:
        """Delete one checkpoint: tombstone its row, then its object unless another checkpoint's chain (or a
        fork's pin) still needs it; False when it is not live (:mod:`storage.visibility`: a fenced writer's row
        is not a checkpoint of the session; the takeovers retire it)."""
        layout.checkpoint_key(session_id, user_id, checkpoint_id)
        snap = self._tails.snapshot(session_id, user_id)
        row = snap.live.get(checkpoint_id)
        if row is None:
            return False
        # What stays is judged on a fresh LIST of the index (retire's), never on a cached view of it; a running
        # writer's next checkpoint builds on its head, so the heads' chains stay (storage.chains).
        self._rows.retire(session_id, user_id, [row],
                          also_needed=[*(r for r in snap.tails.values() if r != row), *snap.heads])
        return True

    def rows(self, session_id: str, *, user_id: str | None = None) -> dict[str, CheckpointRow]:
        """The session's checkpoint rows no tombstone retires, by id, from a fresh LIST: the index's, and its
        writer's tail.

        Objects are not looked at and fenced rows are included: what
        maintenance (prune) retires, not what readers see (that is
        :meth:`snapshot`'s ``live``, and :meth:`list`).
        """
        return self._tails.snapshot(session_id, user_id).rows

    def snapshot(self, session_id: str, *, user_id: str | None = None) -> Snapshot:
        """One look at the session's checkpoints (:class:`storage.tails.Snapshot`): ``rows`` (fenced ones
        included) and ``live`` (what readers see), from one fresh LIST."""
        return self._tails.snapshot(session_id, user_id)

    def release_pins(self, session_id: str, retired: list[CheckpointRow], *, user_id: str | None = None) -> None:
        """Drop this session's pins on the sessions ``retired`` built on and its live rows no longer do, then
        collect what those pins alone kept there (see :mod:`storage.chains`)."""
        remaining = [r for r in self._tails.snapshot(session_id, user_id).rows.values() if r not in retired]
        chains.release_pins(self._rows, session_id, user_id, remaining, retired)

    def retire(self, session_id: str, rows: list[CheckpointRow], *, user_id: str | None = None,
                           collect: bool = True) -> None:
        """Tombstone ``rows`` (of this session), then delete their objects nothing else needs (``collect``)."""
        self._rows.retire(session_id, user_id, rows, collect=collect)
