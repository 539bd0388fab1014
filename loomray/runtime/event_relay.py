"""Run events on their way from session actors to the drivers that stream them.

The actor may be restarted elsewhere and the driver may have gone, so events go through the supervisor:
a bounded buffer per session that drivers poll with a cursor; events that fall off it are counted.
"""

from __future__ import annotations

import asyncio
import itertools
from collections import deque
from dataclasses import dataclass, field
from typing import Any

#: Events kept per session for drivers that poll them (older ones are dropped and counted).
EVENT_BUFFER = 10_000

#: A session's address in the supervisor: ``(user_id, session_id)``.
SessionKey = tuple[str | None, str]


@dataclass
class EventLog:
    """A bounded, cursor-addressed buffer of one session's events (JSON strings)."""

    items: deque = field(default_factory=lambda: deque(maxlen=EVENT_BUFFER))
    #: Cursor of ``items[0]``: events before it were dropped.
    base: int = 0
    changed: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def end(self) -> int:
        """The cursor after the newest event."""
        return self.base + len(self.items)

    def extend(self, events: list[str]) -> None:
        """Append events in order, dropping the oldest beyond :data:`EVENT_BUFFER`; wake waiting readers."""
        self.base += max(0, len(self.items) + len(events) - EVENT_BUFFER)
        self.items.extend(events)
        self.changed.set()
        self.changed = asyncio.Event()

    def since(self, cursor: int) -> tuple[list[str], int, int]:
        """Events from ``cursor`` on, the next cursor, and how many were dropped before ``cursor`` could see them."""
        start = max(cursor, self.base)
        return list(itertools.islice(self.items, start - self.base, None)), self.end, start - cursor


class EventRelay:
    """The supervisor's event buffers, one :class:`EventLog` per streamed session."""

    def __init__(self) -> None:
        self.logs: dict[SessionKey, EventLog] = {}

    def open(self, key: SessionKey) -> None:
        """Start buffering a session's events (a driver asked to stream them)."""
        self.logs[key] = EventLog()

    def drop(self, key: SessionKey) -> None:
        """Forget a session's buffer (the session was forgotten)."""
        self.logs.pop(key, None)

    def push(self, key: SessionKey, events: list[str], *, supervised: bool) -> None:
        """Buffer a batch of a session's events; ignored unless streamed or ``supervised`` here."""
        log = self.logs.get(key)
        if log is None:
            if not supervised:
                return  # nobody asked for them (or the session was forgotten)
            log = self.logs[key] = EventLog()
        log.extend(events)

    async def read(self, key: SessionKey, cursor: int, wait_s: float, done: asyncio.Future | None) -> dict[str, Any]:
        """``{"events": [json, ...], "cursor": next, "dropped": n, "done": bool}`` from ``cursor`` on, waiting up
        to ``wait_s`` while the run (``done``, None: not supervised here) goes on; ``done`` once all are in."""
        log = self.logs.get(key)
        if log is None:
            return {"events": [], "cursor": cursor, "dropped": 0, "done": done is None or done.done()}
        if log.end <= cursor and not (done is None or done.done()) and wait_s > 0:
            waiter = asyncio.ensure_future(log.changed.wait())
            await asyncio.wait([waiter, done], timeout=wait_s, return_when=asyncio.FIRST_COMPLETED)
            waiter.cancel()
        events, nxt, dropped = log.since(cursor)
        return {"events": events, "cursor": nxt, "dropped": dropped, "done": done is None or done.done()}
