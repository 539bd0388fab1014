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
"""

from __future__ import annotations

import logging
import time
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime, timedelta
from typing import TYPE_CHECKING

import pyarrow as pa
import pyarrow.compute as pc

from storage import layout
from storage.ids import user_from_segment, user_segment, validate_id
from storage.index import compact_checkpoint_partition, conform
from storage.errors import PreconditionFailed
from storage.journal import RUN_END, last_run_window, load_entries, unfinished_last_run
from storage.rows import (CHECKPOINT_SCHEMA, SESSION_SCHEMA, CheckpointRow, CompactReport, JournalEntry, PruneReport,
                          RunRecord, as_utc, utcnow)

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


def compact(store: "Store", *, tombstone_grace: timedelta | None = None) -> CompactReport:
    """Merge every index partition holding more than one file (or applicable tombstones) into one file.

    ``tombstone_grace`` (default :data:`TOMBSTONE_GRACE`): how long tombstones
    outlive their rows; ``timedelta(0)`` drops them at once and is safe only
    when no other compaction can run at the same time. ``rows`` in the report
    counts live rows kept, not the tombstones kept.
    """
    grace = TOMBSTONE_GRACE if tombstone_grace is None else tombstone_grace
    if not isinstance(grace, timedelta) or grace < timedelta(0):
        raise ValueError(f"tombstone_grace must be a non-negative timedelta, got {tombstone_grace!r}")
    # A merge must be written within half the grace of its partition's LIST (else abandoned), so any
    # compactor still holding a row read before its tombstone existed is done before that tombstone goes.
    max_lag = grace.total_seconds() / 2
    files_before = files_after = rows = dropped = 0
    for kind, schema in (("checkpoints", CHECKPOINT_SCHEMA), ("sessions", SESSION_SCHEMA)):
        listed_wall, listed_at = utcnow(), _clock()  # taken before the LIST: tombstones written during it are young
        listing = {o.key: o.modified for o in store.index.list_infos(f"index/{kind}/")}
        groups = _partitions(list(listing))
        files_before += sum(len(v) for v in groups.values())

        def merge(item: tuple[str, list[str]], listing: dict[str, datetime | None] = listing
                  ) -> tuple[int, int, int]:
            partition, keys = item
            wall, started = listed_wall, listed_at
            if max_lag and _clock() - started > max_lag / 2:
                # This partition's turn came long after the big LIST: list it afresh, so its lag is its own.
                wall, started = utcnow(), _clock()
                fresh = {o.key: o.modified for o in store.index.list_infos(partition)}
                keys, listing = list(fresh), {**listing, **fresh}
            vanished: list[str] = []
            pairs = store.index.read_files(keys, cache=False, vanished=vanished)
            if vanished:
                # Another compaction merged (and deleted) files of this listing: it owns the partition now.
                log.info("compaction skips %s: listed files vanished (another compaction merged them)",
                         store.describe(partition))
                return len(keys) - len(vanished), 0, 0
            tables = [conform(t, schema) for _, t in pairs]
            table = pa.concat_tables(tables) if tables else schema.empty_table()
            if kind == "checkpoints":
                merged, applied = compact_checkpoint_partition(
                    table, keep_tombstones_since=wall - grace if grace else None,
                    young_ids=_young_tombstones(pairs, tables, listing, grace) if grace else ())
                live = merged.num_rows - pc.sum(merged["tombstone"]).as_py() if merged.num_rows else 0
            else:
                # Session rows arrive in file order; the latest-written row per session is its state.
                merged, applied = _latest_session_rows(table), 0
                live = merged.num_rows
            if len(pairs) <= 1 and applied == 0 and merged.num_rows == table.num_rows:
                return len(keys), live, 0  # already compact
            if max_lag and _clock() - started > max_lag:
                log.warning("compaction skips %s: its merge would land %.0f s after its LIST (limit %.0f s, half "
                            "the tombstone grace)", store.describe(partition), _clock() - started, max_lag)
                return len(keys), live, 0
            if merged.num_rows:
                merged_key = store.index.write(partition, merged, suffix="-c", cache=False)
                if max_lag and _clock() - started > max_lag:
                    # It landed too late after all (a pause between the check above and the PUT): a concurrent
                    # compaction may have dropped a tombstone this merge's rows predate. Take it back: every row
                    # it holds is still in its sources (or in the merge of whoever deleted them), so nothing is lost.
                    log.warning("compaction takes back its merge of %s: it landed %.0f s after its LIST (limit "
                                "%.0f s)", store.describe(partition), _clock() - started, max_lag)
                    store.objects.delete(keys=[merged_key])
                    return len(keys), live, 0
            # Delete only what was read and merged: a file that appeared after the LIST survives.
            store.objects.delete(keys=[k for k, _ in pairs])
            return (1 if merged.num_rows else 0) + (len(keys) - len(pairs)), live, applied

        # Its own pool: merge() reads through the index's pool, and nesting one pool in itself deadlocks.
        with ThreadPoolExecutor(max_workers=4, thread_name_prefix="storage-compact") as pool:
            results = list(pool.map(merge, groups.items()))
        for n_files, n_rows, n_applied in results:
            files_after += n_files
            rows += n_rows
            dropped += n_applied
    return CompactReport(files_before=files_before, files_after=files_after, rows=rows, tombstones_dropped=dropped)


def _young_tombstones(pairs: list[tuple[str, pa.Table]], tables: list[pa.Table],
                      listing: dict[str, datetime | None], grace: timedelta) -> set[str]:
    """Checkpoint ids of the tombstones read from files the store's clock says are younger than ``grace``.

    The store's "now" is the newest modification time in ``listing`` (a LIST
    shows only files written before it, so that is never later than the
    store's clock at the LIST). A file without a (zone-aware) modification time is young.
    """
    def known(m: datetime | None) -> datetime | None:
        return as_utc(m) if m is not None and m.tzinfo is not None else None  # naive: whose zone? unknown

    stamps = [m for m in map(known, listing.values()) if m is not None]
    cutoff = max(stamps) - grace if stamps else None
    young: set[str] = set()
    for (key, _), table in zip(pairs, tables):
        modified = known(listing.get(key))
        if cutoff is None or modified is None or modified >= cutoff:
            tomb = pc.fill_null(table["tombstone"], False)
            young.update(table["checkpoint_id"].filter(tomb).to_pylist())
    return young


def _sessions(store: "Store", session_id: str | None, user_id: str | None) -> list[tuple[str | None, str]]:
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


def prune(store: "Store", *, before: datetime | None, session_id: str | None, user_id: str | None) -> PruneReport:
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


def _recovery_needs(store: "Store", sessions: list[tuple[str | None, str]],
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


def _read_objects(store: "Store", keys: list[str]) -> dict[str, bytes]:
    """The bytes of ``keys`` that exist (read in parallel), to put back what a run started meanwhile needs."""
    def read(key: str) -> bytes | None:
        obj = store.objects.get(key=key)
        return None if obj is None else obj.data

    datas = store.index._pool.map(read, keys) if len(keys) > 2 else map(read, keys)
    return {k: d for k, d in zip(keys, datas) if d is not None}


def _restore_entry(store: "Store", key: str, entry: JournalEntry) -> None:
    try:
        store.objects.put(key=key, data=entry.__pydantic_serializer__.to_json(entry), if_none_match=True)
    except PreconditionFailed:
        pass  # already there again: nothing to put back


def _legacy_last_run(store: "Store", sid: str, uid: str | None) -> str | None:
    """The last run of a session without run records: its last journal run id in sorted order."""
    runs = store.objects.list_dirs(prefix=layout.journal_prefix(sid, uid))
    return runs[-1] if runs else None


def _doomed_records(store: "Store", sid: str, uid: str | None, cutoff: datetime | None,
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
