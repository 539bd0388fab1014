"""The journal's storage side: step entries, fencing seals and store-sequenced run records.

Objects, under ``sessions/{user or _}/{session_id}/``::

    journal/{run_id}/{seq:08d}-{step_key}.json   one create-only entry per step (JournalEntry)
    runs/{n:08d}.json                            one create-only record per run start (RunRecord)

Fencing (a new owner *seals* the runs an old writer may still append to,
naming the seqs its listing lacked, :func:`seal_listed`, :func:`seal_run`,
:func:`complete_fences`) and run order (the highest create-only ``runs/{n}``)
are described in docs/design.md, "Ownership and fencing".

Entry kinds storage interprets: ``run_start`` (its output may name
``base_checkpoint_id``, ``source_session`` and ``replay_from``), ``run_end``
(the run finished) and ``seal``; every other kind is opaque here.
"""

from ..journal.entries import (
    RUN_END,
    RUN_START,
    SEAL,
    JournalRun,
    entry_name,
    fenced_names,
    journal_keys,
    load_entries,
    missing_ranges,
    read_run,
    seal_listed,
    seal_run,
)
from ..journal.fences import FenceNote, Listing, complete_fences, list_for_fence
from ..journal.runs import (
    Unfinished,
    create_run,
    last_journal_run,
    last_run,
    last_run_window,
    list_runs,
    unfinished_last_run,
)

__all__ = ["RUN_END", "RUN_START", "SEAL", "FenceNote", "JournalRun", "Listing", "Unfinished", "complete_fences",
           "create_run", "entry_name", "fenced_names", "journal_keys", "last_journal_run", "last_run", "last_run_window", "list_for_fence",
           "list_runs", "load_entries", "missing_ranges", "read_run", "seal_listed", "seal_run", "unfinished_last_run"]
