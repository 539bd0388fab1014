"""Fences carried by the lease swap: what a new owner lists, records in ``lease.json`` and seals.

A new owner lists the runs an old writer may still append to right before
its lease swap (:func:`list_for_fence`), records that listing in the very
swap that takes the epoch (:class:`FenceNote`), and writes the seals that
the owners before it recorded but did not write (:func:`complete_fences`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from typing import Any

from .. import layout
from ..errors import InvalidIdError
from ..ids import validate_id
from ..journal.entries import SEAL, JournalStore, journal_keys, missing_ranges, parse_ranges, put_seal, seqs_of
from ..journal.runs import last_run, read_records, record_slots
from ..rows import JournalEntry, RunRecord

log = logging.getLogger("storage")

#: Earlier owners' fences a lease body carries (see :class:`FenceNote`).
_FENCE_CHAIN = 8


@dataclass(frozen=True)
class Listing:
    """What a new owner lists right before its lease swap: the journal keys of the runs it must fence,
    and the highest run record slot then (runs recorded later were started after the listing)."""

    runs: dict[str, frozenset[str]] = field(default_factory=dict)
    top_record: int = -1


def list_for_fence(store: JournalStore, session_id: str, user_id: str | None, run_id: str | None = None) -> Listing:
    """The :class:`Listing` of the session: its last run (and ``run_id``, when it has entries)."""
    slots = record_slots(store, session_id, user_id)
    last = None
    if slots:
        rec = last_run(store, session_id, user_id, slots=slots)
        last = rec.run_id if rec is not None else None
    else:
        runs = store.objects.list_dirs(prefix=layout.journal_prefix(session_id, user_id))
        last = runs[-1] if runs else None
    listing = {last: journal_keys(store, session_id, last, user_id)} if last is not None else {}
    if run_id is not None and run_id not in listing:
        keys = journal_keys(store, session_id, run_id, user_id)
        if keys:
            listing[run_id] = keys
    return Listing(listing, slots[-1][0] if slots else -1)


class FenceNote:
    """What a new owner's lease swap records, so that its fence survives it (``store.leases.acquire(note=...)``).

    A crash between taking the lease and sealing would leave the old writer
    unfenced, so the lease body, written by the very swap that takes the
    epoch, holds the listing (``runs``: run id -> highest seq seen;
    ``missing``: the seqs below it the listing lacked; ``records``: the highest
    run record slot) and up to :data:`_FENCE_CHAIN` earlier owners' (``prev``);
    each new owner writes whichever of those seals is missing
    (:func:`complete_fences`), the chain read from the newest kept copy when
    ``lease.json`` is gone.
    """

    def __init__(self, lister: Callable[[], Listing]) -> None:
        self._lister = lister
        #: The listing the successful swap recorded (what to seal above).
        self.listing = Listing()
        #: The predecessors' fences found in the body that swap replaced.
        self.chain: list[dict[str, Any]] = []

    def __call__(self, previous: dict[str, Any] | None) -> dict[str, Any]:
        # Listed at every attempt, right before its swap: a listing taken before a long contended
        # acquire would leave everything the old writer appended meanwhile unfenced.
        self.listing = self._lister()
        chain: list[dict[str, Any]] = []
        note = previous.get("note") if previous is not None else None
        if previous is not None and isinstance(note, dict):
            epoch, noted = previous.get("epoch"), note.get("runs")
            if type(epoch) is int and isinstance(noted, dict):
                chain.append({"epoch": epoch, "owner": previous.get("owner"), "runs": noted,
                              "missing": note.get("missing") or {}, "records": note.get("records", -1)})
            prev = note.get("prev")
            chain += [c for c in (prev if isinstance(prev, list) else []) if isinstance(c, dict)]
        self.chain = chain[:_FENCE_CHAIN]
        runs: dict[str, int] = {}
        missing: dict[str, list[list[int]]] = {}
        for run, keys in self.listing.runs.items():
            seqs = seqs_of(keys)
            runs[run] = max(seqs, default=-1)
            gaps = missing_ranges(seqs, runs[run])
            if gaps:
                missing[run] = gaps
        return {"runs": runs, "missing": missing, "records": self.listing.top_record, "prev": self.chain}


def carried_note(previous: dict[str, Any] | None) -> dict[str, Any] | None:
    """The note of a swap that takes none of its own (a lease repair): no listing, and the fences of the owners
    before it, ``previous`` (the body it replaces) first, so that the next owner still completes them."""
    if previous is None:
        return None
    # No listing: nothing of its own to seal ("records" None: no run is judged by when it was recorded).
    return {**FenceNote(lambda: Listing())(previous), "records": None}


def _fence_seal(session_id: str, user_id: str | None, run_id: Any, seq: int, item: dict[str, Any]) -> JournalEntry:
    gaps = item.get("missing")
    missing = [list(r) for r in parse_ranges(gaps.get(run_id))] if isinstance(gaps, dict) and seq > 0 else []
    return JournalEntry(session_id=session_id, user_id=user_id, run_id=validate_id(run_id, "run_id"), seq=seq,
                        step_key=f"seal-e{item['epoch']}", kind=SEAL, epoch=item["epoch"],
                        output={"excluded": [], "missing": missing, "owner": item.get("owner"), "completed": True})


def complete_fences(store: JournalStore, session_id: str, user_id: str | None, chain: list[dict[str, Any]],
                    listed: dict[str, Collection[str]]) -> int:
    """Write the seals of earlier owners (``FenceNote.chain``) that are missing; returns how many were written.

    For each earlier owner of epoch ``k``: a seal above its listing in each run
    it listed (naming the seqs that listing lacked below its max), and a seal
    at seq 0 in each run an older epoch recorded after that listing
    (everything such a run holds of epochs below ``k`` was written after
    ``k``'s listing). ``listed`` are the keys the new owner
    listed before its own lease: a seal found there needs no write.
    Malformed chain items (the bucket is not trusted) are skipped: the worst a
    forged one can do is fence entries, and fenced steps are re-executed,
    never replayed wrongly.
    """
    items = [c for c in chain if type(c.get("epoch")) is int and c["epoch"] >= 1 and isinstance(c.get("runs"), dict)]
    tops: list[int] = [c["records"] for c in items if type(c.get("records")) is int]
    newer: list[RunRecord] = []
    if tops:
        slots = [s for s in record_slots(store, session_id, user_id) if s[0] > min(tops)]
        newer = [r for r in read_records(store, slots, session_id, user_id) if r is not None]
    wanted: list[tuple[Any, int, dict[str, Any]]] = []
    for item in items:
        for run_id, top in item["runs"].items():
            if type(top) is int and -1 <= top < 99_999_998:
                wanted.append((run_id, top + 1, item))
        records = item.get("records")
        if type(records) is int:
            wanted += [(r.run_id, 0, item) for r in newer
                       if r.n > records and r.epoch < item["epoch"] and r.run_id not in item["runs"]]
    written = 0
    for run_id, seq, item in wanted:
        try:
            seal = _fence_seal(session_id, user_id, run_id, seq, item)
        except (InvalidIdError, ValueError) as e:
            log.warning("skipping a malformed fence in the lease of session %r: %s", session_id, e)
            continue
        key = layout.journal_key(session_id, user_id, seal.run_id, seal.seq, seal.step_key)
        keys = listed.get(seal.run_id)
        if keys is None:
            keys = listed[seal.run_id] = journal_keys(store, session_id, seal.run_id, user_id)
        if key not in keys:
            put_seal(store, seal)
            written += 1
    if written:
        log.info("session %r: wrote %d seal(s) earlier owners had not written", session_id, written)
    return written
