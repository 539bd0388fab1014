"""What the session page's buttons do: each goes through :mod:`loomray.control`, as the CLI's commands do.

Each is a create-only object in the store, so a click sent twice records nothing new; every action answers
with a redirect back to the page that says what happened (docs/ui.md, "Acting").
"""

from __future__ import annotations

import asyncio
import json
from typing import Any
from urllib.parse import urlencode

from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import RedirectResponse, Response

from loomray import control
from loomray.errors import LoomrayUserError
from loomray.loop import ToolDecision
from loomray.storage import Store
from loomray.ui.state import UiState, session_of

SOURCE = "ui"


def decisions(store: Store, session_id: str, user_id: str | None) -> dict[str, str]:
    """The decisions recorded on the session's tool calls and not consumed yet, in words, by call id."""
    return {r["call_id"]: control.describe_decision(ToolDecision.from_fields(r))
            for r in control.list_requests(store, session_id, user_id)
            if r.get("kind") == "decision" and isinstance(r.get("call_id"), str)}


def _text(form: Any, name: str, *, required: bool = True) -> str:
    value = form.get(name)
    value = value.strip() if isinstance(value, str) else ""
    if required and not value:
        raise LoomrayUserError(f"the form needs a {name.replace('_', ' ')}")
    return value


def _approve(state: UiState, sid: str, user: str | None, form: Any) -> str:
    call = _text(form, "call_id")
    written = control.record_decision(state.store, sid, user, call, True, source=SOURCE)
    return f"tool call {call} approved" + ("" if written else " (already recorded)") + "; resume to run it"


def _approve_edited(state: UiState, sid: str, user: str | None, form: Any) -> str:
    call = _text(form, "call_id")
    try:
        arguments = json.loads(_text(form, "arguments"))
    except ValueError as e:
        raise LoomrayUserError(f"the edited arguments are not JSON: {e}") from e
    if not isinstance(arguments, dict):
        raise LoomrayUserError("the edited arguments must be a JSON object")
    written = control.record_decision(state.store, sid, user, call, {"arguments": arguments}, source=SOURCE)
    return (f"tool call {call} approved with edited arguments" + ("" if written else " (already recorded)")
            + "; resume to run it")


def _respond(state: UiState, sid: str, user: str | None, form: Any) -> str:
    call, text = _text(form, "call_id"), _text(form, "response")
    written = control.record_decision(state.store, sid, user, call, {"respond": text}, source=SOURCE)
    return (f"tool call {call} answered in the tool's place" + ("" if written else " (already recorded)")
            + "; resume to tell the model")


def _deny(state: UiState, sid: str, user: str | None, form: Any) -> str:
    call, reason = _text(form, "call_id"), _text(form, "reason", required=False)
    written = control.record_decision(state.store, sid, user, call, reason or False, source=SOURCE)
    return f"tool call {call} denied" + ("" if written else " (already recorded)") + "; resume to tell the model"


def _signal(state: UiState, sid: str, user: str | None, form: Any) -> str:
    name = control.send_signal(state.store, sid, user, _text(form, "text"), source=SOURCE)
    return f"signal {name} stored: delivered at the next pass boundary"


def _pause(state: UiState, sid: str, user: str | None, form: Any) -> str:
    name = control.request_pause(state.store, sid, user, source=SOURCE)
    return "the session is paused already" if name is None else f"pause {name} stored: it stops at its next pass"


def _cancel(state: UiState, sid: str, user: str | None, form: Any) -> str:
    if form.get("confirm") != "yes":
        raise LoomrayUserError("a cancel needs its confirmation")
    epoch = control.cancel_session(state.store, sid, user, source=SOURCE)
    return f"session cancelled; writers fenced at epoch {epoch}"


_STORED = {"approve": _approve, "approve-edited": _approve_edited, "respond": _respond, "deny": _deny,
           "signal": _signal, "pause": _pause, "cancel": _cancel}


def back(sid: str, user: str | None, **note: str) -> RedirectResponse:
    """303 to the session page, carrying a note of what happened."""
    query = urlencode({**({"user": user} if user else {}), **note})
    return RedirectResponse(f"/session/{sid}?{query}", status_code=303)


async def act(request: Request) -> Response:
    """POST /session/{id}/{action}: check the CSRF token, then do the action (see the module doc)."""
    state, sid, user = session_of(request)
    action = request.path_params["action"]
    if action not in (*_STORED, "resume"):
        raise HTTPException(404, f"no action {action!r}")
    form = await request.form()
    if not state.guard.csrf_ok(form.get("csrf")):
        raise HTTPException(403, "refused: the form lacks this server's token (reload the page)")
    try:
        if action == "resume":
            await asyncio.to_thread(control.require_session, state.store, sid, user)
            state.resumes.start(state, sid, user)
            note = "resumed: the page follows the run"
        else:
            note = await asyncio.to_thread(_STORED[action], state, sid, user, form)
    except (LoomrayUserError, ValueError, TypeError) as e:
        return back(sid, user, error=str(e))
    return back(sid, user, done=note)
