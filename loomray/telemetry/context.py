"""Trace context that outlives a process: the W3C ``traceparent`` a run was asked for under, and the session's own.

A run may execute in another process than the one that asked for it (a Ray
actor), and again after its process died (a restart on another node, a resume
after an approval). So the span current where a run is requested travels with
the request as a ``traceparent`` string (stored in the run's record), and a
session without one gets a trace of its own, derived from its store, user and
id: every incarnation of the session lands in that one trace, whichever node
runs it and however often. Nothing here imports OpenTelemetry: a process that
never loaded it pays nothing.
"""

from __future__ import annotations

import hashlib
import sys


def current_traceparent() -> str | None:
    """The W3C ``traceparent`` of the span current in this context, or None (no span, or OpenTelemetry unused)."""
    trace = sys.modules.get("opentelemetry.trace")
    if trace is None:
        return None
    try:
        ctx = trace.get_current_span().get_span_context()
    except Exception:
        return None
    if not ctx.is_valid:
        return None
    return f"00-{ctx.trace_id:032x}-{ctx.span_id:016x}-{int(ctx.trace_flags):02x}"


def parse_traceparent(value: str | None) -> tuple[int, int, int] | None:
    """``(trace_id, span_id, flags)`` of a W3C ``traceparent``; None when it is missing or malformed."""
    if not value:
        return None
    parts = value.strip().split("-")
    if len(parts) != 4 or len(parts[1]) != 32 or len(parts[2]) != 16 or len(parts[3]) != 2:
        return None
    try:
        trace_id, span_id, flags = int(parts[1], 16), int(parts[2], 16), int(parts[3], 16)
    except ValueError:
        return None
    return (trace_id, span_id, flags) if trace_id and span_id else None


def session_root(store: str | None, user_id: str | None, session_id: str) -> tuple[int, int]:
    """``(trace_id, span_id)`` of the session's own trace root: the same in every process, for every run."""
    digest = hashlib.sha256("\0".join(("loomray-session", store or "", user_id or "", session_id)).encode()).digest()
    trace_id = int.from_bytes(digest[:16], "big") or 1
    span_id = int.from_bytes(digest[16:24], "big") or 1
    return trace_id, span_id


def incarnation_span_id(store: str | None, user_id: str | None, session_id: str, epoch: int) -> int:
    """The span id of the run span the session's lease holder of ``epoch`` opens: derived, not random, so the
    next incarnation (epoch + 1, another process, after a crash) can link to it without anything stored."""
    key = "\0".join(("loomray-incarnation", store or "", user_id or "", session_id, str(epoch)))
    return int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "big") or 1
