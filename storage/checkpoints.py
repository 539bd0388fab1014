"""``store.checkpoints``: write checkpoints through a batched log, read, list, pin, quarantine, delete, retire.

A writer opens a :class:`~storage.checkpoint_log.CheckpointLog` with
:meth:`Checkpoints.log`: the one write path. Reads are in
:mod:`storage.checkpoint_reads`. Retiring a checkpoint tombstones its row; its
object goes once nothing needs it (:mod:`storage.chains`).
"""

from __future__ import annotations

import logging

from . import chains, layout
from .checkpoint_log import INDEX_BATCH, CheckpointLog
from .checkpoint_reads import CheckpointReads
from .checkpoint_rows import CheckpointRows
from .errors import ObjectNotFound
from .ids import validate_id
from .leases import LeaseKeeper
from .objects import ObjectStore
from .rows import CheckpointRow, Lease
from .tails import Snapshot, TailReader

log = logging.getLogger("storage")


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

        The pins are written first (in every session the chain reaches), then the checkpoint is checked to be
        live, so a collector either sees the pin or the fork never starts from it (docs/contracts.md,
        :mod:`storage.chains`).
        """
        return self.pin_and_look(session_id, checkpoint_id, user_id=user_id, dependent=dependent)[0]

    def pin_and_look(self, session_id: str, checkpoint_id: str, *, user_id: str | None = None,
                     dependent: str) -> tuple[tuple[str, ...], Snapshot | None]:
        """:meth:`pin`, and the look at ``session_id`` that found the checkpoint live after the pins landed (None
        when ``dependent``'s pin held it already: no look was needed). A fork reads its fork point from that
        look (``get_chain(..., snapshot=...)``) instead of listing the parent a third time."""
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
        after = None if held else self._tails.snapshot(session_id, user_id)
        if after is not None and checkpoint_id not in after.live:
            for sid in needs:
                if sid != dependent:
                    pins.release(sid, user_id, dependent)
            raise ObjectNotFound(f"session {session_id!r}: checkpoint {checkpoint_id!r} was retired while it was "
                                 "being pinned")
        return chains.compress(chains.ref_of(sid, cid, dependent) for sid, cid in links), after

    def quarantine(self, session_id: str, checkpoint_id: str, *, user_id: str | None = None) -> str | None:
        """Move a checkpoint (typically a corrupt one) aside to ``quarantine/{id}.json``, delete it and retire its
        row; the quarantine key, or None when the object was already gone (docs/contracts.md). Crash-safe in
        that order: a rerun finishes the job."""
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

    def latest_of(self, sessions: list[tuple[str, str | None]]) -> list[CheckpointRow | None]:
        """The newest row :meth:`list` gives for each ``(session_id, user_id)`` (None: it has none), read in
        parallel from a remote store."""
        return self._rows.index.map_io(lambda s: next(iter(self.list(s[0], user_id=s[1], limit=1)), None), sessions)

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
        """Drop this session's pins on the sessions ``retired`` built on and neither its live rows nor its running
        writer's heads do any more, then collect what those pins alone kept there (see :mod:`storage.chains`)."""
        remaining = [r for r in self._tails.snapshot(session_id, user_id).rows.values() if r not in retired]
        chains.release_pins(self._rows, session_id, user_id, remaining, retired)

    def retire(self, session_id: str, rows: list[CheckpointRow], *, user_id: str | None = None,
                           collect: bool = True) -> None:
        """Tombstone ``rows`` (of this session), then delete their objects nothing else needs (``collect``)."""
        self._rows.retire(session_id, user_id, rows, collect=collect)
