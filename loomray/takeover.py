"""What a new owner of a session does before a run's first step: fence, read, plan, record, prove.

The runs an older writer may append to were listed right before the lease swap and are sealed right after
it (:mod:`storage.journal`), so nothing it appends from then on is replayed. Then the takeover reads what
:func:`loomray.planning.decide` (pure code) asks for until it has a plan, records the run, and proves the
lease before the run's first step.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

from loomray.checkpoint_format import load_checkpoint
from loomray.errors import CheckpointException
from loomray.fencing import seal_listed
from loomray.planning import Read, RunPlan, SessionReads, decide
from loomray.records import Checkpoint
from loomray.recovery import CheckpointRef, LastRun, last_run_of, run_to_continue
from loomray.run_request import RunRequest
from loomray.session_store import SessionStore
from loomray.storage.errors import ObjectNotFound, StorageError
from loomray.storage.journal import FenceNote, JournalRun
from loomray.storage.rows import JournalEntry, Lease

#: The session's logger: a run's warnings keep one name, whichever module logs them.
log = logging.getLogger("loomray.session")

#: The journal keys of each run the pre-lease listing showed (run id -> keys).
Seen = dict[str, frozenset[str]]


def _seen_keys(seen: Seen, run_id: str) -> frozenset[str]:
    """The run's keys in the pre-lease listing (a run it did not show was empty then)."""
    return seen.get(run_id, frozenset())


def read_last_run(store: SessionStore, sid: str, uid: str | None, lease: Lease, seen: Seen,
                  sealed: set[str]) -> tuple[LastRun, Sequence[str] | None]:
    """The session's last run as replay will see it once this incarnation sealed it, and the session's
    journal runs when they had to be listed to find it (None: the run record named it)."""
    record = store.runs.last(sid, user_id=uid)
    runs: Sequence[str] | None = None
    if record is not None:
        run_id: str | None = record.run_id
    else:
        runs = store.journal.runs(sid, user_id=uid)
        run_id = runs[-1] if runs else None
    journal = store.journal.read(sid, run_id, user_id=uid) if run_id is not None else None
    unsealed = run_id is not None and run_id not in sealed  # not sealed yet: judge it as its seal will make it
    return last_run_of(record, journal, lease=lease if unsealed else None,
                       seen_before=_seen_keys(seen, run_id) if run_id is not None else ()), runs


def plan_takeover(store: SessionStore, request: RunRequest, lease: Lease, fence: FenceNote,
                  new_run_id: Callable[[], str]) -> RunPlan:
    """Fence, read and plan the run ``request`` asks for, record it, and prove the lease; see the module."""
    sid, uid = request.session_id, request.user_id
    seen = dict(fence.listing.runs)
    sealed = seal_listed(store, sid, uid, lease, fence)
    last, listed = read_last_run(store, sid, uid, lease, seen, sealed)
    known: Sequence[str] = ()
    if request.run_id is not None and request.run_id != last.run_id:
        # A listing read_last_run just made is as good as a second one: nothing was written in between
        # (a fresh fork, no run record yet, names its run: listing twice was one store call per branch).
        known = listed if listed is not None else store.journal.runs(sid, user_id=uid)
    run_id, request = run_to_continue(request, last, known)
    journal = _seal_runs(store, request, lease, seen, sealed, last, run_id)
    reads = SessionReads(request, run_id or request.run_id or new_run_id(), last, journal)
    while not isinstance(step := decide(reads), RunPlan):
        reads = reads.with_read(step, _read(store, step, request))
    plan = step
    if last.record is None or last.record.run_id != plan.run_id:
        _record_run(store, plan, lease.epoch)
    # Appends do not read the lease, so prove ownership once before the first step: a takeover that
    # listed the session before this plan's record landed (and so could not seal the run it is about
    # to start) took the lease before this read, which then fences this writer here.
    store.leases.check(lease)
    return plan


def _seal_runs(store: SessionStore, request: RunRequest, lease: Lease, seen: Seen, sealed: set[str], last: LastRun,
               run_id: str | None) -> JournalRun | None:
    """Seal the runs an old incarnation may still append to; returns the continued run's journal, as sealed
    (None: the request starts a new run)."""
    sid, uid = request.session_id, request.user_id
    if last.unfinished and last.run_id not in sealed and last.run_id != run_id:
        assert last.run_id is not None
        # Not continued by this request: its old incarnation may still append; fence it.
        store.journal.seal(sid, last.run_id, user_id=uid, lease=lease, seen_before=_seen_keys(seen, last.run_id),
                           known=last.journal)
    if run_id is None:
        return None
    known_journal = last.journal if run_id == last.run_id else None
    if run_id not in sealed:
        return store.journal.seal(sid, run_id, user_id=uid, lease=lease, seen_before=_seen_keys(seen, run_id),
                                  known=known_journal)
    return known_journal if known_journal is not None else store.journal.read(sid, run_id, user_id=uid)


def _read(store: SessionStore, ref: Read, request: RunRequest) -> Checkpoint | list[JournalEntry] | None:
    """What ``ref`` names, read for ``request``'s run."""
    uid = request.user_id
    if isinstance(ref, CheckpointRef):
        return _load(store, ref, uid, request.session_id)
    if not ref.optional:
        return store.journal.list(ref.session_id, ref.run_id, user_id=uid)
    try:
        return store.journal.list(ref.session_id, ref.run_id, user_id=uid)
    except Exception as e:  # the journal is an optimisation here: without it the tools run again
        log.warning("could not read journal of run %s of session %r: %s", ref.run_id, ref.session_id, e)
        return []


def _load(store: SessionStore, ref: CheckpointRef | None, user_id: str | None,
          for_session: str | None = None) -> Checkpoint | None:
    """The checkpoint ``ref`` names, or None (also for no ref); a failed load is a ``CheckpointException``.

    A checkpoint of another session (a fork's start) is pinned for ``for_session`` first: the fork's
    checkpoints build on its chain, which the other session's retention and prune then keep.
    """
    if ref is None:
        return None
    pinned = for_session if ref.session_id != for_session and ref.checkpoint_id != "latest" else None
    look = None
    if pinned is not None:
        try:
            # The look that found the fork point live after the pin landed is the one it is read from.
            _, look = store.checkpoints.pin_and_look(ref.session_id, ref.checkpoint_id, user_id=user_id,
                                                     dependent=pinned)
        except ObjectNotFound:
            return None  # retired meanwhile: the fork finds no checkpoint to start from
        except StorageError as e:
            raise CheckpointException(f"checkpoint {ref.checkpoint_id!r} of session {ref.session_id!r} could not "
                                      f"be pinned for fork {for_session!r}: {e}") from e
    return load_checkpoint(store, ref.session_id, ref.checkpoint_id, user_id=user_id, pinned_for=pinned,
                           snapshot=look)


def _record_run(store: SessionStore, plan: RunPlan, epoch: int) -> None:
    """Record the run at the session's next store-sequenced slot, its request and base beside it."""
    request, out = plan.request, plan.start_output
    base = out.get("base_checkpoint_id")
    store.runs.create(request.session_id, user_id=request.user_id, run_id=plan.run_id, request=request.stored_json(),
                     spec_hash=request.spec_hash(), base_session_id=out.get("source_session") if base else None,
                     base_checkpoint_id=base, replay_from=out.get("replay_from"), epoch=epoch)
