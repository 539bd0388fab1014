"""A lease holder's checkpoint writes, at one PUT each: rows, retention and the lease re-check come in batches.

Every writer writes through a :class:`CheckpointLog` (``store.checkpoints.log``;
a batch of one acknowledges each write). A put is one PUT of a
self-describing object (:mod:`storage.envelope`), recoverable once it returns;
every ``batch`` puts, and on flush, the writer proves its lease and only then
indexes the pending rows with retention's tombstones in one file. A fenced
writer may land up to ``batch`` objects but indexes none and retires nothing
any reader honours. The protocol and why it holds: docs/design.md
"Ownership and fencing" and docs/contracts.md (the checkpoint log).
"""

from __future__ import annotations

import hashlib
import logging
from dataclasses import replace

from . import envelope, layout
from .checkpoint_rows import CheckpointRows, over_keep
from .envelope import header_of_row
from .errors import LeaseCorruptError, LeaseLostError, StorageError
from .ids import validate_id
from .leases import LeaseKeeper
from .rows import CheckpointInfo, CheckpointRow, Lease, as_utc

log = logging.getLogger("storage")
#: Checkpoints a log writes before it indexes them and re-checks its lease.
INDEX_BATCH = 16
#: Flushes between full LISTs of the session's rows (the log's view of them is refreshed).
_VIEW_REFRESH = 32


_INT64 = range(-(2**63), 2**63)


def _check_values(row: CheckpointRow) -> None:
    """``TypeError``/``ValueError`` for a row value the Parquet index cannot hold (checked in Python: encoding
    the row with Arrow on every put would cost more than the put)."""
    for name in ("turn", "message_count", "input_tokens", "output_tokens"):
        value = getattr(row, name)
        if type(value) is not int:
            raise TypeError(f"checkpoint {name} must be an int, got {type(value).__name__}")
        if value not in _INT64:
            raise ValueError(f"checkpoint {name}={value} does not fit a 64-bit index column")
    for name in ("cost_usd", "spend_usd"):
        value = getattr(row, name)
        if value is not None and type(value) not in (int, float):
            raise TypeError(f"checkpoint {name} must be a number or None, got {type(value).__name__}")
    for name in ("position", "execution_status"):
        if not isinstance(getattr(row, name), str):
            raise TypeError(f"checkpoint {name} must be a str, got {type(getattr(row, name)).__name__}")


class CheckpointLog:
    """One lease holder's checkpoint writes to one session (see the module docstring). Not thread-safe: one
    writer calls it, in order."""

    def __init__(self, rows: CheckpointRows, leases: LeaseKeeper, lease: Lease, *, keep: int = 20,
                 batch: int = INDEX_BATCH) -> None:
        if batch < 1:
            raise ValueError(f"batch must be >= 1, got {batch!r}")
        self._rows, self._leases, self.lease = rows, leases, lease
        self.keep, self.batch = keep, batch
        #: Written, not yet acknowledged (indexed or not), oldest first.
        self.pending: list[CheckpointRow] = []
        self._unindexed = 0
        self._view: dict[str, CheckpointRow] | None = None
        #: Rows this writer's tombstones retired whose objects wait for the next proof (see :meth:`flush`).
        self._unsettled: list[CheckpointRow] = []
        self._flushes = 0

    def put(self, data: bytes, info: CheckpointInfo) -> list[CheckpointRow]:
        """Write one checkpoint object (``data``: the caller's JSON object); the rows this call acknowledged
        (a batch was due), usually none. :class:`LeaseLostError` when a batch found this writer fenced."""
        if not isinstance(info, CheckpointInfo):
            raise TypeError(f"checkpoint info must be a CheckpointInfo, got {type(info).__name__}")
        if info.session_id != self.lease.session_id or info.user_id != self.lease.user_id:
            raise LeaseLostError(f"lease for session {self.lease.session_id!r}/user {self.lease.user_id!r} used to "
                                 f"write session {info.session_id!r}/user {info.user_id!r}")
        key = layout.checkpoint_key(info.session_id, info.user_id, info.checkpoint_id)  # validates the ids
        for name in ("parent_checkpoint_id", "forked_from", "agent_id"):
            if getattr(info, name) is not None:
                validate_id(getattr(info, name), name)
        info = replace(info, created_at=as_utc(info.created_at))
        draft = CheckpointRow(**{n: getattr(info, n) for n in envelope.INFO_FIELDS}, epoch=self.lease.epoch, key=key,
                              size=0, sha256="")
        _check_values(draft)  # a value the index cannot hold fails before anything lands
        obj = envelope.wrap(data, header_of_row(draft))
        self._rows.wrote(key, self._rows.objects.put(key=key, data=obj))
        self.pending.append(replace(draft, size=len(obj), sha256=hashlib.sha256(obj).hexdigest()))
        self._unindexed += 1
        if self._unindexed < self.batch:
            return []
        try:
            return self.flush()
        except (LeaseLostError, LeaseCorruptError):
            raise  # fenced, or ownership unprovable: the caller stops
        except StorageError as e:  # the checkpoint itself landed; its row goes with the next batch
            log.warning("session %r: checkpoint index not written yet (%s); retried with the next checkpoint",
                        self.lease.session_id, e)
            return []

    def flush(self) -> list[CheckpointRow]:
        """Prove the lease, then index the pending rows (one file, with retention's tombstones) and collect what
        the previous flush's retention freed; returns the rows acknowledged (every pending one). Safe to call
        again after a storage error: what was not indexed is indexed next time.

        The proof comes first because a takeover claims its epoch before it lists the session: it saw every
        object of a proven batch. The tombstones carry this writer's epoch and newest checkpoint
        (``retired_by``) so a takeover between proof and write makes readers ignore them (visibility rule 5);
        hence the objects they retire are deleted only after the next proof, which settles them.
        """
        if not self.pending:
            return []
        try:
            self._leases.confirm(self.lease, read_lease=True)
        except LeaseLostError:
            self._abandon()
            raise
        self._collect_settled()  # the proof above settled the tombstones the last flush wrote
        view = self._current_view()
        fresh = self.pending[len(self.pending) - self._unindexed:] if self._unindexed else []
        live = {**view, **{r.checkpoint_id: r for r in self.pending}}
        doomed = over_keep(live, self.keep)
        if fresh or doomed:
            self._rows.write(self.lease.session_id, self.lease.user_id, [*fresh, *doomed],
                             tombstone=[False] * len(fresh) + [True] * len(doomed),
                             retired_by=max(r.order for r in self.pending))
        self._unindexed = 0
        acked, self.pending = self.pending, []
        for r in doomed:
            live.pop(r.checkpoint_id, None)
        self._view = live
        self._unsettled += doomed
        return acked

    def _collect_settled(self) -> None:
        """Delete what the tombstones of earlier flushes retired, now that a proof came after them (they are
        honoured by every reader from now on); what a storage error left is collected by a later sweep."""
        if not self._unsettled:
            return
        retired, self._unsettled = self._unsettled, []
        try:
            self._rows.collect(self.lease.session_id, self.lease.user_id, retired, live=self._view,
                               also_needed=self.pending)
        except StorageError as e:
            log.warning("retention of session %r: objects not collected yet (%s)", self.lease.session_id, e)

    def _current_view(self) -> dict[str, CheckpointRow]:
        """The session's live rows (indexed), from a fresh LIST on the first flush and every ``_VIEW_REFRESH``;
        each refresh also collects what earlier collections left behind (:meth:`CheckpointRows.sweep`), after
        the flush's proof: every tombstone it honours is settled then."""
        self._flushes += 1
        if self._view is None or self._flushes % _VIEW_REFRESH == 0:
            try:
                self._view = self._rows.sweep(self.lease.session_id, self.lease.user_id, also_needed=self.pending)
            except StorageError as e:
                log.warning("session %r: left-over objects not collected (%s)", self.lease.session_id, e)
                self._view = self._rows.live(self.lease.session_id, self.lease.user_id)
        return self._view

    def _abandon(self) -> None:
        """Fenced: forget what was not acknowledged. Nothing is retired: what landed before the takeover's
        listing is what the new owner may have started from, and what landed after it is hidden by the
        takeover's fence (``lease.json``) and retired by the next takeover. The objects of the last flush's
        retirement stay: its tombstones may be ignored (the new owner's sweep collects them if they are not)."""
        self._unsettled = []
        log.warning("session %r: %d checkpoint(s) written by epoch %d were never acknowledged: a newer epoch "
                    "was taken", self.lease.session_id, len(self.pending), self.lease.epoch)
        self.pending, self._unindexed = [], 0
