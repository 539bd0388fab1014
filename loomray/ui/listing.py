"""The sessions list: one row per session from the checkpoint index, filtered, newest activity first, paged.

It reads the store's cross-session index (:meth:`storage.Store.query`: the
compacted table plus the uncompacted tail), never every session's objects;
only the rows of the page shown get one more read each (the session's status
row: whether it runs, and why it stopped). A session's row is its latest
checkpoint row, "latest" meaning the highest ``(epoch, checkpoint_id)`` as
everywhere in loomray; its last activity is its newest checkpoint's time (or
its status row's, when that is newer).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from storage import Store
from storage.sessions import ANY

_COLUMNS = ["session_id", "user_id", "checkpoint_id", "epoch", "turn", "created_at", "cost_usd", "execution_status"]

#: The statuses a checkpoint records (the status filter's choices): what the session's latest checkpoint says.
CHECKPOINT_STATUSES = ("active", "completed", "awaiting_approval", "paused")


@dataclass(frozen=True)
class ListQuery:
    """What the list shows: filters, search and the page.

    ``user`` is :data:`storage.sessions.ANY` for every user (a UI scoped to
    one user always passes that user). ``status`` filters on the latest
    checkpoint's status; ``since``/``until`` keep sessions whose latest
    checkpoint is in that range (``until`` exclusive); ``min_spend`` is on the session's
    running total; ``search`` keeps session ids that contain it.
    """

    user: Any = ANY
    status: str | None = None
    since: datetime | None = None
    until: datetime | None = None
    min_spend: float | None = None
    search: str | None = None
    offset: int = 0
    limit: int = 50


@dataclass
class SessionSummary:
    """One row of the list."""

    session_id: str
    user_id: str | None
    turns: int
    spend_usd: float | None
    last_activity: datetime
    checkpoint_status: str
    run_status: str | None = None
    error: str | None = None

    @property
    def status(self) -> str:
        """The session's status as a person reads it: the status row's when there is one (it knows "running",
        "cancelled", "failed"), else the latest checkpoint's."""
        return self.run_status or self.checkpoint_status

    @property
    def stop_reason(self) -> str | None:
        """Why its last run stopped; None while it runs."""
        if self.status in ("running", "pending", "active"):
            return None
        return self.status


@dataclass
class Page:
    """A page of the list and how many sessions matched in all."""

    rows: list[SessionSummary] = field(default_factory=list)
    total: int = 0
    query: ListQuery = field(default_factory=ListQuery)


def latest_per_session(table: pa.Table) -> pa.Table:
    """One row per (user, session): its latest checkpoint's turn, cost and status, and its newest time."""
    ordered = table.sort_by([("user_id", "ascending"), ("session_id", "ascending"), ("epoch", "ascending"),
                             ("checkpoint_id", "ascending")])
    # use_threads=False keeps the input order inside a group, so "last" is the latest (epoch, checkpoint_id).
    grouped = ordered.group_by(["user_id", "session_id"], use_threads=False).aggregate([
        ("turn", "last"), ("cost_usd", "last"), ("execution_status", "last"), ("created_at", "max")])
    return grouped.rename_columns({"turn_last": "turn", "cost_usd_last": "cost_usd",
                                   "execution_status_last": "execution_status",
                                   "created_at_max": "last_activity"})


def _session_filter(table: pa.Table, q: ListQuery) -> pa.Table:
    mask = None
    for cond in (
        pc.equal(table["execution_status"], q.status) if q.status else None,
        pc.greater_equal(table["cost_usd"], float(q.min_spend)) if q.min_spend is not None else None,
        pc.less(table["last_activity"], pa.scalar(q.until, table["last_activity"].type)) if q.until else None,
    ):
        if cond is not None:
            mask = cond if mask is None else pc.and_(mask, cond)
    return table if mask is None else table.filter(pc.fill_null(mask, False))


class Snapshots:
    """One row per session from recent index reads, per view (user, since), kept off the request path.

    Paging, the status and spend filters and the id search of one view work
    on one read of the index (Arrow operations over a row per session), so
    turning pages or refining a filter does not query the store again. A
    read younger than ``ttl_s`` is served as it is; one younger than
    ``stale_s`` is served while a background thread reads the index again
    (stale while revalidating); an older one, or none, is read in the
    request. :meth:`warm` reads a view in the background (the server warms
    its default view when it starts). The session page and its live stream
    read the session itself, never this.
    """

    def __init__(self, ttl_s: float = 10.0, stale_s: float = 120.0) -> None:
        self.ttl_s, self.stale_s = ttl_s, stale_s
        self._lock = threading.Lock()
        self._kept: dict[tuple[Any, ...], tuple[float, pa.Table]] = {}
        self._reading: set[tuple[Any, ...]] = set()

    @staticmethod
    def _key(q: ListQuery) -> tuple[Any, ...]:
        return ("*" if q.user is ANY else q.user, q.since)

    def _read(self, store: Store, q: ListQuery) -> pa.Table:
        key, t = self._key(q), time.monotonic()
        try:
            # Only ``since`` narrows the read: a session's latest row is at or after it whenever any row is,
            # while ``until`` applies to the latest row itself (rows after it decide what "latest" is).
            table = latest_per_session(store.query(user_id=q.user, since=q.since, columns=_COLUMNS))
        finally:
            with self._lock:
                self._reading.discard(key)
        with self._lock:
            self._kept = {k: v for k, v in self._kept.items() if t - v[0] < self.stale_s}
            self._kept[key] = (t, table)
        return table

    def warm(self, store: Store, q: ListQuery) -> None:
        """Read ``q``'s view in a background thread (unless one reads it already)."""
        key = self._key(q)
        with self._lock:
            if key in self._reading:
                return
            self._reading.add(key)
        threading.Thread(target=self._read, args=(store, q), name="loomray-ui-index", daemon=True).start()

    def sessions(self, store: Store, q: ListQuery) -> pa.Table:
        """One row per session in ``q``'s user and time range (see the class doc for how fresh)."""
        with self._lock:
            hit = self._kept.get(self._key(q))
        age = time.monotonic() - hit[0] if hit is not None else None
        if hit is not None and age is not None and age < self.ttl_s:
            return hit[1]
        if hit is not None and age is not None and age < self.stale_s:
            self.warm(store, q)
            return hit[1]
        return self._read(store, q)


def list_sessions(store: Store, q: ListQuery, snapshots: Snapshots | None = None) -> Page:
    """The page of sessions ``q`` asks for (see the module doc for what is read)."""
    table = (snapshots or Snapshots(ttl_s=0)).sessions(store, q)
    if q.search:
        table = table.filter(pc.match_substring(table["session_id"], q.search))
    if table.num_rows == 0:
        return Page(query=q)
    sessions = _session_filter(table, q)
    total = sessions.num_rows
    page = sessions.sort_by([("last_activity", "descending"), ("session_id", "ascending")]).slice(q.offset, q.limit)
    rows = [SessionSummary(session_id=r["session_id"], user_id=r["user_id"], turns=r["turn"],
                           spend_usd=r["cost_usd"], last_activity=r["last_activity"],
                           checkpoint_status=r["execution_status"]) for r in page.to_pylist()]
    for row in rows:
        status = store.get_session(row.session_id, user_id=row.user_id)
        if status is not None:
            row.run_status, row.error = status.status, status.error
            row.last_activity = max(row.last_activity, status.updated_at)
    return Page(rows=rows, total=total, query=q)
