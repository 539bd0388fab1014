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

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from storage import layout
from storage.errors import InvalidIdError, PreconditionFailed, StorageError
from storage.ids import validate_id
from storage.rows import JournalEntry, Lease, RunRecord

if TYPE_CHECKING:
    from storage.store import Store

log = logging.getLogger("storage")

RUN_START = "run_start"
RUN_END = "run_end"
SEAL = "seal"
_RECORD_ATTEMPTS = 32
#: Earlier owners' fences a lease body carries (see :class:`FenceNote`).
_FENCE_CHAIN = 8
#: Newest run records read to find the last run (see :func:`last_run`).
_LAST_RUN_WINDOW = 4
#: Ranges of missing seqs a seal (or a lease note) names per run (see :func:`missing_ranges`).
_MISSING_RANGES = 32


def entry_name(entry: JournalEntry) -> str:
    """``{seq:08d}-{step_key}``: an entry's object name within its run (what a seal's ``excluded`` lists)."""
    return f"{entry.seq:08d}-{entry.step_key}"


def _seq_of(key: str) -> int | None:
    """The seq in a journal key's object name, or None when the name does not start with one."""
    name = key.rsplit("/", 1)[-1]
    return int(name[:8]) if name[:8].isdigit() else None


def missing_ranges(seqs: Collection[int], top: int) -> list[list[int]]:
    """The seqs in ``[0, top]`` absent from ``seqs``, as sorted inclusive ``[lo, hi]`` ranges.

    What a seal at ``top + 1`` names so that an older-epoch append whose seq
    was taken before the listing but that landed after it is fenced too.
    Journals have few gaps (appends in flight, or ones that failed), so the
    list is short; beyond :data:`_MISSING_RANGES` ranges the lowest ones are
    merged into one, which may also fence listed older-epoch entries between
    them: those steps are re-executed, never replayed wrongly.
    """
    present = sorted({s for s in seqs if 0 <= s <= top})
    out: list[list[int]] = []
    expect = 0
    for s in present + [top + 1]:
        if s > expect:
            out.append([expect, s - 1])
        expect = s + 1
    if len(out) > _MISSING_RANGES:
        cut = len(out) - _MISSING_RANGES + 1
        log.warning("journal has %d gaps below seq %d; the seal fences seqs %d..%d whole", len(out), top,
                    out[0][0], out[cut - 1][1])
        out = [[out[0][0], out[cut - 1][1]]] + out[cut:]
    return out


def _ranges(value: Any) -> list[tuple[int, int]]:
    """``missing`` ranges as read back from a seal or a lease note (the bucket is not trusted: malformed
    items are dropped; the worst a forged range can do is fence entries, which are then re-executed)."""
    if not isinstance(value, list):
        return []
    return [(r[0], r[1]) for r in value[:_MISSING_RANGES]
            if isinstance(r, list) and len(r) == 2 and all(type(x) is int for x in r) and 0 <= r[0] <= r[1]]


def fenced_names(entries: Collection[JournalEntry]) -> set[str]:
    """Names of the entries replay must ignore: written by a writer a seal had fenced (module docstring)."""
    seals = [(s.epoch, s.seq, set(map(str, s.output.get("excluded") or ())), _ranges(s.output.get("missing")))
             for s in entries if s.kind == SEAL]
    if not seals:
        return set()
    out = set()
    for e in entries:
        name = entry_name(e)
        for epoch, seq, excluded, missing in seals:
            if epoch > e.epoch and (e.seq >= seq or name in excluded or any(lo <= e.seq <= hi for lo, hi in missing)):
                out.add(name)
                break
    return out


@dataclass
class JournalRun:
    """One run's journal as read: every readable entry by key, and the view replay may use."""

    session_id: str
    user_id: str | None
    run_id: str
    by_key: dict[str, JournalEntry] = field(default_factory=dict)

    @property
    def all(self) -> list[JournalEntry]:
        """Every readable entry, fenced ones included, by (seq, step_key)."""
        return sorted(self.by_key.values(), key=lambda e: (e.seq, e.step_key))

    @property
    def entries(self) -> list[JournalEntry]:
        """What replay may use: every entry except fenced ones (seals included), by (seq, step_key)."""
        fenced = fenced_names(self.by_key.values())
        return [e for e in self.all if entry_name(e) not in fenced]

    @property
    def max_seq(self) -> int:
        """The highest seq taken by any entry, fenced or not (-1 for an empty journal)."""
        return max((e.seq for e in self.by_key.values()), default=-1)

    @property
    def finished(self) -> bool:
        """True when an unfenced ``run_end`` entry exists."""
        return any(e.kind == RUN_END for e in self.entries)

    @property
    def start(self) -> JournalEntry | None:
        """The run's unfenced ``run_start`` entry, if any."""
        return next((e for e in self.entries if e.kind == RUN_START), None)

    def seal_for(self, lease: Lease, seen_before: Collection[str] | None) -> JournalEntry:
        """The seal an incarnation holding ``lease`` writes on this journal (see :func:`seal_run`)."""
        excluded: list[str] = []
        if seen_before is not None:
            seen = set(seen_before)
            excluded = sorted(entry_name(e) for k, e in self.by_key.items() if k not in seen and e.epoch < lease.epoch)
        top = self.max_seq
        missing = missing_ranges([e.seq for e in self.by_key.values()], top)
        return JournalEntry(session_id=self.session_id, user_id=self.user_id, run_id=self.run_id,
                            seq=top + 1, step_key=f"seal-e{lease.epoch}", kind=SEAL, epoch=lease.epoch,
                            output={"excluded": excluded, "missing": missing, "owner": lease.owner})

    def sealed_view(self, lease: Lease, seen_before: Collection[str] | None) -> JournalRun:
        """This journal as replay will see it once ``lease``'s incarnation sealed it; nothing is written.

        What a new owner decides with (is the run finished? where did it start?):
        a ``run_end`` a fenced writer appended during the takeover must not count.
        """
        seal = self.seal_for(lease, seen_before)
        key = layout.journal_key(self.session_id, self.user_id, self.run_id, seal.seq, seal.step_key)
        return JournalRun(self.session_id, self.user_id, self.run_id, {**self.by_key, key: seal})


def load_entries(store: Store, keys: list[str]) -> dict[str, JournalEntry]:
    """Entries of ``keys`` read in parallel; vanished, unreadable or misplaced ones are skipped with a warning."""
    def load(key: str) -> JournalEntry | None:
        obj = store.objects.get(key=key)
        if obj is None:
            return None  # pruned between LIST and GET
        try:
            entry = JournalEntry.model_validate_json(obj.data)
            placed = layout.journal_key(entry.session_id, entry.user_id, entry.run_id, entry.seq, entry.step_key)
        except (ValueError, InvalidIdError) as e:
            log.warning("skipping unreadable journal entry: %s: %s", store.describe(key), e)
            return None
        if placed != key:
            # Its own ids say it belongs elsewhere: a copied or forged object, never replayed here.
            log.warning("skipping journal entry stored under the wrong key: %s holds %s", store.describe(key), placed)
            return None
        return entry

    if not keys:
        return {}
    entries = store.index._pool.map(load, keys) if len(keys) > 2 else map(load, keys)
    return {k: e for k, e in zip(keys, entries, strict=False) if e is not None}


def read_run(store: Store, session_id: str, run_id: str, user_id: str | None,
             known: JournalRun | None = None) -> JournalRun:
    """LIST the run's journal and read its entries (only those ``known`` does not already hold)."""
    prefix = layout.journal_prefix(session_id, user_id, run_id)
    keys = [o.key for o in store.objects.list(prefix=prefix) if o.key.endswith(".json")]
    have = known.by_key if known is not None else {}
    by_key = {k: have[k] for k in keys if k in have}
    by_key.update(load_entries(store, [k for k in keys if k not in have]))
    return JournalRun(session_id, user_id, run_id, by_key)


def journal_keys(store: Store, session_id: str, run_id: str, user_id: str | None) -> frozenset[str]:
    """Keys of the run's journal entries (one LIST, no GET): the listing taken before a takeover."""
    prefix = layout.journal_prefix(session_id, user_id, run_id)
    return frozenset(o.key for o in store.objects.list(prefix=prefix) if o.key.endswith(".json"))


def _check_lease_for(lease: Lease, session_id: str, user_id: str | None) -> None:
    if lease.session_id != session_id or lease.user_id != user_id:
        raise StorageError(f"lease for session {lease.session_id!r}/user {lease.user_id!r} used to seal a run of "
                           f"session {session_id!r}/user {user_id!r}")


def _put_seal(store: Store, seal: JournalEntry) -> tuple[str, JournalEntry]:
    """Create the seal's object; a retried PUT that finds this very seal already there is fine."""
    key = layout.journal_key(seal.session_id, seal.user_id, seal.run_id, seal.seq, seal.step_key)
    try:
        store.objects.put(key=key, data=seal.__pydantic_serializer__.to_json(seal), if_none_match=True)
    except PreconditionFailed:
        obj = store.objects.get(key=key)
        try:
            existing = JournalEntry.model_validate_json(obj.data) if obj is not None else None
        except ValueError:
            existing = None
        if existing is None or existing.kind != SEAL or existing.epoch != seal.epoch:
            raise
        seal = existing
    excluded = seal.output.get("excluded") or ()
    if excluded:
        log.info("run %s of session %r sealed at seq %d by epoch %d; %d late entr%s of older epochs excluded",
                 seal.run_id, seal.session_id, seal.seq, seal.epoch, len(excluded),
                 "y" if len(excluded) == 1 else "ies")
    return key, seal


def seal_listed(store: Store, session_id: str, run_id: str, user_id: str | None, lease: Lease,
                listed: Collection[str]) -> JournalEntry:
    """Seal the run right after ``lease`` was taken, above the keys ``listed`` before it (one PUT, no LIST).

    The cheapest and earliest fence: it lands one PUT after the lease, so
    almost nothing can stop a new owner between taking the lease and fencing
    the run. Whatever the old writer appended after that listing has a seq at
    or above the seal's, or one of the seqs the listing lacked below it (an
    append that was in flight when it was listed), and is ignored.
    """
    _check_lease_for(lease, session_id, user_id)
    seqs = _seqs(listed)
    top = max(seqs, default=-1)
    seal = JournalEntry(session_id=session_id, user_id=user_id, run_id=run_id, seq=top + 1,
                        step_key=f"seal-e{lease.epoch}", kind=SEAL, epoch=lease.epoch,
                        output={"excluded": [], "missing": missing_ranges(seqs, top), "owner": lease.owner})
    return _put_seal(store, seal)[1]


def seal_run(store: Store, session_id: str, run_id: str, user_id: str | None, lease: Lease, *,
             seen_before: Collection[str] | None = None, known: JournalRun | None = None) -> JournalRun:
    """Seal the run for the incarnation holding ``lease`` and return its journal, the seal included.

    ``seen_before`` are the run's keys listed before ``lease`` was taken
    (:func:`journal_keys`); entries of an older epoch that appeared since are
    excluded by the seal. ``known`` is an earlier read whose entries need no
    second GET.
    """
    _check_lease_for(lease, session_id, user_id)
    run = read_run(store, session_id, run_id, user_id, known)
    key, seal = _put_seal(store, run.seal_for(lease, seen_before))
    run.by_key[key] = seal
    return run


# -- fences carried by the lease swap -------------------------------------------------
def lease_body(data: bytes | None) -> dict[str, Any] | None:
    """A lease object's JSON body as a dict, or None (missing or unreadable)."""
    if not data:
        return None
    try:
        body = json.loads(data)
    except ValueError:
        return None
    return body if isinstance(body, dict) else None


def _seqs(keys: Collection[str]) -> list[int]:
    return [s for s in map(_seq_of, keys) if s is not None]


@dataclass(frozen=True)
class Listing:
    """What a new owner lists right before its lease swap: the journal keys of the runs it must fence,
    and the highest run record slot then (runs recorded later were started after the listing)."""

    runs: dict[str, frozenset[str]] = field(default_factory=dict)
    top_record: int = -1


def list_for_fence(store: Store, session_id: str, user_id: str | None, run_id: str | None = None) -> Listing:
    """The :class:`Listing` of the session: its last run (and ``run_id``, when it has entries)."""
    slots = _slots(store, session_id, user_id)
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
    """What a new owner's lease swap records, so that its fence survives it (``Store.acquire_lease(note=...)``).

    A new owner seals the runs it listed before taking the lease right after
    taking it; a crash or a failed write in between would leave the old
    writer unfenced, and no later owner could tell which of its entries came
    after the takeover. So the lease body itself, written by the very swap
    that takes the epoch, holds the listing (``runs``: run id -> highest seq
    seen; ``missing``: run id -> the seqs below it the listing lacked, for
    runs with gaps; ``records``: the highest run record slot) and those of up to
    :data:`_FENCE_CHAIN` owners before it (``prev``); each new owner writes
    whatever of those seals is missing (:func:`complete_fences`). Only a
    deleted ``lease.json`` loses the chain.
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
        if isinstance(note, dict):
            epoch, runs = previous.get("epoch"), note.get("runs")
            if type(epoch) is int and isinstance(runs, dict):
                chain.append({"epoch": epoch, "owner": previous.get("owner"), "runs": runs,
                              "missing": note.get("missing") or {}, "records": note.get("records", -1)})
            prev = note.get("prev")
            chain += [c for c in (prev if isinstance(prev, list) else []) if isinstance(c, dict)]
        self.chain = chain[:_FENCE_CHAIN]
        runs: dict[str, int] = {}
        missing: dict[str, list[list[int]]] = {}
        for run, keys in self.listing.runs.items():
            seqs = _seqs(keys)
            runs[run] = max(seqs, default=-1)
            gaps = missing_ranges(seqs, runs[run])
            if gaps:
                missing[run] = gaps
        return {"runs": runs, "missing": missing, "records": self.listing.top_record, "prev": self.chain}


def _fence_seal(session_id: str, user_id: str | None, run_id: Any, seq: int, item: dict[str, Any]) -> JournalEntry:
    gaps = item.get("missing")
    missing = [list(r) for r in _ranges(gaps.get(run_id))] if isinstance(gaps, dict) and seq > 0 else []
    return JournalEntry(session_id=session_id, user_id=user_id, run_id=validate_id(run_id, "run_id"), seq=seq,
                        step_key=f"seal-e{item['epoch']}", kind=SEAL, epoch=item["epoch"],
                        output={"excluded": [], "missing": missing, "owner": item.get("owner"), "completed": True})


def complete_fences(store: Store, session_id: str, user_id: str | None, chain: list[dict[str, Any]],
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
    tops = [c.get("records") for c in items if type(c.get("records")) is int]
    newer: list[RunRecord] = []
    if tops:
        slots = [s for s in _slots(store, session_id, user_id) if s[0] > min(tops)]
        newer = [r for r in _read_records(store, slots, session_id, user_id) if r is not None]
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
            _put_seal(store, seal)
            written += 1
    if written:
        log.info("session %r: wrote %d seal(s) earlier owners had not written", session_id, written)
    return written


# -- run records -----------------------------------------------------------------
def _slots(store: Store, session_id: str, user_id: str | None) -> list[tuple[int, str]]:
    """``(n, key)`` of the session's run records, by n (one LIST)."""
    prefix = layout.run_prefix(session_id, user_id)
    out = []
    for o in store.objects.list(prefix=prefix):
        name = o.key[len(prefix):]
        if len(name) == 13 and name.endswith(".json") and name[:8].isdigit():
            out.append((int(name[:8]), o.key))
    return sorted(out)


def _read_record(store: Store, key: str, n: int, session_id: str, user_id: str | None) -> RunRecord | None:
    obj = store.objects.get(key=key)
    if obj is None:
        return None
    try:
        rec = RunRecord.model_validate_json(obj.data)
    except ValueError as e:
        log.warning("skipping unreadable run record: %s: %s", store.describe(key), e)
        return None
    if rec.type != "run_record" or (rec.session_id, rec.user_id, rec.n) != (session_id, user_id, n):
        # A record must describe the slot it sits in; one naming another session is copied or forged.
        log.warning("skipping run record that names session %r/user %r slot %d: %s", rec.session_id, rec.user_id,
                    rec.n, store.describe(key))
        return None
    return rec


def create_run(store: Store, session_id: str, user_id: str | None, *, run_id: str,
               request: dict[str, Any] | None = None, spec_hash: str = "", base_session_id: str | None = None,
               base_checkpoint_id: str | None = None, replay_from: str | None = None,
               epoch: int = 0) -> RunRecord:
    """Write the record of a run starting now at the session's next free slot (create-only) and return it."""
    validate_id(run_id, "run_id")
    for name, value in (("base_session_id", base_session_id), ("base_checkpoint_id", base_checkpoint_id),
                        ("replay_from", replay_from)):
        if value is not None:
            validate_id(value, name)
    slots = _slots(store, session_id, user_id)
    n = slots[-1][0] + 1 if slots else 0
    for _ in range(_RECORD_ATTEMPTS):
        rec = RunRecord(session_id=session_id, user_id=user_id, n=n, run_id=run_id, spec_hash=spec_hash,
                        request=request, base_session_id=base_session_id, base_checkpoint_id=base_checkpoint_id,
                        replay_from=replay_from, epoch=epoch)
        key = layout.run_key(session_id, user_id, n)
        try:
            store.objects.put(key=key, data=rec.__pydantic_serializer__.to_json(rec), if_none_match=True)
            return rec
        except PreconditionFailed:
            n += 1  # another start took this slot first: the store ordered it before ours
    raise PreconditionFailed(f"{store.describe(layout.run_prefix(session_id, user_id))}: no free run record slot "
                             f"after {_RECORD_ATTEMPTS} attempts")


def last_run(store: Store, session_id: str, user_id: str | None,
             slots: list[tuple[int, str]] | None = None) -> RunRecord | None:
    """The session's last run: the highest ``(epoch, n)`` among its newest records; None without records.

    Epochs rise with every lease and ``n`` with every run, so a legitimate
    record never has a lower epoch than one before it. A fenced writer that
    planned a run before a takeover may still land its record after the new
    owner's (it stops at its lease check right after): ordering by epoch first
    keeps that record from passing for the last run. A few of the newest
    records are read (at most :data:`_LAST_RUN_WINDOW` GETs, in parallel).
    """
    return last_run_window(store, session_id, user_id, slots)[0]


def last_run_window(store: Store, session_id: str, user_id: str | None,
                    slots: list[tuple[int, str]] | None = None
                    ) -> tuple[RunRecord | None, list[tuple[int, str]], list[tuple[int, str]]]:
    """:func:`last_run`, the record slots older than those its choice depends on, and those: every slot from the
    start of the window it was found in to the newest (all slots when it found none). Deleting none of the
    latter keeps the last run the same (what prune spares)."""
    slots = _slots(store, session_id, user_id) if slots is None else list(slots)
    rest = slots
    while rest:
        window, rest = rest[-_LAST_RUN_WINDOW:], rest[:-_LAST_RUN_WINDOW]
        recs = [r for r in _read_records(store, window, session_id, user_id) if r is not None]
        if recs:
            return max(recs, key=lambda r: (r.epoch, r.n)), rest, slots[len(rest):]
    return None, [], slots


def _read_records(store: Store, slots: list[tuple[int, str]], session_id: str,
                  user_id: str | None) -> list[RunRecord | None]:
    if len(slots) <= 1:
        return [_read_record(store, key, n, session_id, user_id) for n, key in slots]
    return list(store.index._pool.map(lambda s: _read_record(store, s[1], s[0], session_id, user_id), slots))


def list_runs(store: Store, session_id: str, user_id: str | None) -> list[RunRecord]:
    """Every readable record of the session, by n."""
    return [r for r in _read_records(store, _slots(store, session_id, user_id), session_id, user_id) if r is not None]


@dataclass(frozen=True)
class Unfinished:
    """What recovering a session's unfinished last run needs besides the session's latest checkpoint."""

    run_id: str
    record: RunRecord | None
    base_session_id: str | None
    base_checkpoint_id: str | None
    replay_from: str | None


def unfinished_last_run(store: Store, session_id: str, user_id: str | None) -> Unfinished | None:
    """The session's last run (by run record, else by sorted journal run id) if it has not finished."""
    rec = last_run(store, session_id, user_id)
    if rec is not None:
        run_id = rec.run_id
    else:
        runs = store.objects.list_dirs(prefix=layout.journal_prefix(session_id, user_id))
        if not runs:
            return None
        run_id = runs[-1]
    run = read_run(store, session_id, run_id, user_id)
    if run.finished or (rec is None and run.start is None):
        return None  # finished, or a journal no run can continue (recovery starts from a run_start or a record)
    out = run.start.output if run.start is not None else {}
    base_ckpt = (rec.base_checkpoint_id if rec is not None else None) or out.get("base_checkpoint_id")
    base_session = (rec.base_session_id if rec is not None else None) or out.get("source_session") or session_id
    replay_from = (rec.replay_from if rec is not None else None) or out.get("replay_from")
    return Unfinished(run_id, rec, base_session if base_ckpt else None, base_ckpt, replay_from)


__all__ = ["FenceNote", "JournalRun", "Listing", "list_for_fence", "RUN_END", "RUN_START", "SEAL", "Unfinished", "complete_fences", "create_run",
           "entry_name", "fenced_names", "journal_keys", "last_run", "last_run_window", "lease_body", "list_runs",
           "missing_ranges", "read_run", "seal_listed", "seal_run", "unfinished_last_run"]
