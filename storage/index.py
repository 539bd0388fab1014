"""The Parquet index: append-only row files per session partition, compaction, queries.

Every write appends one small immutable Parquet file to its session's
partition (``index/{kind}/user={u}/session={s}/{written_ns}-{rand}.parquet``);
retention, prune and delete append tombstone files. Files are never modified,
so a parsed file can be cached by key forever (until LIST stops showing it).
Readers deduplicate identical rows, which makes a compaction interrupted
between "write merged file" and "delete sources" harmless. A listed file
that is gone at GET time was merged by a compaction into a file that LIST
predates: readers LIST again (:meth:`ParquetIndex.read_listed`) and never
read a vanished file as "no rows".
"""

from __future__ import annotations

import io
import logging
import os
import random
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

import pyarrow as pa
import pyarrow.parquet as pq

from .errors import CorruptObjectError, IndexChangedError
from .index_guard import checked, own_rows
from .objects import ObjectInfo, ObjectStore

log = logging.getLogger("storage.index")
T = TypeVar("T")
R = TypeVar("R")

_CACHE_FILES = 8192
_READ_THREADS = 16
#: Requests a reader keeps in flight when it fetches a checkpoint chain (one round trip for up to this many links).
CHAIN_FETCH_THREADS = 64
#: LISTs a read makes when listed files keep vanishing (concurrent compactions) before giving up.
_RELIST_ATTEMPTS = 6
_sleep = time.sleep  # module-level so tests can record the backoff instead of waiting


def new_file_name(suffix: str = "") -> str:
    """A unique, time-ordered index file name."""
    return f"{time.time_ns():019d}-{os.urandom(4).hex()}{suffix}.parquet"


def encode(table: pa.Table) -> bytes:
    """One Parquet file's bytes: snappy always (ids and keys repeat their prefixes); a write's few rows skip
    dictionaries and statistics, compacted files get both, for readers that skip row groups."""
    sink = io.BytesIO()
    if table.num_rows < 1000:
        # The Arrow schema is stored only for a file with metadata of its own (a compacted file's deletion
        # watermark, storage.visibility): without it, Parquet keeps no schema metadata.
        pq.write_table(table, sink, compression="snappy", use_dictionary=False, write_statistics=False,
                       store_schema=bool(table.schema.metadata))
    else:
        pq.write_table(table, sink, compression="snappy", row_group_size=256 * 1024,
                       use_dictionary=[c for c in DICTIONARY_COLUMNS if c in table.column_names])
    return sink.getvalue()


def parquet_table(data: bytes) -> pa.Table:
    """One Parquet file's table, from its bytes, :func:`checked` (``pyarrow.ArrowInvalid`` otherwise).

    The low-level reader without inner threads or pre-buffering is the cheapest
    for small index files; parallelism comes from reading many files at once.
    """
    reader = pq.ParquetReader()
    reader.open(pa.py_buffer(data), pre_buffer=False)
    return checked(reader.read_all(use_threads=False))


#: Index columns with few distinct values per file: dictionary-encoded in compacted files.
DICTIONARY_COLUMNS = ("session_id", "user_id", "position", "execution_status", "agent_id", "parent_checkpoint_id",
                      "forked_from", "status", "agent_ref", "node_id")


def serial_backend(objects: ObjectStore) -> bool:
    """True for in-process and local-directory stores: threads only add contention for the interpreter lock."""
    return objects.backend in ("memory", "file")


class SerialPool:
    """A thread pool's ``map`` (results as a list), ``shutdown`` and ``with``, run on the caller's thread."""

    def map(self, fn, *iterables):
        return list(map(fn, *iterables))

    def shutdown(self, wait: bool = True) -> None:
        pass

    def __enter__(self) -> SerialPool:
        return self

    def __exit__(self, *exc: object) -> None:
        pass


class ParquetIndex:
    """Reads and writes index files through an :class:`ObjectStore` (one code path for every backend)."""

    def __init__(self, objects: ObjectStore, *, serial_reads: bool = False) -> None:
        self.objects = objects
        self._cache: OrderedDict[str, pa.Table] = OrderedDict()
        self._lock = threading.Lock()
        # serial_reads: every read runs on the caller's thread, one at a time (deterministic
        # fault-injection tests attribute each storage call to the actor that made it).
        self.serial = serial_reads
        self._pool = SerialPool() if serial_reads else ThreadPoolExecutor(
            max_workers=_READ_THREADS, thread_name_prefix="storage-index")
        #: Reads of a local store run on the caller's thread (see serial_backend).
        self._local = serial_backend(objects)
        self._wide: ThreadPoolExecutor | None = None

    def close(self) -> None:
        self._pool.shutdown(wait=False)
        if self._wide is not None:
            self._wide.shutdown(wait=False)

    def map(self, fn: Callable[[T], R], items: Iterable[T]) -> list[R]:
        """``fn`` over ``items`` on the reader threads (on this thread with ``serial_reads``), results in order."""
        return list(self._pool.map(fn, items))

    def map_wide(self, fn: Callable[[T], R], items: Iterable[T]) -> list[R]:
        """Like :meth:`map_io` with up to ``CHAIN_FETCH_THREADS`` calls in flight (a chain's objects at once)."""
        items = list(items)
        if self._local or len(items) < 2 or self.serial:
            return self.map_io(fn, items)
        with self._lock:
            if self._wide is None:
                self._wide = ThreadPoolExecutor(max_workers=CHAIN_FETCH_THREADS, thread_name_prefix="storage-chain")
        return list(self._wide.map(fn, items))

    def map_io(self, fn: Callable[[T], R], items: Iterable[T]) -> list[R]:
        """Like :meth:`map` for a few storage calls at once: on this thread for a local store (a call costs
        microseconds, threads only add contention), on the reader threads for a remote one."""
        items = list(items)
        return [fn(i) for i in items] if self._local or len(items) < 2 else self.map(fn, items)

    def clear_cache(self) -> None:
        """Forget every cached table (a cold reader: LISTs, GETs and parses every time)."""
        with self._lock:
            self._cache.clear()

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
        return [o.key for o in self.list_infos(prefix)]

    def list_infos(self, prefix: str) -> list[ObjectInfo]:
        """The listing of the index files under ``prefix`` (with the store's ``modified`` times), in key order."""
        return [o for o in self.objects.list(prefix=prefix) if o.key.endswith(".parquet")]

    def read_file(self, key: str, *, cache: bool = True, vanished: list[str] | None = None) -> pa.Table | None:
        """One file's table; ``None`` (with a warning) if it vanished or is unreadable.

        A vanished key is appended to ``vanished``: the caller's LIST is stale.
        """
        with self._lock:
            hit = self._cache.get(key)
        if hit is not None:
            return hit
        obj = self.objects.get(key=key)
        if obj is None:
            if vanished is not None:
                vanished.append(key)  # compacted away between LIST and GET
            return None
        try:
            table = own_rows(parquet_table(obj.data), key)
        except Exception as e:  # pyarrow raises several types for bad bytes
            log.warning("skipping unreadable index file: %s", CorruptObjectError(f"{self.objects.describe(key)}: {e}"))
            return None
        if cache:
            self._remember(key, table)
        return table

    def read_files(self, keys: Iterable[str], *, cache: bool = True,
                   vanished: list[str] | None = None) -> list[tuple[str, pa.Table]]:
        """Tables of ``keys`` (read in parallel), skipping vanished (noted in ``vanished``) and unreadable files."""
        keys = list(keys)
        if len(keys) <= 2 or self._local:
            tables = [self.read_file(k, cache=cache, vanished=vanished) for k in keys]
        else:
            tables = list(self._pool.map(lambda k: self.read_file(k, cache=cache, vanished=vanished), keys))
        return [(k, t) for k, t in zip(keys, tables, strict=False) if t is not None]

    def read_listed(self, prefix: str, read: Callable[[list[str], list[str]], T], *,
                    key_filter: Callable[[str], bool] | None = None,
                    alongside: Callable[[], object] | None = None) -> tuple[list[str], T]:
        """LIST ``prefix`` and call ``read(keys, vanished)``; the keys of the LIST whose reads all held, and the result.

        A file gone at GET time was merged into one this LIST predates: LIST again
        (jittered backoff) and let ``read`` fetch what it lacks; after
        ``_RELIST_ATTEMPTS`` stale LISTs, :class:`IndexChangedError`, never "no rows".
        ``alongside``: called with every LIST, in parallel on a remote store (another
        LIST whose answer must come before what ``read`` reads).
        """
        for attempt in range(_RELIST_ATTEMPTS):
            keys = self.list_files(prefix) if alongside is None else self._list_beside(prefix, alongside)
            if key_filter is not None:
                keys = [k for k in keys if key_filter(k)]
            vanished: list[str] = []
            result = read(keys, vanished)
            if not vanished:
                return keys, result
            log.info("index files vanished between LIST and GET (compacted meanwhile), listing again: %s",
                     self.objects.describe(vanished[0]))
            if attempt + 1 < _RELIST_ATTEMPTS:
                _sleep(random.uniform(0, min(0.5, 0.01 * 2 ** attempt)))  # full jitter
        raise IndexChangedError(
            f"{self.objects.describe(prefix)}: index files kept vanishing between LIST and GET after "
            f"{_RELIST_ATTEMPTS} listings (compactions running); try again")

    def _list_beside(self, prefix: str, alongside: Callable[[], object]) -> list[str]:
        """:meth:`list_files` of ``prefix``, with ``alongside`` called in parallel (on a remote store)."""
        keys: list[str] = []

        def call(i: int) -> None:
            if i == 0:
                keys.extend(self.list_files(prefix))
            else:
                alongside()

        self.map_io(call, range(2))
        return keys

    def read_prefix(self, prefix: str, schema: pa.Schema, *, cache: bool = True,
                    key_filter: Callable[[str], bool] | None = None) -> tuple[list[str], pa.Table]:
        """All files under ``prefix`` (passing ``key_filter``) as one table (schema-aligned), and the keys read.

        Consistent with one LIST: see :meth:`read_listed`.
        """
        tables: dict[str, pa.Table] = {}

        def read(keys: list[str], vanished: list[str]) -> None:
            # Files are immutable: what an earlier LIST's round read stays valid while it is listed.
            for key, table in self.read_files([k for k in keys if k not in tables], cache=cache, vanished=vanished):
                tables[key] = table

        keys, _ = self.read_listed(prefix, read, key_filter=key_filter)
        return self.concat([(k, tables[k]) for k in keys if k in tables], schema)

    def concat(self, pairs: list[tuple[str, pa.Table]], schema: pa.Schema) -> tuple[list[str], pa.Table]:
        """The keys of ``pairs`` and their tables as one table in ``schema``; a table of a foreign schema is
        skipped with a warning naming its key."""
        tables = []
        for key, t in pairs:
            try:
                tables.append(conform(t, schema))
            except (KeyError, pa.ArrowInvalid, pa.ArrowTypeError) as e:
                log.warning("skipping index file with a foreign schema: %s: %s", self.objects.describe(key), e)
        table = pa.concat_tables(tables) if tables else schema.empty_table()
        return [k for k, _ in pairs], table


def conform(table: pa.Table, schema: pa.Schema) -> pa.Table:
    """``table`` in exactly ``schema`` (column order and types); a no-op for files this package wrote.
    ``KeyError`` or ``pyarrow.ArrowInvalid`` when it cannot be (another schema: readers skip the file)."""
    if table.schema.equals(schema):
        return table
    # A nullable column added since the file was written reads as nulls; a file without the schema's leading
    # (identity) columns is another schema altogether, and select() refuses it below (readers skip it).
    if all(n in table.schema.names for n in schema.names[:3]):
        for f in schema:
            if f.name not in table.schema.names and f.nullable:
                table = table.append_column(f.name, pa.nulls(table.num_rows, f.type))
    try:
        return table.select(schema.names).cast(schema)
    except pa.ArrowException as e:  # a column of a type no cast reaches (a list for an int): not our schema
        raise pa.ArrowInvalid(f"not readable in the index schema: {e}") from e
