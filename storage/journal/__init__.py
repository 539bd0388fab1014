"""The journal's storage side: step entries, fencing seals and store-sequenced run records.

Objects, under ``sessions/{user or _}/{session_id}/``::

    journal/{run_id}/{seq:08d}-{step_key}.json   one create-only entry per step (JournalEntry)
    runs/{n:08d}.json                            one create-only record per run start (RunRecord)

Fencing. An append carries its writer's epoch but does not read the lease
(no round trip per step). Instead a new owner *seals* the runs an old writer
may still append to: it lists the session's last run before taking the
lease, and right after taking it writes a create-only ``seal`` entry with its
epoch at ``max(seq) + 1`` of that listing (:func:`seal_listed`, one PUT).
Replay uses an entry of epoch ``e`` only if, for every seal of an epoch
above ``e``, its seq is below the seal's and is not one of the seal's
``missing`` seqs. A writer takes its seqs in rising order, but its appends
may be in flight together (a pass's tool results are appended concurrently),
so one whose seq was taken before the listing may land after it, below the
listed max: the seal names the seqs below its own that the listing lacked
(``missing``, as ``[lo, hi]`` ranges; see :func:`missing_ranges`), and an
older-epoch entry found at one of them later is ignored like one above the
seal. Everything the old writer appends after the listing is therefore
ignored (a step journaled inside the listing window is re-executed: the
price of not reading the lease per step). A run found only after the lease
is sealed above a fresh listing, naming in its ``excluded`` list the
older-epoch entries the earlier listing did not show (:func:`seal_run`).
The listing also rides in the lease swap itself (:class:`FenceNote`), so a
new owner that dies between its lease and its seal is fenced for by the
next one (:func:`complete_fences`).

Run order. Starting a run writes a create-only record at the next free slot
``n``: the store sequences a session's runs, so its last run is the highest
``n`` whatever the nodes' clocks say. Sessions written before run records
existed (no ``runs/``) fall back to their journal's run ids in sorted order.

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
from ..journal.runs import Unfinished, create_run, last_run, last_run_window, list_runs, unfinished_last_run

__all__ = ["RUN_END", "RUN_START", "SEAL", "FenceNote", "JournalRun", "Listing", "Unfinished", "complete_fences",
           "create_run", "entry_name", "fenced_names", "journal_keys", "last_run", "last_run_window", "list_for_fence",
           "list_runs", "load_entries", "missing_ranges", "read_run", "seal_listed", "seal_run", "unfinished_last_run"]
