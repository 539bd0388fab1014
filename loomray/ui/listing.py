"""The sessions list: one row per session from the compacted session-status table, filtered, newest first, paged.

A page reads the table (a file already parsed at the ETag listed is not read again), the change markers since
the last compaction, and for the rows shown only a running session's latest checkpoint: never every session.
Filters, search and paging are Arrow operations over that table (docs/ui.md, "Pages").
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from datetime import datetime
from types import EllipsisType
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from loomray.storage import Store
from loomray.storage.ids import user_segment
from loomray.storage.rows import SessionRow
from loomray.storage.session_table import read_session_tables
from loomray.storage.sessions import ANY, UserFilter

#: The statuses a session's status row says (the status filter's choices).
STATUSES = ("pending", "running", "completed", "awaiting_approval", "paused", "budget_exceeded", "failed",
            "cancelled")
_LIVE = ("pending", "running")
#: What the list shows and filters on (the table's other columns are not decoded).
_COLUMNS = ["session_id", "user_id", "status", "updated_at", "error", "turn", "cost_usd", "exploration_id"]


@dataclass(frozen=True)
class ListQuery:
    """What the list shows: filters, search and the page.

    ``user`` is :data:`storage.sessions.ANY` for every user (a UI scoped to
    one user always passes that user). ``status`` filters on the session's
    status row; ``since``/``until`` keep sessions whose last status change
    is in that range (``until`` exclusive); ``min_spend`` is on the running
    total as of that row; ``search`` keeps session ids that contain it;
    ``exploration`` keeps the branches of one exploration (the
    ``exploration_id`` of their run's metadata).
    """

    user: UserFilter = ANY
    status: str | None = None
    since: datetime | None = None
    until: datetime | None = None
    min_spend: float | None = None
    search: str | None = None
    exploration: str | None = None
    offset: int = 0
    limit: int = 50


@dataclass
class SessionSummary:
    """One row of the list."""

    session_id: str
    user_id: str | None
    status: str
    turns: int | None
    spend_usd: float | None
    last_activity: datetime
    error: str | None = None
    exploration_id: str | None = None

    @property
    def stop_reason(self) -> str | None:
        """Why its last run stopped; None while it runs."""
        return None if self.status in _LIVE else self.status


@dataclass
class Page:
    """A page of the list and how many sessions matched in all."""

    rows: list[SessionSummary] = field(default_factory=list)
    total: int = 0
    query: ListQuery = field(default_factory=ListQuery)


class TableCache:
    """What a server read of the session-status table and its tail, kept while the store says it is current.

    Table files are kept by key at the ETag they were read at (a compaction
    replaces a file whole, so an unchanged ETag is an unchanged file); the
    merged rows of a view (a user, or every user) are kept with the files'
    ETags and the newest change marker of each changed session they were
    built from (markers are never rewritten), so a request whose two LISTs
    show the same reads nothing else and merges nothing again.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._files: dict[str, tuple[str, pa.Table]] = {}
        self._merged: dict[Any, tuple[Any, pa.Table]] = {}

    def current(self, store: Store, user: UserFilter) -> pa.Table:
        """Each session's latest status row, of ``user`` (``ANY``: every user)."""
        with self._lock:
            files = dict(self._files)
        seen: list[tuple[str, str]] = []
        table = read_session_tables(store, None if isinstance(user, EllipsisType) else user_segment(user), files, _COLUMNS, seen)
        markers = store.sessions.changed(user)
        signature = (tuple(sorted(seen)), tuple(sorted((k, max(v)) for k, v in markers.items())))
        view = "*" if isinstance(user, EllipsisType) else user
        with self._lock:
            self._files.update(files)
            hit = self._merged.get(view)
        if hit is not None and hit[0] == signature:
            return hit[1]
        # One chunk: a page's rows are taken from it (taking from 50 chunks copies them all first).
        merged = _with_tail(table, store.sessions.changed_rows(user, markers)).combine_chunks()
        with self._lock:
            self._merged[view] = (signature, merged)
        return merged


def _who(table: pa.Table) -> pa.Array:
    """``user/session`` per row (``_`` for no user, which no user id can be): one key across users."""
    return pc.binary_join_element_wise(pc.fill_null(table["user_id"], "_"), table["session_id"], "/")


def _with_tail(table: pa.Table, rows: list[SessionRow]) -> pa.Table:
    """``table`` with the tail's rows in place of its own for the sessions they are of (unless older)."""
    if not rows:
        return table
    tail = pa.Table.from_pylist([{c: getattr(r, c) for c in _COLUMNS} for r in rows], schema=table.schema)
    if table.num_rows:
        # Latest updated_at wins, as everywhere: a tail row replaces the table's row of its session unless older.
        who = _who(tail)
        hit = table.filter(pc.is_in(_who(table), value_set=who))
        at = dict(zip(_who(hit).to_pylist(), hit["updated_at"].to_pylist(), strict=True))
        tail = tail.filter(pa.array([w not in at or t >= at[w] for w, t in zip(
            who.to_pylist(), tail["updated_at"].to_pylist(), strict=True)], pa.bool_()))
        table = table.filter(pc.invert(pc.is_in(_who(table), value_set=_who(tail))))
    return pa.concat_tables([table, tail]) if table.num_rows else tail


def _filtered(table: pa.Table, q: ListQuery) -> pa.Table:
    ts = table.schema.field("updated_at").type
    mask = None
    for cond in (
        pc.equal(table["status"], q.status) if q.status else None,
        pc.greater_equal(table["updated_at"], pa.scalar(q.since, ts)) if q.since else None,
        pc.less(table["updated_at"], pa.scalar(q.until, ts)) if q.until else None,
        pc.greater_equal(table["cost_usd"], float(q.min_spend)) if q.min_spend is not None else None,
        pc.match_substring(table["session_id"], q.search) if q.search else None,
        pc.equal(table["exploration_id"], q.exploration) if q.exploration else None,
    ):
        if cond is not None:
            mask = cond if mask is None else pc.and_(mask, cond)
    return table if mask is None else table.filter(pc.fill_null(mask, False))


def list_sessions(store: Store, q: ListQuery, tables: TableCache | None = None) -> Page:
    """The page of sessions ``q`` asks for (see the module doc for what is read)."""
    sessions = _filtered((tables or TableCache()).current(store, q.user), q)
    # Newest first; the session id (then the user) breaks ties, so a page's rows do not move between requests.
    keys = [("updated_at", "descending"), ("session_id", "ascending"), ("user_id", "ascending")]
    top = sessions
    if q.offset + q.limit < sessions.num_rows:  # the rows up to this page's end, without sorting the rest
        top = sessions.take(pc.select_k_unstable(sessions, k=q.offset + q.limit, sort_keys=keys))
    page = top.sort_by(keys).slice(q.offset, q.limit)
    rows = [SessionSummary(session_id=r["session_id"], user_id=r["user_id"], status=r["status"], turns=r["turn"],
                           spend_usd=r["cost_usd"], last_activity=r["updated_at"], error=r["error"],
                           exploration_id=r["exploration_id"]) for r in page.to_pylist()]
    # A running session's (or an old row's) turn and spend come from its latest checkpoint, when it has one.
    stale = [r for r in rows if r.status in _LIVE or r.turns is None]
    for row, latest in zip(stale, store.checkpoints.latest_of([(r.session_id, r.user_id) for r in stale]),
                           strict=True):
        if latest is not None:
            row.turns, row.spend_usd = latest.turn, latest.cost_usd
            row.last_activity = max(row.last_activity, latest.created_at)
    return Page(rows=rows, total=sessions.num_rows, query=q)
