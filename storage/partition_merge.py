"""One compaction's merge of one index partition: its files into one, retired rows dropped.

The rules it keeps are in :mod:`storage.maintenance`: it merges only the
files it listed, writes the merged file, then deletes exactly those files;
it keeps every tombstone younger than the grace period (by the store's
clock); it abandons a partition whose listed files vanished or whose merge
would land more than half the grace after its LIST, and takes back a merge
that landed later than that anyway. A lease holder's tombstone is dropped
when the session's fences ignore it and applied only once it is settled
(:mod:`storage.tombstone_settle`, rule 5 of :mod:`storage.visibility`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from typing import TYPE_CHECKING

import pyarrow as pa
import pyarrow.compute as pc

from . import layout
from .errors import IndexChangedError, PreconditionFailed
from .index import conform
from .index_merge import compact_checkpoint_partition, live_checkpoints
from .rows import CHECKPOINT_SCHEMA, as_utc, utcnow
from .table import SessionState, days_of, table_rows
from .table_publish import SessionRead
from .tombstone_settle import settled_files
from .visibility import merge_tops, retired_tops

if TYPE_CHECKING:
    from .store import Store

log = logging.getLogger("storage")
#: One partition's work: ``(partition, keys listed, for the table, what the table holds of it, base file)``.
MergeItem = tuple[str, list[str], bool, SessionState | None, str | None]
#: What a merge did: ``(files after, live rows, tombstones applied, what the table gets or None)``.
MergeResult = tuple[int, int, int, SessionRead | None]


def latest_session_rows(table: pa.Table) -> pa.Table:
    """The row ``get_session`` would return (highest updated_at, later file wins a tie); one partition = one session."""
    if table.num_rows < 2:
        return table
    stamps = table["updated_at"].to_pylist()
    # A null updated_at (a file edited by hand) ranks below every stamp; the flag keeps None and a datetime apart.
    best = max(range(len(stamps)), key=lambda i: (stamps[i] is not None, stamps[i], i))
    return table.slice(best, 1)


@dataclass
class _Part:
    """One partition as a merge works on it."""

    partition: str
    keys: list[str]
    for_table: bool
    known: SessionState | None
    base: str | None
    wall: datetime
    started: float
    now: datetime | None
    listing: dict[str, datetime | None]
    #: A file lost rows before the merge (a fenced writer's tombstones): write the merge even of one file.
    rewrite: bool = False


@dataclass(frozen=True)
class _Merged:
    """A partition's files as read (``pairs``, each ``tables`` entry conformed, ``table`` all of them) and merged."""

    pairs: list[tuple[str, pa.Table]]
    tables: list[pa.Table]
    table: pa.Table
    merged: pa.Table
    applied: int
    live: int


class PartitionMerger:
    """The per-partition merge of one compaction: ``merger(item)`` for each :data:`MergeItem`.

    ``base`` (of an item): the partition's compacted file, left as it is (not
    even read) while the files that came after it are merged among
    themselves, every tombstone kept (their rows may be in ``base``); None
    merges every file. ``clock``: the compaction's monotonic clock (its lag
    limit is measured with it).
    """

    def __init__(self, store: Store, schema: pa.Schema, grace: timedelta, max_lag: float, listed_wall: datetime,
                 listed_at: float, listing: dict[str, datetime | None], clock: Callable[[], float],
                 delete: Callable[[list[str]], None] | None = None) -> None:
        self.store, self.schema, self.grace, self.max_lag = store, schema, grace, max_lag
        #: How merged files are deleted (once their merge is written): at once unless the compaction says.
        self.delete = delete or (lambda keys: store.objects.delete(keys=keys))
        self.listed_wall, self.listed_at, self.listing, self.clock = listed_wall, listed_at, listing, clock
        # Once: a partition's own files never move the store's "now" past the LIST's.
        self.listed_now = listing_now(listing)

    def _listed(self, item: MergeItem) -> _Part:
        """The item, listed afresh when its turn came long after the big LIST (so its lag is its own)."""
        partition, keys, for_table, known, base = item
        if not (self.max_lag and self.clock() - self.listed_at > self.max_lag / 2):
            return _Part(partition, [k for k in keys if k != base], for_table, known, base, self.listed_wall,
                         self.listed_at, self.listed_now, self.listing)
        wall, started = utcnow(), self.clock()
        fresh = {o.key: o.modified for o in self.store._index.list_infos(partition)}
        now = listing_now({"": self.listed_now, **fresh})
        if base not in fresh:
            base = None
        return _Part(partition, [k for k in fresh if k != base], for_table, known, base, wall, started, now,
                     {**self.listing, **fresh})

    def __call__(self, item: MergeItem) -> MergeResult:
        part = self._listed(item)
        vanished: list[str] = []
        pairs = self.store._index.read_files(part.keys, cache=False, vanished=vanished)
        if vanished:
            # Another compaction merged (and deleted) files of this listing: it owns the partition now.
            log.info("compaction skips %s: listed files vanished (another compaction merged them)",
                     self.store.describe(part.partition))
            return (len(part.keys) - len(vanished) + (part.base is not None), 0, 0,
                    _reread(self.store, part.partition, part.known) if part.for_table else None)
        usable = self._usable(pairs)
        moved = {k for k, _ in pairs} - {k for k, _ in usable}
        if moved:  # no longer the partition's: neither merged nor counted, nor named to the table
            part.keys = [k for k in part.keys if k not in moved]
        if self.schema is CHECKPOINT_SCHEMA:
            judged, settled = settled_files(self.store, usable)  # a fenced writer's tombstones dropped (visibility)
            if not settled:
                log.info("compaction leaves %s as it is for now: a takeover under way may yet ignore its "
                         "tombstones", self.store.describe(part.partition))
                return len(part.keys) + (part.base is not None), 0, 0, _provisional(part, judged)
            part.rewrite = any(a.num_rows != b.num_rows for (_, a), (_, b) in zip(usable, judged, strict=True))
            usable = judged
        return self._replace(part, self._merge(part, usable))

    def _usable(self, pairs: list[tuple[str, pa.Table]]) -> list[tuple[str, pa.Table]]:
        """``pairs`` conformed to the schema, less the files of another schema altogether: each of those is
        moved to its :func:`~storage.layout.index_quarantine_key` (readers skip such a file; a merge cannot use
        it, and one left in place would be read again by every compaction). A warning names both keys."""
        usable: list[tuple[str, pa.Table]] = []
        for key, table in pairs:
            try:
                usable.append((key, conform(table, self.schema)))
            except (KeyError, pa.ArrowInvalid, pa.ArrowTypeError) as e:
                aside = layout.index_quarantine_key(key)
                obj = self.store.objects.get(key=key)
                if obj is not None:
                    try:
                        self.store.objects.put(key=aside, data=obj.data, if_none_match=True)
                    except PreconditionFailed:
                        pass  # another compaction moved it first: its copy holds the same bytes
                    self.store.objects.delete(keys=[key])
                log.warning("compaction moved an index file of a foreign schema to %s (%s): %s",
                            self.store.describe(aside), key, e)
        return usable

    def _merge(self, part: _Part, pairs: list[tuple[str, pa.Table]]) -> _Merged:
        """The files read, merged."""
        tables = [conform(t, self.schema) for _, t in pairs]
        table = pa.concat_tables(tables) if tables else self.schema.empty_table()
        if self.schema is CHECKPOINT_SCHEMA:
            retired = merge_tops(*(retired_tops(t) for _, t in pairs))  # the merged files' deletion watermarks
            if part.base is not None:
                merged, applied = compact_checkpoint_partition(table, keep_tombstones_since=_KEEP_ALL,
                                                               retired=retired)
            else:
                grace = self.grace
                merged, applied = compact_checkpoint_partition(
                    table, keep_tombstones_since=part.wall - grace if grace else None,
                    young_ids=_young_tombstones(pairs, tables, part.listing, grace, part.now) if grace else (),
                    retired=retired)
            live = merged.num_rows - pc.sum(merged["tombstone"]).as_py() if merged.num_rows else 0
        else:
            # Session rows arrive in file order; the latest-written row per session is its state.
            merged, applied = latest_session_rows(table), 0
            live = merged.num_rows
        if part.base is not None:
            live = _tier_live(part.known, pairs, tables)
        return _Merged(pairs, tables, table, merged, applied, live)

    def _late(self, part: _Part) -> bool:
        return bool(self.max_lag) and self.clock() - part.started > self.max_lag

    def _replace(self, part: _Part, m: _Merged) -> MergeResult:
        """Write the merged file and delete the files merged, unless already compact or too late."""
        merged, keys, base = m.merged, part.keys, part.base
        unchanged = len(keys) + (base is not None), m.live, 0
        if len(m.pairs) <= 1 and m.applied == 0 and merged.num_rows == m.table.num_rows and not part.rewrite:
            return (*unchanged, self._session_read(part, m, keys))  # already compact
        if self._late(part):
            log.warning("compaction skips %s: its merge would land %.0f s after its LIST (limit %.0f s, half "
                        "the tombstone grace)", self.store.describe(part.partition), self.clock() - part.started,
                        self.max_lag)
            return (*unchanged, self._session_read(part, m, keys))
        merged_key = None
        if merged.num_rows or merged.schema.metadata:  # rows, or a deletion watermark (storage.visibility)
            merged_key = self.store._index.write(part.partition, merged, suffix="-c", cache=False)
            if self._late(part):
                # It landed too late after all (a pause between the check above and the PUT): a concurrent
                # compaction may have dropped a tombstone this merge's rows predate. Take it back: every row
                # it holds is still in its sources (or in the merge of whoever deleted them), so nothing is lost.
                log.warning("compaction takes back its merge of %s: it landed %.0f s after its LIST (limit "
                            "%.0f s)", self.store.describe(part.partition), self.clock() - part.started,
                            self.max_lag)
                self.store.objects.delete(keys=[merged_key])
                return (*unchanged, self._session_read(part, m, keys))
        # Delete only what was read and merged: a file that appeared after the LIST survives.
        read_keys = {k for k, _ in m.pairs}
        self.delete([k for k, _ in m.pairs])
        after = [k for k in keys if k not in read_keys] + ([merged_key] if merged_key else [])
        return ((1 if merged_key else 0) + (len(keys) - len(m.pairs)) + (base is not None), m.live,
                m.applied, self._session_read(part, m, after))

    def _session_read(self, part: _Part, m: _Merged, files: list[str]) -> SessionRead | None:
        """What the compacted table gets of this session, its per-session files being ``files`` afterwards."""
        if not part.for_table:
            return None
        merged, known, base = m.merged, part.known, part.base
        files = files + ([base] if base is not None else [])
        names = tuple(sorted(k.rsplit("/", 1)[1] for k in part.keys + ([base] if base is not None else [])))
        tomb = pc.fill_null(merged["tombstone"], False) if merged.num_rows else pa.array([], pa.bool_())
        tombs = bool(pc.any(tomb).as_py()) if merged.num_rows else False
        dead = set(merged["checkpoint_id"].filter(tomb).to_pylist()) if tombs else set()
        after = tuple(sorted(k.rsplit("/", 1)[1] for k in files))
        extra = {base.rsplit("/", 1)[1]} if base is not None else set()
        days = _days_changed(known, m.pairs, m.tables, m.table, extra)
        if base is None or known is None:
            return SessionRead(table_rows(merged), after, tombs, changed=known is None or names != known.files,
                               days_changed=days, dead=tuple(sorted(dead)))
        # Only what came after the table's last look: its rows, and every checkpoint id it touches. A row
        # a tombstone in the unread base file retires (a stale copy, an id used again) stays dead.
        new = [t for (k, _), t in zip(m.pairs, m.tables, strict=False)
               if k.rsplit("/", 1)[1] not in known.files and t.num_rows]
        ids = pa.chunked_array([t["checkpoint_id"] for t in new] or [pa.array([], pa.string())]).combine_chunks()
        rows = table_rows(merged)
        rows = rows.filter(pc.is_in(rows["checkpoint_id"], value_set=ids))
        if known.dead:
            rows = rows.filter(pc.invert(pc.is_in(rows["checkpoint_id"],
                                                  value_set=pa.array(known.dead, pa.string()))))
        return SessionRead(rows, after, tombs or known.tombs, changed=True, days_changed=days, touched=ids,
                           count=m.live, dead=tuple(sorted(dead | set(known.dead))))


#: ``keep_tombstones_since`` that keeps every tombstone (a merge that leaves the partition's base file out).
_KEEP_ALL = datetime(1, 1, 1, tzinfo=timezone.utc)


def base_file(keys: list[str], known: SessionState, sizes: dict[str, int]) -> str | None:
    """The partition's compacted file to leave out of its merge, or None to merge every file.

    When the table absorbed every file the partition still has (appends only since), and what came after the
    largest of them is no bigger than it, only that is merged: a compaction then reads and writes what is
    new, not the session's history, and a partition holds at most two files after it (the second one no
    bigger than the first). Otherwise (and when tombstones may go) everything is merged, as always.
    """
    by_name = {k.rsplit("/", 1)[1]: k for k in keys}
    absorbed = [by_name[n] for n in known.files if n in by_name]
    if not absorbed or len(absorbed) != len(known.files):
        return None
    base = max(absorbed, key=lambda k: (sizes.get(k, 0), k))
    rest = sum(sizes.get(k, 0) for k in keys if k != base)
    return base if rest <= sizes.get(base, 0) else None


def _tier_live(known: SessionState | None, pairs: list[tuple[str, pa.Table]], tables: list[pa.Table]) -> int:
    """Live rows of a session merged without its base file: the table's count, plus new rows, less new tombstones
    (an estimate when a tombstone retires a row that was already retired)."""
    n = known.rows if known is not None else 0
    for (k, _), t in zip(pairs, tables, strict=False):
        if known is not None and k.rsplit("/", 1)[1] in known.files:
            continue
        tomb = pc.sum(pc.fill_null(t["tombstone"], False)).as_py() or 0
        n += t.num_rows - 2 * tomb
    return max(n, 0)


def _days_changed(known: SessionState | None, pairs: list[tuple[str, pa.Table]], tables: list[pa.Table],
                  table: pa.Table, unread: Collection[str] = ()) -> frozenset[str] | None:
    """The days on which the session's live rows may differ from what the table absorbed (``known``): those of
    every row sharing a checkpoint id with a file the table has not absorbed (a new row, the row a new tombstone
    retires, wherever it lives). None (every day) unless every absorbed file is still there."""
    if known is None:
        return None
    names = {k.rsplit("/", 1)[1]: t for (k, _), t in zip(pairs, tables, strict=False)}
    if not set(known.files) <= set(names) | set(unread):
        return None
    new = [t for n, t in names.items() if n not in known.files and t.num_rows]
    if not new:
        return frozenset()
    stamps = pa.chunked_array([c for t in new for c in t["created_at"].cast(CHECKPOINT_SCHEMA.field("created_at").type)
                               .chunks], CHECKPOINT_SCHEMA.field("created_at").type)
    days = set(days_of(pa.table({"created_at": stamps})).to_pylist())
    tombs = [t["checkpoint_id"].filter(pc.fill_null(t["tombstone"], False)) for t in new
             if pc.any(pc.fill_null(t["tombstone"], False)).as_py()]
    if tombs:
        # A tombstone carries its row's created_at, but a retired row's day is where the row is: look it up.
        ids = pa.chunked_array(tombs).combine_chunks()
        days.update(days_of(table.filter(pc.is_in(table["checkpoint_id"], value_set=ids))).to_pylist())
    return frozenset(days)


def _reread(store: Store, partition: str, known: SessionState | None) -> SessionRead | None:
    """The session's live rows after a concurrent compaction merged its files (consistent with a fresh LIST)."""
    try:
        keys, table = store._index.read_prefix(partition, CHECKPOINT_SCHEMA, cache=False)
    except IndexChangedError as e:
        log.info("table skips %s for now: %s", store.describe(partition), e)
        return None
    names = tuple(sorted(k.rsplit("/", 1)[1] for k in keys))
    judged, settled = settled_files(store, [("", table)])
    table = judged[0][1]
    if not settled:
        return SessionRead(table_rows(live_checkpoints(table)), (), True, changed=True)
    tomb = pc.fill_null(table["tombstone"], False)
    dead = tuple(sorted(set(table["checkpoint_id"].filter(tomb).to_pylist())))
    return SessionRead(table_rows(live_checkpoints(table)), names, bool(dead),
                       changed=known is None or names != known.files, dead=dead)


def _provisional(part: _Part, pairs: list[tuple[str, pa.Table]]) -> SessionRead | None:
    """What the table gets of a session whose leased tombstones are not settled (a takeover under way): its
    live rows as the rule reads them now, absorbing none of its files (the query reads it from them, and the next
    compaction reads it again: :mod:`storage.tombstone_settle`)."""
    if not part.for_table:
        return None
    tables = [t for _, t in pairs]
    table = pa.concat_tables(tables) if tables else CHECKPOINT_SCHEMA.empty_table()
    return SessionRead(table_rows(live_checkpoints(table)), (), True, changed=True)


def listing_now(listing: dict[str, datetime | None]) -> datetime | None:
    """The newest (zone-aware) modification time in ``listing``: the store's clock at the LIST, at the latest."""
    stamps = [as_utc(m) for m in listing.values() if m is not None and m.tzinfo is not None]
    return max(stamps) if stamps else None


def _young_tombstones(pairs: list[tuple[str, pa.Table]], tables: list[pa.Table],
                      listing: dict[str, datetime | None], grace: timedelta, store_now: datetime | None) -> set[str]:
    """Checkpoint ids of the tombstones read from files the store's clock says are younger than ``grace``.

    ``store_now`` is the store's "now": the newest modification time in the
    LIST (:func:`listing_now`; a LIST shows only files written before it, so
    that is never later than the store's clock at the LIST). A file without a
    (zone-aware) modification time is young.
    """
    def known(m: datetime | None) -> datetime | None:
        return as_utc(m) if m is not None and m.tzinfo is not None else None  # naive: whose zone? unknown

    cutoff = store_now - grace if store_now is not None else None
    young = [t for (key, _), t in zip(pairs, tables, strict=False) if t.num_rows and (
        cutoff is None or (modified := known(listing.get(key))) is None or modified >= cutoff)]
    if not young:
        return set()
    tomb = pc.fill_null(pa.chunked_array([c for t in young for c in t["tombstone"].chunks], pa.bool_()), False)
    ids = pa.chunked_array([c for t in young for c in t["checkpoint_id"].chunks], pa.string())
    return set(ids.filter(tomb).to_pylist())
