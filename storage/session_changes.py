"""Change markers: which sessions have a status row newer than the compacted session-status table.

``sessions.put`` writes, *after* each status row, a marker
``changed/{u}/{s}/{written_ns}-{rand}.json`` holding a copy of that row. A
compaction lists the markers before the status rows it absorbs
(:mod:`storage.session_table`) and deletes those it listed once the user's
table is written, so table plus markers name every session whose latest row
the table may not hold. A crash between row and marker leaves a row only the
next compaction's table shows; a marker that does not parse, or names
another session than its key, is skipped with a warning.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, fields
from datetime import datetime
from types import EllipsisType
from typing import Any

from .ids import user_from_segment, user_segment, validate_id
from .objects import ObjectStore
from .rows import SessionRow, as_utc

log = logging.getLogger("storage")
CHANGED = "changed/"
_FIELDS = {f.name for f in fields(SessionRow)}


def marker(row: SessionRow) -> tuple[str, bytes]:
    """The key and body of the change marker of ``row`` (a new key every time)."""
    key = f"{CHANGED}{user_segment(row.user_id)}/{validate_id(row.session_id, 'session_id')}/" \
          f"{time.time_ns():019d}-{os.urandom(4).hex()}.json"
    body = {**asdict(row), "updated_at": as_utc(row.updated_at).isoformat()}
    return key, json.dumps(body, separators=(",", ":")).encode()


def scope(user_id: str | None | EllipsisType) -> str:
    """The markers' prefix for ``user_id`` (``...``: every user)."""
    return CHANGED if isinstance(user_id, EllipsisType) else f"{CHANGED}{user_segment(user_id)}/"


def session_of(key: str) -> tuple[str | None, str] | None:
    """``(user_id, session_id)`` a marker key names; None (with a warning) for a key that names none."""
    parts = key[len(CHANGED):].split("/")
    try:
        if len(parts) != 3 or not parts[2]:
            raise ValueError("not a change marker")
        user = user_from_segment(parts[0]) if parts[0] == "_" else validate_id(parts[0], "user_id")
        return user, validate_id(parts[1], "session_id")
    except ValueError:
        log.warning("ignoring a change marker that names no session: %s", key)
        return None


def _row_of(data: bytes, owner: tuple[str | None, str]) -> SessionRow:
    body = json.loads(data)
    if not isinstance(body, dict) or not set(body) <= _FIELDS:
        raise ValueError("not a session status row")
    row = SessionRow(**{**body, "updated_at": as_utc(datetime.fromisoformat(body["updated_at"]))})
    if (row.user_id, row.session_id) != owner:
        raise ValueError(f"it names session {row.session_id!r} of user {row.user_id!r}")
    return row


class ChangedRows:
    """The rows the newest markers hold, read through a cache of parsed markers (by key: never rewritten)."""

    def __init__(self, objects: ObjectStore, max_kept: int = 100_000) -> None:
        self.objects, self.max_kept = objects, max_kept
        self._lock = threading.Lock()
        self._kept: dict[str, SessionRow | None] = {}

    def read(self, markers: dict[tuple[str | None, str], list[str]],
             map_io: Callable[[Callable[[Any], Any], list[Any]], list[Any]],
             from_index: Callable[[str, str | None], SessionRow | None]) -> list[SessionRow]:
        """The latest row of each session of ``markers`` (its newest marker's; the index's when that marker is
        unreadable or gone)."""
        def one(item: tuple[tuple[str | None, str], list[str]]) -> SessionRow | None:
            (user, sid), keys = item
            key = max(keys)  # the newest: names start with the writer's clock in nanoseconds
            with self._lock:
                if key in self._kept:
                    return self._kept[key]
            obj = self.objects.get(key=key)
            row = None
            if obj is not None:
                try:
                    row = _row_of(obj.data, (user, sid))
                except (ValueError, TypeError, KeyError) as e:
                    log.warning("change marker %s is not a status row (%s); reading the index instead",
                                self.objects.describe(key), e)
            if row is None:
                return from_index(sid, user)
            with self._lock:
                if len(self._kept) >= self.max_kept:
                    self._kept.clear()
                self._kept[key] = row
            return row

        return [r for r in map_io(one, list(markers.items())) if r is not None]
