"""Hand-offs from a driver to a supervisor are idempotent: a resend never starts a run twice.

A driver hands the supervisor a request (``submit``, a fan-out's batch) and
waits. When the supervisor dies meanwhile, the driver cannot know how far it
got, so it resends the same hand-off to the replacement, which must answer
with the original outcome and start nothing that already started:

- every request carries a ``request_id`` chosen by the driver
  (:func:`handed_off`), stored with the run it starts (the run record);
- every fork of a fan-out also carries its ``run_id``, chosen by the driver:
  forks are new sessions, so the id names exactly one run;
- the replacement adopts the runs under way from the store; a resent request
  of a session it watches joins that run (``same_request``);
- a resent request of a session it does not watch goes first to the actor
  (or activation) that runs or ran this very hand-off (:func:`same_handoff`),
  if one is still there: its run may have gone on, or ended unwatched while
  no supervisor lived (its actor lingers with the outcome), and collecting
  it there keeps the run's one lease;
- else a resent request whose ``request_id`` started the session's last run is
  pinned to that run's id (:func:`pinned`): it continues the run, replaying
  its journal, or (finished) returns its result from its final checkpoint
  (a new incarnation: a new lease). A fork's run id does the same.

Cancel and approve need nothing more: a cancel is a durable request in the
store (applied once, whoever reads it), and an approval travels in a resume
request, which is a hand-off like any other.
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
