"""Active-session marks: the supervisor's worklist in the store, so its pass is O(active sessions).

A mark carries the session's placement and its own actor options (never a secret), so an adopted session
restarts the way it ran (docs/ray-notes.md, "Dense placement"). A mark whose session row is finished and
newer than the mark is stale (a supervisor died before the cleanup) and is removed by the pass that finds it.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable
from datetime import datetime, timezone
from typing import Any

from loomray.runtime.actors import ACTIVE_STATES
from loomray.runtime.stored_options import secret_env_names, storable_options
from loomray.storage import SessionRow, Store

log = logging.getLogger("loomray.runtime.active")

#: A mark older than this whose session never wrote a row is abandoned (its start failed unseen).
_ORPHAN_AFTER_S = 3600.0


def note(placement: str, actor_options: dict[str, Any] | None = None, *, host_crashes: int = 0,
         quarantined: bool = False, charged: int = 0) -> bytes:
    """The mark's body: placement, the session's own actor options (JSON only, secrets left out and named in
    ``secret_env_vars``), when it was marked, and its crash attribution, which an adopting supervisor carries on."""
    body: dict[str, Any] = {"v": 1, "placement": placement, "since": datetime.now(timezone.utc).isoformat()}
    if host_crashes:
        body["host_crashes"] = host_crashes
    if quarantined:
        body["quarantined"] = True
    if charged:
        body["charged"] = charged
    if actor_options:
        body["actor_options"] = storable_options(actor_options)
        names = secret_env_names(actor_options)
        if names:
            body["secret_env_vars"] = names
    return json.dumps(body).encode()


def parse(raw: bytes | None) -> dict[str, Any]:
    """A mark's body as a dict (``{}`` when absent or unreadable: a mark is only a hint)."""
    if not raw:
        return {}
    try:
        value = json.loads(raw)
    except (ValueError, RecursionError):  # RecursionError: JSON nested deeper than the parser recurses
        return {}
    return value if isinstance(value, dict) else {}


async def mark(store: Store, session_id: str, user_id: str | None, placement: str,
               actor_options: dict[str, Any] | None = None, *, host_crashes: int = 0,
               quarantined: bool = False, charged: int = 0) -> None:
    """Mark the session active (again: the body is replaced); a failure is logged (the session then is only
    adoptable by a full scan, and an adopter starts its crash attribution afresh)."""
    try:
        data = note(placement, actor_options, host_crashes=host_crashes, quarantined=quarantined, charged=charged)
        await asyncio.to_thread(store.active.put, session_id, user_id=user_id, data=data)
    except Exception as e:
        log.warning("could not mark session %r active: %s: %s", session_id, type(e).__name__, e)


async def clear(store: Store, session_id: str, user_id: str | None) -> None:
    """Remove the session's mark; a failure is logged (a later pass removes the stale mark)."""
    try:
        await asyncio.to_thread(store.active.delete, session_id, user_id=user_id)
    except Exception as e:
        log.warning("could not clear the active mark of session %r: %s: %s", session_id, type(e).__name__, e)


async def candidates(store: Store, watched: Callable[[tuple[str | None, str]], bool],
                     foreign: bool = False) -> list[tuple[SessionRow, dict[str, Any]]]:
    """``(session row, mark)`` of every marked, still active session for which ``watched(key)`` is false.

    With ``foreign`` (an operator's ``supervise``: the cluster that ran the
    sessions is gone) the whole session index is read as well, once, so
    active sessions without a mark (a store written before marks existed, a
    lost mark) are found too.
    """
    keys = [k for k in await asyncio.to_thread(store.active.list) if not watched(k)]

    async def one(key: tuple[str | None, str]) -> tuple[SessionRow, dict[str, Any]] | None:
        user_id, session_id = key
        raw, row = await asyncio.gather(asyncio.to_thread(store.active.get, session_id, user_id=user_id),
                                        asyncio.to_thread(store.sessions.get, session_id, user_id=user_id))
        info = parse(raw)
        if row is not None and row.status in ACTIVE_STATES:
            return row, info
        if _stale(row, info):
            await clear(store, session_id, user_id)
        return None

    found = [c for c in await asyncio.gather(*(one(k) for k in keys)) if c is not None]
    if foreign:
        seen = {(r.user_id, r.session_id) for r, _ in found}
        for state in ACTIVE_STATES:
            for row in await asyncio.to_thread(store.sessions.list, status=state, user_id=...):
                key = (row.user_id, row.session_id)
                if key not in seen and not watched(key):
                    seen.add(key)
                    found.append((row, {}))
    return found


def _stale(row: SessionRow | None, info: dict[str, Any]) -> bool:
    """A mark nobody needs: its session finished after it was marked, or never started at all."""
    try:
        since = datetime.fromisoformat(info["since"])
    except (KeyError, TypeError, ValueError):
        return row is not None  # an unreadable mark of a finished session
    if row is None:
        return (datetime.now(timezone.utc) - since).total_seconds() > _ORPHAN_AFTER_S
    return row.updated_at >= since
