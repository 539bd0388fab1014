"""Control requests as objects in the store: writing them (signal, pause, decision) and reading them back.

Each request is one create-only JSON object under the session's ``control/``
prefix (:func:`storage.layout.control_key`); see :mod:`loomray.control`.
"""

from __future__ import annotations

import json
import logging
from typing import Any

from loomray.checkpoint_format import load_checkpoint
from loomray.decisions import Approve, Respond
from loomray.errors import LoomrayUserError
from loomray.ids import new_id
from loomray.journal import safe_call_id
from loomray.loop import ToolDecision, dangling_tool_calls
from loomray.records import ToolCall, utcnow
from loomray.session_store import SessionStore
from loomray.storage import layout
from loomray.storage.errors import PreconditionFailed

log = logging.getLogger("loomray.control")

#: The name of the (sticky) cancel request.
CANCEL = "cancel"


def decision_name(call_id: str) -> str:
    """The name of the decision request on tool call ``call_id`` (one per call: the first decision wins)."""
    return f"decision-{safe_call_id(call_id)}"


def request_body(kind: str, name: str, session_id: str, user_id: str | None, source: str, **fields: Any) -> bytes:
    """The JSON object of one control request."""
    return json.dumps({"type": "control", "v": 1, "kind": kind, "name": name, "session_id": session_id,
                       "user_id": user_id, "source": source, "created_at": utcnow().isoformat(), **fields}).encode()


def create_request(store: SessionStore, session_id: str, user_id: str | None, name: str, data: bytes) -> bool:
    """Create-only PUT of ``control/{name}.json``; False when it already exists."""
    try:
        store.objects.put(key=layout.control_key(session_id, user_id, name), data=data, if_none_match=True)
        return True
    except PreconditionFailed:
        return False


def read_request(store: SessionStore, key: str) -> dict[str, Any] | None:
    """The control request stored at ``key``; None when it is gone or unreadable (logged)."""
    obj = store.objects.get(key=key)
    if obj is None:
        return None
    try:
        body = json.loads(obj.data)
    except (ValueError, RecursionError):  # RecursionError: JSON nested deeper than the parser recurses
        log.warning("skipping unreadable control request %s", store.describe(key))
        return None
    return body if isinstance(body, dict) and body.get("type") == "control" else None


def session_status(store: SessionStore, session_id: str, user_id: str | None) -> str | None:
    """The session's latest status row's status, or None when it has none."""
    row = store.sessions.get(session_id, user_id=user_id)
    return row.status if row is not None else None


def require_session(store: SessionStore, session_id: str, user_id: str | None) -> str | None:
    """The session's status; :class:`LoomrayUserError` for a session the store does not know.

    A session submitted to a supervisor but not started yet (its actor waits for what it asked for) has
    no status row or run yet, only its active mark: it is known, and may be cancelled before it starts.
    """
    status = session_status(store, session_id, user_id)
    if (status is None and not store.journal.runs(session_id, user_id=user_id)
            and store.active.get(session_id, user_id=user_id) is None):
        raise LoomrayUserError(f"unknown session {session_id!r}" + (f" of user {user_id!r}" if user_id else "")
                               + f" in {store.describe()}")
    return status


def is_cancelled(store: SessionStore, session_id: str, user_id: str | None) -> bool:
    """True when the session was cancelled (one GET)."""
    return store.objects.get(key=layout.control_key(session_id, user_id, CANCEL)) is not None


def _refuse_cancelled(store: SessionStore, session_id: str, user_id: str | None) -> None:
    if is_cancelled(store, session_id, user_id):
        raise LoomrayUserError(f"session {session_id!r} was cancelled")


def send_signal(store: SessionStore, session_id: str, user_id: str | None, text: str, *, source: str = "api") -> str:
    """Store a user message for the session's next pass boundary; returns the signal's id."""
    if not isinstance(text, str) or not text:
        raise LoomrayUserError("a signal needs a non-empty text")
    require_session(store, session_id, user_id)
    _refuse_cancelled(store, session_id, user_id)
    name = f"signal-{new_id('')}"
    create_request(store, session_id, user_id, name,
                   request_body("signal", name, session_id, user_id, source, text=text))
    return name


def request_pause(store: SessionStore, session_id: str, user_id: str | None, *, source: str = "api") -> str | None:
    """Ask the session to stop at its next pass boundary; returns the request's id (None: already paused)."""
    status = require_session(store, session_id, user_id)
    _refuse_cancelled(store, session_id, user_id)
    if status == "paused":
        return None
    if status == "completed":
        raise LoomrayUserError(f"session {session_id!r} is not running (its last run completed)")
    name = f"pause-{new_id('')}"
    create_request(store, session_id, user_id, name, request_body("pause", name, session_id, user_id, source))
    return name


def normalize_decision(value: object) -> ToolDecision:
    """A decision from what a caller passes.

    ``True`` approves; ``False`` or a reason (a str) denies; :class:`~loomray.Approve`
    (or ``{"arguments": {...}}``) approves, with those arguments in place of the model's when given;
    :class:`~loomray.Respond` (or ``{"respond": "text"}``) answers in the tool's place (it does not run);
    a :class:`ToolDecision` as it is.
    """
    if isinstance(value, ToolDecision):
        return value
    if isinstance(value, Approve):
        return ToolDecision(approved=True, arguments=value.arguments)
    if isinstance(value, Respond):
        return ToolDecision(approved=False, response=value.text)
    if isinstance(value, bool):
        return ToolDecision(approved=value)
    if isinstance(value, str):
        return ToolDecision(approved=False, reason=value or None)
    if isinstance(value, dict) and set(value) == {"arguments"}:
        if not isinstance(value["arguments"], dict):
            raise TypeError(f"edited arguments must be a JSON object (dict), got {type(value['arguments']).__name__}")
        try:
            json.dumps(value["arguments"])
        except (TypeError, ValueError) as e:
            raise TypeError(f"edited arguments must be JSON: {e}") from e
        return ToolDecision(approved=True, arguments=value["arguments"])
    if isinstance(value, dict) and set(value) == {"respond"}:
        if not isinstance(value["respond"], str):
            raise TypeError(f"a response in a tool's place must be a str, got {type(value['respond']).__name__}")
        return ToolDecision(approved=False, response=value["respond"])
    raise TypeError("a decision is True, False, a reason for denial (str), Approve(arguments=...), Respond(text), "
                    f"{{'arguments': {{...}}}} or {{'respond': 'text'}}, got {value!r:.80}")


def pending_calls(store: SessionStore, session_id: str, user_id: str | None) -> list[ToolCall] | None:
    """The tool calls the session waits on (its latest checkpoint is "awaiting_approval"); ``[]`` when it waits
    on none; None when it has no checkpoint (checkpointing off: nothing to check against)."""
    ckpt = load_checkpoint(store, session_id, "latest", user_id=user_id)
    if ckpt is None:
        return None
    if ckpt.execution_status != "awaiting_approval":
        return []
    calls = dangling_tool_calls(list(ckpt.messages))
    if ckpt.pending_approvals is None:
        return calls
    wanted = set(ckpt.pending_approvals)
    return [c for c in calls if c.id in wanted]


def record_decision(store: SessionStore, session_id: str, user_id: str | None, call_id: str, decision: object, *,
                    source: str = "api", check_pending: bool = True) -> bool:
    """Record the decision on tool call ``call_id`` (create-only: the first decision wins).

    Returns True when written, False when the same decision was already there;
    a different earlier decision, or (``check_pending``) a call the session
    does not wait on, is a :class:`LoomrayUserError`.
    """
    if not isinstance(call_id, str) or not call_id:
        raise LoomrayUserError("a tool call id must be a non-empty str")
    decided = normalize_decision(decision)
    if check_pending:
        require_session(store, session_id, user_id)
        _refuse_cancelled(store, session_id, user_id)
        pending = pending_calls(store, session_id, user_id)
        if pending is not None and call_id not in {c.id for c in pending}:
            waiting = ", ".join(c.id for c in pending) or "none"
            raise LoomrayUserError(f"session {session_id!r} does not wait for a decision on tool call {call_id!r} "
                                   f"(it waits on: {waiting})")
    name = decision_name(call_id)
    body = request_body("decision", name, session_id, user_id, source, call_id=call_id, **decided.fields())
    if create_request(store, session_id, user_id, name, body):
        return True
    existing = read_request(store, layout.control_key(session_id, user_id, name)) or {}
    if existing.get("call_id") == call_id and ToolDecision.from_fields(existing) == decided:
        return False
    if existing.get("call_id") not in (None, call_id):  # two call ids with the same safe name (never in practice)
        raise LoomrayUserError(f"tool call {call_id!r}: its decision slot holds call {existing.get('call_id')!r}")
    raise LoomrayUserError(f"tool call {call_id!r} of session {session_id!r} was already decided: "
                           f"{describe_decision(ToolDecision.from_fields(existing))}")


def describe_decision(decision: ToolDecision) -> str:
    """A decision in a few words, for messages and listings."""
    if decision.response is not None:
        return "answered in the tool's place"
    if not decision.approved:
        return f"denied ({decision.reason or 'no reason'})"
    return "approved with edited arguments" if decision.arguments is not None else "approved"


def list_requests(store: SessionStore, session_id: str, user_id: str | None) -> list[dict[str, Any]]:
    """Every readable control request of the session (one LIST, one GET each), oldest first per kind."""
    prefix = layout.control_prefix(session_id, user_id)
    out = []
    for info in store.objects.list(prefix=prefix):
        body = read_request(store, info.key)
        if body is not None:
            out.append(body)
    return out

