"""Hand-offs from a driver to a supervisor are idempotent: a resend never starts a run twice.

A driver that lost the supervisor it handed a request to resends it; the replacement joins the run under
way (:func:`same_handoff`) or pins the resend to the run its ``request_id`` started (:func:`pinned`).
docs/containment.md, "A supervisor lost during a hand-off".
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

from loomray.ids import new_id
from loomray.session import RunRequest
from loomray.storage import Store


def handed_off(request: RunRequest, *, fork: bool = False) -> RunRequest:
    """``request`` with the id of this hand-off (kept if it has one); a fork also gets its run id."""
    update: dict[str, Any] = {}
    if not request.request_id:
        update["request_id"] = new_id("req")
    if fork and not request.run_id:
        update["run_id"] = new_id("run")
    return request.model_copy(update=update) if update else request


async def pinned(store: Store, request: RunRequest, request_json: str) -> str:
    """``request_json``, pinned to the session's last run if this very hand-off (``request_id``) started it."""
    if request.request_id is None or request.run_id is not None:
        return request_json  # no id to look up, or the run is named already (a fork)
    record = await asyncio.to_thread(store.runs.last, request.session_id, user_id=request.user_id)
    if record is None or (record.request or {}).get("request_id") != request.request_id:
        return request_json
    return request.model_copy(update={"run_id": record.run_id}).model_dump_json()


def same_handoff(ran: Any, resent: str) -> bool:
    """Whether ``resent`` (a request as JSON, maybe :func:`pinned`) is the hand-off an actor runs as ``ran``.

    The same ``request_id`` (chosen per hand-off by the driver) and otherwise the same request; a pinned
    resend names the run id that hand-off's run got, which the actor's own request may leave unset.
    """
    try:
        theirs, ours = json.loads(ran), json.loads(resent)
    except (TypeError, ValueError):
        return False
    if not isinstance(theirs, dict) or not isinstance(ours, dict) or not theirs.get("request_id"):
        return False
    if theirs.get("run_id") is None:
        ours = {**ours, "run_id": None}
    return bool(theirs == ours)
