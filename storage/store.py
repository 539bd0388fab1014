"""``Store``: checkpoints, journal, run records, leases, session index and queries over one :class:`ObjectStore`.

Everything here is backend-neutral; the memory, local-directory and S3
adapters only move bytes. See the package docstring for the layout and the
partitioning choice. A ``Store`` is its sub-stores, each a small class over
the state it needs: ``store.checkpoints`` (:mod:`storage.checkpoints`),
``store.journal`` and ``store.runs`` (:mod:`storage.journaling`),
``store.leases`` (:mod:`storage.leasing`), ``store.sessions`` and
``store.active`` (:mod:`storage.sessions`). The store itself answers
queries across sessions and runs maintenance: compaction and prune
(:mod:`storage.maintenance`, :mod:`storage.pruning`).
"""

from __future__ import annotations

import logging
from datetime import datetime, timedelta
from types import EllipsisType
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from . import layout
from .checkpoint_rows import CheckpointRows
from .checkpoints import Checkpoints
from .errors import StorageError
from .heads import writer_rows
from .ids import user_from_segment, user_segment, validate_id
from .index import ParquetIndex
from .journaling import Journal, Runs
from .leases import LeaseKeeper
from .leasing import Leases
from .maintenance import IndexCompactReport, compact
from .objects import ObjectStore
from .pruning import Progress, PrunePlan, plan_prune, prune
from .rows import INDEX_BOOKKEEPING, PruneReport, as_utc
from .sessions import ANY, ActiveMarks, Sessions, UserFilter
from .table import TableCache, load_tables, with_staleness
from .table_query import read_for_query
from .tails import TailReader

log = logging.getLogger("storage")


class Store:
    """The storage API of docs/contracts.md: its sub-stores, plus queries and maintenance across sessions.

    All methods are synchronous and thread-safe.
    """

    def __init__(self, objects: ObjectStore, url: str, *, serial_reads: bool = False,
                 checkpoint_batch: int | None = None) -> None:
        self.objects = objects
        self.url = url
        #: The Parquet index files' reader and writer: the sub-stores' shared state, not part of the API.
        #: serial_reads: no reader threads; each storage call runs on the thread that asked (for tests).
        self._index = ParquetIndex(objects, serial_reads=serial_reads)
        #: Parsed compacted-table manifests and partitions (see :mod:`storage.table`).
        self.table_cache = TableCache()
        self._rows = CheckpointRows(objects, self._index)
        self._tails = TailReader(self._rows)
        self._leases = LeaseKeeper(objects, self._rows, self._tails.snapshot)
        #: ``checkpoint_batch``: checkpoints a log indexes at once (None: ``storage.checkpoint_log.INDEX_BATCH``).
        self.checkpoints = Checkpoints(objects, self._rows, self._tails, self._leases, batch=checkpoint_batch)
        self.journal = Journal(objects, self._index, self._leases)
        self.runs = Runs(objects, self._index)
        self.leases = Leases(self._leases)
        self.sessions = Sessions(objects, self._index)
        self.active = ActiveMarks(objects)
        # Which rows a session's running writer builds on is known from its run records (storage.chains).
        self._rows.writer_rows = lambda session_id, user_id: writer_rows(self, session_id, user_id)

    def describe(self, key: str | None = None) -> str:
        """Backend, root and (optionally) key, for messages and the CLI."""
        return self.objects.describe(key)

    def fsspec(self) -> tuple[Any, str]:
        """``(filesystem, root)``: e.g. ``pyarrow.dataset.dataset(root + "/index/checkpoints", filesystem=fs,
        partitioning="hive")``. Not available for ``memory://``;
        needs the ``[fsspec]`` extra (s3fs)."""
        return self.objects.fsspec()

    def drop_caches(self) -> None:
        """Forget every parsed index file and table partition, as a new process would (a cold reader: benchmarks)."""
        self._index.clear_cache()
        self._rows.clear_cache()
        self._tails.clear_cache()
        self.table_cache.clear()

    def close(self, *, keep_objects: bool = False) -> None:
        """Release reader threads and the backend's clients (``keep_objects``: not the backend, which another
        ``Store`` over the same ``objects`` still uses)."""
        self._index.close()
        if not keep_objects:
            self.objects.close()

    def __repr__(self) -> str:
        return f"Store({self.describe()})"

    # -- queries -----------------------------------------------------------
    def query(self, *, user_id: UserFilter = ANY, session_id: str | None = None, status: str | None = None,
              since: datetime | None = None, until: datetime | None = None, min_cost: float | None = None,
              max_cost: float | None = None, columns: list[str] | None = None) -> pa.Table:
        """Live checkpoint rows across sessions as an Arrow table (``user_id=...`` = any user; the filters and
        staleness: docs/contracts.md). Reads the compacted table's partitions of the days in range plus the
        uncompacted tail (the sessions whose per-session files changed since the last compaction), so it is as
        fresh as the per-session index; the rows are the live ones of :mod:`storage.visibility`."""
        segment = None if isinstance(user_id, EllipsisType) else user_segment(user_id)
        if session_id is not None:
            validate_id(session_id, "session_id")
        # Consistent with one LIST of the per-session files even while a compaction merges them.
        table_part, tail, stale = read_for_query(self, segment=segment, session_id=session_id, since=since,
                                                 until=until)
        # The tail as every reader sees it (storage.visibility): tombstones applied, fenced rows hidden.
        tail = self._tails.visible_rows(tail).drop_columns(list(INDEX_BOOKKEEPING))
        tail = tail.cast(table_part.schema)
        table = pa.concat_tables([table_part, tail]) if table_part.num_rows else tail
        mask = None
        for cond in (
            pc.equal(table["execution_status"], status) if status is not None else None,
            pc.greater_equal(table["created_at"], pa.scalar(as_utc(since), table["created_at"].type)) if since else None,
            pc.less(table["created_at"], pa.scalar(as_utc(until), table["created_at"].type)) if until else None,
            pc.greater_equal(table["cost_usd"], float(min_cost)) if min_cost is not None else None,
            pc.less_equal(table["cost_usd"], float(max_cost)) if max_cost is not None else None,
        ):
            if cond is not None:
                mask = cond if mask is None else pc.and_(mask, cond)
        if mask is not None:
            table = table.filter(pc.fill_null(mask, False))
        if columns:
            table = table.select(columns)
        return with_staleness(table, stale)

    def index_files(self, kind: str = "checkpoints") -> list[str]:
        """Keys of the index files of ``kind``: "checkpoints" or "sessions" (per-session append files), or
        "table" (the compacted table's partition files, see :mod:`storage.table`)."""
        if kind == "table":
            return self._index.list_files(layout.TABLE_INDEX)
        if kind not in ("checkpoints", "sessions"):
            raise ValueError(f"index kind must be 'checkpoints', 'sessions' or 'table', got {kind!r}")
        return self._index.list_files(f"index/{kind}/")

    # -- maintenance -------------------------------------------------------
    def compact(self, *, tombstone_grace: timedelta | None = None, users: list[str | None] | None = None
                ) -> IndexCompactReport:
        """Merge each changed partition's files into one and bring the compacted table up to date; tombstones
        younger than ``tombstone_grace`` (one hour) stay; ``users`` limits the work to those users (None = no
        user). Safe with concurrent writers and compactions (:mod:`storage.maintenance`)."""
        return compact(self, tombstone_grace=tombstone_grace, users=users)

    def plan_prune(self, before: datetime | None = None, session_id: str | None = None,
                   user_id: str | None = None, *, progress: Progress | None = None) -> PrunePlan:
        """What :meth:`prune` with these filters would delete, read without deleting anything.

        The very selection ``prune`` makes (see :func:`storage.pruning.plan_prune`);
        ``progress(items, label)`` wraps each pass over the sessions in scope.
        """
        return plan_prune(self, before=before, session_id=session_id, user_id=user_id, progress=progress)

    def prune(self, before: datetime | None = None, session_id: str | None = None,
              user_id: str | None = None) -> PruneReport:
        """Delete checkpoints, journal entries and run records matching all filters (None = any), nothing else,
        and the records of those sessions' explorations once over (:mod:`storage.prune_explorations`); never
        what recovery of an unfinished last run needs (:func:`storage.pruning.prune`). Then the compacted table
        of every user in scope is compacted, so readers of the bucket no longer see pruned rows."""
        report = prune(self, before=before, session_id=session_id, user_id=user_id)
        try:
            prefix = layout.TABLE_INDEX if user_id is None else layout.table_user_prefix(user_id)
            users = [user_from_segment(seg) for seg, ut in load_tables(self, prefix).items()
                     if ut.manifest is not None or ut.parts]
            if users:
                compact(self, users=users)
        except StorageError as e:
            log.warning("prune done; the compacted table still shows pruned rows until the next compaction: %s", e)
        return report


__all__ = ["ANY", "Store"]
