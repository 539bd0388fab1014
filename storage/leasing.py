"""``store.leases``: take, repair and check a session's lease (the epochs that fence older writers)."""

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

        The protocol (epoch marker, then compare-and-swap of ``lease.json``) and
        its cost are in docs/design.md "Taking the lease". Contention is retried
        with backoff for up to ``timeout`` seconds, then :class:`LeaseLostError`;
        an unreadable ``lease.json`` raises :class:`LeaseCorruptError` before
        anything is written (see :meth:`repair`). ``note`` is called with the
        body being replaced right before each swap; its JSON result is stored
        under ``"note"`` by the very swap that takes the epoch.
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
