"""``store.journal`` and ``store.runs``: a session's journal entries and run records (see :mod:`storage.journal`)."""

from __future__ import annotations

import builtins
from collections.abc import Collection
from typing import Any

from . import journal, layout
from .errors import ObjectNotFound
from .index import ParquetIndex
from .leases import LeaseKeeper
from .objects import ObjectStore
from .rows import JournalEntry, Lease, RunRecord


class Journal:
    """A store's journal (``store.journal``): create-only entries per run, and the seals that fence old writers."""

    def __init__(self, objects: ObjectStore, index: ParquetIndex, leases: LeaseKeeper) -> None:
        self.objects = objects
        #: The index's reader threads read many entries at once (the journal functions' ``JournalStore``).
        self._index = index
        self._leases = leases

    def append(self, entry: JournalEntry, *, lease: Lease | None = None) -> None:
        """Create-only write of one journal entry; PreconditionFailed if that (run, seq, step) exists.

        With ``lease`` the lease is checked first (one GET) and the entry takes
        its epoch. A running loop passes none: its entries carry their epoch and
        the seal of the next incarnation fences them (see :mod:`storage.journal`),
        so a step costs one PUT.
        """
        key = layout.journal_key(entry.session_id, entry.user_id, entry.run_id, entry.seq, entry.step_key)
        epoch = self._leases.fence(lease, entry.session_id, entry.user_id)
        if lease is not None and entry.epoch != epoch:
            entry = entry.model_copy(update={"epoch": epoch})
        self.objects.put(key=key, data=entry.__pydantic_serializer__.to_json(entry), if_none_match=True)

    def read(self, session_id: str, run_id: str, *, user_id: str | None = None) -> journal.JournalRun:
        """The run's journal: every readable entry by key, fenced ones included (``.entries`` drops them)."""
        return journal.read_run(self, session_id, run_id, user_id)

    def list(self, session_id: str, run_id: str, *, user_id: str | None = None,
             include_fenced: bool = False) -> builtins.list[JournalEntry]:
        """The run's entries by seq, without those a seal fenced (unless ``include_fenced``).

        Unreadable entries, and entries whose ids do not match their key, are skipped with a warning.
        """
        run = journal.read_run(self, session_id, run_id, user_id)
        return run.all if include_fenced else run.entries

    def keys(self, session_id: str, run_id: str, *, user_id: str | None = None) -> frozenset[str]:
        """Keys of the run's entries (one LIST): what a new incarnation lists before taking the lease."""
        return journal.journal_keys(self, session_id, run_id, user_id)

    def seal(self, session_id: str, run_id: str, *, user_id: str | None = None, lease: Lease,
             seen_before: Collection[str] | None = None,
             known: journal.JournalRun | None = None) -> journal.JournalRun:
        """Seal the run for ``lease``'s incarnation (fences older writers) and return its journal, seal included."""
        return journal.seal_run(self, session_id, run_id, user_id, lease, seen_before=seen_before,
                                known=known)

    def seal_listed(self, session_id: str, run_id: str, *, user_id: str | None = None, lease: Lease,
                    listed: Collection[str]) -> JournalEntry:
        """Seal the run right after taking ``lease``, above the keys ``listed`` before it (one PUT)."""
        return journal.seal_listed(self, session_id, run_id, user_id, lease, listed)

    def listing(self, session_id: str, *, user_id: str | None = None,
                run_id: str | None = None) -> journal.Listing:
        """What a new owner lists right before its lease swap to fence the session's last run (and ``run_id``)."""
        return journal.list_for_fence(self, session_id, user_id, run_id)

    def complete_fences(self, session_id: str, *, user_id: str | None = None,
                        chain: builtins.list[dict[str, Any]], listed: dict[str, Collection[str]]) -> int:
        """Write the seals earlier owners recorded in the lease but did not write (see ``journal.FenceNote``)."""
        return journal.complete_fences(self, session_id, user_id, chain, listed)

    def runs(self, session_id: str, *, user_id: str | None = None) -> builtins.list[str]:
        """Run ids with journal entries, sorted (not run order: see :meth:`Runs.last`)."""
        return self.objects.list_dirs(prefix=layout.journal_prefix(session_id, user_id))


class Runs:
    """A store's run records (``store.runs``): one object per run, in store order (see :class:`RunRecord`)."""

    def __init__(self, objects: ObjectStore, index: ParquetIndex) -> None:
        self.objects = objects
        self._index = index

    def create(self, session_id: str, *, user_id: str | None = None, run_id: str,
               request: dict[str, Any] | None = None, spec_hash: str = "", base_session_id: str | None = None,
               base_checkpoint_id: str | None = None, replay_from: str | None = None,
               epoch: int = 0) -> RunRecord:
        """Record a run starting now at the session's next store-sequenced slot (see :class:`RunRecord`).

        A run that starts from a checkpoint looks for its object once more right
        after its record landed (one LIST): :class:`ObjectNotFound` when a
        concurrent prune deleted it, so the run stops before its first step
        (docs/design.md "Prune and a run that starts meanwhile").
        """
        rec = journal.create_run(self, session_id, user_id, run_id=run_id, request=request, spec_hash=spec_hash,
                                 base_session_id=base_session_id, base_checkpoint_id=base_checkpoint_id,
                                 replay_from=replay_from, epoch=epoch)
        if rec.base_checkpoint_id is not None:
            source = rec.base_session_id or session_id
            key = layout.checkpoint_key(source, user_id, rec.base_checkpoint_id)
            if not any(o.key == key for o in self.objects.list(prefix=key)):
                raise ObjectNotFound(f"{self.objects.describe(key)}: checkpoint {rec.base_checkpoint_id!r} of "
                                     f"session {source!r}, where run {run_id} starts, was deleted (pruned) before "
                                     "the run was recorded; start from another checkpoint")
        return rec

    def last(self, session_id: str, *, user_id: str | None = None) -> RunRecord | None:
        """The session's last run by store order; None for a session without run records."""
        return journal.last_run(self, session_id, user_id)

    def list(self, session_id: str, *, user_id: str | None = None) -> builtins.list[RunRecord]:
        """The session's run records in store order."""
        return journal.list_runs(self, session_id, user_id)
