"""The rows a session's writer may build its next checkpoint on, whatever retired them: what prune, delete and
the release of a fork's pins keep the chains of (docs/design.md "Checkpoints: incremental objects in chains").

A running writer builds its next incremental checkpoint on the last one it
wrote (its *head*) even after a prune or delete from another process retired
that row: the objects the head's chain names (in its session, and in the
sessions it forked from, which its pins hold) must stay while the run goes on.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .journal import last_journal_run
from .rows import CheckpointRow

if TYPE_CHECKING:
    from .store import Store
    from .tails import Snapshot


def last_run_unfinished(store: Store, session_id: str, user_id: str | None) -> bool | None:
    """Whether the session's last run (by record, else by journal) has not finished; None when nothing tells: no
    run, or a journal without its start and record (what a prune without ``before`` leaves of a run going on)."""
    rec, run = last_journal_run(store, session_id, user_id)
    if run is None:
        return None
    if run.finished:
        return False
    return None if rec is None and run.start is None else True


def writer_heads(snap: Snapshot, unfinished: bool | None) -> list[CheckpointRow]:
    """The rows a writer of ``snap``'s session may build its next checkpoint on (:attr:`Snapshot.heads`, retired
    or not) while its last run is ``unfinished``; none once it finished (a run that starts later checks its base
    after recording itself) or when nothing tells (None): then the heads a prune kept for a run it deleted the
    records of are held by the session's writer pin (:meth:`storage.chains.Pins.write_writer`)."""
    return snap.heads if unfinished else []


def writer_rows(store: Store, session_id: str, user_id: str | None) -> list[CheckpointRow]:
    """The rows of a session its writer may build its next checkpoint on besides its indexed live ones: its tail
    and :func:`writer_heads`. The run is looked at before the rows, so the rows of a run that finishes meanwhile
    are in the look (live or tail)."""
    unfinished = last_run_unfinished(store, session_id, user_id)
    snap = store.checkpoints.snapshot(session_id, user_id=user_id)
    return [*snap.tails.values(), *writer_heads(snap, unfinished)]
