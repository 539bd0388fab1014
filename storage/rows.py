"""The records storage hands back: index rows, journal entries, run records, leases, reports.

Rows are frozen dataclasses mirrored one-to-one by Arrow schemas
(``CHECKPOINT_SCHEMA``, ``SESSION_SCHEMA``), so the Parquet index is the
same data a caller sees. Journal entries and run records are pydantic models
stored as tagged JSON (``"type": "journal_entry", "v": 1``; ``"type":
"run_record", "v": 1``); nothing is ever pickled.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from datetime import datetime, timezone
from typing import Any

import pyarrow as pa
from pydantic import BaseModel, ConfigDict, Field, field_validator

_TS = pa.timestamp("us", tz="UTC")


def utcnow() -> datetime:
    """Now, timezone-aware UTC."""
    return datetime.now(timezone.utc)


def as_utc(value: datetime) -> datetime:
    """``value`` as aware UTC; a naive datetime is refused (ambiguous)."""
    if value.tzinfo is None:
        raise ValueError(f"datetime {value!r} must be timezone-aware")
    return value.astimezone(timezone.utc)


@dataclass(frozen=True)
class Lease:
    """A session lease: the holder writes with ``epoch``; a higher epoch fences it."""

    session_id: str
    user_id: str | None
    epoch: int
    owner: str


@dataclass(frozen=True)
class CheckpointRow:
    """One checkpoint's index row (no payload).

    ``cost_usd`` is the session's running total as of this checkpoint (a
    fork's rows include its parent's spend up to the fork point);
    ``spend_usd`` is what the model calls made since the previous checkpoint
    of the same lineage cost (the checkpoint the run last wrote, or the one it
    started from, in whichever session), so summing ``spend_usd`` over a fork
    tree counts every billed call once. ``None``: unknown (an unpriced call)
    or a row written before the column existed.
    """

    session_id: str
    user_id: str | None
    checkpoint_id: str
    turn: int
    created_at: datetime
    position: str
    execution_status: str
    message_count: int
    input_tokens: int
    output_tokens: int
    cost_usd: float | None
    parent_checkpoint_id: str | None
    forked_from: str | None
    agent_id: str | None
    epoch: int
    key: str
    size: int
    sha256: str
    spend_usd: float | None = None

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


@dataclass(frozen=True)
class PruneReport:
    """What ``prune`` deleted."""

    checkpoints: int
    journal_entries: int
    run_records: int = 0


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
    created_at: datetime = Field(default_factory=utcnow)
    epoch: int = 0

    @field_validator("created_at")
    @classmethod
    def _aware(cls, value: datetime) -> datetime:
        # A naive time is ambiguous and would break prune(before=...) comparisons later.
        return as_utc(value)


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
    created_at: datetime = Field(default_factory=utcnow)

    @field_validator("created_at")
    @classmethod
    def _aware(cls, value: datetime) -> datetime:
        return as_utc(value)


# -- Arrow schemas ---------------------------------------------------------
#: Checkpoint index columns; ``tombstone`` rows retire a checkpoint_id, ``written_at`` orders rows.
#: ``spend_usd`` was added later: files written before it lack the column and read as null (None).
CHECKPOINT_SCHEMA = pa.schema([
    ("session_id", pa.string()), ("user_id", pa.string()), ("checkpoint_id", pa.string()),
    ("turn", pa.int64()), ("created_at", _TS), ("position", pa.string()),
    ("execution_status", pa.string()), ("message_count", pa.int64()), ("input_tokens", pa.int64()),
    ("output_tokens", pa.int64()), ("cost_usd", pa.float64()), ("spend_usd", pa.float64()),
    ("parent_checkpoint_id", pa.string()),
    ("forked_from", pa.string()), ("agent_id", pa.string()), ("epoch", pa.int64()), ("key", pa.string()),
    ("size", pa.int64()), ("sha256", pa.string()), ("tombstone", pa.bool_()), ("written_at", _TS),
])
CHECKPOINT_FIELDS = [f.name for f in fields(CheckpointRow)]
#: Columns added after the first release: a table without them reads them as None.
_LATER_FIELDS = frozenset({"spend_usd"})

SESSION_SCHEMA = pa.schema([
    ("session_id", pa.string()), ("user_id", pa.string()), ("status", pa.string()), ("updated_at", _TS),
    ("run_id", pa.string()), ("agent_ref", pa.string()), ("spec_json", pa.string()), ("epoch", pa.int64()),
    ("node_id", pa.string()), ("error", pa.string()),
])


def checkpoint_rows_table(rows: list[CheckpointRow], *, tombstone: bool, written_at: datetime) -> pa.Table:
    """Rows (or tombstones for them) as one Arrow table in ``CHECKPOINT_SCHEMA``."""
    cols: dict[str, list] = {name: [getattr(r, name) for r in rows] for name in CHECKPOINT_FIELDS}
    cols["tombstone"] = [tombstone] * len(rows)
    cols["written_at"] = [written_at] * len(rows)
    return pa.Table.from_pydict(cols, schema=CHECKPOINT_SCHEMA)


def checkpoint_rows_from_table(table: pa.Table) -> list[tuple[CheckpointRow, bool]]:
    """``(row, is_tombstone)`` for every row of a ``CHECKPOINT_SCHEMA`` table."""
    data = table.to_pydict()
    absent = [None] * table.num_rows
    cols = {name: data.get(name, absent) if name in _LATER_FIELDS else data[name] for name in CHECKPOINT_FIELDS}
    out = []
    for i in range(table.num_rows):
        row = CheckpointRow(**{name: col[i] for name, col in cols.items()})
        out.append((row, bool(data["tombstone"][i])))
    return out


def session_rows_table(rows: list[SessionRow]) -> pa.Table:
    """Session rows as one Arrow table in ``SESSION_SCHEMA``."""
    return pa.Table.from_pylist([asdict(r) for r in rows], schema=SESSION_SCHEMA)


def session_rows_from_table(table: pa.Table) -> list[SessionRow]:
    """Every row of a ``SESSION_SCHEMA`` table."""
    return [SessionRow(**r) for r in table.to_pylist()]
