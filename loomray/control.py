"""Steering a session from outside: approvals, signals, pause and cancel, durable in the store.

A control request is one create-only object under the session's prefix, so
it is written by whoever steers (``Agent.signal``/``pause``/``cancel``,
``Agent.resume(approvals=...)``, the ``loomray`` CLI), from any process,
without a cluster::

    sessions/{user or _}/{session}/control/
        signal-{id}.json        a user message for the next pass boundary (one object per signal)
        pause-{id}.json         stop at the next pass boundary (one object per request)
        decision-{call}.json    approve or deny one tool call (create-only: the first decision wins)
        cancel.json             the session is cancelled (sticky: every later run returns "cancelled")

Exactly once. The loop consumes a request at a defined point of the run (a
signal or a pause at a pass boundary, a decision before its tool call) and
*journals the consumption* (kinds "signal", "pause", "approval"; the entry
names the request) before acting on it. Replay re-applies journaled
consumptions at the same point (a signal becomes the same user message at
the same boundary, so the journaled model calls still match), and a request
whose consumption is journaled is never consumed again: the run knows the
names consumed by the run it continues and by the session's last run. A
consumed object is deleted once its journal entry is provably durable (the
next checkpoint write, which re-reads the lease, or a lease read at the end
of the run); a deletion that did not happen is redone by the next run that
sees the object. Without the journal (``Tuning(journal=False)``) a request
is deleted as it is consumed: at most once.

Cost. At each live pass boundary (one whose model call is not replayed) a
run makes one LIST of ``control/`` and one GET per request it has not read
yet; a pass with calls that need a decision makes one more LIST. While a
run executes, a watcher GETs ``control/cancel.json`` every
:func:`cancel_poll_s` seconds (``LOOMRAY_CANCEL_POLL_S``, default 2; not on
in-memory stores, which only this process can reach), so a cancel from
another process abandons even a long tool call.

Cancel. :func:`cancel_session` writes ``cancel.json``, cancels every run of
the session in this process (their in-flight tool or model call is
abandoned: the asyncio task is cancelled) and waits until each has stopped
writing, then takes the session's lease and seals its last run, so a writer
in another process is fenced: its later checkpoints are retired and its
later journal entries are never replayed. Only then is the cancel
acknowledged; nothing the session does after it is made durable.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import logging
import os
import threading
from collections.abc import Iterable
from typing import Any

from loomray.errors import LoomrayUserError
from loomray.ids import new_id
from loomray.journal import CONTROL_KINDS, safe_call_id
from loomray.loop import ControlSnapshot, dangling_tool_calls
from loomray.records import ToolCall, load_checkpoint, utcnow
from storage import layout
from storage.errors import PreconditionFailed

log = logging.getLogger("loomray.control")

CANCEL = "cancel"
_DEFAULT_CANCEL_POLL_S = 2.0
#: How long cancelling waits for a run of this process to stop writing.
CANCEL_ACK_TIMEOUT_S = 60.0


def cancel_poll_s() -> float:
    """Seconds between two looks at ``cancel.json`` while a run executes (``LOOMRAY_CANCEL_POLL_S``)."""
    raw = os.environ.get("LOOMRAY_CANCEL_POLL_S")
    try:
        value = float(raw) if raw else _DEFAULT_CANCEL_POLL_S
    except ValueError:
        value = _DEFAULT_CANCEL_POLL_S
    return value if value > 0 else _DEFAULT_CANCEL_POLL_S


def decision_name(call_id: str) -> str:
    return f"decision-{safe_call_id(call_id)}"


def _hex_id() -> str:
    return new_id("")


def _body(kind: str, name: str, session_id: str, user_id: str | None, source: str, **fields: Any) -> bytes:
    return json.dumps({"type": "control", "v": 1, "kind": kind, "name": name, "session_id": session_id,
                       "user_id": user_id, "source": source, "created_at": utcnow().isoformat(), **fields}).encode()


def _create(store: Any, session_id: str, user_id: str | None, name: str, data: bytes) -> bool:
    """Create-only PUT of ``control/{name}.json``; False when it already exists."""
    try:
        store.objects.put(key=layout.control_key(session_id, user_id, name), data=data, if_none_match=True)
        return True
    except PreconditionFailed:
        return False


def _read(store: Any, key: str) -> dict[str, Any] | None:
    obj = store.objects.get(key=key)
    if obj is None:
        return None
    try:
        body = json.loads(obj.data)
    except ValueError:
        log.warning("skipping unreadable control request %s", store.describe(key))
        return None
    return body if isinstance(body, dict) and body.get("type") == "control" else None


# -- the session as steering sees it ---------------------------------------------------------------
def session_status(store: Any, session_id: str, user_id: str | None) -> str | None:
    """The session's latest status row's status, or None when it has none."""
    row = store.get_session(session_id, user_id=user_id)
    return row.status if row is not None else None


def require_session(store: Any, session_id: str, user_id: str | None) -> str | None:
    """The session's status; :class:`LoomrayUserError` for a session the store does not know."""
    status = session_status(store, session_id, user_id)
    if status is None and not store.journal_runs(session_id, user_id=user_id):
        raise LoomrayUserError(f"unknown session {session_id!r}" + (f" of user {user_id!r}" if user_id else "")
                               + f" in {store.describe()}")
    return status


def is_cancelled(store: Any, session_id: str, user_id: str | None) -> bool:
    """True when the session was cancelled (one GET)."""
    return store.objects.get(key=layout.control_key(session_id, user_id, CANCEL)) is not None


def _refuse_cancelled(store: Any, session_id: str, user_id: str | None) -> None:
    if is_cancelled(store, session_id, user_id):
        raise LoomrayUserError(f"session {session_id!r} was cancelled")


def send_signal(store: Any, session_id: str, user_id: str | None, text: str, *, source: str = "api") -> str:
    """Store a user message for the session's next pass boundary; returns the signal's id."""
    if not isinstance(text, str) or not text:
        raise LoomrayUserError("a signal needs a non-empty text")
    require_session(store, session_id, user_id)
    _refuse_cancelled(store, session_id, user_id)
    name = f"signal-{_hex_id()}"
    _create(store, session_id, user_id, name, _body("signal", name, session_id, user_id, source, text=text))
    return name


def request_pause(store: Any, session_id: str, user_id: str | None, *, source: str = "api") -> str | None:
    """Ask the session to stop at its next pass boundary; returns the request's id (None: already paused)."""
    status = require_session(store, session_id, user_id)
    _refuse_cancelled(store, session_id, user_id)
    if status == "paused":
        return None
    if status == "completed":
        raise LoomrayUserError(f"session {session_id!r} is not running (its last run completed)")
    name = f"pause-{_hex_id()}"
    _create(store, session_id, user_id, name, _body("pause", name, session_id, user_id, source))
    return name


def normalize_decision(value: Any) -> tuple[bool, str | None]:
    """``True`` approves; ``False`` or a reason (a str) denies."""
    if isinstance(value, bool):
        return value, None
    if isinstance(value, str):
        return False, value or None
    raise TypeError(f"a decision is True, False or a reason for denial (str), got {type(value).__name__}")


def pending_calls(store: Any, session_id: str, user_id: str | None) -> list[ToolCall] | None:
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


def record_decision(store: Any, session_id: str, user_id: str | None, call_id: str, decision: Any, *,
                    source: str = "api", check_pending: bool = True) -> bool:
    """Record the decision on tool call ``call_id`` (create-only: the first decision wins).

    Returns True when written, False when the same decision was already there;
    a different earlier decision, or (``check_pending``) a call the session
    does not wait on, is a :class:`LoomrayUserError`.
    """
    if not isinstance(call_id, str) or not call_id:
        raise LoomrayUserError("a tool call id must be a non-empty str")
    approved, reason = normalize_decision(decision)
    if check_pending:
        require_session(store, session_id, user_id)
        _refuse_cancelled(store, session_id, user_id)
        pending = pending_calls(store, session_id, user_id)
        if pending is not None and call_id not in {c.id for c in pending}:
            waiting = ", ".join(c.id for c in pending) or "none"
            raise LoomrayUserError(f"session {session_id!r} does not wait for a decision on tool call {call_id!r} "
                                   f"(it waits on: {waiting})")
    name = decision_name(call_id)
    if _create(store, session_id, user_id, name, _body("decision", name, session_id, user_id, source,
                                                        call_id=call_id, approved=approved, reason=reason)):
        return True
    existing = _read(store, layout.control_key(session_id, user_id, name)) or {}
    if (existing.get("call_id"), existing.get("approved"), existing.get("reason")) == (call_id, approved, reason):
        return False
    if existing.get("call_id") not in (None, call_id):  # two call ids with the same safe name (never in practice)
        raise LoomrayUserError(f"tool call {call_id!r}: its decision slot holds call {existing.get('call_id')!r}")
    was = "approved" if existing.get("approved") else f"denied ({existing.get('reason') or 'no reason'})"
    raise LoomrayUserError(f"tool call {call_id!r} of session {session_id!r} was already decided: {was}")


def list_requests(store: Any, session_id: str, user_id: str | None) -> list[dict[str, Any]]:
    """Every readable control request of the session (one LIST, one GET each), oldest first per kind."""
    prefix = layout.control_prefix(session_id, user_id)
    out = []
    for info in store.objects.list(prefix=prefix):
        body = _read(store, info.key)
        if body is not None:
            out.append(body)
    return out


# -- runs in this process ----------------------------------------------------------------------
class RunHandle:
    """A run of this process, as cancelling sees it (registered for the run's duration)."""

    def __init__(self, store: Any, session_id: str, user_id: str | None) -> None:
        self.store, self.session_id, self.user_id = store, session_id, user_id
        self.loop = asyncio.get_running_loop()
        self.task: asyncio.Task | None = None
        self.cancel_requested = False
        #: Set once the run wrote its last object (what a cancel waits for before it is acknowledged).
        self.stopped: concurrent.futures.Future = concurrent.futures.Future()

    def _cancel(self) -> None:
        self.cancel_requested = True
        if self.task is not None and not self.task.done():
            self.task.cancel()

    def request_cancel(self) -> None:
        """Cancel the run's task (from any thread)."""
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is self.loop:
            self._cancel()
        else:
            self.loop.call_soon_threadsafe(self._cancel)

    def finished(self) -> None:
        if not self.stopped.done():
            self.stopped.set_result(True)

    def same_store(self, store: Any) -> bool:
        if store is self.store:
            return True
        backend = getattr(getattr(store, "objects", None), "backend", "memory")
        return backend != "memory" and getattr(store, "url", None) == getattr(self.store, "url", object())


_RUNS: dict[tuple[str | None, str], list[RunHandle]] = {}
_RUNS_LOCK = threading.Lock()


def register(store: Any, session_id: str, user_id: str | None) -> RunHandle:
    handle = RunHandle(store, session_id, user_id)
    with _RUNS_LOCK:
        _RUNS.setdefault((user_id, session_id), []).append(handle)
    return handle


def unregister(handle: RunHandle) -> None:
    handle.finished()
    with _RUNS_LOCK:
        handles = _RUNS.get((handle.user_id, handle.session_id), [])
        if handle in handles:
            handles.remove(handle)
        if not handles:
            _RUNS.pop((handle.user_id, handle.session_id), None)


def local_runs(store: Any, session_id: str, user_id: str | None) -> list[RunHandle]:
    with _RUNS_LOCK:
        return [h for h in _RUNS.get((user_id, session_id), []) if h.same_store(store)]


async def watch_cancel(store: Any, session_id: str, user_id: str | None, handle: RunHandle,
                       interval: float) -> None:
    """GET ``cancel.json`` every ``interval`` seconds; cancel the run when it appears."""
    key = layout.control_key(session_id, user_id, CANCEL)
    while not handle.cancel_requested:
        await asyncio.sleep(interval)
        try:
            found = await asyncio.to_thread(store.objects.get, key=key)
        except Exception as e:  # a missed look only delays the cancel to the next one (or the next boundary)
            log.debug("cancel watch of session %r: %s", session_id, e)
            continue
        if found is not None:
            log.info("session %r: cancel.json found; cancelling the run", session_id)
            handle.request_cancel()
            return


# -- cancel ----------------------------------------------------------------------------------------
def _write_cancel(store: Any, session_id: str, user_id: str | None, source: str) -> bool:
    require_session(store, session_id, user_id)
    name = CANCEL
    return _create(store, session_id, user_id, name, _body("cancel", name, session_id, user_id, source))


def _fence_and_mark(store: Any, session_id: str, user_id: str | None, source: str) -> int:
    """Fence every writer of the session elsewhere (take its lease, seal its last run) and mark it cancelled."""
    from loomray.session import fence_session
    from storage.rows import SessionRow

    lease = fence_session(store, session_id, user_id, owner=f"loomray cancel ({source})")
    last = store.last_run(session_id, user_id=user_id)
    runs = [last.run_id] if last is not None else store.journal_runs(session_id, user_id=user_id)[-1:]
    previous = store.get_session(session_id, user_id=user_id)
    store.put_session(SessionRow(session_id=session_id, user_id=user_id, status="cancelled", updated_at=utcnow(),
                                 run_id=runs[0] if runs else None,
                                 agent_ref=previous.agent_ref if previous is not None else None,
                                 spec_json=None, epoch=lease.epoch, node_id=None, error=None))
    return lease.epoch


async def cancel_session_async(store: Any, session_id: str, user_id: str | None, *, source: str = "api",
                               timeout: float = CANCEL_ACK_TIMEOUT_S) -> None:
    """See the module docstring (Cancel); for callers on an event loop (``Agent.cancel``)."""
    await asyncio.to_thread(_write_cancel, store, session_id, user_id, source)
    handles = local_runs(store, session_id, user_id)
    for h in handles:
        h.request_cancel()
    for h in handles:
        await asyncio.wait_for(asyncio.wrap_future(h.stopped), timeout)
    await asyncio.to_thread(_fence_and_mark, store, session_id, user_id, source)


def cancel_session(store: Any, session_id: str, user_id: str | None, *, source: str = "cli",
                   timeout: float = CANCEL_ACK_TIMEOUT_S) -> int:
    """Blocking :func:`cancel_session_async` (the CLI); must not run on the event loop of a run it cancels.
    Returns the epoch of the fencing lease."""
    _write_cancel(store, session_id, user_id, source)
    handles = local_runs(store, session_id, user_id)
    for h in handles:
        h.request_cancel()
    for h in handles:
        h.stopped.result(timeout)
    return _fence_and_mark(store, session_id, user_id, source)


# -- what a run consumes ---------------------------------------------------------------------------------
class SessionControls:
    """The control requests of one run's session, as the loop consumes them (``LoopOptions.controls``).

    ``consumed``: request names whose consumption is journaled (by the run this
    one continues or the session's last run); they are never consumed again,
    and deleted when seen. ``inflight`` runs the store calls that write (so a
    cancel can wait for them); ``journaled=False`` deletes as it consumes.
    """

    def __init__(self, store: Any, session_id: str, user_id: str | None, *, consumed: Iterable[str] = (),
                 handle: RunHandle | None = None, journaled: bool = True, inflight: Any = None) -> None:
        self.store, self.session_id, self.user_id = store, session_id, user_id
        self.consumed: set[str] = set(consumed)
        self._durable = set(self.consumed)  # journaled by an earlier incarnation: deletable on sight
        self.handle = handle
        self.journaled = journaled
        self._inflight = inflight
        self._bodies: dict[str, dict[str, Any]] = {}
        self._queue: list[str] = []  # consumed by this run, deleted once provably durable
        #: LIST calls made (the per-pass cost, for tests and benches).
        self.lists = 0

    @property
    def cancel_requested(self) -> bool:
        return self.handle is not None and self.handle.cancel_requested

    def _key(self, name: str) -> str:
        return layout.control_key(self.session_id, self.user_id, name)

    def _look(self) -> tuple[ControlSnapshot, list[str]]:
        """One LIST and the GETs of requests not read yet (runs in a worker thread)."""
        prefix = layout.control_prefix(self.session_id, self.user_id)
        self.lists += 1
        names = []
        for info in self.store.objects.list(prefix=prefix):
            if info.key.endswith(".json"):
                names.append(info.key[len(prefix):-len(".json")])
        snap = ControlSnapshot()
        stale = []
        signals: list[tuple[str, str, str]] = []
        for name in names:
            if name == CANCEL:
                snap.cancelled = True
                continue
            if name in self.consumed:
                if name in self._durable:
                    stale.append(name)
                continue
            body = self._bodies.get(name)
            if body is None:
                body = _read(self.store, self._key(name))
                if body is None:
                    continue
                self._bodies[name] = body
            kind = body.get("kind")
            if kind == "signal" and isinstance(body.get("text"), str):
                signals.append((name.split("-", 1)[-1], name, body["text"]))
            elif kind == "pause":
                snap.pauses.append(name)
            elif kind == "decision" and isinstance(body.get("call_id"), str):
                snap.decisions[body["call_id"]] = (name, bool(body.get("approved")), body.get("reason"))
        snap.signals = [(name, text) for _, name, text in sorted(signals)]
        return snap, stale

    async def poll(self) -> ControlSnapshot:
        """One look at the session's requests: one LIST of ``control/`` plus one GET per request not read
        before (bodies are cached: requests are create-only). A failed look is logged and finds nothing (the
        next one retries)."""
        try:
            snap, stale = await asyncio.to_thread(self._look)
        except Exception as e:
            log.warning("control requests of session %r could not be listed: %s: %s", self.session_id,
                        type(e).__name__, e)
            return ControlSnapshot(cancelled=self.cancel_requested)
        if stale:
            await self._delete(stale)
        if self.cancel_requested:
            snap.cancelled = True
        return snap

    def consume(self, name: str) -> None:
        """``name``'s consumption was journaled: never again; delete it once that is durable."""
        self.consumed.add(name)
        self._queue.append(name)
        if not self.journaled:  # nothing records the consumption: delete now (at most once)
            self._schedule_delete()

    def _schedule_delete(self) -> None:
        names, self._queue = self._queue, []
        if names:
            asyncio.ensure_future(self._delete(names))

    def durable_mark(self) -> list[str]:
        """Requests consumed so far: durable once the checkpoint write starting now succeeds."""
        return list(self._queue)

    async def durable(self, names: list[str]) -> None:
        """A checkpoint write that re-read the lease succeeded after ``names`` were journaled: delete them."""
        done = set(names)
        self._queue = [n for n in self._queue if n not in done]
        self._durable |= done
        await self._delete(names)

    async def release(self, prove_lease: Any = None) -> None:
        """At the end of a run: delete what it consumed since its last checkpoint, after ``prove_lease()``."""
        names = list(self._queue)
        if not names:
            return
        if prove_lease is not None:
            try:
                await asyncio.to_thread(prove_lease)
            except Exception as e:  # unprovable: leave them; the next run that sees them deletes them
                log.info("control requests %s of session %r not deleted: %s", names, self.session_id, e)
                return
        await self.durable(names)

    async def _delete(self, names: list[str]) -> None:
        keys = [self._key(n) for n in names]
        try:
            if self._inflight is not None:
                await self._inflight.run(self.store.objects.delete, keys=keys)
            else:
                await asyncio.to_thread(self.store.objects.delete, keys=keys)
        except Exception as e:  # best effort: a consumed request left behind is skipped and deleted later
            log.info("control requests %s of session %r not deleted: %s", names, self.session_id, e)
        for n in names:
            self._bodies.pop(n, None)


def consumed_names(records: Iterable[Any]) -> set[str]:
    """Names of the control requests whose consumption ``records`` (journal records or entries) hold."""
    return {str(r.output.get("control")) for r in records if r.kind in CONTROL_KINDS and r.output.get("control")}


__all__ = ["CANCEL", "RunHandle", "SessionControls", "cancel_poll_s", "cancel_session", "cancel_session_async",
           "consumed_names", "decision_name", "is_cancelled", "list_requests", "local_runs", "normalize_decision",
           "pending_calls", "record_decision", "register", "request_pause", "require_session", "send_signal",
           "session_status", "unregister", "watch_cancel"]
