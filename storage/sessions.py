"""``store.sessions`` (the session index) and ``store.active`` (active-session markers).

Status rows are appended to ``index/sessions/user={u}/session={s}/`` on every
status change; the latest ``updated_at`` wins. So that listings need not read
every session ever run, :meth:`Sessions.put` keeps two markers beside the
rows: ``live/{u}/{s}``, written *before* a live row and deleted *after* a
finished one (a hint: the row decides), and a change marker after each row
(:mod:`storage.session_changes`). Keys: docs/design.md "Object layout".
"""

from __future__ import annotations

import builtins
import logging
from datetime import datetime
from types import EllipsisType
from typing import TypeAlias

from . import layout, session_changes
from .ids import user_from_segment, user_segment, validate_id
from .index import ParquetIndex
from .objects import ObjectStore
from .rows import SESSION_SCHEMA, SessionRow, as_utc, session_rows_from_table, session_rows_table

log = logging.getLogger("storage")
#: "any user" in queries (``...``); None means "no user".
ANY: EllipsisType = ...
#: Whose sessions a query reads: a user id, None (sessions of no user) or :data:`ANY`.
UserFilter: TypeAlias = "str | None | EllipsisType"
_ACTIVE = "active/"
_LIVE = "live/"
#: Statuses a later row follows (a run under way): listing by them reads only the live markers.
LIVE_STATUSES = ("pending", "running")


def _active_key(session_id: str, user_id: str | None) -> str:
    return f"{_ACTIVE}{user_segment(user_id)}/{validate_id(session_id, 'session_id')}.json"


def _live_key(session_id: str, user_id: str | None) -> str:
    return f"{_LIVE}{user_segment(user_id)}/{validate_id(session_id, 'session_id')}"


def latest_sessions(rows: list[SessionRow]) -> list[SessionRow]:
    """Latest row per (user, session), newest first; a later row wins a tie on updated_at."""
    latest: dict[tuple[str | None, str], SessionRow] = {}
    for row in rows:  # rows arrive in file (write) order
        if not isinstance(row.updated_at, datetime):
            continue  # a row no writer wrote (an index file edited by hand): it cannot be ordered
        k = (row.user_id, row.session_id)
        if k not in latest or row.updated_at >= latest[k].updated_at:
            latest[k] = row
    return sorted(latest.values(), key=lambda r: r.updated_at, reverse=True)


class Sessions:
    """A store's session index (``store.sessions``): status rows, latest wins; see the module docstring."""

    def __init__(self, objects: ObjectStore, index: ParquetIndex) -> None:
        self.objects = objects
        self._index = index
        self._changes = session_changes.ChangedRows(objects)

    def put(self, row: SessionRow) -> None:
        """Append a status row for the session (and keep its live marker: see the module docstring)."""
        live = _live_key(row.session_id, row.user_id)
        row = SessionRow(**{**row.__dict__, "updated_at": as_utc(row.updated_at)})
        partition = layout.index_partition(layout.SESSION_INDEX, row.session_id, row.user_id)
        if row.status in LIVE_STATUSES:
            self.objects.put(key=live, data=b"")
        self._index.write(partition, session_rows_table([row]))
        key, body = session_changes.marker(row)
        self.objects.put(key=key, data=body)
        if row.status not in LIVE_STATUSES:
            self.objects.delete(keys=[live])

    def changed(self, user_id: UserFilter = ANY) -> dict[tuple[str | None, str], builtins.list[str]]:
        """The sessions (of ``user_id``) with a status row newer than the session-status table, with their change
        markers' keys: one LIST (see :mod:`storage.session_changes`)."""
        out: dict[tuple[str | None, str], builtins.list[str]] = {}
        for info in self.objects.list(prefix=session_changes.scope(user_id)):
            owner = session_changes.session_of(info.key)
            if owner is not None:
                out.setdefault(owner, []).append(info.key)
        return out

    def changed_rows(self, user_id: UserFilter = ANY, markers: dict[tuple[str | None, str], builtins.list[str]] | None = None
                     ) -> builtins.list[SessionRow]:
        """The latest status row of each session :meth:`changed` names (or ``markers``, what it
        returned): one LIST, then one GET per session whose newest marker this store has not read yet."""
        markers = self.changed(user_id) if markers is None else markers
        return self._changes.read(markers, self._index.map_io,
                                  lambda sid, user: self.get(sid, user_id=user))

    def forget_changes(self, keys: builtins.list[str]) -> None:
        """Delete change markers a compaction listed before the rows it absorbed (absent ones are fine)."""
        if keys:
            self.objects.delete(keys=keys)

    def get(self, session_id: str, *, user_id: str | None = None) -> SessionRow | None:
        """The session's latest status row, or None."""
        rows = self.history(session_id, user_id=user_id)
        return latest_sessions(rows)[0] if rows else None

    def history(self, session_id: str, *, user_id: str | None = None) -> builtins.list[SessionRow]:
        """Every status row the session's partition holds, in file order (its history until a compaction
        merges it to the latest row)."""
        prefix = layout.index_partition(layout.SESSION_INDEX, session_id, user_id)
        # A row whose ids differ from its file's partition is dropped by every index read (index_guard.own_rows).
        return session_rows_from_table(self._index.read_prefix(prefix, SESSION_SCHEMA)[1])

    def list(self, *, status: str | None = None, user_id: UserFilter = ANY) -> builtins.list[SessionRow]:
        """The latest row of every session (of ``user_id``; ``...`` = any user), filtered by status.

        A live ``status`` (:data:`LIVE_STATUSES`) reads only the sessions with a
        live marker; any other reads the whole session index.
        """
        if status in LIVE_STATUSES:
            rows = [r for uid, sid in self._live_sessions(user_id) if (r := self.get(sid, user_id=uid)) is not None]
            return [r for r in sorted(rows, key=lambda r: r.updated_at, reverse=True) if r.status == status]
        prefix = layout.SESSION_INDEX if isinstance(user_id, EllipsisType) else \
            f"{layout.SESSION_INDEX}user={user_segment(user_id)}/"
        rows = latest_sessions(session_rows_from_table(self._index.read_prefix(prefix, SESSION_SCHEMA)[1]))
        return [r for r in rows if status is None or r.status == status]

    def _live_sessions(self, user_id: UserFilter) -> builtins.list[tuple[str | None, str]]:
        """``(user_id, session_id)`` of every live marker (of ``user_id``): one LIST."""
        prefix = _LIVE if isinstance(user_id, EllipsisType) else f"{_LIVE}{user_segment(user_id)}/"
        out = []
        for info in self.objects.list(prefix=prefix):
            user, _, name = info.key[len(_LIVE):].partition("/")
            try:
                out.append((user_from_segment(user) if user == "_" else validate_id(user, "user_id"),
                            validate_id(name, "session_id")))
            except ValueError:
                log.warning("ignoring a live marker that names no session: %s", self.objects.describe(info.key))
        return out


class ActiveMarks:
    """Which sessions a supervisor owns now (``store.active``): one small object each, so "what is active" is
    one LIST whose size follows the active sessions, not every session ever run."""

    def __init__(self, objects: ObjectStore) -> None:
        self.objects = objects

    def put(self, session_id: str, *, user_id: str | None = None, data: bytes = b"{}") -> None:
        """Mark the session active (``data``: the caller's small JSON note); overwrites an earlier mark."""
        self.objects.put(key=_active_key(session_id, user_id), data=bytes(data))

    def get(self, session_id: str, *, user_id: str | None = None) -> bytes | None:
        """The session's active mark, or None when it is not marked."""
        obj = self.objects.get(key=_active_key(session_id, user_id))
        return None if obj is None else obj.data

    def delete(self, session_id: str, *, user_id: str | None = None) -> None:
        """Remove the session's active mark (absent is fine)."""
        self.objects.delete(keys=[_active_key(session_id, user_id)])

    def list(self) -> builtins.list[tuple[str | None, str]]:
        """``(user_id, session_id)`` of every marked session: one LIST, no GET."""
        out = []
        for info in self.objects.list(prefix=_ACTIVE):
            user, _, name = info.key[len(_ACTIVE):].partition("/")
            if name.endswith(".json") and "/" not in name:
                out.append((user_from_segment(user), name[:-len(".json")]))
        return out
