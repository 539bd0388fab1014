"""Steering a session from outside: approvals, signals, pause and cancel, durable in the store.

A control request is one create-only object under the session's
``control/`` prefix (``signal-{id}``, ``pause-{id}``, ``decision-{call}``,
``cancel``: docs/design.md, "Object layout"), so it is written by whoever
steers (``Agent.signal``/``pause``/``cancel``, ``Agent.resume(approvals=...)``,
the ``loomray`` CLI), from any process, without a cluster.

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

from loomray.control.cancel import (
    CANCEL_ACK_TIMEOUT_S,
    RunHandle,
    cancel_poll_s,
    cancel_session,
    cancel_session_async,
    local_runs,
    register,
    unregister,
    watch_cancel,
)
from loomray.control.consume import SessionControls, consumed_names
from loomray.control.requests import (
    CANCEL,
    decision_name,
    describe_decision,
    is_cancelled,
    list_requests,
    normalize_decision,
    pending_calls,
    record_decision,
    request_pause,
    require_session,
    send_signal,
    session_status,
)

__all__ = ["CANCEL", "CANCEL_ACK_TIMEOUT_S", "RunHandle", "SessionControls", "cancel_poll_s", "cancel_session",
           "cancel_session_async", "consumed_names", "decision_name", "describe_decision", "is_cancelled", "list_requests", "local_runs",
           "normalize_decision", "pending_calls", "record_decision", "register", "request_pause", "require_session",
           "send_signal", "session_status", "unregister", "watch_cancel"]
