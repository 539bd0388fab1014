"""Maintenance over a :class:`~storage.store.Store`: ``compact`` and ``prune``.

Compaction is safe against concurrent writers: it merges only the files it
listed, writes the merged file, then deletes exactly those files. A row
written meanwhile lives in a file compaction never saw, so it survives; a
crash between write and delete leaves duplicates that readers drop.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime
from typing import TYPE_CHECKING

import pyarrow as pa

from storage import layout
from storage.ids import user_from_segment, user_segment, validate_id
from storage.index import compact_checkpoint_partition, conform
from storage.rows import CHECKPOINT_SCHEMA, SESSION_SCHEMA, CompactReport, PruneReport, as_utc

if TYPE_CHECKING:
    from storage.store import Store

log = logging.getLogger("storage")


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


def compact(store: "Store") -> CompactReport:
    """Merge every index partition holding more than one file (or applicable tombstones) into one file."""
    files_before = files_after = rows = dropped = 0
    for kind, schema in (("checkpoints", CHECKPOINT_SCHEMA), ("sessions", SESSION_SCHEMA)):
        groups = _partitions(store.index_files(kind))
        files_before += sum(len(v) for v in groups.values())

        def merge(item: tuple[str, list[str]]) -> tuple[int, int, int]:
            partition, keys = item
            pairs = store.index.read_files(keys, cache=False)
            tables = [conform(t, schema) for _, t in pairs]
            table = pa.concat_tables(tables) if tables else schema.empty_table()
            if kind == "checkpoints":
                merged, applied = compact_checkpoint_partition(table)
            else:
                # Session rows arrive in file order; the latest-written row per session is its state.
                merged, applied = _latest_session_rows(table), 0
            if len(pairs) <= 1 and applied == 0 and merged.num_rows == table.num_rows:
                return len(keys), table.num_rows, 0  # already compact
            if merged.num_rows:
                store.index.write(partition, merged, suffix="-c", cache=False)
            # Delete only what was read and merged: a file that appeared after the LIST survives.
            store.objects.delete(keys=[k for k, _ in pairs])
            return (1 if merged.num_rows else 0) + (len(keys) - len(pairs)), merged.num_rows, applied

        # Its own pool: merge() reads through the index's pool, and nesting one pool in itself deadlocks.
        with ThreadPoolExecutor(max_workers=4, thread_name_prefix="storage-compact") as pool:
            results = list(pool.map(merge, groups.items()))
        for n_files, n_rows, n_applied in results:
            files_after += n_files
            rows += n_rows
            dropped += n_applied
    return CompactReport(files_before=files_before, files_after=files_after, rows=rows, tombstones_dropped=dropped)


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
    """Delete checkpoints and journal entries matching every given filter, tombstoning their index rows."""
    cutoff = as_utc(before) if before is not None else None
    n_ckpt = n_journal = 0
    for uid, sid in _sessions(store, session_id, user_id):
        rows = list(store._live_rows(sid, uid).values())
        doomed = [r for r in rows if cutoff is None or r.created_at < cutoff]
        doomed_keys = {r.key for r in doomed}
        if cutoff is None:
            # Orphaned objects (written, index row lost in a crash) go too when everything goes.
            doomed_keys |= {o.key for o in store.objects.list(prefix=layout.session_prefix(sid, uid) + "checkpoints/")}
        store._retire(sid, uid, doomed)  # objects, tombstones, and the retention view
        orphans = sorted(doomed_keys - {r.key for r in doomed})
        if orphans:
            store.objects.delete(keys=orphans)
        n_ckpt += len(doomed_keys)

        keys = [o.key for o in store.objects.list(prefix=layout.journal_prefix(sid, uid))]
        if cutoff is not None:
            entries = {layout.journal_key(e.session_id, e.user_id, e.run_id, e.seq, e.step_key): e
                       for e in store._read_entries(keys)}
            keys = [k for k in keys if k in entries and as_utc(entries[k].created_at) < cutoff]
        if keys:
            store.objects.delete(keys=keys)
        n_journal += len(keys)
    return PruneReport(checkpoints=n_ckpt, journal_entries=n_journal)

