"""``loomray approvals``: the tool calls waiting for a person's decision, with the command that decides each."""

from __future__ import annotations

import json
from typing import Any

import click

from loomray import control
from loomray.cli.common import (
    check_id,
    console,
    err_console,
    guarded,
    json_option,
    open_store_or_fail,
    session_exists,
    store_option,
    unknown_session,
    user_option,
)
from loomray.cli.output import emit_json, excerpt
from loomray.cli.tables import Col, fit_table
from loomray.loop import ToolDecision
from loomray.storage import ANY, Store

_COLUMNS = [Col("session", "session"), Col("user", "user", drop=2), Col("call", "call"), Col("tool", "tool"),
            Col("arguments", "arguments", drop=1, wrap=True), Col("decision", "decision")]


def _decisions(store: Store, session_id: str, user_id: str | None) -> dict[str, dict[str, Any]]:
    """Decisions stored but not yet applied (the session applies them when it resumes), by call id."""
    return {str(r.get("call_id")): r for r in control.list_requests(store, session_id, user_id)
            if r.get("kind") == "decision"}


def _waiting(store: Store, session_id: str, user_id: str | None) -> list[dict[str, Any]]:
    """One row per call the session waits on."""
    calls = control.pending_calls(store, session_id, user_id) or []
    decided = _decisions(store, session_id, user_id) if calls else {}
    rows = []
    for call in calls:
        stored = decided.get(call.id)
        decision = None if stored is None else control.describe_decision(ToolDecision.from_fields(stored))
        rows.append({"session_id": session_id, "user_id": user_id, "call_id": call.id, "tool": call.name,
                     "arguments": call.arguments, "decision": decision})
    return rows


@click.command()
@store_option
@click.option("--session", "session_id", default=None, help="Only this session (default: every session waiting).")
@user_option
@json_option
@guarded
def approvals(store_url: str | None, session_id: str | None, user_id: str | None, as_json: bool) -> None:
    """List the tool calls waiting for approval, and how to decide each.

    Without --session, every session whose status is awaiting_approval (of
    --user, or of every user). A decision already stored shows in the last
    column; the session applies it when it resumes.
    """
    check_id(session_id, "session_id")
    check_id(user_id, "user_id")
    store = open_store_or_fail(store_url)
    if session_id is not None:
        if not session_exists(store, session_id, user_id):
            raise unknown_session(store, session_id, user_id)
        sessions = [(session_id, user_id)]
    else:
        rows = store.sessions.list(status="awaiting_approval", user_id=ANY if user_id is None else user_id)
        sessions = [(r.session_id, r.user_id) for r in rows]
    waiting = [row for s, u in sessions for row in _waiting(store, s, u)]
    if as_json:
        emit_json(waiting)
        return
    if not waiting:
        console.print("no tool calls waiting for approval")
        return
    console.print(fit_table(_COLUMNS, [_cells(r) for r in waiting], title="waiting for approval"))
    first = waiting[0]
    user = f" --user {first['user_id']}" if first["user_id"] else ""
    err_console.print(f"decide with: loomray approve {first['session_id']} {first['call_id']}{user}  "
                      f"(or: loomray deny ... --reason TEXT)", highlight=False, soft_wrap=True)


def _cells(row: dict[str, Any]) -> dict[str, Any]:
    return {"session": row["session_id"], "user": row["user_id"], "call": row["call_id"], "tool": row["tool"],
            "arguments": excerpt(json.dumps(row["arguments"], ensure_ascii=False), 200),
            "decision": row["decision"] or "pending"}
