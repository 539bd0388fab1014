"""Reading the checkpoint index across sessions: the compacted table's partitions plus the uncompacted tail.

What :meth:`storage.store.Store.query` reads (see :mod:`storage.table`): the
table's partitions for sessions whose per-session files are what the table
absorbed, and those files themselves for every other session.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from datetime import datetime, timedelta
from typing import TYPE_CHECKING

import pyarrow as pa
import pyarrow.compute as pc

from . import layout
from .errors import StorageError
from .ids import user_from_segment
from .index_guard import own_rows
from .rows import CHECKPOINT_SCHEMA, as_utc
from .table import TABLE_SCHEMA, Staleness, UserTable, decode_partition, load_tables

if TYPE_CHECKING:
    from .store import Store


def _session_of(key: str) -> tuple[str, str] | None:
    """``(user segment, session id)`` of a per-session index file key."""
    parts = key[len(layout.CHECKPOINT_INDEX):].split("/")
    if len(parts) != 3 or not parts[0].startswith("user=") or not parts[1].startswith("session="):
        return None
    return parts[0][len("user="):], parts[1][len("session="):]


def _day_range(since: datetime | None, until: datetime | None) -> Callable[[str], bool]:
    lo = as_utc(since).date().isoformat() if since is not None else None
    hi = (as_utc(until) - timedelta(microseconds=1)).date().isoformat() if until is not None else None
    return lambda d: (lo is None or d >= lo) and (hi is None or d <= hi)


class _TailReader:
    """The ``read`` of one query's ``read_listed``: sorts the listed sessions into those the table holds as
    listed (clean) and the tail, and reads the tail's files (only those an earlier LIST's round did not)."""

    def __init__(self, store: Store, tables: dict[str, UserTable]) -> None:
        self.store = store
        self.tables = tables
        self.read: dict[str, pa.Table] = {}
        self.clean: dict[str, set[str]] = defaultdict(set)
        self.tail: set[tuple[str, str]] = set()
        self.keys: list[str] = []  # the tail's keys in the last LIST

    def __call__(self, keys: list[str], vanished: list[str]) -> None:
        listed: dict[tuple[str, str], list[str]] = defaultdict(list)
        for k in keys:
            sk = _session_of(k)
            if sk is not None:
                listed[sk].append(k.rsplit("/", 1)[1])
        clean: dict[str, set[str]] = defaultdict(set)
        tail: set[tuple[str, str]] = set()
        for (seg, sid), names in listed.items():
            m = self.tables[seg].manifest if seg in self.tables else None
            st = m.sessions.get(sid) if m is not None else None
            if st is not None and tuple(sorted(names)) == tuple(sorted(st.files)):
                clean[seg].add(sid)
            else:
                tail.add((seg, sid))
        todo = [k for k in keys if _session_of(k) in tail and k not in self.read]
        for key, t in self.store._index.read_files(todo, cache=False, vanished=vanished):
            self.read[key] = t
        self.clean, self.tail, self.keys = clean, tail, [k for k in keys if _session_of(k) in tail]


def _wanted(tables: dict[str, UserTable], clean: dict[str, set[str]], session_id: str | None,
            since: datetime | None, until: datetime | None) -> tuple[list[tuple[str, str, str | None]], list[datetime]]:
    """``(segment, day, listed ETag)`` of the partitions to read, and when each user's table was listed."""
    in_range = _day_range(since, until)
    wanted: list[tuple[str, str, str | None]] = []
    as_of: list[datetime] = []
    for seg, ut in sorted(tables.items()):
        m = ut.manifest
        if m is None or not clean.get(seg):
            continue
        if m.listed_at is not None:
            as_of.append(m.listed_at)
        days = set(m.partitions)
        if session_id is not None:
            st = m.sessions.get(session_id)
            days &= set(st.days) if st is not None else set()
        wanted += [(seg, d, ut.parts.get(d)) for d in sorted(days) if in_range(d) and d in ut.parts]
    return wanted, as_of


def _partition_rows(store: Store, seg: str, day: str, etag: str | None) -> pa.Table:
    """One partition's rows: cached at the listed ETag, else read (a missing file has no rows)."""
    key = layout.table_partition_key(user_from_segment(seg), day)
    hit = store.table_cache.get(key)
    if hit is not None and hit[0] == etag:
        return hit[1]
    obj = store.objects.get(key=key)
    if obj is None:
        return TABLE_SCHEMA.empty_table()  # never deleted by loomray; someone removed it: no rows
    try:
        rows = own_rows(decode_partition(obj.data), key)  # never another user's rows, whatever the file holds
    except Exception as e:  # pyarrow raises several types for bad bytes
        raise StorageError(f"{store.describe(key)}: unreadable table partition ({e}); run compact() to "
                           "rebuild it") from e
    store.table_cache[key] = (obj.etag, rows)
    return rows


def read_for_query(store: Store, *, segment: str | None, session_id: str | None, since: datetime | None,
                   until: datetime | None) -> tuple[pa.Table, pa.Table, Staleness]:
    """``(table rows, tail rows, staleness)`` for a query of one user (``segment``) or all (None).

    Table rows: partitions of the days in ``[since, until)`` without the rows
    of tail sessions, in :data:`TABLE_SCHEMA`. Tail rows: every file of each
    tail session under the scope (a session whose listed files differ from what
    its manifest absorbed), raw (``CHECKPOINT_SCHEMA``, tombstones included).
    Order of reads: manifests, then the per-session LIST, then partitions; a
    listed file gone at GET time LISTs again (``ParquetIndex.read_listed``).
    """
    tables = load_tables(store, layout.TABLE_INDEX if segment is None else f"{layout.TABLE_INDEX}user={segment}/")
    prefix = layout.CHECKPOINT_INDEX
    key_filter = None
    if segment is not None:
        prefix += f"user={segment}/"
        if session_id is not None:
            prefix += f"session={session_id}/"
    elif session_id is not None:
        key_filter = lambda k: f"/session={session_id}/" in k  # noqa: E731
    tail = _TailReader(store, tables)
    store._index.read_listed(prefix, tail, key_filter=key_filter)
    _, tail_rows = store._index.concat([(k, tail.read[k]) for k in tail.keys if k in tail.read], CHECKPOINT_SCHEMA)
    wanted, as_of = _wanted(tables, tail.clean, session_id, since, until)

    def part(item: tuple[str, str, str | None]) -> pa.Table:
        rows = _partition_rows(store, *item)
        ids = pa.array(sorted(tail.clean[item[0]]), pa.string())
        return rows.filter(pc.is_in(rows["session_id"], value_set=ids))

    parts = store._index.map_io(part, wanted)
    table_part = pa.concat_tables(parts) if parts else TABLE_SCHEMA.empty_table()
    without = sum(1 for seg in {s for s, _ in tail.tail} if tables.get(seg) is None or tables[seg].manifest is None)
    st = Staleness(min(as_of) if as_of else None, len(tail.keys), len(tail.tail), without)
    return table_part, tail_rows, st
