"""Journal entries and seals: reading a run's journal, and the seals that fence older writers.

See :mod:`storage.journal` for the fencing rule a seal implements.
"""

from __future__ import annotations

import logging
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Protocol

from .. import layout
from ..errors import InvalidIdError, PreconditionFailed, StorageError
from ..index import ParquetIndex
from ..objects import ObjectStore
from ..rows import JournalEntry, Lease

log = logging.getLogger("storage")

RUN_START = "run_start"
RUN_END = "run_end"
SEAL = "seal"


class JournalStore(Protocol):
    """What the journal functions use of a :class:`~storage.store.Store`: its objects, and its index's reader
    threads (to read many entries at once)."""

    objects: ObjectStore
    _index: ParquetIndex


#: Ranges of missing seqs a seal (or a lease note) names per run (see :func:`missing_ranges`).
_MISSING_RANGES = 32


def entry_name(entry: JournalEntry) -> str:
    """``{seq:08d}-{step_key}``: an entry's object name within its run (what a seal's ``excluded`` lists)."""
    return f"{entry.seq:08d}-{entry.step_key}"


def seq_of(key: str) -> int | None:
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


def parse_ranges(value: object) -> list[tuple[int, int]]:
    """``missing`` ranges as read back from a seal or a lease note (the bucket is not trusted: malformed
    items are dropped; the worst a forged range can do is fence entries, which are then re-executed)."""
    if not isinstance(value, list):
        return []
    return [(r[0], r[1]) for r in value[:_MISSING_RANGES]
            if isinstance(r, list) and len(r) == 2 and all(type(x) is int for x in r) and 0 <= r[0] <= r[1]]


def fenced_names(entries: Collection[JournalEntry]) -> set[str]:
    """Names of the entries replay must ignore: written by a writer a seal had fenced (module docstring)."""
    seals = [(s.epoch, s.seq, set(map(str, s.output.get("excluded") or ())), parse_ranges(s.output.get("missing")))
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


def load_entries(store: JournalStore, keys: list[str]) -> dict[str, JournalEntry]:
    """Entries of ``keys`` read in parallel; vanished, unreadable or misplaced ones are skipped with a warning."""
    def load(key: str) -> JournalEntry | None:
        obj = store.objects.get(key=key)
        if obj is None:
            return None  # pruned between LIST and GET
        try:
            entry = JournalEntry.model_validate_json(obj.data)
            placed = layout.journal_key(entry.session_id, entry.user_id, entry.run_id, entry.seq, entry.step_key)
        except (ValueError, InvalidIdError) as e:
            log.warning("skipping unreadable journal entry: %s: %s", store.objects.describe(key), e)
            return None
        if placed != key:
            # Its own ids say it belongs elsewhere: a copied or forged object, never replayed here.
            log.warning("skipping journal entry stored under the wrong key: %s holds %s", store.objects.describe(key), placed)
            return None
        return entry

    if not keys:
        return {}
    entries = store._index.map(load, keys) if len(keys) > 2 else map(load, keys)
    return {k: e for k, e in zip(keys, entries, strict=False) if e is not None}


def read_run(store: JournalStore, session_id: str, run_id: str, user_id: str | None,
             known: JournalRun | None = None) -> JournalRun:
    """LIST the run's journal and read its entries (only those ``known`` does not already hold)."""
    prefix = layout.journal_prefix(session_id, user_id, run_id)
    keys = [o.key for o in store.objects.list(prefix=prefix) if o.key.endswith(".json")]
    have = known.by_key if known is not None else {}
    by_key = {k: have[k] for k in keys if k in have}
    by_key.update(load_entries(store, [k for k in keys if k not in have]))
    return JournalRun(session_id, user_id, run_id, by_key)


def journal_keys(store: JournalStore, session_id: str, run_id: str, user_id: str | None) -> frozenset[str]:
    """Keys of the run's journal entries (one LIST, no GET): the listing taken before a takeover."""
    prefix = layout.journal_prefix(session_id, user_id, run_id)
    return frozenset(o.key for o in store.objects.list(prefix=prefix) if o.key.endswith(".json"))


def _check_lease_for(lease: Lease, session_id: str, user_id: str | None) -> None:
    if lease.session_id != session_id or lease.user_id != user_id:
        raise StorageError(f"lease for session {lease.session_id!r}/user {lease.user_id!r} used to seal a run of "
                           f"session {session_id!r}/user {user_id!r}")


def put_seal(store: JournalStore, seal: JournalEntry) -> tuple[str, JournalEntry]:
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


def seal_listed(store: JournalStore, session_id: str, run_id: str, user_id: str | None, lease: Lease,
                listed: Collection[str]) -> JournalEntry:
    """Seal the run right after ``lease`` was taken, above the keys ``listed`` before it (one PUT, no LIST).

    The cheapest and earliest fence: it lands one PUT after the lease, so
    almost nothing can stop a new owner between taking the lease and fencing
    the run. Whatever the old writer appended after that listing has a seq at
    or above the seal's, or one of the seqs the listing lacked below it (an
    append that was in flight when it was listed), and is ignored.
    """
    _check_lease_for(lease, session_id, user_id)
    seqs = seqs_of(listed)
    top = max(seqs, default=-1)
    seal = JournalEntry(session_id=session_id, user_id=user_id, run_id=run_id, seq=top + 1,
                        step_key=f"seal-e{lease.epoch}", kind=SEAL, epoch=lease.epoch,
                        output={"excluded": [], "missing": missing_ranges(seqs, top), "owner": lease.owner})
    return put_seal(store, seal)[1]


def seal_run(store: JournalStore, session_id: str, run_id: str, user_id: str | None, lease: Lease, *,
             seen_before: Collection[str] | None = None, known: JournalRun | None = None) -> JournalRun:
    """Seal the run for the incarnation holding ``lease`` and return its journal, the seal included.

    ``seen_before`` are the run's keys listed before ``lease`` was taken
    (:func:`journal_keys`); entries of an older epoch that appeared since are
    excluded by the seal. ``known`` is an earlier read whose entries need no
    second GET.
    """
    _check_lease_for(lease, session_id, user_id)
    run = read_run(store, session_id, run_id, user_id, known)
    key, seal = put_seal(store, run.seal_for(lease, seen_before))
    run.by_key[key] = seal
    return run


def seqs_of(keys: Collection[str]) -> list[int]:
    """The seqs of the journal keys ``keys`` whose object names start with one."""
    return [s for s in map(seq_of, keys) if s is not None]
