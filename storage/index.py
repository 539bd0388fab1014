"""The Parquet index: append-only row files per session partition, compaction, queries.

Every write appends one small immutable Parquet file to its session's
partition (``index/{kind}/user={u}/session={s}/{written_ns}-{rand}.parquet``);
retention, prune and delete append tombstone files. Files are never modified,
so a parsed file can be cached by key forever (until LIST stops showing it).
Readers deduplicate identical rows, which makes a compaction interrupted
between "write merged file" and "delete sources" harmless.
"""

from __future__ import annotations

import io
import logging
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from storage.errors import CorruptObjectError
from storage.objects import ObjectStore

log = logging.getLogger("storage.index")

_CACHE_FILES = 8192
_READ_THREADS = 16


def new_file_name(suffix: str = "") -> str:
    """A unique, time-ordered index file name."""
    return f"{time.time_ns():019d}-{os.urandom(4).hex()}{suffix}.parquet"


def encode(table: pa.Table) -> bytes:
    """One Parquet file's bytes.

    A write's own file (a row or a few) skips compression, dictionaries and
    statistics: they cost ~1 ms and bytes for nothing on one row. Compacted
    files get zstd, dictionaries and statistics, so readers can skip row groups.
    """
    sink = io.BytesIO()
    if table.num_rows < 1000:
        pq.write_table(table, sink, compression="none", use_dictionary=False, write_statistics=False,
                       store_schema=False)
    else:
        pq.write_table(table, sink, compression="zstd", row_group_size=256 * 1024)
    return sink.getvalue()


class ParquetIndex:
    """Reads and writes index files through an :class:`ObjectStore` (one code path for every backend)."""

    def __init__(self, objects: ObjectStore) -> None:
        self.objects = objects
        self._cache: OrderedDict[str, pa.Table] = OrderedDict()
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(max_workers=_READ_THREADS, thread_name_prefix="storage-index")

    def close(self) -> None:
        self._pool.shutdown(wait=False)

    # -- write -----------------------------------------------------------
    def write(self, partition: str, table: pa.Table, *, suffix: str = "", cache: bool = True) -> str:
        """Append ``table`` as a new file in ``partition``; visible to readers when this returns."""
        key = partition + new_file_name(suffix)
        self.objects.put(key=key, data=encode(table))
        if cache:
            self._remember(key, table)
        return key

    def _remember(self, key: str, table: pa.Table) -> None:
        with self._lock:
            self._cache[key] = table
            self._cache.move_to_end(key)
            while len(self._cache) > _CACHE_FILES:
                self._cache.popitem(last=False)

    # -- read ------------------------------------------------------------
    def list_files(self, prefix: str) -> list[str]:
        """Index file keys under ``prefix``, in name (write) order within a partition."""
        return [o.key for o in self.objects.list(prefix=prefix) if o.key.endswith(".parquet")]

    def read_file(self, key: str, *, cache: bool = True) -> pa.Table | None:
        """One file's table; ``None`` (with a warning) if it vanished or is unreadable."""
        with self._lock:
            hit = self._cache.get(key)
        if hit is not None:
            return hit
        obj = self.objects.get(key=key)
        if obj is None:
            return None  # compacted away between LIST and GET
        try:
            # ParquetFile.read without inner threads is ~4x cheaper than read_table for small files;
            # parallelism comes from reading many files at once.
            table = pq.ParquetFile(pa.BufferReader(obj.data)).read(use_threads=False)
        except Exception as e:  # pyarrow raises several types for bad bytes
            log.warning("skipping unreadable index file: %s", CorruptObjectError(f"{self.objects.describe(key)}: {e}"))
            return None
        if cache:
            self._remember(key, table)
        return table

    def read_files(self, keys: Iterable[str], *, cache: bool = True) -> list[tuple[str, pa.Table]]:
        """Tables of ``keys`` (read in parallel), skipping vanished and unreadable files."""
        keys = list(keys)
        if len(keys) <= 2:
            tables = [self.read_file(k, cache=cache) for k in keys]
        else:
            tables = list(self._pool.map(lambda k: self.read_file(k, cache=cache), keys))
        return [(k, t) for k, t in zip(keys, tables) if t is not None]

    def read_prefix(self, prefix: str, schema: pa.Schema, *, cache: bool = True) -> tuple[list[str], pa.Table]:
        """All files under ``prefix`` as one table (schema-aligned), and the keys read."""
        return self.read_keys(self.list_files(prefix), schema, cache=cache)

    def read_keys(self, keys: list[str], schema: pa.Schema, *, cache: bool = True) -> tuple[list[str], pa.Table]:
        """Files ``keys`` as one table in ``schema``; files of a foreign schema are skipped with a warning."""
        pairs = self.read_files(keys, cache=cache)
        tables = []
        for key, t in pairs:
            try:
                tables.append(conform(t, schema))
            except (KeyError, pa.ArrowInvalid, pa.ArrowTypeError) as e:
                log.warning("skipping index file with a foreign schema: %s: %s", self.objects.describe(key), e)
        table = pa.concat_tables(tables) if tables else schema.empty_table()
        return [k for k, _ in pairs], table


def _keyed(table: pa.Table) -> pa.Table:
    """Add ``__u`` (user_id with null as "") so joins match "no user" rows: SQL joins never match nulls."""
    return table.append_column("__u", pc.fill_null(table["user_id"], ""))


_JOIN = ["__u", "session_id", "checkpoint_id"]


def conform(table: pa.Table, schema: pa.Schema) -> pa.Table:
    """``table`` in exactly ``schema`` (column order and types); a no-op for files this package wrote."""
    if table.schema.equals(schema):
        return table
    return table.select(schema.names).cast(schema)


def dedupe(table: pa.Table) -> pa.Table:
    """Drop exact repeats of a (user, session, checkpoint, tombstone) row; rows are immutable, repeats are copies."""
    if table.num_rows < 2:
        return table
    keyed = _keyed(table)
    cols = _JOIN + ["tombstone"]
    if keyed.group_by(cols, use_threads=False).aggregate([]).num_rows == table.num_rows:
        return table
    numbered = keyed.append_column("__i", pa.array(range(table.num_rows), pa.int64()))
    first = numbered.group_by(cols, use_threads=False).aggregate([("__i", "min")])["__i_min"]
    return table.take(pc.take(first, pc.sort_indices(first)))


def _split(table: pa.Table) -> tuple[pa.Table, pa.Table]:
    table = _keyed(dedupe(table))
    is_tomb = table["tombstone"]
    return table.filter(pc.invert(is_tomb)), table.filter(is_tomb)


def live_checkpoints(table: pa.Table) -> pa.Table:
    """Rows not retired by a tombstone (in any file), without the tombstones themselves."""
    live, tombs = _split(table)
    if tombs.num_rows:
        live = live.join(tombs.select(_JOIN), keys=_JOIN, join_type="left anti", use_threads=False)
    return live.drop_columns(["__u"])


def compact_checkpoint_partition(table: pa.Table) -> tuple[pa.Table, int]:
    """Merged rows of one partition and the number of tombstones applied.

    A tombstone whose target row is in the merged set is dropped together with
    it; a tombstone whose target is elsewhere (not yet seen) is kept.
    """
    live, tombs = _split(table)
    applied = 0
    if tombs.num_rows:
        targets = live.select(_JOIN)
        applied = tombs.join(targets, keys=_JOIN, join_type="left semi", use_threads=False).num_rows
        orphans = tombs.join(targets, keys=_JOIN, join_type="left anti", use_threads=False)
        live = live.join(tombs.select(_JOIN), keys=_JOIN, join_type="left anti", use_threads=False)
        live = pa.concat_tables([live, orphans.select(live.column_names)])
    merged = live.drop_columns(["__u"])
    return merged.sort_by([("epoch", "ascending"), ("checkpoint_id", "ascending")]), applied
