"""Checkpoint reads of :class:`~storage.checkpoints.Checkpoints` (``store.checkpoints``): list, get, get a chain.

Readers never fall back to an older checkpoint, or to none, because a LIST
went stale: a row whose object is missing is looked up again in a fresh LIST
(retention writes a row's successor before it deletes the row's object), for
up to ``READ_TIMEOUT`` seconds.
"""

from __future__ import annotations

import builtins
import functools
import hashlib
import logging
from dataclasses import dataclass, field

from . import backoff, chains, envelope, layout
from .checkpoint_rows import CheckpointRows
from .errors import CorruptObjectError, IndexChangedError, StorageError
from .objects import ObjectStore
from .rows import CheckpointRow
from .tails import Snapshot, TailReader

log = logging.getLogger("storage")
#: Seconds a reader keeps listing again while writers keep changing what it lists (then IndexChangedError).
READ_TIMEOUT = 10.0


def _relist_pause(attempt: int, deadline: float, what: str) -> None:
    """Back off before a reader's next LIST (full jitter); :class:`IndexChangedError` past ``deadline``."""
    if not backoff.wait(attempt, deadline):
        raise IndexChangedError(f"{what}; listed {attempt} times in {READ_TIMEOUT:g} s while writers kept "
                                "changing it; try again")


@dataclass
class _Reading:
    """One ``get``: what it asked for and what its LISTs met so far."""

    session_id: str
    checkpoint_id: str
    #: Keys whose object was missing although a fresh LIST still showed their row.
    gone: set[str] = field(default_factory=set)
    warned: set[str] = field(default_factory=set)
    first_error: CorruptObjectError | None = None
    relist: bool = False


class CheckpointReads:
    """The reads of :class:`~storage.checkpoints.Checkpoints` (over its object store, index rows and tails)."""

    objects: ObjectStore
    _rows: CheckpointRows
    _tails: TailReader

    def list(self, session_id: str, *, user_id: str | None = None,
             limit: int | None = 50) -> builtins.list[CheckpointRow]:
        """Newest first by (epoch, checkpoint_id), index rows and tail; damaged rows skipped (docs/contracts.md).

        Rows whose object is missing or not of its written size are skipped, and
        so is a newest one whose bytes do not match its sha256, so the first is
        what "latest" reads. Newest rows without an object were retired after
        the index LIST (retention writes a successor before it deletes), so the
        index is listed again; a row a fresh LIST still shows without its
        object was deleted for good. :class:`IndexChangedError` after
        ``READ_TIMEOUT`` seconds of that.
        """
        objects_prefix = layout.session_prefix(session_id, user_id) + "checkpoints/"
        deadline = backoff.clock() + READ_TIMEOUT
        gone: set[str] = set()  # keys whose object was missing although a fresh LIST still showed their row
        bad: set[str] = set()  # keys whose object does not match its row's sha256
        attempt = 0
        while True:
            snap = self._tails.snapshot(session_id, user_id, ahead=self._head_ahead)
            rows, present = snap.live, snap.present
            above: set[str] = set()  # rows newer than the newest one whose object exists, their objects gone
            for row in sorted(rows.values(), key=lambda r: r.order, reverse=True):
                if row.key in present:
                    break
                above.add(row.key)
            if not above - gone:
                head = self._verify_head(snap, gone, bad)
                if head is None:
                    break
                above = {head}  # the newest object vanished between the LIST and its GET: retired meanwhile
            # The retirement of a row comes after its successor's row is written, so a fresh LIST shows that
            # successor; a row it still shows, whose object is still missing, was deleted without one.
            gone |= above
            attempt += 1
            _relist_pause(attempt, deadline, f"{self.objects.describe(objects_prefix)}: the newest checkpoints of "
                                             f"session {session_id!r} kept being retired before they were read")
        return self._present(snap, bad, limit)

    def _head_ahead(self, snap: Snapshot) -> builtins.list[str]:
        """The newest live object listed at its written size, unless this store verified it already: what
        :meth:`_verify_head` reads first, read with the snapshot's last round."""
        head = max((r for r in snap.live.values() if snap.present.get(r.key) == r.size), key=lambda r: r.order,
                   default=None)
        return [] if head is None or self._tails.verified(head.key, snap.etags.get(head.key)) else [head.key]

    def _verify_head(self, snap: Snapshot, gone: set[str], bad: set[str]) -> str | None:
        """Read and check the newest live row listed at its written size against its sha256 (what "latest"
        checks), and the next while one fails (their keys go to ``bad``). None when done; the key of one whose
        object vanished since the LIST, for a fresh LIST to decide."""
        for row in sorted(snap.live.values(), key=lambda r: r.order, reverse=True):
            if snap.present.get(row.key) != row.size or row.key in bad:
                continue
            etag = snap.etags.get(row.key)
            if self._tails.verified(row.key, etag):
                return None
            data = snap.data.get(row.key)
            if data is None:
                data = self._data(row.key)
            if data is None:
                if row.key in gone:
                    bad.add(row.key)  # still missing after a fresh LIST: deleted for good
                    continue
                return row.key
            try:
                _verify(self.objects, row, data, snap.session_id)
            except CorruptObjectError as error:
                log.warning("skipping an unreadable checkpoint in the listing: %s", error)
                bad.add(row.key)
                continue
            self._tails.verified(row.key, etag, mark=True)
            return None
        return None

    def _present(self, snap: Snapshot, bad: set[str], limit: int | None) -> builtins.list[CheckpointRow]:
        """The live rows listed at their written size and not ``bad``, newest first, at most ``limit`` (< 1: all).

        The damaged ones are retired only when a readable one is left, so a
        session with no readable checkpoint keeps raising for "latest".
        """
        out: builtins.list[CheckpointRow] = []
        damaged: builtins.list[CheckpointRow] = []
        for row in sorted(snap.live.values(), key=lambda r: r.order, reverse=True):
            size = snap.present.get(row.key)
            if size is not None and size != row.size:
                log.warning("skipping checkpoint: %s is %d bytes, %d were written (truncated or replaced)",
                            self.objects.describe(row.key), size, row.size)
            if size is None or size != row.size or row.key in bad:
                damaged.append(row)
                continue
            if limit is None or limit < 1 or len(out) < limit:
                out.append(row)
        if out:
            self._record_damage(snap, damaged)
        return out

    def _record_damage(self, snap: Snapshot, rows: builtins.list[CheckpointRow]) -> None:
        """Retire the damaged indexed ``rows`` for every view: one tombstone file (no lease: always honoured).

        Only a hand or a bug damages a live row's object (every writer that
        deletes one tombstones its row first), and only the list records damage.
        The objects stay for ``quarantine``; a reader that may not write warns.
        """
        doomed = [r for r in rows if r.key in snap.indexed]
        if not doomed:
            return
        names = ", ".join(sorted(r.checkpoint_id for r in doomed))
        try:
            self._rows.write(snap.session_id, snap.user_id, doomed, tombstone=True)
        except StorageError as e:
            log.warning("session %r: checkpoint(s) %s are damaged (missing, truncated or replaced); their rows "
                        "were not retired (%s)", snap.session_id, names, e)
            return
        log.warning("session %r: retired checkpoint(s) %s, damaged (missing, truncated or replaced) behind the "
                    "index's back", snap.session_id, names)

    def get(self, session_id: str, checkpoint_id: str = "latest", *, user_id: str | None = None) -> bytes | None:
        """The checkpoint's object, verified against its recorded size and sha256 (and its own digest).

        A fenced or retired id reads as ``None``. An explicit corrupt id raises
        :class:`CorruptObjectError`; ``"latest"`` skips a corrupt one with a
        warning and raises only when none is readable. A "latest" retired after
        the index LIST is looked up in a fresh LIST, never replaced by an older
        one (:class:`IndexChangedError` after ``READ_TIMEOUT``). An incremental
        object holds only what changed: see :meth:`get_chain`.
        """
        found = self._resolve(session_id, checkpoint_id, user_id, chain=False)
        return None if found is None else found[-1]

    def get_chain(self, session_id: str, checkpoint_id: str = "latest", *,
                  user_id: str | None = None, pinned_for: str | None = None,
                  snapshot: Snapshot | None = None) -> builtins.list[bytes] | None:
        """The objects a checkpoint is read from, oldest first (its chain's, then its own), each verified.

        Like :meth:`get`; "latest" also skips a checkpoint whose chain is broken.
        ``pinned_for``: the fork reading its fork point, found while its pin
        holds it (visibility rule 4). ``snapshot``: a look already taken (what
        :meth:`pin` returns), read before a fresh LIST.
        """
        return self._resolve(session_id, checkpoint_id, user_id, chain=True, pinned_for=pinned_for, first=snapshot)

    def _resolve(self, session_id: str, checkpoint_id: str, user_id: str | None, *, chain: bool,
                 pinned_for: str | None = None, first: Snapshot | None = None) -> builtins.list[bytes] | None:
        if checkpoint_id != "latest":
            layout.checkpoint_key(session_id, user_id, checkpoint_id)  # validates the id
        read = _Reading(session_id, checkpoint_id)
        deadline = backoff.clock() + READ_TIMEOUT
        attempt = 0
        ahead = None if pinned_for is not None else functools.partial(_ahead, checkpoint_id, chain)
        while True:
            snap = first if first is not None and attempt == 0 else self._tails.snapshot(session_id, user_id, ahead)
            if checkpoint_id == "latest":
                candidates = sorted(snap.live.values(), key=lambda r: r.order, reverse=True)
            elif pinned_for is not None:
                row = self._tails.pinned_row(snap, checkpoint_id, pinned_for)
                candidates = [row] if row is not None else []
            else:
                candidates = [snap.live[checkpoint_id]] if checkpoint_id in snap.live else []
            found = self._read_first(read, candidates, snap, chain)
            if not read.relist:
                break
            attempt += 1
            _relist_pause(attempt, deadline, f"{self.objects.describe(layout.session_prefix(session_id, user_id))}: "
                                             f"the latest checkpoints of session {session_id!r} kept being retired "
                                             "before they were read")
        if found is None and read.first_error is not None:
            raise read.first_error  # a session whose checkpoints are all unreadable never reads as "no checkpoint"
        return found

    def _read_first(self, read: _Reading, candidates: builtins.list[CheckpointRow], snap: Snapshot,
                    chain: bool) -> builtins.list[bytes] | None:
        """The objects of the first of ``candidates`` that is readable and intact (with its chain's when
        ``chain``); sets ``read.relist`` when a "latest" candidate's object is gone and a fresh LIST must decide."""
        read.relist = False
        for row in candidates:
            if chain and row.key not in snap.data:
                self._prefetch(row, snap)  # its object and its chain's in one parallel round trip
            data = snap.data.get(row.key)
            if data is None and not chain:
                obj = self.objects.get(key=row.key)
                data = None if obj is None else obj.data
            if data is None:
                if read.checkpoint_id == "latest" and row.key not in read.gone:
                    # Retired since our LIST (retention, prune): its successor was written first, so a fresh
                    # LIST shows it. Never fall back to an older checkpoint, or to none, on a stale LIST; a
                    # row whose object is still missing after a fresh LIST was deleted for good.
                    read.gone.add(row.key)
                    read.relist = True
                    return None
                continue  # deleted behind the index's back; the next newest is the latest that exists
            try:
                _verify(self.objects, row, data, read.session_id)
                return [*self._chain_of(row, snap), data] if chain else [data]
            except CorruptObjectError as error:
                if read.checkpoint_id != "latest":
                    raise
                if row.key not in read.warned:  # once, though a re-LIST may meet it again
                    read.warned.add(row.key)
                    log.warning("skipping an unreadable checkpoint for 'latest', falling back to the next "
                                "newest (quarantine it with store.checkpoints.quarantine): %s", error)
                read.first_error = read.first_error or error
        return None

    def _prefetch(self, row: CheckpointRow, snap: Snapshot) -> None:
        """Read ``row``'s object and its chain's (those not read yet) in parallel into ``snap.data``."""
        try:
            links = _chain_keys(row)
        except ValueError:
            links = []  # a malformed chain: reported when the chain is read
        keys = [k for k in (row.key, *links) if k not in snap.data]
        for key, data in zip(keys, self._rows.index.map_wide(self._data, keys), strict=True):
            if data is not None:
                snap.data[key] = data

    def _data(self, key: str) -> bytes | None:
        """The object at ``key``'s bytes, None if there is none."""
        obj = self.objects.get(key=key)
        return None if obj is None else obj.data

    def _chain_of(self, row: CheckpointRow, snap: Snapshot) -> builtins.list[bytes]:
        """The objects of ``row``'s chain, oldest first, fetched in parallel and verified."""
        try:
            keys = _chain_keys(row)
        except ValueError as e:
            raise CorruptObjectError(f"{self.objects.describe(row.key)}: checkpoint {row.checkpoint_id!r} names a "
                                     f"malformed chain: {e}") from e

        def get(key: str) -> bytes | None:
            return snap.data[key] if key in snap.data else self._data(key)

        out = []
        for key, data in zip(keys, self._rows.index.map_wide(get, keys), strict=True):
            if data is None:
                raise CorruptObjectError(f"{self.objects.describe(key)}: checkpoint {row.checkpoint_id!r} of "
                                         f"session {row.session_id!r} builds on this object, which is missing")
            known = snap.indexed.get(key)
            if envelope.is_enveloped(data) or known is not None:
                _verify(self.objects, known or row, data, row.session_id, own=known is not None)
            out.append(data)
        return out


def _verify(objects: ObjectStore, row: CheckpointRow, data: bytes, session_id: str, *, own: bool = True) -> None:
    """:class:`CorruptObjectError` unless ``data`` is what ``row`` recorded (``own``) and, for a self-describing
    object, what its digest says."""
    key = row.key if own else "?"
    bad = own and (len(data) != row.size or hashlib.sha256(data).hexdigest() != row.sha256)
    if not bad and envelope.is_enveloped(data) and not envelope.intact(data):
        bad = True
    if bad:
        raise CorruptObjectError(
            f"{objects.describe(key)}: checkpoint {row.checkpoint_id if own else '(in a chain)'!r} of session "
            f"{session_id!r} is corrupt or truncated ({len(data)} bytes, {row.size if own else '?'} written; "
            "sha256 mismatch)")


def _ahead(checkpoint_id: str, chain: bool, snap: Snapshot) -> list[str]:
    """The objects :meth:`CheckpointReads._read_first` reads first from ``snap``: its first candidate's (and its
    chain's when ``chain``), read with the snapshot's last round; none when that object is not listed."""
    if checkpoint_id == "latest":
        row = max(snap.live.values(), key=lambda r: r.order, default=None)
    else:
        row = snap.live.get(checkpoint_id)
    if row is None or row.key not in snap.present:
        return []
    try:
        return [row.key, *(_chain_keys(row) if chain else ())]
    except ValueError:
        return [row.key]  # a malformed chain: reported when the chain is read


def _chain_keys(row: CheckpointRow) -> list[str]:
    """The object keys of ``row``'s chain, oldest first (ValueError when the chain is malformed)."""
    return [layout.checkpoint_key(sid, row.user_id, cid) for sid, cid in chains.expand(row.chain, row.session_id)]
