"""Steering a session from the command line: ``approve``, ``deny``, ``signal``, ``pause``, ``cancel``, ``logs``.

These write control objects to the store (:mod:`loomray.control`) or read
the session's journal, so they need no cluster: the session picks a control
up at its next pass boundary, wherever it runs.
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any

import click

from loomray import control
from loomray.cli.common import (
    EXIT_RUN,
    CliError,
    err_console,
    guarded,
    json_option,
    open_session_store,
    session_exists,
    store_option,
    unknown_session,
    user_option,
)
from loomray.cli.output import excerpt, iso_time, short_time, tell
from loomray.cli.progress import stdin_is_tty
from loomray.run_errors import read_errors
from loomray.storage import JournalEntry, Store
from loomray.storage.journal import JournalRun, entry_name, read_run


def _resume_hint(session_id: str, user_id: str | None) -> str:
    return f"loomray resume {session_id}" + (f" --user {user_id}" if user_id else "")


def _decide(session_id: str, call_id: str, decision: Any, store_url: str | None, user_id: str | None,
            as_json: bool) -> None:
    store = open_session_store(store_url, session_id, user_id)
    written = control.record_decision(store, session_id, user_id, call_id, decision, source="cli")
    decided = control.normalize_decision(decision)
    what = control.describe_decision(decided)
    again = "" if written else " (already recorded)"
    extra = {k: v for k, v in (("arguments", decided.arguments), ("response", decided.response)) if v is not None}
    tell(as_json, {"session_id": session_id, "user_id": user_id, "call_id": call_id, "approved": decided.approved,
                    "reason": decided.reason, **extra, "recorded": written},
          f"tool call {call_id} of session {session_id} {what}{again}; `{_resume_hint(session_id, user_id)}` "
          "continues the session")


@click.command()
@click.argument("session_id")
@click.argument("call_id")
@click.option("--arguments", "arguments", default=None, metavar="JSON",
              help="Run the call with these arguments (a JSON object) instead of the model's.")
@store_option
@user_option
@json_option
@guarded
def approve(session_id: str, call_id: str, arguments: str | None, store_url: str | None, user_id: str | None,
            as_json: bool) -> None:
    """Approve a tool call a session waits on (stop reason awaiting_approval).

    The decision is stored (create-only: the first decision on a call wins);
    `loomray resume SESSION` then runs the call once and continues. With
    --arguments the tool runs with those arguments; the model's call stays as
    it wrote it in the transcript.
    """
    if arguments is None:
        _decide(session_id, call_id, True, store_url, user_id, as_json)
        return
    try:
        edited = json.loads(arguments)
    except ValueError as e:
        raise CliError(f"--arguments is not JSON: {e}") from e
    if not isinstance(edited, dict):
        raise CliError(f"--arguments must be a JSON object, got {type(edited).__name__}")
    _decide(session_id, call_id, {"arguments": edited}, store_url, user_id, as_json)


@click.command()
@click.argument("session_id")
@click.argument("call_id")
@click.argument("text")
@store_option
@user_option
@json_option
@guarded
def respond(session_id: str, call_id: str, text: str, store_url: str | None, user_id: str | None,
            as_json: bool) -> None:
    """Answer a tool call a session waits on in the tool's place: the tool does not run, the model gets TEXT.

    Stored like approve and deny (the first decision on a call wins);
    `loomray resume SESSION` continues.
    """
    _decide(session_id, call_id, {"respond": text}, store_url, user_id, as_json)


@click.command()
@click.argument("session_id")
@click.argument("call_id")
@click.option("--reason", default=None, help="Why; the model gets it as the call's error result.")
@store_option
@user_option
@json_option
@guarded
def deny(session_id: str, call_id: str, reason: str | None, store_url: str | None, user_id: str | None,
         as_json: bool) -> None:
    """Deny a tool call a session waits on; the model gets the denial (and --reason) as the call's error result."""
    _decide(session_id, call_id, reason if reason else False, store_url, user_id, as_json)


@click.command("signal")
@click.argument("session_id")
@click.argument("text")
@store_option
@user_option
@json_option
@guarded
def signal_cmd(session_id: str, text: str, store_url: str | None, user_id: str | None, as_json: bool) -> None:
    """Send TEXT to a session as a user message, delivered once at its next pass boundary."""
    store = open_session_store(store_url, session_id, user_id)
    name = control.send_signal(store, session_id, user_id, text, source="cli")
    tell(as_json, {"session_id": session_id, "user_id": user_id, "signal": name},
          f"signal {name} stored for session {session_id}: delivered at its next pass boundary")


@click.command()
@click.argument("session_id")
@store_option
@user_option
@json_option
@guarded
def pause(session_id: str, store_url: str | None, user_id: str | None, as_json: bool) -> None:
    """Ask a session to stop at its next pass boundary (with a checkpoint); `loomray resume` continues it."""
    store = open_session_store(store_url, session_id, user_id)
    name = control.request_pause(store, session_id, user_id, source="cli")
    tell(as_json, {"session_id": session_id, "user_id": user_id, "pause": name},
          f"session {session_id} is paused already; `{_resume_hint(session_id, user_id)}` continues it"
          if name is None else f"pause {name} stored for session {session_id}: it stops at its next pass boundary")


@click.command()
@click.argument("session_id")
@store_option
@user_option
@click.option("--yes", "-y", is_flag=True,
              help="Cancel without asking. Without it cancel asks on a terminal and refuses when stdin is not one.")
@json_option
@guarded
def cancel(session_id: str, store_url: str | None, user_id: str | None, yes: bool, as_json: bool) -> None:
    """Cancel a session: its step in flight is abandoned and nothing it does afterwards is made durable.

    Stores the cancel, then takes the session's lease and seals its last run,
    so a writer anywhere is fenced before this command returns. Final: every
    later run of the session stops at once as "cancelled" (fork a checkpoint
    to go on from it).
    """
    store = open_session_store(store_url, session_id, user_id)
    control.require_session(store, session_id, user_id)  # an unknown session is an error before any question
    if not yes:
        if not stdin_is_tty():
            raise CliError(f"cancel of session {session_id} is final and asks first, but stdin is not a terminal: "
                           "pass --yes to cancel without asking")
        if not click.confirm(f"Cancel session {session_id}? It cannot be undone", default=False, err=True):
            err_console.print("not cancelled", highlight=False)
            sys.exit(EXIT_RUN)
    epoch = control.cancel_session(store, session_id, user_id, source="cli")
    tell(as_json, {"session_id": session_id, "user_id": user_id, "cancelled": True, "epoch": epoch},
          f"session {session_id} cancelled; writers fenced at epoch {epoch}")


def entry_summary(entry: JournalEntry) -> str:
    """One line about a journal entry for ``loomray logs``."""
    out = entry.output or {}
    kind = entry.kind
    if kind == "run_start":
        base = out.get("base_checkpoint_id")
        return f"prompt: {excerpt(out.get('prompt'), 120)}" + (f" (from checkpoint {base})" if base else "")
    if kind == "model":
        msg = (out.get("response") or {}).get("message") or {}
        calls = msg.get("tool_calls") or []
        if calls:
            return "calls " + ", ".join(f"{c.get('name')}({excerpt(json.dumps(c.get('arguments', {})), 60)}) "
                                        f"[{c.get('id')}]" for c in calls)
        return f"answer: {excerpt(msg.get('content'), 120)}"
    if kind == "tool":
        msg = out.get("message") or {}
        head = f"{out.get('tool') or msg.get('name')} [{msg.get('tool_call_id')}] "
        return head + ("error: " if msg.get("is_error") else "-> ") + excerpt(msg.get("content"), 120)
    if kind == "signal":
        return f"signal {out.get('control')}: {excerpt(out.get('text'), 120)}"
    if kind == "pause":
        return f"pause {out.get('control')}: the run stopped here"
    if kind == "approval":
        what = "approved" if out.get("approved") else "denied" + (f": {out.get('reason')}" if out.get("reason") else "")
        return f"{out.get('tool')} [{out.get('call_id')}] {what}"
    if kind == "run_end":
        return f"run finished: {out.get('turns')} turns, {out.get('model_calls')} model calls"
    if kind == "seal":
        return f"older writers fenced (epoch {entry.epoch}, {out.get('owner') or '-'})"
    return excerpt(json.dumps(out, default=str), 120)


class LogReader:
    """A session's journal entries across its runs (oldest run first), each entry returned once."""

    def __init__(self, store: Store, session_id: str, user_id: str | None) -> None:
        self.store, self.session_id, self.user_id = store, session_id, user_id
        self._runs: dict[str, JournalRun] = {}
        self._seen: set[str] = set()
        self._order: list[str] = []
        self._done: set[str] = set()

    def _run_ids(self) -> list[str]:
        ids = [r.run_id for r in self.store.runs.list(self.session_id, user_id=self.user_id)]
        journaled = self.store.journal.runs(self.session_id, user_id=self.user_id)
        return ids + [run_id for run_id in journaled if run_id not in ids]  # and runs without records

    def new_entries(self) -> list[JournalEntry]:
        """The entries written since the last call (all of them on the first), oldest run first."""
        self._order = self._run_ids()
        out = []
        for run_id in self._order:
            if run_id in self._done and run_id != self._order[-1]:
                continue  # an older run that had finished when read: nothing new comes
            run = read_run(self.store, self.session_id, run_id, self.user_id, self._runs.get(run_id))
            self._runs[run_id] = run
            entries = run.entries
            if any(e.kind == "run_end" for e in entries):
                self._done.add(run_id)
            for e in entries:
                key = f"{run_id}/{entry_name(e)}"
                if key not in self._seen:
                    self._seen.add(key)
                    out.append(e)
        return out

    def ended(self) -> bool:
        """The last run finished, or the session stopped (its status is not an active one)."""
        if self._order and self._order[-1] in self._done:
            return True
        row = self.store.sessions.get(self.session_id, user_id=self.user_id)
        return row is not None and row.status not in ("running", "pending")


def _print_entry(e: JournalEntry, session_id: str, user_id: str | None, as_json: bool) -> None:
    if as_json:
        click.echo(json.dumps({"session_id": session_id, "user_id": user_id, "run_id": e.run_id,
                               "seq": e.seq, "kind": e.kind, "step_key": e.step_key,
                               "epoch": e.epoch, "created_at": iso_time(e.created_at),
                               "summary": entry_summary(e), "output": e.output}, default=str))
    else:
        click.echo(f"{short_time(e.created_at)}  {e.run_id}  {e.seq:>5}  {e.kind:<9} {entry_summary(e)}")


@click.command()
@click.argument("session_id")
@store_option
@user_option
@click.option("-f", "--follow", is_flag=True, help="Keep printing new entries until the run ends (or Ctrl-C).")
@click.option("--interval", default=1.0, show_default=True, type=click.FloatRange(0.01, 3600),
              help="Seconds between two looks with --follow.")
@json_option
@guarded
def logs(session_id: str, store_url: str | None, user_id: str | None, follow: bool, interval: float,
         as_json: bool) -> None:
    """A session's events from the store: its journal entries across runs, oldest first.

    Model answers, tool results, signals, pauses, approvals and run starts and
    ends, one line each (`--json`: one JSON object per line). With
    `-f` it polls for new entries until the run ends or stops (awaiting
    approval, paused, cancelled, ...).
    """
    store = open_session_store(store_url, session_id, user_id)
    if not session_exists(store, session_id, user_id):
        raise unknown_session(store, session_id, user_id)
    reader = LogReader(store, session_id, user_id)
    try:
        while True:
            for e in reader.new_entries():
                _print_entry(e, session_id, user_id, as_json)
            if not follow:
                break
            if reader.ended():
                # What the run wrote between the read above and its end (run_end among it) still shows.
                for e in reader.new_entries():
                    _print_entry(e, session_id, user_id, as_json)
                break
            time.sleep(interval)
    except KeyboardInterrupt:
        pass
    if not as_json:
        row = store.sessions.get(session_id, user_id=user_id)
        if row is not None:
            err_console.print(f"session {session_id}: {row.status}", highlight=False, soft_wrap=True)
        if row is not None and row.status == "failed":  # the full text: the index holds only its type
            for rec in read_errors(store, session_id, user_id)[-1:]:
                err_console.print(f"  {rec['error']}", highlight=False, soft_wrap=True, markup=False)


STEERING_COMMANDS: tuple[click.Command, ...] = (approve, respond, deny, signal_cmd, pause, cancel, logs)
