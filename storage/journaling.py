"""The :class:`~storage.store.Store`'s journal and run-record operations (the storage side: :mod:`storage.journal`)."""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

from storage import journal, layout
from storage.errors import ObjectNotFound
from storage.index import ParquetIndex
from storage.leases import Leases
from storage.objects import ObjectStore
from storage.rows import JournalEntry, Lease, RunRecord


class JournalMethods:
    """Journal and run-record operations of :class:`~storage.store.Store`."""

    objects: ObjectStore
    index: ParquetIndex
    _leases: Leases

    def journal_append(self, entry: JournalEntry, *, lease: Lease | None = None) -> None:
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
                     seen_before: Collection[str] | None = None,
                     known: journal.JournalRun | None = None) -> journal.JournalRun:
        """Seal the run for ``lease``'s incarnation (fences older writers) and return its journal, seal included."""
        return journal.seal_run(self, session_id, run_id, user_id, lease, seen_before=seen_before,
                                known=known)

    def journal_seal_listed(self, session_id: str, run_id: str, *, user_id: str | None = None, lease: Lease,
                            listed: Collection[str]) -> JournalEntry:
        """Seal the run right after taking ``lease``, above the keys ``listed`` before it (one PUT)."""
        return journal.seal_listed(self, session_id, run_id, user_id, lease, listed)

    def journal_listing(self, session_id: str, *, user_id: str | None = None,
                        run_id: str | None = None) -> journal.Listing:
        """What a new owner lists right before its lease swap to fence the session's last run (and ``run_id``)."""
        return journal.list_for_fence(self, session_id, user_id, run_id)

    def journal_complete_fences(self, session_id: str, *, user_id: str | None = None, chain: list[dict[str, Any]],
                                listed: dict[str, Collection[str]]) -> int:
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
        (see :func:`storage.pruning.prune`): so either prune saw this
        record, or this look sees the deletion, and a run never works from a
        base that prune deletes (its recovery would restart from that base).
        """
        rec = journal.create_run(self, session_id, user_id, run_id=run_id, **fields)
        if rec.base_checkpoint_id is not None:
            source = rec.base_session_id or session_id
            key = layout.checkpoint_key(source, user_id, rec.base_checkpoint_id)
            if not any(o.key == key for o in self.objects.list(prefix=key)):
                raise ObjectNotFound(f"{self.objects.describe(key)}: checkpoint {rec.base_checkpoint_id!r} of "
                                     f"session {source!r}, where run {run_id} starts, was deleted (pruned) before "
                                     "the run was recorded; start from another checkpoint")
        return rec

    def last_run(self, session_id: str, *, user_id: str | None = None) -> RunRecord | None:
        """The session's last run by store order; None for a session without run records."""
        return journal.last_run(self, session_id, user_id)

    def list_runs(self, session_id: str, *, user_id: str | None = None) -> list[RunRecord]:
        """The session's run records in store order."""
        return journal.list_runs(self, session_id, user_id)
