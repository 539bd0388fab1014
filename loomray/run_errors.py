"""What a failed run leaves behind: a content-free line in the session index, the full text under its session.

Places read across users get the error's type and a fixed note (:func:`index_error`): an exception's text
may quote a model's answer or the prompt. The full text goes under the session's own prefix
(:func:`record_error`). docs/tenancy.md, "Errors in shared places".
"""

from __future__ import annotations

import json
import logging
from datetime import datetime, timezone
from typing import Any

from loomray.errors import (
    CheckpointException,
    DurabilityLost,
    MaxTurnsExceeded,
    ModelAuthError,
    ModelBadRequestError,
    ModelConfigError,
    ModelError,
    OutputValidationError,
    SessionStartError,
)
from loomray.session_store import SessionStore
from loomray.storage import layout
from loomray.storage.errors import LeaseLostError
from loomray.storage.ids import validate_id

log = logging.getLogger("loomray.run_errors")

#: The longest error an index row carries.
INDEX_ERROR_MAX = 160
#: Longest error text kept under the session's prefix (a runaway message must not make a huge object).
FULL_ERROR_MAX = 64 * 1024

#: Fixed, content-free notes by error class (the first class in this order an error is an instance of).
_NOTES: tuple[tuple[type[BaseException], str], ...] = (
    (OutputValidationError, "the final answer did not match output_schema"),
    (ModelAuthError, "the model provider rejected the credentials"),
    (ModelBadRequestError, "the model provider rejected the request"),
    (ModelError, "a model call failed"),
    (ModelConfigError, "the model could not be configured"),
    (MaxTurnsExceeded, "the run reached max_turns"),
    (DurabilityLost, "the run could no longer prove it owns its session"),
    (LeaseLostError, "a newer incarnation took the session over"),
    (CheckpointException, "a checkpoint could not be read or written"),
    (SessionStartError, "the session could not be started"),
)


def index_error(error: BaseException | None = None, *, error_type: str | None = None) -> str:
    """The error as a session index row may say it: ``"{type}: {fixed note}"``, never the error's text.

    ``error_type`` names the type when only its name is known (an outcome that
    crossed from an actor).
    """
    name = type(error).__name__ if error is not None else (error_type or "Error")
    note = next((n for cls, n in _NOTES if isinstance(error, cls) or cls.__name__ == name),
                "the run failed (its full error: loomray logs)")
    name = "".join(ch for ch in name if ch.isalnum() or ch in "_.")[:60] or "Error"
    return f"{name}: {note}"[:INDEX_ERROR_MAX]


def error_key(session_id: str, user_id: str | None, run_id: str) -> str:
    """``sessions/{u}/{s}/errors/{run_id}.json``: where a run's full error text is kept."""
    return f"{layout.session_prefix(session_id, user_id)}errors/{validate_id(run_id, 'run_id')}.json"


def record_error(store: SessionStore, session_id: str, user_id: str | None, run_id: str,
                 error: BaseException | str, *, error_type: str | None = None) -> None:
    """Keep a run's full error under its session's prefix (``error``: the exception, or its text and
    ``error_type``); a failure to write it is only logged."""
    kind = type(error).__name__ if isinstance(error, BaseException) else (error_type or "Error")
    text = (f"{kind}: {error}" if isinstance(error, BaseException) else error)[:FULL_ERROR_MAX]
    body = {"v": 1, "session_id": session_id, "user_id": user_id, "run_id": run_id,
            "error_type": kind, "error": text, "at": datetime.now(timezone.utc).isoformat()}
    try:
        store.objects.put(key=error_key(session_id, user_id, run_id), data=json.dumps(body).encode())
    except Exception as e:
        log.warning("could not keep the error of run %r of session %r: %s", run_id, session_id, type(e).__name__)


def read_error(store: SessionStore, session_id: str, user_id: str | None, run_id: str | None) -> str | None:
    """The full error text of run ``run_id`` of the session, or None (none kept, or unreadable)."""
    if run_id is None:
        return None
    obj = store.objects.get(key=error_key(session_id, user_id, run_id))
    try:
        body = json.loads(obj.data) if obj is not None and len(obj.data) <= 2 * FULL_ERROR_MAX else None
    except ValueError:
        return None
    if not isinstance(body, dict) or (body.get("session_id"), body.get("user_id"), body.get("run_id")) != \
            (session_id, user_id, run_id) or not isinstance(body.get("error"), str):
        return None
    return body["error"]


def read_errors(store: SessionStore, session_id: str, user_id: str | None) -> list[dict[str, Any]]:
    """The session's recorded run errors, oldest first; unreadable or foreign ones are skipped."""
    prefix = f"{layout.session_prefix(session_id, user_id)}errors/"
    out = []
    for info in store.objects.list(prefix=prefix):
        obj = store.objects.get(key=info.key)
        try:
            body = json.loads(obj.data) if obj is not None and len(obj.data) <= 2 * FULL_ERROR_MAX else None
        except ValueError:
            body = None
        if not isinstance(body, dict) or (body.get("session_id"), body.get("user_id")) != (session_id, user_id) \
                or not isinstance(body.get("error"), str):
            log.warning("skipping an unreadable error record: %s", store.objects.describe(info.key))
            continue
        out.append(body)
    return sorted(out, key=lambda b: str(b.get("at")))
