"""Fencing a session: take its lease and seal the runs an older owner may still append to.

Both a run's takeover (:mod:`loomray.takeover`) and ``loomray cancel`` fence. The runs an older writer may
append to are listed right before the lease swap and sealed right after it (:mod:`storage.journal`), so
whatever it appends from then on is never replayed.
"""

from __future__ import annotations

from loomray.run_request import RunRequest
from loomray.session_store import SessionStore
from loomray.storage.journal import FenceNote
from loomray.storage.rows import Lease


def take_lease(store: SessionStore, request: RunRequest, owner: str) -> tuple[Lease, FenceNote]:
    """Take the session's lease; the note holds the listing the swap recorded and the predecessors' fences.

    The session's last run and the run the request names are listed right before the lease swap (what the
    seals go above) and recorded by that swap, so the fence survives this process dying before it seals.
    """
    fence = FenceNote(lambda: store.journal.listing(request.session_id, user_id=request.user_id,
                                                    run_id=request.run_id))
    lease = store.leases.acquire(request.session_id, user_id=request.user_id, owner=owner, note=fence)
    return lease, fence


def fence_session(store: SessionStore, session_id: str, user_id: str | None, *, owner: str) -> Lease:
    """Take the session's lease and seal the runs its old owner may still append to, running nothing (what
    ``loomray cancel`` does): afterwards nothing an older writer does is durable. Returns the lease."""
    lease, fence = take_lease(store, RunRequest(session_id=session_id, user_id=user_id), owner)
    seal_listed(store, session_id, user_id, lease, fence)
    return lease


def seal_listed(store: SessionStore, sid: str, uid: str | None, lease: Lease, fence: FenceNote) -> set[str]:
    """Seal the runs the pre-lease listing showed (one PUT per run) and write the seals earlier owners
    recorded in the lease but never wrote; return the sealed run ids."""
    for run_id, keys in fence.listing.runs.items():
        store.journal.seal_listed(sid, run_id, user_id=uid, lease=lease, listed=keys)
    if fence.chain:
        store.journal.complete_fences(sid, user_id=uid, chain=fence.chain, listed=dict(fence.listing.runs))
    return set(fence.listing.runs)
