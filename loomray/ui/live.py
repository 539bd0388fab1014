"""Live updates of a session page: server-sent events over the session's journal and status.

Each journal entry is sent once, with id ``{run_id}/{entry}`` (:func:`event_id`); a reconnecting
``EventSource`` sends ``Last-Event-ID`` and the new stream starts after it (docs/ui.md, "Live").
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from typing import Any

from loomray.cli.steering import LogReader
from loomray.storage import JournalEntry, Store
from loomray.ui.session_view import event_id, event_view
from loomray.ui.state import UiState


def sse(event: str, data: dict[str, Any], event_id: str | None = None) -> str:
    """One server-sent event (JSON data on one line)."""
    head = f"id: {event_id}\n" if event_id is not None else ""
    return f"{head}event: {event}\ndata: {json.dumps(data, default=str)}\n\n"


def after(entries: list[JournalEntry], last_id: str | None) -> list[JournalEntry]:
    """The entries after the one with id ``last_id`` (all of them when it is None or no longer there)."""
    if last_id is None:
        return entries
    ids = [event_id(e) for e in entries]
    return entries[ids.index(last_id) + 1:] if last_id in ids else entries


def status_of(store: Store, session_id: str, user_id: str | None) -> dict[str, Any]:
    """What a ``status`` event says: the session's status, and its latest checkpoint's id, turn and cost."""
    row = store.sessions.get(session_id, user_id=user_id)
    latest = store.checkpoints.list(session_id, user_id=user_id, limit=1)
    top = latest[0] if latest else None
    status = row.status if row is not None else (top.execution_status if top is not None else "unknown")
    return {"status": status, "checkpoint_id": top.checkpoint_id if top else None,
            "turn": top.turn if top else None, "cost_usd": top.cost_usd if top else None}


async def stream(state: UiState, session_id: str, user_id: str | None, last_id: str | None) -> AsyncIterator[str]:
    """The events of one stream (see the module doc)."""
    reader = LogReader(state.store, session_id, user_id)
    deadline = time.monotonic() + state.stream_s
    seen: dict[str, Any] | None = None
    yield "retry: 1000\n\n"
    first = True
    while True:
        entries = await asyncio.to_thread(reader.new_entries)
        if first:
            entries, first = after(entries, last_id), False
        for e in entries:
            yield sse("entry", event_view(e), event_id(e))
        now = await asyncio.to_thread(status_of, state.store, session_id, user_id)
        if now != seen:
            seen = now
            yield sse("status", now)
        if time.monotonic() >= deadline:
            return
        await asyncio.sleep(state.poll_s)
