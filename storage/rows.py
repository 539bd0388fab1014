"""The records storage hands back: index rows, journal entries, run records, leases, reports.

Rows are frozen dataclasses whose Arrow schemas (``CHECKPOINT_SCHEMA``,
``SESSION_SCHEMA``) are derived from their fields, so the Parquet index is
the same data a caller sees, and a new column is one new field. Journal entries and run records are pydantic models
stored as tagged JSON (``"type": "journal_entry", "v": 1``; ``"type":
"run_record", "v": 1``); nothing is ever pickled.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields
from datetime import datetime, timezone
from typing import Annotated, Any, get_args, get_origin, get_type_hints

import pyarrow as pa
from pydantic import AfterValidator, BaseModel, ConfigDict, Field

_TS = pa.timestamp("us", tz="UTC")


def utcnow() -> datetime:
    """Now, timezone-aware UTC."""
    return datetime.now(timezone.utc)


def as_utc(value: datetime) -> datetime:
    """``value`` as aware UTC; a naive datetime is refused (ambiguous)."""
    if value.tzinfo is None:
        raise ValueError(f"datetime {value!r} must be timezone-aware")
    return value.astimezone(timezone.utc)


#: A stored record's time: aware, as UTC (a naive one is ambiguous and would break ``prune(before=...)``).
UtcTime = Annotated[datetime, AfterValidator(as_utc)]


@dataclass(frozen=True)
class Lease:
    """A session lease: the holder writes with ``epoch``; a higher epoch fences it."""

    session_id: str
    user_id: str | None
    epoch: int
    owner: str


#: Field metadata of an index column added after the first release: files written before it lack the column
#: and read it as None.
ADDED_LATER: dict[str, bool] = {"added_later": True}


@dataclass(frozen=True, kw_only=True)
class CheckpointInfo:
    """What a caller says about a checkpoint it writes (:meth:`storage.checkpoint_log.CheckpointLog.put`).

    The fields, in order, are the leading columns of the checkpoint index, so
    a new column is one new field (``metadata=ADDED_LATER`` and a default, so
    older files still read). ``cost_usd``: the session's running total (a
    fork's includes its parent's spend up to the fork point); ``spend_usd``:
    what model calls cost since the previous checkpoint of the same lineage,
    so summing it over a fork tree counts every billed call once; ``None``:
    unknown.
    """

    session_id: str
    user_id: str | None = None
    checkpoint_id: str
    turn: int
    created_at: datetime
    position: str
    execution_status: str
    message_count: int
    input_tokens: int = 0
    output_tokens: int = 0
    cost_usd: float | None = None
    spend_usd: float | None = field(default=None, metadata=ADDED_LATER)
    parent_checkpoint_id: str | None = None
    forked_from: str | None = None
    agent_id: str | None = None
    #: The checkpoints this one's object builds on (an incremental checkpoint holds only what changed since the
    #: last of them), oldest first: ``"{checkpoint_id}"`` in this session, ``"{session_id}/{checkpoint_id}"`` in
    #: another session of the same user (a fork shares its parent's chain). Empty for a self-contained object.
    #: Reading the checkpoint fetches these objects too; retention and prune keep them while the row lives.
    chain: tuple[str, ...] = field(default=(), metadata=ADDED_LATER)


@dataclass(frozen=True, kw_only=True)
class CheckpointRow(CheckpointInfo):
    """One checkpoint's index row (no payload): the caller's :class:`CheckpointInfo` plus what the store adds.

    ``epoch`` is the writer's lease epoch (0 without a lease), ``key`` the
    object's key, ``size`` and ``sha256`` what was written (checked on read).
    """

    epoch: int
    key: str
    size: int
    sha256: str

    @property
    def order(self) -> tuple[int, str]:
        """Sort key: "latest" is the highest ``(epoch, checkpoint_id)``."""
        return (self.epoch, self.checkpoint_id)


@dataclass(frozen=True)
class SessionRow:
    """A session status row, appended on every status change (latest ``updated_at`` wins)."""

    session_id: str
    user_id: str | None
    status: str
    updated_at: datetime
    run_id: str | None = None
    agent_ref: str | None = None
    spec_json: str | None = None
    epoch: int = 0
    node_id: str | None = None
    error: str | None = None
    #: The turn and running cost of the checkpoint the run last wrote or started from, as of this row (a listing
    #: reads them from the session-status table without reading the checkpoint index). None: not known.
    turn: int | None = field(default=None, metadata=ADDED_LATER)
    cost_usd: float | None = field(default=None, metadata=ADDED_LATER)
    #: The exploration the run is a branch of (its request's ``metadata["exploration_id"]``), for listings.
    exploration_id: str | None = field(default=None, metadata=ADDED_LATER)


@dataclass(frozen=True)
class PruneReport:
    """What ``prune`` deleted."""

    checkpoints: int
    journal_entries: int
    run_records: int = 0
    #: Explorations whose records went (:mod:`storage.prune_explorations`).
    explorations: int = 0


@dataclass(frozen=True)
class CompactReport:
    """What ``compact`` did: index file counts before/after, rows kept, tombstones applied."""

    files_before: int
    files_after: int
    rows: int
    tombstones_dropped: int


class JournalEntry(BaseModel):
    """One journaled step, stored as tagged JSON under ``journal/{run_id}/{seq:08d}-{step_key}.json``."""

    model_config = ConfigDict(frozen=True, extra="ignore")

    type: str = "journal_entry"
    v: int = 1
    session_id: str
    user_id: str | None = None
    run_id: str
    seq: int = Field(ge=0)
    step_key: str
    kind: str
    input_hash: str = ""
    output: dict[str, Any] = Field(default_factory=dict)
    created_at: UtcTime = Field(default_factory=utcnow)
    epoch: int = 0


class RunRecord(BaseModel):
    """One run of a session, stored create-only as ``runs/{n:08d}.json`` under the session's prefix.

    ``n`` is the next free slot when the run started: the store, not a node's
    clock, sequences a session's runs, so "the last run" is the highest ``n``.
    ``request`` is the run request as JSON; it may hold secrets (``context``,
    ``metadata``), so it lives beside the session's own objects and never in
    the Parquet index. ``base_session_id``/``base_checkpoint_id`` name the
    checkpoint the run started from and ``replay_from`` the run whose journal it
    replays (what recovery of the run needs besides its own journal).
    """

    model_config = ConfigDict(frozen=True, extra="ignore")

    type: str = "run_record"
    v: int = 1
    session_id: str
    user_id: str | None = None
    n: int = Field(ge=0)
    run_id: str
    spec_hash: str = ""
    request: dict[str, Any] | None = None
    base_session_id: str | None = None
    base_checkpoint_id: str | None = None
    replay_from: str | None = None
    epoch: int = 0
    created_at: UtcTime = Field(default_factory=utcnow)


# -- Arrow schemas ---------------------------------------------------------
#: The Arrow type of each Python type a row field may have (``X | None`` is a nullable ``X``).
ARROW_TYPES: dict[type, pa.DataType] = {str: pa.string(), int: pa.int64(), float: pa.float64(), bool: pa.bool_(),
                                        datetime: _TS}


def arrow_schema(row_type: type) -> pa.Schema:
    """The Arrow schema of a row dataclass: one nullable column per field, in field order (``tuple[str, ...]``
    is a string column holding a JSON array, null when empty: list columns cannot ride through Arrow's joins)."""
    hints = get_type_hints(row_type)
    columns = []
    for f in fields(row_type):
        if get_origin(hints[f.name]) is tuple:
            columns.append(pa.field(f.name, pa.string()))
            continue
        python_types = [t for t in get_args(hints[f.name]) if t is not type(None)] or [hints[f.name]]
        columns.append(pa.field(f.name, ARROW_TYPES[python_types[0]]))
    return pa.schema(columns)


#: Checkpoint index columns: a row's fields, then ``tombstone`` (the row retires its checkpoint_id),
#: ``written_at`` (orders rows), and for a tombstone a lease holder's retention wrote, ``tomb_epoch`` (its lease
#: epoch) and ``tomb_mark`` (its newest checkpoint id when it proved that lease); both null for a row, for a
#: tombstone written without a lease (prune, delete, quarantine, a takeover) and in files written before them:
#: such a tombstone is always honoured (:mod:`storage.visibility`).
CHECKPOINT_SCHEMA = arrow_schema(CheckpointRow).append(pa.field("tombstone", pa.bool_())).append(
    pa.field("written_at", _TS)).append(pa.field("tomb_epoch", pa.int64())).append(pa.field("tomb_mark", pa.string()))
#: The index's bookkeeping columns: not part of a checkpoint row (the compacted table and queries drop them).
INDEX_BOOKKEEPING = ("tombstone", "written_at", "tomb_epoch", "tomb_mark")
CHECKPOINT_FIELDS = [f.name for f in fields(CheckpointRow)]
#: Columns added after the first release: a table without them reads them as None.
LATER_FIELDS = frozenset(f.name for f in fields(CheckpointRow) if f.metadata.get("added_later"))

#: Session index columns: a :class:`SessionRow`'s fields.
SESSION_SCHEMA = arrow_schema(SessionRow)


def encode_chain(chain: tuple[str, ...]) -> str | None:
    """The ``chain`` column's value: a JSON array of refs, or null for an empty chain."""
    return json.dumps(list(chain), separators=(",", ":")) if chain else None


def decode_chain(value: str | None) -> tuple[str, ...]:
    """A ``chain`` column value back as refs (null, or a file written before the column: no chain)."""
    return strings(json.loads(value)) if value else ()


def strings(value: object) -> tuple[str, ...]:
    """A JSON list of strings (names, days) as a tuple; ``ValueError`` for anything else."""
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise ValueError(f"expected a list of strings, got {value!r:.80}")
    return tuple(value)


def checkpoint_rows_table(rows: list[CheckpointRow], *, tombstone: bool | list[bool], written_at: datetime,
                          retired_by: tuple[int, str] | None = None) -> pa.Table:
    """Rows (or tombstones for them) as one Arrow table in ``CHECKPOINT_SCHEMA``; ``tombstone`` is one flag for
    every row or one per row (a batch of new rows and the tombstones retention adds). ``retired_by``: the
    ``(lease epoch, newest checkpoint id at its proof)`` of the lease holder whose retention writes these
    tombstones (``tomb_epoch``, ``tomb_mark``); None: written without a lease."""
    cols: dict[str, list] = {name: [getattr(r, name) for r in rows] for name in CHECKPOINT_FIELDS}
    cols["chain"] = [encode_chain(c) for c in cols["chain"]]
    cols["tombstone"] = list(tombstone) if isinstance(tombstone, list) else [tombstone] * len(rows)
    if len(cols["tombstone"]) != len(rows):
        raise ValueError(f"{len(cols['tombstone'])} tombstone flags for {len(rows)} rows")
    cols["written_at"] = [written_at] * len(rows)
    by = retired_by if retired_by is not None else (None, None)
    cols["tomb_epoch"] = [by[0] if t else None for t in cols["tombstone"]]
    cols["tomb_mark"] = [by[1] if t else None for t in cols["tombstone"]]
    return pa.Table.from_pydict(cols, schema=CHECKPOINT_SCHEMA)


#: What a parsed index row is besides its fields: False (a row), True (a tombstone written without a lease:
#: always honoured), or a leased retention tombstone's ``(tomb_epoch, tomb_mark)`` (:mod:`storage.visibility`).
Retired = bool | tuple[int, str]


def checkpoint_rows_from_table(table: pa.Table) -> list[tuple[CheckpointRow, Retired]]:
    """``(row, retired)`` for every row of a ``CHECKPOINT_SCHEMA`` table (see :data:`Retired`)."""
    data = table.to_pydict()
    absent = [None] * table.num_rows
    cols = {name: data.get(name, absent) if name in LATER_FIELDS else data[name] for name in CHECKPOINT_FIELDS}
    cols["chain"] = [decode_chain(c) for c in cols["chain"]]
    epochs, marks = data.get("tomb_epoch", absent), data.get("tomb_mark", absent)
    out: list[tuple[CheckpointRow, Retired]] = []
    for i in range(table.num_rows):
        row = CheckpointRow(**{name: col[i] for name, col in cols.items()})
        tomb: Retired = bool(data["tombstone"][i])
        if tomb and type(epochs[i]) is int and epochs[i] > 0 and isinstance(marks[i], str):
            tomb = (epochs[i], marks[i])
        out.append((row, tomb))
    return out


def session_rows_table(rows: list[SessionRow]) -> pa.Table:
    """Session rows as one Arrow table in ``SESSION_SCHEMA``."""
    return pa.Table.from_pylist([asdict(r) for r in rows], schema=SESSION_SCHEMA)


def session_rows_from_table(table: pa.Table) -> list[SessionRow]:
    """Every row of a ``SESSION_SCHEMA`` table."""
    return [SessionRow(**r) for r in table.to_pylist()]
