"""``store.leases``: take, repair and check a session's lease (the epochs that fence older writers).

The protocol itself (epoch markers, the compare-and-swap of ``lease.json``,
the fence of the checkpoint index) is :class:`storage.leases.LeaseKeeper`'s;
this is the part callers use.
"""

from __future__ import annotations

from .leases import LEASE_TIMEOUT, LeaseKeeper, LeaseNote
from .rows import Lease


class Leases:
    """A store's session leases (``store.leases``); see docs/contracts.md. Thread-safe."""

    def __init__(self, keeper: LeaseKeeper) -> None:
        self._keeper = keeper

    def acquire(self, session_id: str, *, user_id: str | None = None, owner: str,
                timeout: float = LEASE_TIMEOUT, note: LeaseNote | None = None) -> Lease:
        """Take the session's lease: the next epoch, with a conditional write that fences every older holder.

        Epochs rise strictly for the life of a session, whatever happens to
        ``lease.json``. An acquire first claims its epoch ``n`` with a
        create-only marker ``epochs/{n}``, then swaps ``lease.json`` to ``n``
        (compare-and-swap on the ETag it read, or create-only when it read
        none). So every epoch that ever reaches ``lease.json`` had its marker
        first, and markers are claimed in epoch order without gaps: when
        ``lease.json`` is missing, the highest marker is a floor above every
        epoch granted so far (see :meth:`LeaseKeeper.epoch_floor`). A marker that already
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
        before anything is written (repair: :meth:`repair`). Contention
        is retried with exponential backoff and full jitter for up to
        ``timeout`` seconds, then :class:`LeaseLostError`. Right before its
        swap an acquire lists the session's checkpoint index, and right after
        it retires the rows a fenced writer landed since (see
        :mod:`storage.fencing`). Cost: one GET, two PUTs (marker, lease)
        and three LISTs of the checkpoint index (one reads it ahead, with GETs
        of the index files this Store has not read yet), plus two LISTs when
        ``lease.json`` does not exist (a new session).

        ``note`` (the journal's fencing, :mod:`storage.journal`) is called with
        the lease body being replaced (a dict, or None) right before each swap,
        and its JSON result is stored in the new body under ``"note"``: written
        by the very swap that takes the epoch, so it exists exactly when the
        epoch was taken.
        """
        return self._keeper.take(session_id, user_id, str(owner), timeout, repair=False, note=note)

    def repair(self, session_id: str, *, user_id: str | None = None, owner: str = "lease repair",
               timeout: float = LEASE_TIMEOUT) -> Lease:
        """Rewrite a corrupt or missing ``lease.json`` above every epoch the session used; returns that new lease.

        The new epoch fences every holder, so a running writer stops at its next
        lease check and the session's next incarnation takes the epoch after it.
        On a healthy lease this is :meth:`acquire`.
        """
        return self._keeper.take(session_id, user_id, str(owner), timeout, repair=True)

    def current_epoch(self, session_id: str, *, user_id: str | None = None) -> int:
        """The session's lease epoch; 0 when it was never leased.

        When ``lease.json`` is missing, the highest epoch marker (the last
        epoch claimed: its holder, or an acquire under way, which fences every
        older holder anyway). :class:`LeaseCorruptError` when ``lease.json`` is
        unreadable.
        """
        return self._keeper.current_epoch(session_id, user_id)

    def check(self, lease: Lease) -> None:
        """Raise :class:`LeaseLostError` if a newer epoch has taken the session."""
        self._keeper.check(lease)
