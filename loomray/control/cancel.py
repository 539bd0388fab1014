"""Cancelling a session: the runs of this process, the watcher of ``cancel.json``, and the cancel itself.

The guarantees (what is acknowledged when): docs/design.md, "Control requests".
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import os
import threading

from loomray.control.requests import CANCEL, create_request, request_body, require_session
from loomray.fencing import fence_session
from loomray.records import utcnow
from loomray.session_store import SessionStore
from loomray.storage import layout
from loomray.storage.rows import SessionRow

log = logging.getLogger("loomray.control")

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


class RunHandle:
    """A run of this process, as cancelling sees it (registered for the run's duration)."""

    def __init__(self, store: SessionStore, session_id: str, user_id: str | None) -> None:
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
        """The run wrote its last object: a cancel waiting for it may go on."""
        if not self.stopped.done():
            self.stopped.set_result(True)

    def same_store(self, store: SessionStore) -> bool:
        """True when ``store`` is the one the run writes to (the same object, or the same non-memory URL)."""
        if store is self.store:
            return True
        backend = getattr(getattr(store, "objects", None), "backend", "memory")
        return backend != "memory" and getattr(store, "url", None) == getattr(self.store, "url", object())


#: The runs of this process by (user, session), for a cancel to reach them.
_RUNS: dict[tuple[str | None, str], list[RunHandle]] = {}
_RUNS_LOCK = threading.Lock()


def register(store: SessionStore, session_id: str, user_id: str | None) -> RunHandle:
    """Make a run of this process reachable by a cancel (until :func:`unregister`)."""
    handle = RunHandle(store, session_id, user_id)
    with _RUNS_LOCK:
        _RUNS.setdefault((user_id, session_id), []).append(handle)
    return handle


def unregister(handle: RunHandle) -> None:
    """The run ended: mark it stopped and forget it."""
    handle.finished()
    with _RUNS_LOCK:
        handles = _RUNS.get((handle.user_id, handle.session_id), [])
        if handle in handles:
            handles.remove(handle)
        if not handles:
            _RUNS.pop((handle.user_id, handle.session_id), None)


def local_runs(store: SessionStore, session_id: str, user_id: str | None) -> list[RunHandle]:
    """The runs of this process writing session ``session_id`` to ``store``."""
    with _RUNS_LOCK:
        return [h for h in _RUNS.get((user_id, session_id), []) if h.same_store(store)]


async def watch_cancel(store: SessionStore, session_id: str, user_id: str | None, handle: RunHandle,
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


def _write_cancel(store: SessionStore, session_id: str, user_id: str | None, source: str) -> bool:
    require_session(store, session_id, user_id)
    return create_request(store, session_id, user_id, CANCEL,
                          request_body("cancel", CANCEL, session_id, user_id, source))


def _fence_and_mark(store: SessionStore, session_id: str, user_id: str | None, source: str) -> int:
    """Fence every writer of the session elsewhere (take its lease, seal its last run) and mark it cancelled."""
    lease = fence_session(store, session_id, user_id, owner=f"loomray cancel ({source})")
    last = store.runs.last(session_id, user_id=user_id)
    runs = [last.run_id] if last is not None else store.journal.runs(session_id, user_id=user_id)[-1:]
    previous = store.sessions.get(session_id, user_id=user_id)
    store.sessions.put(SessionRow(session_id=session_id, user_id=user_id, status="cancelled", updated_at=utcnow(),
                                 run_id=runs[0] if runs else None,
                                 agent_ref=previous.agent_ref if previous is not None else None,
                                 spec_json=None, epoch=lease.epoch, node_id=None, error=None))
    return lease.epoch


async def cancel_session_async(store: SessionStore, session_id: str, user_id: str | None, *, source: str = "api",
                               timeout: float = CANCEL_ACK_TIMEOUT_S) -> None:
    """Cancel the session as :mod:`loomray.control` (Cancel) says; for callers on an event loop (``Agent.cancel``)."""
    await asyncio.to_thread(_write_cancel, store, session_id, user_id, source)
    handles = local_runs(store, session_id, user_id)
    for h in handles:
        h.request_cancel()
    for h in handles:
        await asyncio.wait_for(asyncio.wrap_future(h.stopped), timeout)
    await asyncio.to_thread(_fence_and_mark, store, session_id, user_id, source)


def cancel_session(store: SessionStore, session_id: str, user_id: str | None, *, source: str = "cli",
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

