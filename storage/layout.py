"""Object keys, built only from validated ids (the object layout is in docs/design.md)."""

from __future__ import annotations

from typing import TypeGuard

from .ids import user_segment, validate_id

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


def run_prefix(session_id: str, user_id: str | None) -> str:
    """``sessions/{user or _}/{session_id}/runs/``: the session's run records."""
    return f"{session_prefix(session_id, user_id)}runs/"


def run_key(session_id: str, user_id: str | None, n: int) -> str:
    """The run record of the session's ``n``-th run (create-only; ``n`` is its store-sequenced position)."""
    if not isinstance(n, int) or isinstance(n, bool) or n < 0 or n > 99_999_999:
        raise ValueError(f"run record number must be an int in [0, 99999999], got {n!r}")
    return f"{run_prefix(session_id, user_id)}{n:08d}.json"


def lease_key(session_id: str, user_id: str | None) -> str:
    return f"{session_prefix(session_id, user_id)}lease.json"


#: Epochs are JSON-safe integers (exact in a double), so every reader agrees on them.
MAX_EPOCH = 2**53 - 1


def is_epoch(value: object) -> TypeGuard[int]:
    """Whether ``value`` is an epoch: an int (not a bool) in [0, MAX_EPOCH]."""
    return type(value) is int and 0 <= value <= MAX_EPOCH


def _epoch(epoch: int) -> int:
    """``epoch`` if it is an epoch (a key names it zero-padded to 20 digits); else ValueError."""
    if not is_epoch(epoch):
        raise ValueError(f"epoch must be an int in [0, 2**53), got {epoch!r}")
    return epoch


def epoch_prefix(session_id: str, user_id: str | None) -> str:
    """``sessions/{user or _}/{session_id}/epochs/``: one create-only marker per epoch ever acquired."""
    return f"{session_prefix(session_id, user_id)}epochs/"


def epoch_marker_key(session_id: str, user_id: str | None, epoch: int) -> str:
    """The marker of ``epoch`` (zero-padded, so key order is epoch order)."""
    return f"{epoch_prefix(session_id, user_id)}{_epoch(epoch):020d}"


def pin_prefix(session_id: str, user_id: str | None) -> str:
    """``sessions/{u}/{s}/pins/``: which other sessions build on this session's checkpoint objects (forks)."""
    return f"{session_prefix(session_id, user_id)}pins/"


def pin_key(session_id: str, user_id: str | None, dependent_session_id: str) -> str:
    """The pin that session ``dependent_session_id`` (of the same user) holds on ``session_id``'s objects."""
    return f"{pin_prefix(session_id, user_id)}{validate_id(dependent_session_id, 'session_id')}.json"


def lease_copy_prefix(session_id: str, user_id: str | None) -> str:
    """``sessions/{u}/{s}/leases/``: a copy of every ``lease.json`` body a swap wrote, by epoch."""
    return f"{session_prefix(session_id, user_id)}leases/"


def lease_copy_key(session_id: str, user_id: str | None, epoch: int) -> str:
    """The copy of the ``lease.json`` body the swap to ``epoch`` wrote (create-only)."""
    return f"{lease_copy_prefix(session_id, user_id)}{_epoch(epoch):020d}.json"


def quarantine_key(session_id: str, user_id: str | None, checkpoint_id: str) -> str:
    """Where a quarantined checkpoint's bytes are kept: ``sessions/{u}/{s}/quarantine/{checkpoint_id}.json``."""
    return f"{session_prefix(session_id, user_id)}quarantine/{validate_id(checkpoint_id, 'checkpoint_id')}.json"


#: Index files compaction cannot merge (another schema altogether) are moved under here, key for key.
INDEX_QUARANTINE = "index/quarantine/"


def index_quarantine_key(index_key: str) -> str:
    """Where compaction moves a foreign index file: ``index/quarantine/`` + its key below ``index/``
    (``index/checkpoints/user=u/session=s/f.parquet`` -> ``index/quarantine/checkpoints/user=u/session=s/f.parquet``).
    Outside every index prefix, so no reader lists it."""
    if not index_key.startswith("index/") or index_key.startswith(INDEX_QUARANTINE):
        raise ValueError(f"not an index file key: {index_key!r}")
    return INDEX_QUARANTINE + index_key[len("index/"):]


def index_partition(kind_prefix: str, session_id: str, user_id: str | None) -> str:
    """Hive-style partition of one session: ``index/{kind}/user={u}/session={s}/``."""
    return f"{kind_prefix}user={user_segment(user_id)}/session={validate_id(session_id, 'session_id')}/"


#: The compacted session-status table (see :mod:`storage.session_table`): one Parquet file per user.
SESSION_TABLE = "index/session_table/"

#: The compacted checkpoint table (see :mod:`storage.table`): one Parquet file per user and UTC day.
TABLE_INDEX = "index/table/"


def table_user_prefix(user_id: str | None) -> str:
    """``index/table/user={u}/``: every object of one user's compacted table (partitions and manifest)."""
    return f"{TABLE_INDEX}user={user_segment(user_id)}/"


def table_partition_key(user_id: str | None, day: str) -> str:
    """``index/table/user={u}/day={YYYY-MM-DD}/part-0.parquet``: replaced in place by each compaction."""
    return f"{table_user_prefix(user_id)}day={day}/part-0.parquet"


def table_manifest_key(user_id: str | None) -> str:
    """``index/table/user={u}/_manifest.json.gz``: what the user's partitions absorbed (not a Parquet file)."""
    return f"{table_user_prefix(user_id)}_manifest.json.gz"


def control_prefix(session_id: str, user_id: str | None) -> str:
    """``sessions/{user or _}/{session_id}/control/``: control requests (signals, pauses, decisions, cancel)."""
    return f"{session_prefix(session_id, user_id)}control/"


def control_key(session_id: str, user_id: str | None, name: str) -> str:
    """One control request: ``control/{name}.json`` (create-only; ``name`` is a validated id)."""
    return f"{control_prefix(session_id, user_id)}{validate_id(name, 'control name')}.json"


def exploration_prefix(session_id: str, user_id: str | None, exploration_id: str) -> str:
    """``sessions/{u}/{s}/explorations/{exploration_id}/``: an exploration's plan, branches, scores and decisions
    (create-only JSON objects), under the session it explores from."""
    return f"{session_prefix(session_id, user_id)}explorations/{validate_id(exploration_id, 'exploration_id')}/"


def exploration_pointer_key(user_id: str | None, exploration_id: str) -> str:
    """``explorations/{user or _}/{exploration_id}.json``: which session an exploration id belongs to (so an id
    alone finds it)."""
    return f"explorations/{user_segment(user_id)}/{validate_id(exploration_id, 'exploration_id')}.json"


#: Marks of the explorations handed to a supervisor and not over yet (its worklist, one LIST).
SUBMITTED_EXPLORATIONS = "submitted-explorations/"


def submitted_exploration_key(user_id: str | None, exploration_id: str) -> str:
    """``submitted-explorations/{user or _}/{exploration_id}.json``: a submitted exploration still to run."""
    return f"{SUBMITTED_EXPLORATIONS}{user_segment(user_id)}/{validate_id(exploration_id, 'exploration_id')}.json"
