"""The compacted session-status table: the latest status row of every session, one Parquet file per user.

    index/session_table/user={u}/part-0.parquet

Beside the checkpoint table (:mod:`storage.table`), for the questions asked of
sessions rather than checkpoints (what runs, what failed, what waits for a
decision) by outside readers (DuckDB, polars, pyarrow: ``user`` is a hive
key) and by listings that must not read every session. Each compaction
brings it up to date after merging the session status partitions: for every
user whose partitions changed, the rows of the sessions whose partition file
differs from the one the table absorbed (its ``source`` column) are read
again, sessions no longer listed are dropped, and the file is replaced whole
by one PUT. So a compaction that changed nothing reads and writes nothing,
and one that changed k sessions of a user reads k files and that user's
table. A row that names another session than its partition is ignored, as
every reader of status rows does.

The file is as of one compaction: two compactions racing may publish in
either order, and the next compaction corrects whichever lost (its sources
differ from the listing).
"""

from __future__ import annotations

import logging
from collections import defaultdict
from typing import TYPE_CHECKING

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from storage import layout
from storage.index import checked
from storage.rows import SESSION_SCHEMA, SessionRow, session_rows_from_table, session_rows_table
from storage.sessions import latest_sessions

if TYPE_CHECKING:
    from storage.store import Store

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
        return table.select(SESSION_TABLE_SCHEMA.names).cast(SESSION_TABLE_SCHEMA)
    except Exception as e:  # a foreign or truncated file: rebuild it from the partitions
        log.warning("session table %s is unreadable (%s: %s); rebuilding it", store.describe(session_table_key(
            segment)), type(e).__name__, e)
        return SESSION_TABLE_SCHEMA.empty_table()


def _own_rows(store: Store, key: str, table: pa.Table) -> list[SessionRow]:
    """The status rows of index file ``key`` that speak for its own session; none from a foreign file (skipped
    with a warning, as every reader of the index skips it; compaction moves it to quarantine)."""
    try:
        own = store.own_session_rows(key, table).select(SESSION_SCHEMA.names).cast(SESSION_SCHEMA)
        return session_rows_from_table(own)
    except (KeyError, ValueError, TypeError, pa.ArrowException) as e:
        log.warning("session table: skipping %s, not a session status file (%s: %s)", store.describe(key),
                    type(e).__name__, e)
        return []


def _latest_rows(store: Store, files: dict[str, list[str]]) -> pa.Table:
    """The latest own row of each session in ``files`` (session id -> its partition's files), with its source."""
    tables = dict(store.index.read_files([k for keys in files.values() for k in keys]))
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
    prefixes = [f"{layout.SESSION_INDEX}user={s}/" for s in segments] if segments is not None else [layout.SESSION_INDEX]
    listed: dict[str, dict[str, list[str]]] = defaultdict(lambda: defaultdict(list))
    for prefix in prefixes:
        for key in store.index.list_files(prefix):
            ids = _partition_ids(key)
            if ids is not None:
                listed[ids[0]][ids[1]].append(key)
    users = set(listed) | set(segments or ())
    if segments is None:
        users |= {o.key[len(layout.SESSION_TABLE):].split("/")[0][len("user="):]
                  for o in store.objects.list(prefix=layout.SESSION_TABLE) if o.key.endswith("/part-0.parquet")}
    return sum(_publish_user(store, seg, listed.get(seg, {})) for seg in sorted(users))


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
