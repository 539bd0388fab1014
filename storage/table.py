"""The compacted checkpoint table: live rows only, one Parquet file per (user, UTC day), readable without loomray.

``compact()`` maintains it beside the per-session append files::

    index/table/user={u}/day={YYYY-MM-DD}/part-0.parquet   live rows created that UTC day, retired rows gone
    index/table/user={u}/_manifest.json.gz                  what each partition absorbed (loomray's bookkeeping)

Why one file per partition replaced in place, what the manifest records and
how two compactors take turns on it: docs/design.md "The compacted table".
``Store.query`` reports how stale the table was (:func:`staleness`).
"""

from __future__ import annotations

import gzip
import io
import json
import logging
import threading
import zlib
from collections import OrderedDict
from dataclasses import dataclass, field
from datetime import date, datetime, timedelta, timezone
from typing import TYPE_CHECKING, Any

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from . import layout
from .errors import StorageError
from .ids import user_from_segment
from .index import DICTIONARY_COLUMNS, conform, parquet_table
from .rows import CHECKPOINT_SCHEMA, INDEX_BOOKKEEPING, as_utc, strings, utcnow

if TYPE_CHECKING:
    from .store import Store

log = logging.getLogger("storage.table")

#: Columns of the compacted table: a checkpoint row without the index's bookkeeping (tombstone, written_at, ...).
TABLE_SCHEMA = pa.schema([f for f in CHECKPOINT_SCHEMA if f.name not in INDEX_BOOKKEEPING])
#: How long a compaction's write-phase intent holds the user's table before another compaction may take it over.
INTENT_TTL = timedelta(minutes=10)
_PART = "part-0.parquet"
_MANIFEST = "_manifest.json.gz"
_META = b"loomray.table"
_EPOCH, _UTC = date(1970, 1, 1), pa.timestamp("us", tz="UTC")


# -- manifest ------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class SessionState:
    """What the table holds of one session: the per-session file names it absorbed, its days, tombstones left."""

    files: tuple[str, ...]
    days: tuple[str, ...]
    tombs: bool = False
    rows: int = 0
    #: Checkpoint ids the tombstones in ``files`` retire: a later file's copy of such a row is dead too.
    dead: tuple[str, ...] = ()


@dataclass(frozen=True)
class Manifest:
    """One user's table bookkeeping (stored gzip-compressed JSON at ``index/table/user={u}/_manifest.json.gz``)."""

    user_id: str | None
    generation: int = 0
    #: Wall time right before the compaction listed the per-session files (what the table is as fresh as).
    listed_at: datetime | None = None
    committed_at: datetime | None = None
    #: day -> {"etag": ETag of the partition file written, "rows": live rows in it}
    partitions: dict[str, dict[str, Any]] = field(default_factory=dict)
    sessions: dict[str, SessionState] = field(default_factory=dict)
    #: A write phase under way: {"token", "owner", "started_at", "expires_at"}; None when idle.
    intent: dict[str, Any] | None = None

    def encode(self) -> bytes:
        doc = {"type": "index_table_manifest", "v": 1, "user_id": self.user_id, "generation": self.generation,
               "listed_at": _iso(self.listed_at), "committed_at": _iso(self.committed_at),
               "partitions": self.partitions, "intent": self.intent,
               "sessions": {s: [list(st.files), list(st.days), st.tombs, st.rows, list(st.dead)]
                            for s, st in sorted(self.sessions.items())}}
        return gzip.compress(json.dumps(doc, separators=(",", ":"), ensure_ascii=False).encode(), mtime=0,
                             compresslevel=5)

    @classmethod
    def decode(cls, data: bytes, where: str) -> Manifest:
        try:
            doc = json.loads(gzip.decompress(data))
            if not isinstance(doc, dict) or doc.get("type") != "index_table_manifest":
                raise ValueError("not an index table manifest")
            sessions = {str(s): SessionState(strings(v[0]), strings(v[1]), bool(v[2]), int(v[3]),
                                                   strings(v[4]) if len(v) > 4 else ())
                        for s, v in doc.get("sessions", {}).items()}
            parts = {str(d): {"etag": str(p["etag"]), "rows": int(p.get("rows", 0))}
                     for d, p in doc.get("partitions", {}).items()}
            intent = doc.get("intent")
            return cls(doc.get("user_id"), int(doc.get("generation", 0)), _parse_iso(doc.get("listed_at")),
                       _parse_iso(doc.get("committed_at")), parts, sessions,
                       intent if isinstance(intent, dict) else None)
        except (OSError, EOFError, zlib.error, ValueError, TypeError, LookupError, AttributeError, RecursionError) as e:
            raise _Unreadable(f"{where}: unreadable table manifest ({e})") from e


class _Unreadable(StorageError):
    pass


def _iso(t: datetime | None) -> str | None:
    return None if t is None else as_utc(t).isoformat()


def _parse_iso(s: Any) -> datetime | None:
    if not isinstance(s, str):
        return None
    t = datetime.fromisoformat(s)
    return t if t.tzinfo is not None else t.replace(tzinfo=timezone.utc)


@dataclass
class UserTable:
    """One user's table as listed: its manifest (None: none yet, or unreadable), the manifest's ETag, the
    partition files' ETags by day."""

    segment: str
    manifest: Manifest | None = None
    manifest_etag: str | None = None
    parts: dict[str, str] = field(default_factory=dict)
    unreadable: bool = False

    @property
    def user_id(self) -> str | None:
        return user_from_segment(self.segment)

    def busy(self, now: datetime) -> bool:
        """Another compaction's write phase holds the table (its intent has not expired)."""
        intent = self.manifest.intent if self.manifest is not None else None
        if not intent:
            return False
        expires = _parse_iso(intent.get("expires_at"))
        return expires is None or now < expires

    def needs_rebuild(self, now: datetime) -> str | None:
        """Why the user's partitions must be rebuilt from the per-session files (None: incremental is fine)."""
        m = self.manifest
        if m is None:
            return "unreadable manifest" if self.unreadable else ("no manifest" if not self.parts else
                                                                  "partitions without a manifest")
        if m.intent and not self.busy(now):
            return "an expired write phase (its compactor died or stalled)"
        recorded = {d: p["etag"] for d, p in m.partitions.items()}
        if recorded != self.parts:
            return "partition files the manifest does not record (a write phase that did not commit)"
        return None


def table_clock() -> datetime:
    """Now, by the clock write-phase intents are judged with (module-level ``utcnow``, so tests can move it)."""
    return utcnow()


class TableCache:
    """Parsed manifests and partitions by key, each with the ETag it was read at; least recently used go first
    once more than ``max_rows`` partition rows (a manifest counts as 1,000) are held."""

    def __init__(self, max_rows: int = 2_000_000) -> None:
        self._items: OrderedDict[str, tuple[str, Any, int]] = OrderedDict()
        self._rows = 0
        self._max = max_rows
        self._lock = threading.Lock()

    def clear(self) -> None:
        with self._lock:
            self._items.clear()
            self._rows = 0

    def get(self, key: str) -> tuple[str, Any] | None:
        with self._lock:
            hit = self._items.get(key)
            if hit is None:
                return None
            self._items.move_to_end(key)
            return hit[0], hit[1]

    def __setitem__(self, key: str, value: tuple[str, Any]) -> None:
        etag, item = value
        weight = item.num_rows if isinstance(item, pa.Table) else 1000
        with self._lock:
            old = self._items.pop(key, None)
            if old is not None:
                self._rows -= old[2]
            self._items[key] = (etag, item, weight)
            self._rows += weight
            while self._rows > self._max and len(self._items) > 1:
                _, (_, _, w) = self._items.popitem(last=False)
                self._rows -= w


def load_tables(store: Store, prefix: str = layout.TABLE_INDEX) -> dict[str, UserTable]:
    """Every user's table under ``prefix`` (``index/table/`` or one user's): one LIST, plus a GET of each manifest
    this Store has not parsed at its listed ETag."""
    users: dict[str, UserTable] = {}
    manifests: list[tuple[str, str, str]] = []
    for info in store.objects.list(prefix=prefix):
        rest = info.key[len(layout.TABLE_INDEX):]
        head, _, tail = rest.partition("/")
        if not head.startswith("user="):
            continue
        seg = head[len("user="):]
        ut = users.setdefault(seg, UserTable(seg))
        if tail == _MANIFEST:
            manifests.append((seg, info.key, info.etag))
        elif tail.startswith("day=") and tail.endswith("/" + _PART) and tail.count("/") == 1:
            ut.parts[tail[len("day="):-len("/" + _PART)]] = info.etag
    cache = store.table_cache

    def load(item: tuple[str, str, str]) -> None:
        seg, key, etag = item
        hit = cache.get(key)
        if hit is not None and hit[0] == etag:
            users[seg].manifest, users[seg].manifest_etag = hit[1], etag
            return
        obj = store.objects.get(key=key)
        if obj is None:
            return  # gone since the LIST: no manifest (the next compaction rebuilds)
        try:
            manifest = Manifest.decode(obj.data, store.describe(key))
        except _Unreadable as e:
            log.warning("%s; the user's table is rebuilt by the next compaction, and read as tail until then", e)
            users[seg].unreadable, users[seg].manifest_etag = True, obj.etag
            return
        cache[key] = (obj.etag, manifest)
        users[seg].manifest, users[seg].manifest_etag = manifest, obj.etag

    store._index.map_io(load, manifests)
    return users

# -- rows ------------------------------------------------------------------------------------------------------------
def table_rows(table: pa.Table) -> pa.Table:
    """Live rows of a checkpoint-index table (tombstones already applied) in :data:`TABLE_SCHEMA`."""
    if "tombstone" in table.column_names:
        tomb = pc.fill_null(table["tombstone"], False)
        if pc.any(tomb).as_py():
            table = table.filter(pc.invert(tomb))
    table = table.select(TABLE_SCHEMA.names)
    return table if table.schema.equals(TABLE_SCHEMA) else table.cast(TABLE_SCHEMA)


def _day_numbers(table: pa.Table) -> pa.Array:
    """Days since the epoch of each row's ``created_at`` (the zone is UTC, so its local date is the UTC date)."""
    col = table["created_at"] if table.schema.field("created_at").type == _UTC else pc.cast(table["created_at"], _UTC)
    return pc.cast(pc.fill_null(pc.cast(col, pa.date32()), pa.scalar(0, pa.date32())), pa.int32()).combine_chunks()


def days_of(table: pa.Table) -> pa.Array:
    """The UTC day (``YYYY-MM-DD``) of each row's ``created_at`` (a missing one: ``1970-01-01``)."""
    if table.num_rows == 0:
        return pa.array([], pa.string())
    day_no = _day_numbers(table)
    uniq = pc.unique(day_no)
    names = pa.array([(_EPOCH + timedelta(days=d)).isoformat() for d in uniq.to_pylist()], pa.string())
    return pc.take(names, pc.index_in(day_no, value_set=uniq))  # no per-row formatting


def days_in(table: pa.Table) -> set[str]:
    """The set of :func:`days_of` (without a value per row)."""
    uniq = pc.unique(_day_numbers(table)).to_pylist() if table.num_rows else []
    return {(_EPOCH + timedelta(days=d)).isoformat() for d in uniq}


def encode_partition(rows: pa.Table, generation: int, token: str) -> bytes:
    """One partition file: snappy, dictionaries, statistics; the writer's generation and token make its ETag new."""
    meta = json.dumps({"generation": generation, "token": token}).encode()
    rows, names = rows.replace_schema_metadata({_META: meta}), set(rows.column_names)
    sink = io.BytesIO()
    pq.write_table(rows, sink, compression="snappy", row_group_size=128 * 1024,
                   use_dictionary=[c for c in DICTIONARY_COLUMNS if c in names])
    return sink.getvalue()


def decode_partition(data: bytes) -> pa.Table:
    """One partition file's rows in :data:`TABLE_SCHEMA`; a column added since it was written reads as nulls."""
    table = parquet_table(data)
    return conform(table, TABLE_SCHEMA).replace_schema_metadata(None)


def sort_rows(rows: pa.Table) -> pa.Table:
    """``rows`` in a partition's order: by time, then session and checkpoint."""
    return rows.sort_by([("created_at", "ascending"), ("session_id", "ascending"), ("checkpoint_id", "ascending")])


# -- staleness -------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Staleness:
    """How fresh the compacted part of a query was, and how much it read from the per-session tail."""

    #: Oldest time the compacted partitions' sources were listed, among the users read (None: no table read).
    table_as_of: datetime | None
    tail_files: int
    tail_sessions: int
    users_without_table: int = 0

    def describe(self, now: datetime | None = None) -> str:
        now = now or utcnow()
        if self.table_as_of is None:
            head = "no compacted table yet"
        else:
            age = max(0.0, (now - self.table_as_of).total_seconds())
            head = f"compacted table as of {self.table_as_of.isoformat(timespec='seconds')} ({_age(age)} ago)"
        return (f"{head}; uncompacted tail: {self.tail_files} index file(s) in {self.tail_sessions} session(s)"
                + (f"; {self.users_without_table} user(s) not compacted yet" if self.users_without_table else ""))


def _age(s: float) -> str:
    return f"{s:.0f} s" if s < 120 else f"{s / 60:.0f} min" if s < 7200 else f"{s / 3600:.1f} h"


_STALE = b"loomray.staleness"


def staleness(table: pa.Table) -> Staleness | None:
    """The :class:`Staleness` ``Store.query`` attached to ``table`` (None for a table it did not return)."""
    raw = (table.schema.metadata or {}).get(_STALE)
    if raw is None:
        return None
    doc = json.loads(raw)
    return Staleness(_parse_iso(doc.get("table_as_of")), int(doc["tail_files"]), int(doc["tail_sessions"]),
                     int(doc.get("users_without_table", 0)))


def with_staleness(table: pa.Table, st: Staleness) -> pa.Table:
    doc = {"table_as_of": _iso(st.table_as_of), "tail_files": st.tail_files, "tail_sessions": st.tail_sessions,
           "users_without_table": st.users_without_table}
    return table.replace_schema_metadata({**(table.schema.metadata or {}), _STALE: json.dumps(doc).encode()})
