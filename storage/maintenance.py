"""Maintenance over a :class:`~storage.store.Store`: ``compact``.

Compaction merges only the files it listed, writes the merged file, then
deletes exactly those, so a row written meanwhile survives and a crash
between write and delete leaves duplicates readers drop. Against concurrent
compactions it keeps every tombstone younger than a grace period, judged by
the store's modification times (a writer's ``written_at`` may be skewed),
and bounds its own lag to half the grace: a partition whose merge would land
later, or whose listed files vanished, is abandoned, and a merge that landed
late anyway is deleted again before any of its sources. A foreign file in an
index partition is quarantined with a warning; the rest merges as usual.
The compacted table (:mod:`storage.table`) and the session-status table are
brought up to date by the same pass, reading only sessions that changed; a
merge that leaves a partition's compacted file out keeps every tombstone it
reads, so it never drops one whose row is in that file (docs/design.md
"The index: two tiers").
"""

from __future__ import annotations

import logging
import time
from collections import defaultdict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, TypeVar

from . import layout
from .ids import user_segment
from .index import SerialPool, serial_backend
from .partition_merge import MergeItem, MergeResult, PartitionMerger, base_file, listing_now
from .rows import CHECKPOINT_SCHEMA, SESSION_SCHEMA, CompactReport, as_utc, utcnow
from .session_table import publish_session_tables
from .table import UserTable, load_tables, table_clock
from .table_publish import Published, SessionRead, publish

if TYPE_CHECKING:
    from .store import Store

log = logging.getLogger("storage")
R = TypeVar("R")

#: A compaction keeps tombstones younger than this (see the module docstring).
TOMBSTONE_GRACE = timedelta(hours=1)
_clock = time.monotonic  # module-level so tests can move time forward without waiting


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


def _pool(store: Store) -> ThreadPoolExecutor | SerialPool:
    """Where a compaction merges partitions: 4 threads for a remote store, the calling thread for a local one."""
    if serial_backend(store.objects):
        return SerialPool()
    return ThreadPoolExecutor(max_workers=4, thread_name_prefix="storage-compact")


def _partitions(keys: list[str]) -> dict[str, list[str]]:
    groups: dict[str, list[str]] = defaultdict(list)
    for key in keys:
        groups[key.rsplit("/", 1)[0] + "/"].append(key)
    return groups


def _ids_of(partition: str) -> tuple[str | None, str]:
    """``(user segment, session id)`` of a checkpoint partition prefix; ``(None, "")`` for anything else."""
    parts = partition[len(layout.CHECKPOINT_INDEX):].rstrip("/").split("/")
    if len(parts) != 2 or not parts[0].startswith("user=") or not parts[1].startswith("session="):
        return None, ""
    return parts[0][len("user="):], parts[1][len("session="):]


class _Helpers:
    """A local compaction's helper threads: one deletes the files it merged, two write users' tables.

    Deleting a file whose pages the kernel is still writing back waits for that
    I/O, so deletes run beside the merges and all finish (the first failure
    raised) before ``compact()`` returns; until then readers drop the repeated
    rows, as after a crash between write and delete. Users' table writes are
    mostly Parquet encoding outside the interpreter lock, and each user has its
    own manifest and compare-and-swap, so two overlap. Remote and memory stores
    and ``serial_reads`` use no helpers.
    """

    def __init__(self, store: Store) -> None:
        self.store = store
        local = store.objects.backend == "file" and not store._index.serial  # memory: nothing to wait for
        self.deleter = ThreadPoolExecutor(max_workers=1, thread_name_prefix="storage-delete") if local else None
        self.writers = ThreadPoolExecutor(max_workers=2, thread_name_prefix="storage-publish") if local else None
        self.pending: list[Future[None]] = []

    def delete(self, keys: list[str]) -> None:
        if self.deleter is None:
            self.store.objects.delete(keys=keys)
        else:
            self.pending.append(self.deleter.submit(self.store.objects.delete, keys=keys))

    def each_user(self, publish: Callable[[str], R], segments: list[str]) -> list[R]:
        """``publish`` of each user's table: two users at a time on a local store, in order otherwise."""
        if self.writers is None or len(segments) < 2:
            return [publish(seg) for seg in segments]
        return list(self.writers.map(publish, segments))

    def __enter__(self) -> _Helpers:
        return self

    def __exit__(self, exc_type: object, *exc: object) -> None:
        for pool in (self.writers, self.deleter):
            if pool is not None:
                pool.shutdown(wait=True)
        if exc_type is None:
            for f in self.pending:
                f.result()  # a delete that failed fails the compaction, as it did when it ran inline


@dataclass
class _Compaction:
    """One ``compact()``: its scope and limits, and the counts its report gives."""

    store: Store
    grace: timedelta
    segments: list[str] | None
    #: A merge must be written within this many seconds of its partition's LIST (else abandoned), so any
    #: compactor still holding a row read before its tombstone existed is done before that tombstone goes.
    max_lag: float
    helpers: _Helpers
    files_before: int = 0
    files_after: int = 0
    rows: int = 0
    dropped: int = 0
    #: The checkpoint LIST's wall and monotonic times, the users' tables, what was listed and read per user.
    listed_wall: datetime = field(default_factory=utcnow)
    listed_at: float = 0.0
    #: The table clock right after the checkpoint LIST: what write-phase intents are judged by.
    now: datetime = field(default_factory=table_clock)
    tables: dict[str, UserTable] = field(default_factory=dict)
    listed: dict[str, dict[str, tuple[str, ...]]] = field(default_factory=lambda: defaultdict(dict))
    reads: dict[str, dict[str, SessionRead]] = field(default_factory=lambda: defaultdict(dict))

    def prefixes(self, root: str) -> list[str]:
        return [f"{root}user={seg}/" for seg in self.segments] if self.segments is not None else [root]

    def merge_all(self, merger: PartitionMerger, work: list[MergeItem]) -> list[MergeResult]:
        # Its own pool: a merge reads through the index's pool, and nesting one pool in itself deadlocks.
        with _pool(self.store) as pool:
            results = list(pool.map(merger, work))
        for n_files, n_rows, n_applied, _ in results:
            self.files_after += n_files
            self.rows += n_rows
            self.dropped += n_applied
        return results

    def sessions(self) -> None:
        """Session status rows: the latest row per session; a one-file partition is compact already."""
        listed_wall, listed_at = utcnow(), _clock()
        listing = {o.key: o.modified for p in self.prefixes(layout.SESSION_INDEX)
                   for o in self.store._index.list_infos(p)}
        groups = _partitions(list(listing))
        self.files_before += sum(len(v) for v in groups.values())
        merger = PartitionMerger(self.store, SESSION_SCHEMA, self.grace, self.max_lag, listed_wall, listed_at,
                                 listing, _clock, self.helpers.delete)
        self.merge_all(merger, [(p, k, False, None, None) for p, k in groups.items() if len(k) > 1])
        self.files_after += sum(len(k) for k in groups.values() if len(k) <= 1)
        self.rows += sum(len(k) for k in groups.values() if len(k) <= 1)

    def checkpoints(self) -> None:
        """Checkpoint rows: merge the per-session partitions whose files changed since the table absorbed them."""
        for p in self.prefixes(layout.TABLE_INDEX):  # before the per-session LIST: the reads below are newer
            self.tables.update(load_tables(self.store, p))
        # Before the LIST: tombstones written during it are young.
        self.listed_wall, self.listed_at = utcnow(), _clock()
        infos = [o for p in self.prefixes(layout.CHECKPOINT_INDEX) for o in self.store._index.list_infos(p)]
        listing = {o.key: o.modified for o in infos}
        groups = _partitions(list(listing))
        self.files_before += sum(len(v) for v in groups.values())
        self.now = table_clock()
        work = self._work(groups, listing, {o.key: o.size for o in infos})
        merger = PartitionMerger(self.store, CHECKPOINT_SCHEMA, self.grace, self.max_lag, self.listed_wall,
                                 self.listed_at, listing, _clock, self.helpers.delete)
        for (partition, *_), (_, _, _, read) in zip(work, self.merge_all(merger, work), strict=False):
            seg, sid = _ids_of(partition)
            if read is not None and seg is not None:  # a read is only asked of session partitions
                self.reads[seg][sid] = read

    def _work(self, groups: dict[str, list[str]], listing: dict[str, datetime | None],
              sizes: dict[str, int]) -> list[MergeItem]:
        """The partitions to merge; the rest are compact and absorbed by the table as they are (not read)."""
        store_now = listing_now(listing)
        work: list[MergeItem] = []
        for partition, keys in groups.items():
            seg, sid = _ids_of(partition)
            if seg is None:
                work.append((partition, keys, False, None, None))  # not a session partition: merge as before
                continue
            ut = self.tables.setdefault(seg, UserTable(seg))
            names = tuple(sorted(k.rsplit("/", 1)[1] for k in keys))
            self.listed[seg][sid] = names
            known = ut.manifest.sessions.get(sid) if ut.manifest is not None else None
            rebuild = not ut.busy(self.now) and ut.needs_rebuild(self.now) is not None
            due = known is not None and known.tombs and (not self.grace or store_now is None or all(
                (m := listing[k]) is None or as_utc(m) < store_now - self.grace for k in keys))
            if rebuild or due or known is None or names != known.files:
                work.append((partition, keys, True, known,
                             None if rebuild or due or known is None else base_file(keys, known, sizes)))
            else:
                self.files_after += len(keys)
                self.rows += known.rows
        return work

    def publish_tables(self) -> tuple[int, int, int, int]:
        """Each user's compacted table brought up to date: ``(partitions, rows, users committed, skipped)``."""
        def late() -> bool:
            return bool(self.max_lag) and _clock() - self.listed_at > self.max_lag

        def one(seg: str) -> Published:
            ut = self.tables[seg]
            if ut.busy(self.now):
                log.info("table of user %r: another compaction is writing it; skipped", seg)
                return Published("busy")
            reason = ut.needs_rebuild(self.now)
            if reason is not None and ut.manifest is not None:
                log.warning("table of user %r is rebuilt from the per-session index: %s", seg, reason)
            done = publish(self.store, ut, self.listed.get(seg, {}), self.reads.get(seg, {}),
                           rebuild=reason is not None, listed_wall=self.listed_wall, deadline=late)
            if done.outcome == "late":
                log.warning("table of user %r not written: its reads are older than %.0f s (half the "
                            "tombstone grace)", seg, self.max_lag)
            return done

        segs = sorted(set(self.listed) | {s for s, ut in self.tables.items() if ut.manifest is not None or ut.parts})
        for seg in segs:
            self.tables.setdefault(seg, UserTable(seg))
        parts = rows = committed = skipped = 0
        for done in self.helpers.each_user(one, segs):
            if done.outcome == "committed":
                committed += 1
                parts += done.partitions
                rows += done.rows
            elif done.outcome != "clean":
                skipped += 1
        return parts, rows, committed, skipped


def compact(store: Store, *, tombstone_grace: timedelta | None = None,
            users: list[str | None] | None = None) -> IndexCompactReport:
    """Merge index partitions and bring the compacted table up to date; only what changed is read.

    A partition whose files changed since the table absorbed them (or whose
    tombstones may go) is merged into one file; when only appends came since,
    smaller than its compacted file, they are merged among themselves
    (:func:`storage.partition_merge.base_file`). Each user's table partitions
    on which changed sessions' rows changed are rewritten. ``users`` (user ids,
    None = no user) limits both to those users. ``tombstone_grace`` (default
    :data:`TOMBSTONE_GRACE`): ``timedelta(0)`` drops tombstones at once, safe
    only when no other compaction can run meanwhile. The report's ``rows``
    counts live rows kept.
    """
    grace = TOMBSTONE_GRACE if tombstone_grace is None else tombstone_grace
    if not isinstance(grace, timedelta) or grace < timedelta(0):
        raise ValueError(f"tombstone_grace must be a non-negative timedelta, got {tombstone_grace!r}")
    segments = None if users is None else sorted({user_segment(u) for u in users})
    with _Helpers(store) as helpers:
        run = _Compaction(store, grace, segments, grace.total_seconds() / 2, helpers)
        run.sessions()
        publish_session_tables(store, segments)
        run.checkpoints()
        parts, rows, committed, skipped = run.publish_tables()
    return IndexCompactReport(files_before=run.files_before, files_after=run.files_after, rows=run.rows,
                              tombstones_dropped=run.dropped, table_partitions=parts, table_rows=rows,
                              table_users=committed, table_skipped=skipped)
