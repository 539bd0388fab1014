"""Maintenance over a :class:`~storage.store.Store`: ``compact`` and ``prune``.

Compaction is safe against concurrent writers: it merges only the files it
listed, writes the merged file, then deletes exactly those files. A row
written meanwhile lives in a file compaction never saw, so it survives; a
crash between write and delete leaves duplicates that readers drop.

It is safe against concurrent compactions too (the supervisor's loop and a
``loomray compact`` cron, or two clusters on one store). Compactor A may read
a row, compactor B then merge that row with its new tombstone, and A write
its merged file afterwards: only the tombstone keeps A's copy dead, so a
compaction keeps every tombstone younger than a grace period (default one
hour) and drops older ones. A tombstone's age is judged by the store's clock:
it goes only when the file it was read from was last modified more than the
grace before the newest file of the LIST (the store's time, not a node's:
the ``written_at`` a writer stamps may be skewed), and its ``written_at`` is
that old too. A compactor bounds its own lag to match: it abandons a
partition whose merge would be written more than half the grace after its
LIST, and one whose listed files vanish before it reads them (another
compaction merged them first), writing and deleting nothing there; a merge
that landed later than that anyway (the compactor paused between its check
and its PUT) is deleted again before any of its sources.

The compacted table (:mod:`storage.table`) is brought up to date by the same
pass, from the same reads: the user's manifest is read before the per-session
LIST, the partitions it absorbed are compared with that LIST, and only the
sessions that changed are read. A merge that leaves a partition's compacted
file out (appends only since) keeps every tombstone it reads, so it can never
drop one whose row is in that file; the rows it hands the table are filtered
by the tombstones the manifest recorded for that file.
"""

from __future__ import annotations

import logging
import time
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from typing import TYPE_CHECKING

import pyarrow as pa
import pyarrow.compute as pc

from storage import layout
from storage.errors import IndexChangedError, PreconditionFailed
from storage.ids import user_from_segment, user_segment, validate_id
from storage.index import compact_checkpoint_partition, conform, live_checkpoints, serial_backend
from storage.journal import RUN_END, last_run_window, load_entries, unfinished_last_run
from storage.rows import (
    CHECKPOINT_SCHEMA,
    SESSION_SCHEMA,
    CheckpointRow,
    CompactReport,
    JournalEntry,
    PruneReport,
    RunRecord,
    as_utc,
    utcnow,
)
from storage.table import SessionRead, SessionState, UserTable, days_of, load_tables, publish, table_clock, table_rows

if TYPE_CHECKING:
    from storage.store import Store

log = logging.getLogger("storage")

#: A compaction keeps tombstones younger than this (see the module docstring).
TOMBSTONE_GRACE = timedelta(hours=1)
_clock = time.monotonic  # module-level so tests can move time forward without waiting


def _partitions(keys: list[str]) -> dict[str, list[str]]:
    groups: dict[str, list[str]] = defaultdict(list)
    for key in keys:
        groups[key.rsplit("/", 1)[0] + "/"].append(key)
    return groups


def _latest_session_rows(table: pa.Table) -> pa.Table:
    """The row ``get_session`` would return (highest updated_at, later file wins a tie); one partition = one session."""
    if table.num_rows < 2:
        return table
    stamps = table["updated_at"].to_pylist()
    best = max(range(len(stamps)), key=lambda i: (stamps[i], i))
    return table.slice(best, 1)


@dataclass(frozen=True)
class IndexCompactReport(CompactReport):
    """:class:`CompactReport` plus what the compacted table (:mod:`storage.table`) got.

    ``table_partitions``: (user, day) partition files rewritten; ``table_rows``:
    live rows in them; ``table_users``: users whose table was committed;
    ``table_skipped``: users whose table a concurrent compaction held or
    changed (they stay tail until a later run).
    """

    table_partitions: int = 0
    table_rows: int = 0
    table_users: int = 0
    table_skipped: int = 0


def compact(store: Store, *, tombstone_grace: timedelta | None = None,
            users: list[str | None] | None = None) -> IndexCompactReport:
    """Merge index partitions and bring the compacted table up to date; only what changed is read.

    Per-session partitions: a partition whose files changed since the table
    absorbed them (or whose tombstones may go) is merged into one file, as the
    module docstring says; when only appends came since, and they are smaller
    than its compacted file, they are merged among themselves and the
    compacted file is not read (see :func:`_base_file`). Table
    (:mod:`storage.table`): each user's ``(user, day)`` partitions on which
    changed sessions' rows changed are rewritten, deletes applied. A session
    whose files equal what the table's manifest absorbed, holding no
    droppable tombstones, is not read at all. ``users`` (user ids, None = no
    user) limits both to those users.

    ``tombstone_grace`` (default :data:`TOMBSTONE_GRACE`): how long tombstones
    outlive their rows; ``timedelta(0)`` drops them at once and is safe only
    when no other compaction can run at the same time. ``rows`` in the report
    counts live rows kept, not the tombstones kept.
    """
    grace = TOMBSTONE_GRACE if tombstone_grace is None else tombstone_grace
    if not isinstance(grace, timedelta) or grace < timedelta(0):
        raise ValueError(f"tombstone_grace must be a non-negative timedelta, got {tombstone_grace!r}")
    segments = None if users is None else sorted({user_segment(u) for u in users})
    # A merge must be written within half the grace of its partition's LIST (else abandoned), so any
    # compactor still holding a row read before its tombstone existed is done before that tombstone goes.
    max_lag = grace.total_seconds() / 2
    files_before = files_after = rows = dropped = 0

    # -- session status rows: the latest row per session; a one-file partition is compact already --------------
    prefixes = [f"{layout.SESSION_INDEX}user={seg}/" for seg in segments] if segments is not None \
        else [layout.SESSION_INDEX]
    listed_wall, listed_at = utcnow(), _clock()
    listing = {o.key: o.modified for p in prefixes for o in store.index.list_infos(p)}
    groups = _partitions(list(listing))
    files_before += sum(len(v) for v in groups.values())
    merge = _merger(store, SESSION_SCHEMA, grace, max_lag, listed_wall, listed_at, listing)
    with _pool(store) as pool:
        results = list(pool.map(merge, [(p, k, False, None, None) for p, k in groups.items() if len(k) > 1]))
    files_after += sum(len(k) for k in groups.values() if len(k) <= 1)
    rows += sum(len(k) for k in groups.values() if len(k) <= 1)
    for n_files, n_rows, _, _ in results:
        files_after += n_files
        rows += n_rows

    # -- checkpoint rows: per-session merges, then each user's compacted table --------------------------------
    tprefixes = [f"{layout.TABLE_INDEX}user={seg}/" for seg in segments] if segments is not None \
        else [layout.TABLE_INDEX]
    tables: dict[str, UserTable] = {}
    for p in tprefixes:  # read before the per-session LIST: the reads below are newer than any manifest
        tables.update(load_tables(store, p))
    prefixes = [f"{layout.CHECKPOINT_INDEX}user={seg}/" for seg in segments] if segments is not None \
        else [layout.CHECKPOINT_INDEX]
    listed_wall, listed_at = utcnow(), _clock()  # before the LIST: tombstones written during it are young
    infos = [o for p in prefixes for o in store.index.list_infos(p)]
    listing = {o.key: o.modified for o in infos}
    sizes = {o.key: o.size for o in infos}
    groups = _partitions(list(listing))
    files_before += sum(len(v) for v in groups.values())
    now = table_clock()
    store_now = _store_now(listing)
    listed: dict[str, dict[str, tuple[str, ...]]] = defaultdict(dict)
    work = []
    for partition, keys in groups.items():
        seg, sid = _ids_of(partition)
        if seg is None:
            work.append((partition, keys, False, None, None))  # not a session partition: merge as before
            continue
        ut = tables.setdefault(seg, UserTable(seg))
        names = tuple(sorted(k.rsplit("/", 1)[1] for k in keys))
        listed[seg][sid] = names
        known = ut.manifest.sessions.get(sid) if ut.manifest is not None else None
        rebuild = not ut.busy(now) and ut.needs_rebuild(now) is not None
        due = known is not None and known.tombs and (not grace or store_now is None or all(
            listing[k] is None or as_utc(listing[k]) < store_now - grace for k in keys))
        if rebuild or due or known is None or names != known.files:
            work.append((partition, keys, True, known,
                         None if rebuild or due or known is None else _base_file(keys, known, sizes)))
        else:
            files_after += len(keys)  # compact, and absorbed by the table as it is: nothing to read
            rows += known.rows
    merge = _merger(store, CHECKPOINT_SCHEMA, grace, max_lag, listed_wall, listed_at, listing)
    # Its own pool: merge() reads through the index's pool, and nesting one pool in itself deadlocks.
    with _pool(store) as pool:
        results = list(pool.map(merge, work))
    reads: dict[str, dict[str, SessionRead]] = defaultdict(dict)
    for (partition, *_), (n_files, n_rows, n_applied, read) in zip(work, results, strict=False):
        files_after += n_files
        rows += n_rows
        dropped += n_applied
        if read is not None:
            seg, sid = _ids_of(partition)
            reads[seg][sid] = read

    def late() -> bool:
        return bool(max_lag) and _clock() - listed_at > max_lag

    parts = table_rows_written = committed = skipped = 0
    for seg in sorted(set(listed) | {s for s, ut in tables.items() if ut.manifest is not None or ut.parts}):
        ut = tables.setdefault(seg, UserTable(seg))
        if ut.busy(now):
            log.info("table of user %r: another compaction is writing it; skipped", seg)
            skipped += 1
            continue
        reason = ut.needs_rebuild(now)
        if reason is not None and ut.manifest is not None:
            log.warning("table of user %r is rebuilt from the per-session index: %s", seg, reason)
        done = publish(store, ut, listed.get(seg, {}), reads.get(seg, {}), rebuild=reason is not None,
                       listed_wall=listed_wall, deadline=late)
        if done.outcome == "committed":
            committed += 1
            parts += done.partitions
            table_rows_written += done.rows
        elif done.outcome != "clean":
            if done.outcome == "late":
                log.warning("table of user %r not written: its reads are older than %.0f s (half the tombstone "
                            "grace)", seg, max_lag)
            skipped += 1
    return IndexCompactReport(files_before=files_before, files_after=files_after, rows=rows,
                              tombstones_dropped=dropped, table_partitions=parts, table_rows=table_rows_written,
                              table_users=committed, table_skipped=skipped)


class _InOrder:
    """A pool's ``map`` on the calling thread (for local stores: see :func:`storage.index.serial_backend`)."""

    def __enter__(self) -> _InOrder:
        return self

    def __exit__(self, *exc: object) -> None:
        pass

    def map(self, fn, items):
        return map(fn, items)


def _pool(store: Store):
    """Where a compaction merges partitions: 4 threads for a remote store, the calling thread for a local one."""
    if serial_backend(store.objects):
        return _InOrder()
    return ThreadPoolExecutor(max_workers=4, thread_name_prefix="storage-compact")


def _ids_of(partition: str) -> tuple[str | None, str]:
    """``(user segment, session id)`` of a checkpoint partition prefix; ``(None, "")`` for anything else."""
    parts = partition[len(layout.CHECKPOINT_INDEX):].rstrip("/").split("/")
    if len(parts) != 2 or not parts[0].startswith("user=") or not parts[1].startswith("session="):
        return None, ""
    return parts[0][len("user="):], parts[1][len("session="):]


def _merger(store: Store, schema: pa.Schema, grace: timedelta, max_lag: float, listed_wall: datetime,
            listed_at: float, listing: dict[str, datetime | None]):
    """The per-partition merge of one compaction: ``merge((partition, keys, for_table, known, base))`` returns
    ``(files after, live rows, tombstones applied, SessionRead or None)``.

    ``base``: the partition's compacted file, left as it is (not even read) while the files that came after it
    are merged among themselves, every tombstone kept (their rows may be in ``base``); None merges every file.
    """
    listed_now = _store_now(listing)  # once: a partition's own files never move the store's "now" past the LIST's

    def merge(item: tuple[str, list[str], bool, SessionState | None, str | None],
              listing: dict[str, datetime | None] = listing) -> tuple[int, int, int, SessionRead | None]:
        partition, keys, for_table, known, base = item
        wall, started = listed_wall, listed_at
        if max_lag and _clock() - started > max_lag / 2:
            # This partition's turn came long after the big LIST: list it afresh, so its lag is its own.
            wall, started = utcnow(), _clock()
            fresh = {o.key: o.modified for o in store.index.list_infos(partition)}
            keys, listing = list(fresh), {**listing, **fresh}
            now = _store_now({"": listed_now, **fresh})
            if base not in fresh:
                base = None
        else:
            now = listed_now
        keys = [k for k in keys if k != base]
        vanished: list[str] = []
        pairs = store.index.read_files(keys, cache=False, vanished=vanished)
        if vanished:
            # Another compaction merged (and deleted) files of this listing: it owns the partition now.
            log.info("compaction skips %s: listed files vanished (another compaction merged them)",
                     store.describe(partition))
            return (len(keys) - len(vanished) + (base is not None), 0, 0,
                    _reread(store, partition, known) if for_table else None)
        tables = [conform(t, schema) for _, t in pairs]
        table = pa.concat_tables(tables) if tables else schema.empty_table()
        if schema is CHECKPOINT_SCHEMA:
            if base is not None:
                merged, applied = compact_checkpoint_partition(table, keep_tombstones_since=_KEEP_ALL)
            else:
                merged, applied = compact_checkpoint_partition(
                    table, keep_tombstones_since=wall - grace if grace else None,
                    young_ids=_young_tombstones(pairs, tables, listing, grace, store_now=now) if grace else ())
            live = merged.num_rows - pc.sum(merged["tombstone"]).as_py() if merged.num_rows else 0
        else:
            # Session rows arrive in file order; the latest-written row per session is its state.
            merged, applied = _latest_session_rows(table), 0
            live = merged.num_rows
        if base is not None:
            live = _tier_live(known, pairs, tables)

        def read(files: list[str]) -> SessionRead | None:
            if not for_table:
                return None
            files = files + ([base] if base is not None else [])
            names = tuple(sorted(k.rsplit("/", 1)[1] for k in keys + ([base] if base is not None else [])))
            tomb = pc.fill_null(merged["tombstone"], False) if merged.num_rows else pa.array([], pa.bool_())
            tombs = bool(pc.any(tomb).as_py()) if merged.num_rows else False
            dead = set(merged["checkpoint_id"].filter(tomb).to_pylist()) if tombs else set()
            after = tuple(sorted(k.rsplit("/", 1)[1] for k in files))
            extra = {base.rsplit("/", 1)[1]} if base is not None else set()
            days = _days_changed(known, pairs, tables, table, extra)
            if base is None:
                return SessionRead(table_rows(merged), after, tombs, changed=known is None or names != known.files,
                                   days_changed=days, dead=tuple(sorted(dead)))
            # Only what came after the table's last look: its rows, and every checkpoint id it touches. A row
            # a tombstone in the unread base file retires (a stale copy, an id used again) stays dead.
            new = [t for (k, _), t in zip(pairs, tables, strict=False) if k.rsplit("/", 1)[1] not in known.files and t.num_rows]
            ids = pa.chunked_array([t["checkpoint_id"] for t in new] or [pa.array([], pa.string())]).combine_chunks()
            rows = table_rows(merged)
            rows = rows.filter(pc.is_in(rows["checkpoint_id"], value_set=ids))
            if known.dead:
                rows = rows.filter(pc.invert(pc.is_in(rows["checkpoint_id"],
                                                      value_set=pa.array(known.dead, pa.string()))))
            return SessionRead(rows, after, tombs or known.tombs, changed=True, days_changed=days, touched=ids,
                               count=live, dead=tuple(sorted(dead | set(known.dead))))

        if len(pairs) <= 1 and applied == 0 and merged.num_rows == table.num_rows:
            return len(keys) + (base is not None), live, 0, read(keys)  # already compact
        if max_lag and _clock() - started > max_lag:
            log.warning("compaction skips %s: its merge would land %.0f s after its LIST (limit %.0f s, half "
                        "the tombstone grace)", store.describe(partition), _clock() - started, max_lag)
            return len(keys) + (base is not None), live, 0, read(keys)
        merged_key = None
        if merged.num_rows:
            merged_key = store.index.write(partition, merged, suffix="-c", cache=False)
            if max_lag and _clock() - started > max_lag:
                # It landed too late after all (a pause between the check above and the PUT): a concurrent
                # compaction may have dropped a tombstone this merge's rows predate. Take it back: every row
                # it holds is still in its sources (or in the merge of whoever deleted them), so nothing is lost.
                log.warning("compaction takes back its merge of %s: it landed %.0f s after its LIST (limit "
                            "%.0f s)", store.describe(partition), _clock() - started, max_lag)
                store.objects.delete(keys=[merged_key])
                return len(keys) + (base is not None), live, 0, read(keys)
        # Delete only what was read and merged: a file that appeared after the LIST survives.
        read_keys = {k for k, _ in pairs}
        store.objects.delete(keys=[k for k, _ in pairs])
        after = [k for k in keys if k not in read_keys] + ([merged_key] if merged_key else [])
        return ((1 if merged.num_rows else 0) + (len(keys) - len(pairs)) + (base is not None), live, applied,
                read(after))

    return merge


#: ``keep_tombstones_since`` that keeps every tombstone (a merge that leaves the partition's base file out).
_KEEP_ALL = datetime(1, 1, 1, tzinfo=timezone.utc)


def _base_file(keys: list[str], known: SessionState, sizes: dict[str, int]) -> str | None:
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
                  table: pa.Table, unread: set[str] = frozenset()) -> frozenset[str] | None:
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
        keys, table = store.index.read_prefix(partition, CHECKPOINT_SCHEMA, cache=False)
    except IndexChangedError as e:
        log.info("table skips %s for now: %s", store.describe(partition), e)
        return None
    names = tuple(sorted(k.rsplit("/", 1)[1] for k in keys))
    tomb = pc.fill_null(table["tombstone"], False)
    dead = tuple(sorted(set(table["checkpoint_id"].filter(tomb).to_pylist())))
    return SessionRead(table_rows(live_checkpoints(table)), names, bool(dead),
                       changed=known is None or names != known.files, dead=dead)


def _store_now(listing: dict[str, datetime | None]) -> datetime | None:
    """The newest (zone-aware) modification time in ``listing``: the store's clock at the LIST, at the latest."""
    stamps = [as_utc(m) for m in listing.values() if m is not None and m.tzinfo is not None]
    return max(stamps) if stamps else None


def _young_tombstones(pairs: list[tuple[str, pa.Table]], tables: list[pa.Table],
                      listing: dict[str, datetime | None], grace: timedelta, *,
                      store_now: datetime | None = ...) -> set[str]:  # type: ignore[assignment]
    """Checkpoint ids of the tombstones read from files the store's clock says are younger than ``grace``.

    The store's "now" is the newest modification time in ``listing`` (a LIST
    shows only files written before it, so that is never later than the
    store's clock at the LIST). A file without a (zone-aware) modification time is young.
    ``store_now``: that time, when the caller computed it once for many partitions.
    """
    def known(m: datetime | None) -> datetime | None:
        return as_utc(m) if m is not None and m.tzinfo is not None else None  # naive: whose zone? unknown

    if store_now is ...:
        store_now = _store_now(listing)
    cutoff = store_now - grace if store_now is not None else None
    young: set[str] = set()
    for (key, _), table in zip(pairs, tables, strict=False):
        modified = known(listing.get(key))
        if cutoff is None or modified is None or modified >= cutoff:
            tomb = pc.fill_null(table["tombstone"], False)
            young.update(table["checkpoint_id"].filter(tomb).to_pylist())
    return young


def _sessions(store: Store, session_id: str | None, user_id: str | None) -> list[tuple[str | None, str]]:
    if session_id is not None:
        validate_id(session_id, "session_id")  # even when no session exists to match
    users = [user_segment(user_id)] if user_id is not None else store.objects.list_dirs(prefix="sessions/")
    out = []
    for seg in users:
        if session_id is not None:
            out.append((user_from_segment(seg), validate_id(session_id, "session_id")))
        else:
            out.extend((user_from_segment(seg), s) for s in store.objects.list_dirs(prefix=f"sessions/{seg}/"))
    return out


def prune(store: Store, *, before: datetime | None, session_id: str | None, user_id: str | None) -> PruneReport:
    """Delete checkpoints, journal entries and run records matching every given filter, tombstoning index rows.

    With ``before``, recovery of an unfinished run is never broken: when a
    session's last run has not finished, its journal, its run record, the
    journal it replays, the checkpoint it started from (also in another
    session being pruned, for a fork) and the session's latest checkpoint all
    stay, whatever their age; so do the run records the session's last run is
    chosen among (:func:`storage.journal.last_run_window`), so prune never
    changes which run is last. Without ``before`` everything matching goes.

    A run may start while prune works (a ``resume`` from an old checkpoint).
    So, with ``before``, a session's checkpoint objects are read, then
    deleted, and only then are its recovery needs checked again (with the run
    records then in the store): what a run recorded meanwhile is put back
    (objects, and journal entries its run replays) before the remaining rows
    are tombstoned. A run that records itself after that check finds its base
    checkpoint gone when :meth:`storage.store.Store.run_create` looks for it
    right after its record, and stops before its first step; so a run never
    works from a base that prune deletes. Each deleted checkpoint costs one
    more GET than its DELETE; forks started during the prune into other
    sessions are not looked for.
    """
    cutoff = as_utc(before) if before is not None else None
    scope = _sessions(store, session_id, user_id)
    kept_runs: dict[tuple[str | None, str], set[str]] = {}
    kept_checkpoints: set[tuple[str | None, str, str]] = set()
    #: Sessions in scope whose unfinished last run forks from another session's checkpoint (checked again too).
    forks: dict[tuple[str | None, str], list[tuple[str | None, str]]] = defaultdict(list)
    if cutoff is not None:
        kept_runs, kept_checkpoints = _recovery_needs(store, scope, forks)
    n_ckpt = n_journal = n_runs = 0
    for uid, sid in scope:
        rows = list(store._live_rows(sid, uid).values())
        spared = _spared(uid, sid, rows, kept_runs, kept_checkpoints)
        doomed = [r for r in rows if (cutoff is None or r.created_at < cutoff) and r.checkpoint_id not in spared]
        held: dict[str, bytes] = {}
        if cutoff is None:
            # Orphaned objects (written, index row lost in a crash) go too when everything goes.
            doomed_keys = {r.key for r in doomed}
            doomed_keys |= {o.key for o in store.objects.list(prefix=layout.session_prefix(sid, uid) + "checkpoints/")}
            store._retire(sid, uid, doomed)  # objects, tombstones, and the retention view
            orphans = sorted(doomed_keys - {r.key for r in doomed})
            if orphans:
                store.objects.delete(keys=orphans)
            n_ckpt += len(doomed_keys)
        elif doomed:
            # Objects first, rows later (below): a run recorded meanwhile may need one back.
            held = _read_objects(store, [r.key for r in doomed])
            store.objects.delete(keys=[r.key for r in doomed])

        kept = tuple(layout.journal_prefix(sid, uid, r) for r in kept_runs.get((uid, sid), ()))
        keys = [o.key for o in store.objects.list(prefix=layout.journal_prefix(sid, uid)) if not o.key.startswith(kept)]
        entries = {}
        older: list[tuple[int, str]] = []
        if cutoff is not None:
            last, older, _ = last_run_window(store, sid, uid)
            last_id = last.run_id if last is not None else _legacy_last_run(store, sid, uid)
            entries = load_entries(store, keys)
            # The last run's run_end stays: without it a finished run would read as unfinished, and be run again.
            keys = [k for k in keys if k in entries and as_utc(entries[k].created_at) < cutoff
                    and not (entries[k].kind == RUN_END and entries[k].run_id == last_id)]
        if keys:
            store.objects.delete(keys=keys)

        records = _doomed_records(store, sid, uid, cutoff, older, kept_runs.get((uid, sid), set()))
        if records:
            store.objects.delete(keys=records)
        n_runs += len(records)

        if cutoff is not None and (doomed or keys):
            # What recovery needs now, after the deletes: a run recorded since the first look gets back what
            # it names. (Deleted records are never among those the last run is chosen from: no record returns.)
            runs_now, ckpts_now = _recovery_needs(store, [(uid, sid), *forks.get((uid, sid), ())])
            wanted = _spared(uid, sid, rows, runs_now, ckpts_now)
            back = [r for r in doomed if r.checkpoint_id in wanted and r.key in held]
            for row in back:
                store.objects.put(key=row.key, data=held[row.key])
            replayed = runs_now.get((uid, sid), set())
            restored = [k for k in keys if entries[k].run_id in replayed]
            for key in restored:
                _restore_entry(store, key, entries[key])
            if back or restored:
                log.warning("prune of session %r put back %d checkpoint(s) and %d journal entr%s that a run "
                            "started meanwhile needs", sid, len(back), len(restored),
                            "y" if len(restored) == 1 else "ies")
            doomed = [r for r in doomed if r not in back]
            keys = sorted(set(keys) - set(restored))
            store._retire(sid, uid, doomed)  # tombstones (and the retention view); the objects are gone
            n_ckpt += len(doomed)
        n_journal += len(keys)
    return PruneReport(checkpoints=n_ckpt, journal_entries=n_journal, run_records=n_runs)


def _recovery_needs(store: Store, sessions: list[tuple[str | None, str]],
                    forks: dict[tuple[str | None, str], list[tuple[str | None, str]]] | None = None
                    ) -> tuple[dict[tuple[str | None, str], set[str]], set[tuple[str | None, str, str]]]:
    """What recovering the unfinished last run of each of ``sessions`` needs: run ids whose journal and record
    stay, per session; and ``(user, session, checkpoint)`` of the checkpoints they start from. ``forks``
    (when given) gets, per session, the sessions whose run starts from one of its checkpoints."""
    kept_runs: dict[tuple[str | None, str], set[str]] = {}
    kept_checkpoints: set[tuple[str | None, str, str]] = set()
    for uid, sid in sessions:
        needs = unfinished_last_run(store, sid, uid)
        if needs is None:
            continue
        kept_runs[(uid, sid)] = {r for r in (needs.run_id, needs.replay_from) if r}
        if needs.base_checkpoint_id and needs.base_session_id:
            kept_checkpoints.add((uid, needs.base_session_id, needs.base_checkpoint_id))
            if forks is not None and needs.base_session_id != sid:
                forks[(uid, needs.base_session_id)].append((uid, sid))
    return kept_runs, kept_checkpoints


def _spared(uid: str | None, sid: str, rows: list[CheckpointRow], kept_runs: dict[tuple[str | None, str], set[str]],
            kept_checkpoints: set[tuple[str | None, str, str]]) -> set[str]:
    """Checkpoint ids of ``rows`` (session ``sid``'s) that recovery needs: bases, and the latest when unfinished."""
    spared = {cid for u, s, cid in kept_checkpoints if (u, s) == (uid, sid)}
    if (uid, sid) in kept_runs and rows:
        # An unfinished run resumes from the session's latest checkpoint (the newest it wrote).
        spared.add(max(rows, key=lambda r: r.order).checkpoint_id)
    return spared


def _read_objects(store: Store, keys: list[str]) -> dict[str, bytes]:
    """The bytes of ``keys`` that exist (read in parallel), to put back what a run started meanwhile needs."""
    def read(key: str) -> bytes | None:
        obj = store.objects.get(key=key)
        return None if obj is None else obj.data

    datas = store.index._pool.map(read, keys) if len(keys) > 2 else map(read, keys)
    return {k: d for k, d in zip(keys, datas, strict=False) if d is not None}


def _restore_entry(store: Store, key: str, entry: JournalEntry) -> None:
    try:
        store.objects.put(key=key, data=entry.__pydantic_serializer__.to_json(entry), if_none_match=True)
    except PreconditionFailed:
        pass  # already there again: nothing to put back


def _legacy_last_run(store: Store, sid: str, uid: str | None) -> str | None:
    """The last run of a session without run records: its last journal run id in sorted order."""
    runs = store.objects.list_dirs(prefix=layout.journal_prefix(sid, uid))
    return runs[-1] if runs else None


def _doomed_records(store: Store, sid: str, uid: str | None, cutoff: datetime | None,
                    older: list[tuple[int, str]], kept_runs: set[str]) -> list[str]:
    """Run record keys prune deletes: all without a cutoff; else the ``older`` ones (not among those the last run
    is chosen from: the newest also anchors the next slot number) past the cutoff, sparing kept runs."""
    if cutoff is None:
        return sorted(o.key for o in store.objects.list(prefix=layout.run_prefix(sid, uid)))
    doomed = []
    for _, rec_key in older:
        obj = store.objects.get(key=rec_key)
        if obj is None:
            continue
        try:
            rec = RunRecord.model_validate_json(obj.data)
        except ValueError:
            continue  # unreadable: not ours to judge by age; readers skip it
        if rec.run_id not in kept_runs and as_utc(rec.created_at) < cutoff:
            doomed.append(rec_key)
    return doomed
