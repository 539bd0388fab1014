"""The compacted session-status table: the latest status row of every session, one Parquet file per user.

    index/session_table/user={u}/part-0.parquet

For outside readers (docs/readers.md "Sessions") and listings that must not
read every session. Each compaction re-reads, per user whose partitions
changed, only the sessions whose partition file differs from the one the
table absorbed (its ``source`` column), drops sessions no longer listed, and
replaces the file by one PUT. Two racing compactions may publish in either
order; the next corrects whichever lost. What came since is named by the
change markers (:mod:`storage.session_changes`). A row that names another
session than its partition is ignored, as every reader of status rows does.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from typing import TYPE_CHECKING

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from . import layout
from .ids import user_from_segment, user_segment
from .index import checked, conform
from .objects import ObjectInfo
from .rows import SESSION_SCHEMA, SessionRow, session_rows_from_table, session_rows_table
from .sessions import latest_sessions

if TYPE_CHECKING:
    from .store import Store

log = logging.getLogger("storage")

#: The table's schema: a session status row plus the index file it came from.
SESSION_TABLE_SCHEMA = SESSION_SCHEMA.append(pa.field("source", pa.string()))


def session_table_key(segment: str) -> str:
    """``index/session_table/user={segment}/part-0.parquet``."""
    return f"{layout.SESSION_TABLE}user={segment}/part-0.parquet"


def _partition_ids(key: str) -> tuple[str, str] | None:
    """``(user segment, session id)`` of a session status index file's key; None for anything else."""
    parts = key[len(layout.SESSION_INDEX):].split("/")
    if len(parts) != 3 or not parts[0].startswith("user=") or not parts[1].startswith("session="):
        return None
    return parts[0][len("user="):], parts[1][len("session="):]


def read_session_table(store: Store, segment: str) -> pa.Table:
    """One user's session table as stored (empty when it has none, or it is unreadable: then rebuilt)."""
    data = store.objects.get(key=session_table_key(segment))
    if data is None:
        return SESSION_TABLE_SCHEMA.empty_table()
    try:
        table = pq.read_table(pa.BufferReader(data.data))
        checked(table)  # text that is not UTF-8, a time past year 9999 (flipped bytes): fails here, not in a caller
        return conform(table, SESSION_TABLE_SCHEMA)
    except Exception as e:  # a foreign or truncated file: rebuild it from the partitions
        log.warning("session table %s is unreadable (%s: %s); rebuilding it", store.describe(session_table_key(
            segment)), type(e).__name__, e)
        return SESSION_TABLE_SCHEMA.empty_table()


def _own_rows(store: Store, key: str, table: pa.Table) -> list[SessionRow]:
    """The status rows of index file ``key`` that speak for its own session; none from a foreign file (skipped
    with a warning, as every reader of the index skips it; compaction moves it to quarantine)."""
    try:
        return session_rows_from_table(conform(table, SESSION_SCHEMA))
    except (KeyError, ValueError, TypeError, pa.ArrowException) as e:
        log.warning("session table: skipping %s, not a session status file (%s: %s)", store.describe(key),
                    type(e).__name__, e)
        return []


def _latest_rows(store: Store, files: dict[str, list[str]]) -> pa.Table:
    """The latest own row of each session in ``files`` (session id -> its partition's files), with its source."""
    tables = dict(store._index.read_files([k for keys in files.values() for k in keys]))
    out: list[pa.Table] = []
    for keys in files.values():
        rows = []
        for key in keys:
            if key in tables:
                rows += [(r, key) for r in _own_rows(store, key, tables[key])]
        if rows:
            latest = latest_sessions([r for r, _ in rows])[0]
            source = next(k for r, k in rows if r is latest)
            out.append(session_rows_table([latest]).append_column("source", pa.array([source], pa.string())))
    return pa.concat_tables(out) if out else SESSION_TABLE_SCHEMA.empty_table()


def publish_session_tables(store: Store, segments: list[str] | None = None) -> int:
    """Bring the session table of every user (of ``segments``) up to date; returns the rows rewritten."""
    # The change markers before the rows: every marker listed here has its row in the LIST below.
    marked: dict[str, list[str]] = defaultdict(list)
    for scope in ([user_from_segment(s) for s in segments] if segments is not None else [...]):
        for (user, _), keys in store.sessions.changed(scope).items():
            marked[user_segment(user)] += keys
    prefixes = [f"{layout.SESSION_INDEX}user={s}/" for s in segments] if segments is not None else [layout.SESSION_INDEX]
    listed: dict[str, dict[str, list[str]]] = defaultdict(lambda: defaultdict(list))
    for prefix in prefixes:
        for key in store._index.list_files(prefix):
            ids = _partition_ids(key)
            if ids is not None:
                listed[ids[0]][ids[1]].append(key)
    users = set(listed) | set(segments or ())
    if segments is None:
        users |= {o.key[len(layout.SESSION_TABLE):].split("/")[0][len("user="):]
                  for o in store.objects.list(prefix=layout.SESSION_TABLE) if o.key.endswith("/part-0.parquet")}
    users |= set(marked)
    rows = 0
    for seg in sorted(users):
        rows += _publish_user(store, seg, listed.get(seg, {}))
        store.sessions.forget_changes(marked.get(seg, []))
    return rows


def read_session_tables(store: Store, segment: str | None = None,
                        cache: dict[str, tuple[str, pa.Table]] | None = None,
                        columns: list[str] | None = None, seen: list[tuple[str, str]] | None = None) -> pa.Table:
    """Every user's session table (or ``segment``'s) as one table in :data:`SESSION_TABLE_SCHEMA` (only
    ``columns`` of it, when given: the others are not decoded): one LIST and a GET per user file (none for a
    file ``cache`` holds at its listed ETag; parsed files are added to it; ``seen`` gets the key and ETag of
    each file listed). An unreadable file is skipped with a warning (compaction rebuilds it)."""
    schema = SESSION_TABLE_SCHEMA if columns is None else pa.schema([SESSION_TABLE_SCHEMA.field(c) for c in columns])
    prefix = layout.SESSION_TABLE if segment is None else f"{layout.SESSION_TABLE}user={segment}/"
    infos = [o for o in store.objects.list(prefix=prefix) if o.key.endswith("/part-0.parquet")]
    cache = {} if cache is None else cache
    if seen is not None:
        seen += [(o.key, o.etag) for o in infos]

    def one(info: ObjectInfo) -> pa.Table | None:
        hit = cache.get(info.key)
        if hit is not None and hit[0] == info.etag:
            return hit[1]
        obj = store.objects.get(key=info.key)
        if obj is None:
            return None
        try:
            table = conform(_decode(obj.data, schema.names), schema)
            seg = info.key[len(layout.SESSION_TABLE):].split("/")[0][len("user="):]
            table = _own(table, user_from_segment(seg))
        except Exception as e:  # pyarrow raises several types for bad bytes
            log.warning("skipping unreadable session table %s (%s: %s)", store.describe(info.key),
                        type(e).__name__, e)
            return None
        cache[info.key] = (obj.etag, table)
        return table

    tables = [t for t in store._index.map_io(one, infos) if t is not None]
    return pa.concat_tables(tables) if tables else schema.empty_table()


def _own(table: pa.Table, user: str | None) -> pa.Table:
    """The rows of ``user`` (never another user's, whatever the file holds; checked whole first: one pass)."""
    ids = table["user_id"]
    if user is None:
        if ids.null_count == len(ids):
            return table
        return table.filter(pc.is_null(ids))
    bounds = pc.min_max(ids).as_py()
    if ids.null_count == 0 and bounds["min"] == bounds["max"] == user:
        return table
    return table.filter(pc.fill_null(pc.equal(ids, user), False))


def _decode(data: bytes, columns: list[str]) -> pa.Table:
    """The ``columns`` a table file has (a column added since it was written is left to ``conform``)."""
    reader = pq.ParquetFile(pa.py_buffer(data), pre_buffer=False)
    names = reader.schema_arrow.names
    return reader.read(columns=[c for c in columns if c in names], use_threads=False)


def _publish_user(store: Store, segment: str, sessions: dict[str, list[str]]) -> int:
    """One user's table: unchanged rows kept, changed sessions read again, vanished sessions dropped."""
    old = read_session_table(store, segment)
    known = dict(zip(old["session_id"].to_pylist(), old["source"].to_pylist(), strict=True))
    changed = {sid: keys for sid, keys in sessions.items() if len(keys) != 1 or known.get(sid) != keys[0]}
    gone = set(known) - set(sessions)
    if not changed and not gone:
        return 0
    keep = old.filter(pc.invert(pc.is_in(old["session_id"], value_set=pa.array(sorted(set(changed) | gone),
                                                                                 pa.string()))))
    new = pa.concat_tables([keep, _latest_rows(store, changed)]).sort_by("session_id")
    sink = pa.BufferOutputStream()
    pq.write_table(new, sink, compression="snappy")
    store.objects.put(key=session_table_key(segment), data=sink.getvalue().to_pybytes())
    return new.num_rows
