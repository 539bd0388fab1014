"""``Store``: checkpoints, journal, leases, session index and queries over one :class:`ObjectStore`.

Everything here is backend-neutral; the memory, local-directory and S3
adapters only move bytes. See the package docstring for the layout and the
partitioning choice.
"""

from __future__ import annotations

import hashlib
import json
import logging
import random
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from datetime import datetime, timedelta
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from storage import journal, layout
from storage.errors import (
    CorruptObjectError,
    IndexChangedError,
    LeaseCorruptError,
    LeaseLostError,
    ObjectNotFound,
    PreconditionFailed,
    StorageError,
)
from storage.ids import user_from_segment, user_segment, validate_id
from storage.index import ParquetIndex, conform, live_checkpoints
from storage.objects import ObjectStore
from storage.rows import (
    CHECKPOINT_SCHEMA,
    SESSION_SCHEMA,
    CheckpointRow,
    CompactReport,
    JournalEntry,
    Lease,
    PruneReport,
    RunRecord,
    SessionRow,
    as_utc,
    checkpoint_rows_from_table,
    checkpoint_rows_table,
    session_rows_from_table,
    session_rows_table,
    utcnow,
)

log = logging.getLogger("storage")
ANY: Any = ...  # "any user" in queries; None means "no user"
#: Seconds an acquire keeps retrying a contended lease (backoff: exponential, full jitter, base..cap seconds).
LEASE_TIMEOUT = 30.0
_BACKOFF_BASE = 0.005
_BACKOFF_CAP = 0.5
_sleep = time.sleep  # module-level so tests can record the backoff instead of waiting
_clock = time.monotonic  # the time budgets' clock (module-level, like _sleep, for tests)
#: Backoff rounds an acquire waits for another acquirer's claimed epoch to reach lease.json before it goes
#: above that claim (whose acquirer may have died): counted in rounds, not seconds, so the storage calls an
#: acquire makes depend only on what it reads.
_CLAIM_PATIENCE = 8
#: Earlier owners' checkpoint fences a lease body carries (see Store._fence_checkpoints).
_CHECKPOINT_FENCES = 8
_ROW_CACHE_FILES = 16384
_VIEW_REFRESH = 32
#: Seconds a reader keeps listing again while writers keep changing what it lists (then IndexChangedError).
READ_TIMEOUT = 10.0


def _parse_epoch(data: bytes, where: str, what: str) -> int:
    """The ``epoch`` of a lease document: an int in [0, 2**53), else :class:`LeaseCorruptError` naming ``where``."""
    try:
        doc = json.loads(data)
    except (ValueError, RecursionError) as e:  # UnicodeDecodeError is a ValueError
        raise LeaseCorruptError(f"{where}: unreadable {what} ({e}); repair it with Store.repair_lease "
                                "(CLI: loomray lease repair SESSION)") from e
    epoch = doc.get("epoch") if isinstance(doc, dict) else None
    if type(epoch) is not int or not 0 <= epoch <= layout.MAX_EPOCH:
        raise LeaseCorruptError(f"{where}: {what} epoch must be an integer in [0, 2**53), got {epoch!r:.40}; "
                                "repair it with Store.repair_lease (CLI: loomray lease repair SESSION)")
    return epoch


class Store:
    """The storage API of docs/contracts.md. All methods are synchronous and thread-safe."""

    def __init__(self, objects: ObjectStore, url: str, *, serial_reads: bool = False) -> None:
        self.objects = objects
        self.url = url
        #: serial_reads: no reader threads; each storage call runs on the thread that asked (for tests).
        self.index = ParquetIndex(objects, serial_reads=serial_reads)
        self._lock = threading.RLock()
        #: Parsed rows per immutable index file key (LRU).
        self._rows: OrderedDict[str, list[tuple[CheckpointRow, bool]]] = OrderedDict()
        #: Per-session live rows for retention: [rows by checkpoint id, writes since the last full LIST].
        self._views: dict[tuple[str | None, str], list] = {}

    def describe(self, key: str | None = None) -> str:
        """Backend, root and (optionally) key, for messages and the CLI."""
        return self.objects.describe(key)

    def fsspec(self) -> tuple[Any, str]:
        """``(filesystem, root)``: e.g. ``pyarrow.dataset.dataset(root + "/index/checkpoints", filesystem=fs,
        partitioning="hive")``. Not available for ``memory://``."""
        return self.objects.fsspec()

    def close(self) -> None:
        """Release clients and reader threads."""
        self.index.close()
        self.objects.close()

    def __repr__(self) -> str:
        return f"Store({self.describe()})"

    # -- leases ------------------------------------------------------------
    def _lease_state(self, session_id: str, user_id: str | None
                     ) -> tuple[int, str | None, LeaseCorruptError | None, bytes | None]:
        """``(epoch, etag, error, body)`` of ``lease.json``: ``(0, None, None, None)`` when missing; ``error``
        when unreadable."""
        key = layout.lease_key(session_id, user_id)
        obj = self.objects.get(key=key)
        if obj is None:
            return 0, None, None, None
        try:
            return _parse_epoch(obj.data, self.describe(key), "lease"), obj.etag, None, obj.data
        except LeaseCorruptError as e:
            return 0, obj.etag, e, obj.data

    def _read_lease(self, session_id: str, user_id: str | None) -> tuple[int, str | None]:
        """``(epoch, etag)`` of ``lease.json``, ``(0, None)`` when missing; :class:`LeaseCorruptError` if unreadable."""
        epoch, etag, error, _ = self._lease_state(session_id, user_id)
        if error is not None:
            raise error
        return epoch, etag

    def _marker_epoch(self, key: str, prefix: str) -> int | None:
        name = key[len(prefix):]
        if not (name.isascii() and name.isdigit()):
            log.warning("ignoring a foreign object among epoch markers: %s", self.describe(key))
            return None
        epoch = int(name)
        if epoch > layout.MAX_EPOCH:
            raise LeaseCorruptError(f"{self.describe(key)}: epoch marker {epoch} is beyond 2**53-1; no lease can go "
                                    "above it (delete the marker if it was not written by this store)")
        return epoch

    def _max_marker(self, session_id: str, user_id: str | None) -> int:
        """The highest epoch marker of the session (one LIST); 0 when there is none."""
        prefix = layout.epoch_prefix(session_id, user_id)
        epochs = (self._marker_epoch(o.key, prefix) for o in self.objects.list(prefix=prefix))
        return max((e for e in epochs if e is not None), default=0)

    def _epoch_floor(self, session_id: str, user_id: str | None) -> tuple[int, int]:
        """``(floor, marker)``: the highest epoch the session ever used, for when ``lease.json`` is missing or
        unreadable, and the highest epoch marker (0 when there is none).

        One LIST of the session's prefix: the highest epoch marker. A session
        whose objects predate markers (none, but checkpoints or a journal) falls
        back to the epochs its index rows and the last journal entry of each run
        carry; a session with no objects at all has used no epoch.
        """
        prefix = layout.session_prefix(session_id, user_id)
        markers = layout.epoch_prefix(session_id, user_id)
        journal_prefix = layout.journal_prefix(session_id, user_id)
        top, any_marker, any_object = 0, False, False
        last_entry: dict[str, str] = {}
        for info in self.objects.list(prefix=prefix):
            any_object = True
            if info.key.startswith(markers):
                epoch = self._marker_epoch(info.key, markers)
                if epoch is not None:
                    any_marker, top = True, max(top, epoch)
            elif info.key.startswith(journal_prefix):
                run = info.key[len(journal_prefix):].split("/", 1)[0]
                last_entry[run] = max(last_entry.get(run, ""), info.key)  # zero-padded seq: key order is seq order
        if any_marker or not any_object:
            return top, top
        for rows in self._partition_rows(session_id, user_id):
            top = max([top, *(r.epoch for r, _ in rows)])
        _, sessions = self.index.read_prefix(layout.index_partition(layout.SESSION_INDEX, session_id, user_id),
                                             SESSION_SCHEMA, cache=False)
        top = max([top, *(e for e in sessions["epoch"].to_pylist() if e is not None)])
        for key in last_entry.values():
            obj = self.objects.get(key=key)
            try:
                epoch = json.loads(obj.data).get("epoch") if obj is not None else None
            except (ValueError, AttributeError):
                epoch = None
            if type(epoch) is int and 0 <= epoch <= layout.MAX_EPOCH:
                top = max(top, epoch)
        return top, 0

    def _claimed_above(self, session_id: str, user_id: str | None, n: int, etag: str) -> int:
        """The highest epoch marker above ``n`` whose acquirer did not claim it on top of lease.json at ETag
        ``etag`` (0 when there is none): one LIST, and one GET per marker above ``n``."""
        prefix = layout.epoch_prefix(session_id, user_id)
        top = 0
        for info in self.objects.list(prefix=prefix):
            epoch = self._marker_epoch(info.key, prefix)
            if epoch is None or epoch <= n or epoch <= top:
                continue
            obj = self.objects.get(key=info.key)
            try:
                base = json.loads(obj.data).get("base") if obj is not None else None
            except (ValueError, AttributeError):
                base = None
            if obj is None or base != etag:
                top = epoch
        return top

    def acquire_lease(self, session_id: str, *, user_id: str | None = None, owner: str,
                      timeout: float = LEASE_TIMEOUT, note: Any = None) -> Lease:
        """Take the session's lease: the next epoch, with a conditional write that fences every older holder.

        Epochs rise strictly for the life of a session, whatever happens to
        ``lease.json``. An acquire first claims its epoch ``n`` with a
        create-only marker ``epochs/{n}``, then swaps ``lease.json`` to ``n``
        (compare-and-swap on the ETag it read, or create-only when it read
        none). So every epoch that ever reaches ``lease.json`` had its marker
        first, and markers are claimed in epoch order without gaps: when
        ``lease.json`` is missing, the highest marker is a floor above every
        epoch granted so far (see :meth:`_epoch_floor`). A marker that already
        exists means another acquirer claimed that epoch and is about to swap
        it in: the acquire backs off and waits for it, up to
        ``_CLAIM_PATIENCE`` rounds while ``lease.json`` does not move, then
        goes above every marker (that acquirer died, or lost its swap), so a
        marker without a lease only pushes later acquirers up, never blocks
        them. After creating a missing ``lease.json`` the acquire lists the
        markers once more: one above its own that was not claimed on top of
        its lease may be an epoch granted before ``lease.json`` was deleted
        again, so it swaps again, above it. A ``lease.json`` that is unreadable
        or holds an epoch outside [0, 2**53) raises :class:`LeaseCorruptError`
        before anything is written (repair: :meth:`repair_lease`). Contention
        is retried with exponential backoff and full jitter for up to
        ``timeout`` seconds, then :class:`LeaseLostError`. Right before its
        swap an acquire lists the session's checkpoint index, and right after
        it retires the rows a fenced writer landed since (see
        :meth:`_fence_checkpoints`). Cost: one GET, two PUTs (marker, lease)
        and three LISTs of the checkpoint index (one reads it ahead, with GETs
        of the index files this Store has not read yet), plus two LISTs when
        ``lease.json`` does not exist (a new session).

        ``note`` (the journal's fencing, :mod:`storage.journal`) is called with
        the lease body being replaced (a dict, or None) right before each swap,
        and its JSON result is stored in the new body under ``"note"``: written
        by the very swap that takes the epoch, so it exists exactly when the
        epoch was taken.
        """
        return self._take_lease(session_id, user_id, str(owner), timeout, repair=False, note=note)

    def repair_lease(self, session_id: str, *, user_id: str | None = None, owner: str = "lease repair",
                     timeout: float = LEASE_TIMEOUT) -> Lease:
        """Rewrite a corrupt or missing ``lease.json`` above every epoch the session used; returns that new lease.

        The new epoch fences every holder, so a running writer stops at its next
        lease check and the session's next incarnation takes the epoch after it.
        On a healthy lease this is :meth:`acquire_lease`.
        """
        return self._take_lease(session_id, user_id, str(owner), timeout, repair=True)

    def _take_lease(self, session_id: str, user_id: str | None, owner: str, timeout: float, *,
                    repair: bool, note: Any = None) -> Lease:
        key = layout.lease_key(session_id, user_id)
        deadline = _clock() + timeout
        taken = 0  # the highest epoch marker known to exist (claimed by anyone, this acquire included)
        mine = 0  # the highest marker this acquire claimed: an epoch nobody else can take
        blocked: tuple[str | None, int] | None = None  # (lease ETag, marker) when a claim found the marker taken
        waiting: tuple[str | None, int] | None = None  # the other acquirer's claim being waited for
        patience = 0
        attempt = 0
        try:
            # Parse the checkpoint index now, so the LIST right before the swap reads only files that are
            # newer (the shorter that LIST-to-swap window, the fewer rows land in it; see _fence_checkpoints).
            self._partition_rows(session_id, user_id)
        except StorageError as e:
            log.info("lease of session %r: checkpoint index not read ahead (%s); read right before the swap",
                     session_id, e)
        while True:
            epoch, etag, corrupt, previous = self._lease_state(session_id, user_id)
            if corrupt is not None and not repair:
                raise corrupt
            missing, top = etag is None or corrupt is not None, 0
            if missing:
                epoch, top = self._epoch_floor(session_id, user_id)  # one LIST
                taken = max(taken, top)
            # Another acquirer's claim that lease.json does not show yet: it is about to swap it in (or died).
            claim = None
            if etag is None and top > mine:
                claim = (None, top)  # the highest marker is someone else's, and lease.json is missing
            elif blocked is not None and blocked[0] == etag:
                claim = blocked  # our claim found its marker taken, and lease.json has not moved since
            blocked = None
            wait = False
            if claim is not None:
                if claim != waiting:
                    waiting, patience = claim, _CLAIM_PATIENCE
                if patience > 0:
                    patience -= 1
                    wait = True
                elif etag is not None:
                    # lease.json did not move: that acquirer died or lost its swap. Go above every marker.
                    taken = max(taken, self._max_marker(session_id, user_id))
            if not wait:
                n = max(epoch, taken) + 1
                if etag is None and mine and mine == taken:
                    n = mine  # our claim is still the highest (our create lost to a lease deleted meanwhile)
                if n > layout.MAX_EPOCH:
                    raise LeaseCorruptError(f"{self.describe(key)}: session {session_id!r} has used epoch {n - 1}; "
                                            "no lease can go above 2**53-1")
                now = utcnow().isoformat()
                if n != mine:
                    marker = json.dumps({"type": "epoch", "v": 1, "session_id": session_id, "user_id": user_id,
                                         "epoch": n, "owner": owner, "acquired_at": now, "base": etag}).encode()
                    try:
                        self.objects.put(key=layout.epoch_marker_key(session_id, user_id, n), data=marker,
                                         if_none_match=True)
                        mine = taken = n
                    except PreconditionFailed:
                        taken, blocked = max(taken, n), (etag, n)  # wait for its acquirer (above), or go above it
                if n == mine:
                    fields = {"type": "lease", "v": 1, "session_id": session_id, "user_id": user_id,
                              "epoch": n, "owner": owner, "acquired_at": now}
                    if note is not None:
                        fields["note"] = note(journal.lease_body(previous) if corrupt is None else None)
                    # Listed last, right before the swap: a fenced writer's rows that land after it are retired.
                    seen, fields["checkpoints"] = self._checkpoint_view(
                        session_id, user_id, journal.lease_body(previous) if corrupt is None else None)
                    try:
                        new_etag = self.objects.put(key=key, data=json.dumps(fields).encode(),
                                                    if_none_match=etag is None, if_match=etag)
                    except PreconditionFailed:
                        pass  # another acquirer swapped first, or lease.json vanished meanwhile: read again
                    else:
                        if etag is not None:
                            # The swap replaced exactly what we read: no epoch was granted since, and n is
                            # above it and above every marker claimed before ours.
                            return self._fence_checkpoints(Lease(session_id, user_id, n, owner), seen,
                                                           fields["checkpoints"])
                        # We created a missing lease.json. An epoch above n may have been granted after our
                        # floor was listed, its lease.json deleted again before our create: its marker exists.
                        # Markers claimed on top of our own lease are our successors, not that.
                        above = self._claimed_above(session_id, user_id, n, new_etag)
                        if not above:
                            return self._fence_checkpoints(Lease(session_id, user_id, n, owner), seen,
                                                           fields["checkpoints"])
                        taken = max(taken, above)  # our lease.json (held by nobody) goes above it next round
                        if _clock() < deadline:
                            continue
            attempt += 1
            delay = random.uniform(0, min(_BACKOFF_CAP, _BACKOFF_BASE * 2 ** attempt))  # full jitter
            if _clock() + delay > deadline:
                raise LeaseLostError(f"{self.describe(key)}: lease of session {session_id!r} is contended; gave up "
                                     f"after {attempt} attempts in {timeout:g} s")
            _sleep(delay)

    def _checkpoint_view(self, session_id: str, user_id: str | None, previous: dict[str, Any] | None
                         ) -> tuple[set[str], dict[str, Any]]:
        """What an acquire lists of the session's checkpoint rows right before its swap.

        Returns the live checkpoint ids (what :meth:`_fence_checkpoints` spares)
        and the fence the swap records in the new ``lease.json`` under
        ``"checkpoints"``: ``top``, the highest live ``[epoch, checkpoint_id]``
        listed that no earlier fence covers (None: no such row), and ``prev``,
        the fences of up to ``_CHECKPOINT_FENCES`` earlier owners taken from
        ``previous`` (the body being replaced). One LIST, plus GETs of index
        files this Store has not parsed.
        """
        chain: list[dict[str, Any]] = []
        fence = previous.get("checkpoints") if previous is not None else None
        if isinstance(fence, dict) and type(previous.get("epoch")) is int:
            chain.append({"epoch": previous["epoch"], "top": fence.get("top")})
            prev = fence.get("prev")
            chain += [c for c in (prev if isinstance(prev, list) else []) if isinstance(c, dict)]
        chain = chain[:_CHECKPOINT_FENCES]
        live, dead = {}, set()
        for rows in self._partition_rows(session_id, user_id):
            for row, tomb in rows:
                if tomb:
                    dead.add(row.checkpoint_id)
                else:
                    live[row.checkpoint_id] = row
        seen = set(live) - dead
        earlier = _fenced_by(_parse_fences(chain))  # a fenced writer's row not retired yet sets no top
        top = max((live[c].order for c in seen if not earlier(live[c])), default=None)
        return seen, {"top": list(top) if top is not None else None, "prev": chain}

    def _fence_checkpoints(self, lease: Lease, seen: set[str], fence: dict[str, Any]) -> Lease:
        """Right after ``lease`` was taken: retire the checkpoint rows fenced writers landed; returns ``lease``.

        A writer checks the lease before a checkpoint write and, after its
        row landed, the epoch markers (:meth:`_confirm_lease`), retiring the
        row itself when a takeover had claimed its epoch by then. The claim
        precedes this acquire's listing, so every acknowledged row is listed
        and spared. A writer that dies (or cannot read its lease) between its row
        and that re-check leaves a fenced row that could be "latest", and what
        the new owner resumes from. So a new owner retires every live row of
        an older epoch that it did not list right before its swap (its own
        fence), and every row of an epoch below an earlier owner's that ranks
        above what that owner listed before its swap (the fences its
        ``lease.json`` carried: a new owner that died before this step is
        covered by the next one). Rows of epoch 0 were written without a lease
        and are fenced by nothing. A row that lands after this LIST is retired
        by its writer's re-check or by the next takeover; until then any row
        of this owner outranks it. One LIST (cached index files are not read
        again), plus a DELETE and a PUT when there is something to retire.
        """
        earlier = _fenced_by(_parse_fences(fence.get("prev")))

        def fenced(r: CheckpointRow) -> bool:
            return 0 < r.epoch < lease.epoch and (r.checkpoint_id not in seen or earlier(r))

        try:
            doomed = [r for r in self._live_rows(lease.session_id, lease.user_id).values() if fenced(r)]
            if doomed:
                log.warning("session %r: retiring %d checkpoint(s) written by a fenced writer after epoch %d was "
                            "taken: %s", lease.session_id, len(doomed), lease.epoch,
                            ", ".join(sorted(r.checkpoint_id for r in doomed)))
                self._retire(lease.session_id, lease.user_id, doomed)
        except StorageError as e:
            # The lease is taken and readers skip such rows already (the fence the swap recorded, see
            # _unfenced): the next takeover retires them. Raising would leave the new owner not knowing it
            # holds the lease.
            log.warning("session %r: checkpoints a fenced writer may have written before epoch %d was taken are "
                        "not retired yet (%s)", lease.session_id, lease.epoch, e)
        return lease

    def _unfenced(self, session_id: str, user_id: str | None,
                  rows: dict[str, CheckpointRow]) -> dict[str, CheckpointRow]:
        """``rows`` without those the takeovers recorded in ``lease.json`` fenced (one GET, none when no row was
        written under a lease).

        A row of an older epoch that ranks above what a takeover listed right
        before its swap landed after it (see :meth:`_fence_checkpoints`): until
        its writer or the new owner retires it, readers of "latest" and of the
        list skip it. Called after the index LIST, so a row that LIST shows,
        landed after a takeover, is judged by that takeover's fence. A missing
        or unreadable lease fences nothing here.
        """
        if not any(r.epoch for r in rows.values()):
            return rows  # written without a lease: nothing to fence
        obj = self.objects.get(key=layout.lease_key(session_id, user_id))
        body = journal.lease_body(obj.data if obj is not None else None)
        fence = body.get("checkpoints") if body is not None else None
        if not isinstance(fence, dict) or type(body.get("epoch")) is not int:
            return rows
        fenced = _fenced_by(_parse_fences([{"epoch": body["epoch"], "top": fence.get("top")},
                                           *(fence.get("prev") or ())]))
        return {cid: r for cid, r in rows.items() if not fenced(r)}

    def current_epoch(self, session_id: str, *, user_id: str | None = None) -> int:
        """The session's lease epoch; 0 when it was never leased.

        When ``lease.json`` is missing, the highest epoch marker (the last
        epoch claimed: its holder, or an acquire under way, which fences every
        older holder anyway). :class:`LeaseCorruptError` when ``lease.json`` is
        unreadable.
        """
        epoch, etag = self._read_lease(session_id, user_id)
        return epoch if etag is not None else self._max_marker(session_id, user_id)

    def check_lease(self, lease: Lease) -> None:
        """Raise :class:`LeaseLostError` if a newer epoch has taken the session."""
        current = self.current_epoch(lease.session_id, user_id=lease.user_id)
        if current != lease.epoch:
            raise LeaseLostError(
                f"{self.describe(layout.lease_key(lease.session_id, lease.user_id))}: session {lease.session_id!r} "
                f"is at epoch {current}; this writer ({lease.owner}) holds epoch {lease.epoch}")

    def _confirm_lease(self, lease: Lease) -> None:
        """The re-check after a fenced write landed: :class:`LeaseLostError` if an acquire has claimed an epoch
        above ``lease``'s, even one that has not swapped ``lease.json`` yet (one LIST of the epoch markers).

        An acquire claims its epoch marker before it lists the checkpoint
        index for its fence (see :meth:`_fence_checkpoints`), so a write this
        re-check acknowledges landed before that listing and is spared by the
        takeover; a write the listing may have missed is never acknowledged
        (its writer retires it). With no marker for ``lease``'s epoch (a
        session whose markers were removed), ``lease.json`` decides (one GET).
        """
        prefix = layout.epoch_prefix(lease.session_id, lease.user_id)
        epochs = {self._marker_epoch(o.key, prefix) for o in self.objects.list(prefix=prefix)}
        top = max((e for e in epochs if e is not None), default=0)
        if top > lease.epoch:
            raise LeaseLostError(
                f"{self.describe(layout.epoch_marker_key(lease.session_id, lease.user_id, top))}: session "
                f"{lease.session_id!r} has claimed epoch {top}; this writer ({lease.owner}) holds epoch {lease.epoch}")
        if lease.epoch not in epochs:
            self.check_lease(lease)

    def _fence(self, lease: Lease | None, session_id: str, user_id: str | None) -> int:
        if lease is None:
            return 0
        if lease.session_id != session_id or lease.user_id != user_id:
            raise LeaseLostError(f"lease for session {lease.session_id!r}/user {lease.user_id!r} used to write "
                                 f"session {session_id!r}/user {user_id!r}")
        self.check_lease(lease)
        return lease.epoch

    # -- checkpoints -------------------------------------------------------
    def put_checkpoint(self, data: bytes, *, session_id: str, checkpoint_id: str, user_id: str | None = None,
                       turn: int, created_at: datetime, position: str, execution_status: str, message_count: int,
                       input_tokens: int = 0, output_tokens: int = 0, cost_usd: float | None = None,
                       parent_checkpoint_id: str | None = None, forked_from: str | None = None,
                       agent_id: str | None = None, lease: Lease | None = None, keep: int = 20,
                       spend_usd: float | None = None) -> CheckpointRow:
        """One PUT of ``data`` plus one index row, then retention; see docs/contracts.md."""
        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise TypeError(f"checkpoint data must be bytes, got {type(data).__name__}")
        key = layout.checkpoint_key(session_id, user_id, checkpoint_id)
        for name, value in (("parent_checkpoint_id", parent_checkpoint_id), ("forked_from", forked_from),
                            ("agent_id", agent_id)):
            if value is not None:
                validate_id(value, name)
        epoch = self._fence(lease, session_id, user_id)
        # sha256 and size once, over the caller's buffer; the same buffer is the PUT body.
        row = CheckpointRow(session_id, user_id, checkpoint_id, int(turn), as_utc(created_at), str(position),
                            str(execution_status), int(message_count), int(input_tokens), int(output_tokens),
                            None if cost_usd is None else float(cost_usd), parent_checkpoint_id, forked_from,
                            agent_id, epoch, key, len(data), hashlib.sha256(data).hexdigest(),
                            spend_usd=None if spend_usd is None else float(spend_usd))
        # The index row is encoded before the PUT: a value Arrow refuses (an int beyond int64) fails
        # here, never after the object landed without a row.
        table = checkpoint_rows_table([row], tombstone=False, written_at=utcnow())
        self.objects.put(key=key, data=data)
        partition = layout.index_partition(layout.CHECKPOINT_INDEX, session_id, user_id)
        try:
            self._write_rows(partition, [row], tombstone=False, table=table)
        except Exception:
            # The row may have landed though its PUT raised (the reply was lost): if a takeover raced this
            # write, retire it as below, so it can never be "latest". The write's own error is the caller's.
            if lease is not None:
                self._retire_if_fenced(lease, row)
            raise
        if lease is not None:
            try:
                self._confirm_lease(lease)
            except LeaseLostError:
                # A takeover raced this write: retire it so it can never be "latest".
                self._retire(session_id, user_id, [row])
                raise
        if keep >= 1:
            self._apply_retention(session_id, user_id, row, keep)
        return row

    def _retire_if_fenced(self, lease: Lease, row: CheckpointRow) -> None:
        """Retire ``row`` if ``lease`` was lost; never raises (the caller is already failing).

        When the lease cannot be read either, the row stays: if it was fenced,
        the next owner's takeover retires it (see :meth:`_fence_checkpoints`).
        """
        try:
            self._confirm_lease(lease)
        except LeaseLostError:
            try:
                self._retire(row.session_id, row.user_id, [row])
            except Exception as e:
                log.warning("could not retire checkpoint %r written after a takeover (the next takeover "
                            "retires it): %s", row.checkpoint_id, e)
        except Exception as e:
            log.warning("could not check the lease after a failed index write of checkpoint %r (the next "
                        "takeover retires it if it was fenced): %s", row.checkpoint_id, e)

    def _apply_retention(self, session_id: str, user_id: str | None, row: CheckpointRow, keep: int) -> None:
        """Drop the oldest live checkpoints beyond ``keep``.

        The session's live rows come from a per-store view refreshed by a full
        partition LIST on first use and every ``_VIEW_REFRESH`` writes, so a
        steady-state write costs no LIST. The view can only miss rows another
        process wrote; it never deletes beyond the ``keep`` newest rows it knows,
        so a session never drops below ``keep`` checkpoints.
        """
        view_key = (user_id, session_id)
        with self._lock:
            view = self._views.get(view_key)
            if view is not None and view[1] < _VIEW_REFRESH:
                view[0][row.checkpoint_id] = row
                view[1] += 1
                rows = dict(view[0])
            else:
                rows = None
        if rows is None:
            try:
                rows = self._live_rows(session_id, user_id)
            except IndexChangedError as e:
                # The write itself is done; retention runs again on the next write.
                log.warning("retention deferred: %s", e)
                return
        if len(rows) > keep:
            ordered = sorted(rows.values(), key=lambda r: r.order)
            self._retire(session_id, user_id, ordered[:len(ordered) - keep])

    def _file_rows(self, keys: list[str], vanished: list[str] | None = None) -> list[list[tuple[CheckpointRow, bool]]]:
        """Parsed rows of each readable index file; files are immutable, so parsing is cached by key.

        Keys gone at GET time are noted in ``vanished`` (see :meth:`ParquetIndex.read_listed`).
        """
        with self._lock:
            parsed = {k: self._rows[k] for k in keys if k in self._rows}
        missing = [k for k in keys if k not in parsed]
        for key, table in self.index.read_files(missing, cache=False, vanished=vanished):
            try:
                parsed[key] = checkpoint_rows_from_table(conform(table, CHECKPOINT_SCHEMA))
            except (KeyError, ValueError, TypeError, pa.ArrowInvalid) as e:
                log.warning("skipping index file with a foreign schema: %s: %s", self.describe(key), e)
        with self._lock:
            for key in missing:
                if key in parsed:
                    self._cache_rows(key, parsed[key])
        return [parsed[k] for k in keys if k in parsed]

    def _cache_rows(self, key: str, rows: list[tuple[CheckpointRow, bool]]) -> None:
        self._rows[key] = rows
        self._rows.move_to_end(key)
        while len(self._rows) > _ROW_CACHE_FILES:
            self._rows.popitem(last=False)

    def _write_rows(self, partition: str, rows: list[CheckpointRow], *, tombstone: bool,
                    table: pa.Table | None = None) -> None:
        if table is None:
            table = checkpoint_rows_table(rows, tombstone=tombstone, written_at=utcnow())
        key = self.index.write(partition, table, cache=False)
        with self._lock:
            self._cache_rows(key, [(r, tombstone) for r in rows])

    def _partition_rows(self, session_id: str, user_id: str | None) -> list[list[tuple[CheckpointRow, bool]]]:
        """Rows and tombstones of every file of the session's partition, as of one fresh LIST.

        A listed file that vanished before its GET (merged by a compaction)
        means the LIST is stale: LIST again, never read it as "no rows";
        :class:`IndexChangedError` when that keeps happening.
        """
        partition = layout.index_partition(layout.CHECKPOINT_INDEX, session_id, user_id)
        return self.index.read_listed(partition, self._file_rows)[1]

    def _live_rows(self, session_id: str, user_id: str | None) -> dict[str, CheckpointRow]:
        """The session's live rows from a fresh LIST of its partition (strongly consistent); refreshes the view."""
        live: dict[str, CheckpointRow] = {}
        dead: set[str] = set()
        for rows in self._partition_rows(session_id, user_id):
            for row, tomb in rows:
                if tomb:
                    dead.add(row.checkpoint_id)
                else:
                    live[row.checkpoint_id] = row
        result = {cid: r for cid, r in live.items() if cid not in dead}
        with self._lock:
            self._views[(user_id, session_id)] = [dict(result), 0]
        return result

    def _retire(self, session_id: str, user_id: str | None, rows: list[CheckpointRow]) -> None:
        """Delete objects, then write tombstones (a crash between leaves rows whose object is gone: listings skip them)."""
        if not rows:
            return
        self.objects.delete(keys=[r.key for r in rows])
        partition = layout.index_partition(layout.CHECKPOINT_INDEX, session_id, user_id)
        self._write_rows(partition, rows, tombstone=True)
        with self._lock:
            view = self._views.get((user_id, session_id))
            if view is not None:
                for r in rows:
                    view[0].pop(r.checkpoint_id, None)

    def _relist_pause(self, attempt: int, deadline: float, what: str) -> None:
        """Back off before a reader's next LIST (full jitter); :class:`IndexChangedError` past ``deadline``."""
        delay = random.uniform(0, min(_BACKOFF_CAP, _BACKOFF_BASE * 2 ** attempt))
        if _clock() + delay > deadline:
            raise IndexChangedError(f"{what}; listed {attempt} times in {READ_TIMEOUT:g} s while writers kept "
                                    "changing it; try again")
        _sleep(delay)

    def list_checkpoints(self, session_id: str, *, user_id: str | None = None, limit: int | None = 50) -> list[CheckpointRow]:
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
        deadline = _clock() + READ_TIMEOUT
        gone: set[str] = set()  # keys whose object was missing although a fresh LIST still showed their row
        attempt = 0
        while True:
            rows = self._unfenced(session_id, user_id, self._live_rows(session_id, user_id))
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
            self._relist_pause(attempt, deadline, f"{self.describe(objects_prefix)}: the newest checkpoints of "
                                                  f"session {session_id!r} kept being retired before they were read")
        out = []
        for row in sorted(rows.values(), key=lambda r: r.order, reverse=True):
            size = present.get(row.key)
            if size is None:
                continue
            if size != row.size:
                log.warning("skipping checkpoint: %s is %d bytes, %d were written (truncated or replaced)",
                            self.describe(row.key), size, row.size)
                continue
            out.append(row)
            if limit is not None and limit > 0 and len(out) >= limit:
                break
        return out

    def get_checkpoint(self, session_id: str, checkpoint_id: str = "latest", *, user_id: str | None = None) -> bytes | None:
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
        first_error: CorruptObjectError | None = None
        gone: set[str] = set()  # keys whose object was missing although a fresh LIST still showed their row
        warned: set[str] = set()
        deadline = _clock() + READ_TIMEOUT
        attempt = 0
        while True:
            rows = self._live_rows(session_id, user_id)
            if checkpoint_id == "latest":
                candidates = sorted(self._unfenced(session_id, user_id, rows).values(), key=lambda r: r.order,
                                    reverse=True)
            else:
                candidates = [rows[checkpoint_id]] if checkpoint_id in rows else []
            relist = False
            for row in candidates:
                obj = self.objects.get(key=row.key)
                if obj is None:
                    if checkpoint_id == "latest" and row.key not in gone:
                        # Retired since our LIST (retention, prune): its successor was written first, so a
                        # fresh LIST shows it. Never fall back to an older checkpoint, or to none, on a stale
                        # LIST; a row whose object is still missing after a fresh LIST was deleted for good.
                        gone.add(row.key)
                        relist = True
                        break
                    continue  # deleted behind the index's back; the next newest is the latest that exists
                if len(obj.data) != row.size or hashlib.sha256(obj.data).hexdigest() != row.sha256:
                    error = CorruptObjectError(
                        f"{self.describe(row.key)}: checkpoint {row.checkpoint_id!r} of session {session_id!r} is "
                        f"corrupt or truncated ({len(obj.data)} bytes, {row.size} written; sha256 mismatch)")
                    if checkpoint_id != "latest":
                        raise error
                    if row.key not in warned:  # once, though a re-LIST may meet it again
                        warned.add(row.key)
                        log.warning("skipping an unreadable checkpoint for 'latest', falling back to the next "
                                    "newest (quarantine it with Store.quarantine_checkpoint): %s", error)
                    first_error = first_error or error
                    continue
                return obj.data
            if not relist:
                break
            attempt += 1
            self._relist_pause(attempt, deadline, f"{self.describe(layout.session_prefix(session_id, user_id))}: "
                                                  f"the latest checkpoints of session {session_id!r} kept being "
                                                  "retired before they were read")
        if first_error is not None:
            raise first_error  # a session whose checkpoints are all unreadable never reads as "no checkpoint"
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
        row = self._live_rows(session_id, user_id).get(checkpoint_id)
        obj = self.objects.get(key=key)
        if row is None and obj is None:
            raise ObjectNotFound(f"{self.describe(key)}: session {session_id!r} has no checkpoint {checkpoint_id!r}")
        moved = None
        if obj is not None:
            moved = layout.quarantine_key(session_id, user_id, checkpoint_id)
            self.objects.put(key=moved, data=obj.data)
        if row is not None:
            self._retire(session_id, user_id, [row])
        else:
            self.objects.delete(keys=[key])  # an object without a row (its index write was lost)
        log.warning("quarantined checkpoint %r of session %r: %s", checkpoint_id, session_id,
                    self.describe(moved) if moved else "object already gone, row retired")
        return moved

    def delete_checkpoint(self, session_id: str, checkpoint_id: str, *, user_id: str | None = None) -> bool:
        """Delete one checkpoint (object + tombstone); False when it does not exist."""
        layout.checkpoint_key(session_id, user_id, checkpoint_id)
        row = self._live_rows(session_id, user_id).get(checkpoint_id)
        if row is None:
            return False
        self._retire(session_id, user_id, [row])
        return True

    # -- journal and runs (storage/journal.py) --------------------------------
    def journal_append(self, entry: JournalEntry, *, lease: Lease | None = None) -> None:
        """Create-only write of one journal entry; PreconditionFailed if that (run, seq, step) exists.

        With ``lease`` the lease is checked first (one GET) and the entry takes
        its epoch. A running loop passes none: its entries carry their epoch and
        the seal of the next incarnation fences them (see :mod:`storage.journal`),
        so a step costs one PUT.
        """
        key = layout.journal_key(entry.session_id, entry.user_id, entry.run_id, entry.seq, entry.step_key)
        epoch = self._fence(lease, entry.session_id, entry.user_id)
        if lease is not None and entry.epoch != epoch:
            entry = entry.model_copy(update={"epoch": epoch})
        self.objects.put(key=key, data=entry.__pydantic_serializer__.to_json(entry), if_none_match=True)

    def _read_entries(self, keys: list[str]) -> list[JournalEntry]:
        return list(journal.load_entries(self, keys).values())

    def journal_read(self, session_id: str, run_id: str, *, user_id: str | None = None) -> journal.JournalRun:
        """The run's journal: every readable entry by key, fenced ones included (``.entries`` drops them)."""
        return journal.read_run(self, session_id, run_id, user_id)

    def journal_list(self, session_id: str, run_id: str, *, user_id: str | None = None,
                     include_fenced: bool = False) -> list[JournalEntry]:
        """The run's entries by seq, without those a seal fenced (unless ``include_fenced``).

        Unreadable entries, and entries whose ids do not match their key, are skipped with a warning.
        """
        run = journal.read_run(self, session_id, run_id, user_id)
        return run.all if include_fenced else run.entries

    def journal_keys(self, session_id: str, run_id: str, *, user_id: str | None = None) -> frozenset[str]:
        """Keys of the run's entries (one LIST): what a new incarnation lists before taking the lease."""
        return journal.journal_keys(self, session_id, run_id, user_id)

    def journal_seal(self, session_id: str, run_id: str, *, user_id: str | None = None, lease: Lease,
                     seen_before: Any = None, known: journal.JournalRun | None = None) -> journal.JournalRun:
        """Seal the run for ``lease``'s incarnation (fences older writers) and return its journal, seal included."""
        return journal.seal_run(self, session_id, run_id, user_id, lease, seen_before=seen_before, known=known)

    def journal_seal_listed(self, session_id: str, run_id: str, *, user_id: str | None = None, lease: Lease,
                            listed: Any) -> JournalEntry:
        """Seal the run right after taking ``lease``, above the keys ``listed`` before it (one PUT)."""
        return journal.seal_listed(self, session_id, run_id, user_id, lease, listed)

    def journal_listing(self, session_id: str, *, user_id: str | None = None,
                        run_id: str | None = None) -> journal.Listing:
        """What a new owner lists right before its lease swap to fence the session's last run (and ``run_id``)."""
        return journal.list_for_fence(self, session_id, user_id, run_id)

    def journal_complete_fences(self, session_id: str, *, user_id: str | None = None, chain: Any,
                                listed: Any) -> int:
        """Write the seals earlier owners recorded in the lease but did not write (see ``journal.FenceNote``)."""
        return journal.complete_fences(self, session_id, user_id, chain, listed)

    def journal_runs(self, session_id: str, *, user_id: str | None = None) -> list[str]:
        """Run ids with journal entries, sorted (not run order: see :meth:`last_run`)."""
        return self.objects.list_dirs(prefix=layout.journal_prefix(session_id, user_id))

    def run_create(self, session_id: str, *, user_id: str | None = None, run_id: str, **fields: Any) -> RunRecord:
        """Record a run starting now at the session's next store-sequenced slot (see :class:`RunRecord`).

        A run that starts from a checkpoint (``base_checkpoint_id``, in
        ``base_session_id`` or this session) looks for that checkpoint's
        object once more right after its record landed (one LIST):
        :class:`ObjectNotFound` when it is gone, so the run stops before its
        first step. A concurrent ``prune`` deletes checkpoint objects before it
        checks the run records again and puts back what a recorded run needs
        (see :func:`storage.maintenance.prune`): so either prune saw this
        record, or this look sees the deletion, and a run never works from a
        base that prune deletes (its recovery would restart from that base).
        """
        rec = journal.create_run(self, session_id, user_id, run_id=run_id, **fields)
        if rec.base_checkpoint_id is not None:
            source = rec.base_session_id or session_id
            key = layout.checkpoint_key(source, user_id, rec.base_checkpoint_id)
            if not any(o.key == key for o in self.objects.list(prefix=key)):
                raise ObjectNotFound(f"{self.describe(key)}: checkpoint {rec.base_checkpoint_id!r} of session "
                                     f"{source!r}, where run {run_id} starts, was deleted (pruned) before the run "
                                     "was recorded; start from another checkpoint")
        return rec

    def last_run(self, session_id: str, *, user_id: str | None = None) -> RunRecord | None:
        """The session's last run by store order; None for a session without run records."""
        return journal.last_run(self, session_id, user_id)

    def list_runs(self, session_id: str, *, user_id: str | None = None) -> list[RunRecord]:
        """The session's run records in store order."""
        return journal.list_runs(self, session_id, user_id)

    # -- session index -----------------------------------------------------
    def put_session(self, row: SessionRow) -> None:
        """Append a status row for the session."""
        validate_id(row.session_id, "session_id")
        row = SessionRow(**{**row.__dict__, "updated_at": as_utc(row.updated_at)})
        partition = layout.index_partition(layout.SESSION_INDEX, row.session_id, row.user_id)
        self.index.write(partition, session_rows_table([row]))

    def _session_table(self, prefix: str) -> pa.Table:
        """Session rows under ``prefix``; rows whose ids differ from their file's partition are dropped.

        A row in ``user=u/session=s/`` speaks for that session only: one that
        names another (copied or forged by whoever can write the bucket) must
        never make a reader, such as the supervisor, act on that other session.
        """
        tables: dict[str, pa.Table] = {}

        def read(keys: list[str], vanished: list[str]) -> None:
            for key, table in self.index.read_files([k for k in keys if k not in tables], vanished=vanished):
                tables[key] = table

        keys, _ = self.index.read_listed(prefix, read)
        pairs = [(k, self._own_session_rows(k, tables[k])) for k in keys if k in tables]
        return self.index._concat(pairs, SESSION_SCHEMA)[1]

    def _own_session_rows(self, key: str, table: pa.Table) -> pa.Table:
        """The rows of index file ``key`` whose (user, session) match the hive partition the file is in."""
        parts = dict(seg.split("=", 1) for seg in key.split("/") if "=" in seg)
        if "session" not in parts or "user" not in parts or not {"session_id", "user_id"} <= set(table.column_names):
            return table  # not a partition file, or a foreign schema that the reader skips anyway
        user = user_from_segment(parts["user"])
        same = pc.equal(table["session_id"], parts["session"])
        same = pc.and_(same, pc.is_null(table["user_id"]) if user is None else pc.equal(table["user_id"], user))
        same = pc.fill_null(same, False)
        if pc.all(same).as_py():
            return table
        log.warning("ignoring %d session row(s) that name another session than their partition: %s",
                    table.num_rows - pc.sum(same).as_py(), self.describe(key))
        return table.filter(same)

    def get_session(self, session_id: str, *, user_id: str | None = None) -> SessionRow | None:
        """The session's latest status row, or None."""
        rows = session_rows_from_table(self._session_table(layout.index_partition(layout.SESSION_INDEX, session_id, user_id)))
        return _latest_sessions(rows)[0] if rows else None

    def list_sessions(self, *, status: str | None = None, user_id: Any = ANY) -> list[SessionRow]:
        """The latest row of every session (of ``user_id``; ``...`` = any user), filtered by status."""
        prefix = layout.SESSION_INDEX if user_id is ANY else f"{layout.SESSION_INDEX}user={user_segment(user_id)}/"
        rows = _latest_sessions(session_rows_from_table(self._session_table(prefix)))
        return [r for r in rows if status is None or r.status == status]

    # -- active-session markers ----------------------------------------------
    # One small object per session a supervisor currently owns, deleted when it finishes, so
    # "what is active" is one LIST whose size follows the active sessions, not every session
    # ever run (the session index keeps every session's history).
    def put_active(self, session_id: str, *, user_id: str | None = None, data: bytes = b"{}") -> None:
        """Mark the session active (``data``: the caller's small JSON note); overwrites an earlier mark."""
        self.objects.put(key=_active_key(session_id, user_id), data=bytes(data))

    def get_active(self, session_id: str, *, user_id: str | None = None) -> bytes | None:
        """The session's active mark, or None when it is not marked."""
        obj = self.objects.get(key=_active_key(session_id, user_id))
        return None if obj is None else obj.data

    def delete_active(self, session_id: str, *, user_id: str | None = None) -> None:
        """Remove the session's active mark (absent is fine)."""
        self.objects.delete(keys=[_active_key(session_id, user_id)])

    def list_active(self) -> list[tuple[str | None, str]]:
        """``(user_id, session_id)`` of every marked session: one LIST, no GET."""
        out = []
        for info in self.objects.list(prefix=_ACTIVE):
            user, _, name = info.key[len(_ACTIVE):].partition("/")
            if name.endswith(".json") and "/" not in name:
                out.append((user_from_segment(user), name[:-len(".json")]))
        return out

    # -- queries -----------------------------------------------------------
    def query(self, *, user_id: Any = ANY, session_id: str | None = None, status: str | None = None,
              since: datetime | None = None, until: datetime | None = None, min_cost: float | None = None,
              max_cost: float | None = None, columns: list[str] | None = None) -> pa.Table:
        """Live checkpoint rows across sessions as an Arrow table (``user_id=...`` = any user).

        ``since`` is inclusive, ``until`` exclusive (on ``created_at``); rows
        with an unknown cost never match a cost filter. Reads the compacted
        table's partitions of the days in range plus the uncompacted tail (the
        sessions whose per-session files changed since the last compaction),
        so it is as fresh as the per-session index; how stale the compacted part
        was rides along in the schema metadata: ``storage.table.staleness(table)``.
        """
        from storage.table import read_for_query, with_staleness

        segment = None if user_id is ANY else user_segment(user_id)
        if session_id is not None:
            validate_id(session_id, "session_id")
        # Consistent with one LIST of the per-session files even while a compaction merges them.
        table_part, tail, stale = read_for_query(self, segment=segment, session_id=session_id, since=since,
                                                 until=until)
        tail = live_checkpoints(tail).drop_columns(["tombstone", "written_at"]).cast(table_part.schema)
        table = pa.concat_tables([table_part, tail]) if table_part.num_rows else tail
        mask = None
        for cond in (
            pc.equal(table["execution_status"], status) if status is not None else None,
            pc.greater_equal(table["created_at"], pa.scalar(as_utc(since), table["created_at"].type)) if since else None,
            pc.less(table["created_at"], pa.scalar(as_utc(until), table["created_at"].type)) if until else None,
            pc.greater_equal(table["cost_usd"], float(min_cost)) if min_cost is not None else None,
            pc.less_equal(table["cost_usd"], float(max_cost)) if max_cost is not None else None,
        ):
            if cond is not None:
                mask = cond if mask is None else pc.and_(mask, cond)
        if mask is not None:
            table = table.filter(pc.fill_null(mask, False))
        if columns:
            table = table.select(columns)
        return with_staleness(table, stale)

    def index_files(self, kind: str = "checkpoints") -> list[str]:
        """Keys of the index files of ``kind``: "checkpoints" or "sessions" (per-session append files), or
        "table" (the compacted table's partition files, see :mod:`storage.table`)."""
        if kind == "table":
            return self.index.list_files(layout.TABLE_INDEX)
        if kind not in ("checkpoints", "sessions"):
            raise ValueError(f"index kind must be 'checkpoints', 'sessions' or 'table', got {kind!r}")
        return self.index.list_files(f"index/{kind}/")

    def compact(self, *, tombstone_grace: timedelta | None = None, users: list[str | None] | None = None
                ) -> CompactReport:
        """Merge each partition's files into one, dropping retired rows, and bring the compacted table
        (``index/table/``, deletes applied) up to date; incremental: only changed sessions are read.

        Safe with concurrent writers and concurrent compactions; tombstones
        younger than ``tombstone_grace`` (default one hour) stay (see
        :func:`storage.maintenance.compact`); ``users`` limits the work to
        those users (None = no user). Returns a
        :class:`storage.maintenance.IndexCompactReport`.
        """
        from storage.maintenance import compact

        return compact(self, tombstone_grace=tombstone_grace, users=users)

    def prune(self, before: datetime | None = None, session_id: str | None = None,
              user_id: str | None = None) -> PruneReport:
        """Delete checkpoints, journal entries and run records matching all filters (None = any), nothing else.

        With ``before``, what recovery of an unfinished last run needs stays,
        even for a run that starts while prune works, and the session's last
        run stays its last run (see :func:`storage.maintenance.prune`). Then
        the compacted table of every user in scope that has one is compacted
        (incrementally), so readers of the bucket no longer see pruned rows.
        """
        from storage.maintenance import compact, prune
        from storage.table import load_tables

        report = prune(self, before=before, session_id=session_id, user_id=user_id)
        try:
            prefix = layout.TABLE_INDEX if user_id is None else layout.table_user_prefix(user_id)
            users = [user_from_segment(seg) for seg, ut in load_tables(self, prefix).items()
                     if ut.manifest is not None or ut.parts]
            if users:
                compact(self, users=users)
        except StorageError as e:
            log.warning("prune done; the compacted table still shows pruned rows until the next compaction: %s", e)
        return report


_ACTIVE = "active/"


def _parse_fences(items: Any) -> list[tuple[int, tuple[int, str] | None]]:
    """``(epoch, top)`` of the well-formed checkpoint fences among ``items`` (lease.json is not trusted: the worst
    a forged fence does is hide or retire rows of older epochs, never resurrect one)."""
    out: list[tuple[int, tuple[int, str] | None]] = []
    for item in items if isinstance(items, list) else ():
        if not isinstance(item, dict):
            continue
        epoch, top = item.get("epoch"), item.get("top")
        if type(epoch) is not int or epoch < 1:
            continue
        if top is None:
            out.append((epoch, None))
        elif isinstance(top, list) and len(top) == 2 and type(top[0]) is int and isinstance(top[1], str):
            out.append((epoch, (top[0], top[1])))
    return out


def _fenced_by(fences: list[tuple[int, tuple[int, str] | None]]) -> Callable[[CheckpointRow], bool]:
    """True for a row of an epoch below a fence's that ranks above what that takeover listed before its swap."""
    if not fences:
        return lambda row: False
    return lambda row: row.epoch > 0 and any(row.epoch < k and (top is None or row.order > top) for k, top in fences)


def _active_key(session_id: str, user_id: str | None) -> str:
    return f"{_ACTIVE}{user_segment(user_id)}/{validate_id(session_id, 'session_id')}.json"


def _latest_sessions(rows: list[SessionRow]) -> list[SessionRow]:
    """Latest row per (user, session); a later row wins a tie on updated_at."""
    latest: dict[tuple[str | None, str], SessionRow] = {}
    for row in rows:  # rows arrive in file (write) order
        k = (row.user_id, row.session_id)
        if k not in latest or row.updated_at >= latest[k].updated_at:
            latest[k] = row
    return sorted(latest.values(), key=lambda r: r.updated_at, reverse=True)


__all__ = ["ANY", "Store"]
