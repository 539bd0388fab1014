"""Object keys, built only from validated ids (see DESIGN.md "Object layout")."""

from __future__ import annotations

from storage.ids import user_segment, validate_id

CHECKPOINT_INDEX = "index/checkpoints/"
SESSION_INDEX = "index/sessions/"


def session_prefix(session_id: str, user_id: str | None) -> str:
    """``sessions/{user or _}/{session_id}/``."""
    return f"sessions/{user_segment(user_id)}/{validate_id(session_id, 'session_id')}/"


def checkpoint_key(session_id: str, user_id: str | None, checkpoint_id: str) -> str:
    return f"{session_prefix(session_id, user_id)}checkpoints/{validate_id(checkpoint_id, 'checkpoint_id')}.json"


def journal_prefix(session_id: str, user_id: str | None, run_id: str | None = None) -> str:
    base = f"{session_prefix(session_id, user_id)}journal/"
    return base if run_id is None else f"{base}{validate_id(run_id, 'run_id')}/"


def journal_key(session_id: str, user_id: str | None, run_id: str, seq: int, step_key: str) -> str:
    if not isinstance(seq, int) or seq < 0 or seq > 99_999_999:
        raise ValueError(f"journal seq must be an int in [0, 99999999], got {seq!r}")
    return f"{journal_prefix(session_id, user_id, run_id)}{seq:08d}-{validate_id(step_key, 'step_key')}.json"


def lease_key(session_id: str, user_id: str | None) -> str:
    return f"{session_prefix(session_id, user_id)}lease.json"


def index_partition(kind_prefix: str, session_id: str, user_id: str | None) -> str:
    """Hive-style partition of one session: ``index/{kind}/user={u}/session={s}/``."""
    return f"{kind_prefix}user={user_segment(user_id)}/session={validate_id(session_id, 'session_id')}/"
