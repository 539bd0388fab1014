"""Steering a session from outside: approvals, signals, pause and cancel, durable in the store.

A control request is one create-only object under the session's ``control/`` prefix, written by whoever
steers, from any process. The loop journals a request's consumption before acting on it, so each applies
exactly once; a cancel fences every writer before it is acknowledged. docs/design.md, "Control requests".
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
