"""Store-sequenced run records: ``runs/{n:08d}.json``, one create-only record per run start.

The store, not a node's clock, orders a session's runs: starting a run
writes a record at the next free slot ``n``, so the last run is the highest
``n`` (its epoch first: see :func:`last_run`). Sessions written before run
records existed fall back to their journal's run ids in sorted order.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .. import layout
from ..errors import PreconditionFailed
from ..ids import validate_id
from ..journal.entries import JournalRun, JournalStore, read_run
from ..rows import RunRecord

log = logging.getLogger("storage")

_RECORD_ATTEMPTS = 32
#: Newest run records read to find the last run (see :func:`last_run`).
_LAST_RUN_WINDOW = 4


def record_slots(store: JournalStore, session_id: str, user_id: str | None) -> list[tuple[int, str]]:
    """``(n, key)`` of the session's run records, by n (one LIST)."""
    prefix = layout.run_prefix(session_id, user_id)
    out = []
    for o in store.objects.list(prefix=prefix):
        name = o.key[len(prefix):]
        if len(name) == 13 and name.endswith(".json") and name[:8].isdigit():
            out.append((int(name[:8]), o.key))
    return sorted(out)


def _read_record(store: JournalStore, key: str, n: int, session_id: str, user_id: str | None) -> RunRecord | None:
    obj = store.objects.get(key=key)
    if obj is None:
        return None
    try:
        rec = RunRecord.model_validate_json(obj.data)
    except ValueError as e:
        log.warning("skipping unreadable run record: %s: %s", store.objects.describe(key), e)
        return None
    if rec.type != "run_record" or (rec.session_id, rec.user_id, rec.n) != (session_id, user_id, n):
        # A record must describe the slot it sits in; one naming another session is copied or forged.
        log.warning("skipping run record that names session %r/user %r slot %d: %s", rec.session_id, rec.user_id,
                    rec.n, store.objects.describe(key))
        return None
    return rec


def create_run(store: JournalStore, session_id: str, user_id: str | None, *, run_id: str,
               request: dict[str, Any] | None = None, spec_hash: str = "", base_session_id: str | None = None,
               base_checkpoint_id: str | None = None, replay_from: str | None = None,
               epoch: int = 0) -> RunRecord:
    """Write the record of a run starting now at the session's next free slot (create-only) and return it."""
    validate_id(run_id, "run_id")
    for name, value in (("base_session_id", base_session_id), ("base_checkpoint_id", base_checkpoint_id),
                        ("replay_from", replay_from)):
        if value is not None:
            validate_id(value, name)
    slots = record_slots(store, session_id, user_id)
    n = slots[-1][0] + 1 if slots else 0
    for _ in range(_RECORD_ATTEMPTS):
        rec = RunRecord(session_id=session_id, user_id=user_id, n=n, run_id=run_id, spec_hash=spec_hash,
                        request=request, base_session_id=base_session_id, base_checkpoint_id=base_checkpoint_id,
                        replay_from=replay_from, epoch=epoch)
        key = layout.run_key(session_id, user_id, n)
        try:
            store.objects.put(key=key, data=rec.__pydantic_serializer__.to_json(rec), if_none_match=True)
            return rec
        except PreconditionFailed:
            n += 1  # another start took this slot first: the store ordered it before ours
    raise PreconditionFailed(f"{store.objects.describe(layout.run_prefix(session_id, user_id))}: no free run record slot "
                             f"after {_RECORD_ATTEMPTS} attempts")


def last_run(store: JournalStore, session_id: str, user_id: str | None,
             slots: list[tuple[int, str]] | None = None) -> RunRecord | None:
    """The session's last run: the highest ``(epoch, n)`` among its newest records; None without records.

    Epochs rise with every lease and ``n`` with every run, so a legitimate
    record never has a lower epoch than one before it. A fenced writer that
    planned a run before a takeover may still land its record after the new
    owner's (it stops at its lease check right after): ordering by epoch first
    keeps that record from passing for the last run. A few of the newest
    records are read (at most :data:`_LAST_RUN_WINDOW` GETs, in parallel).
    """
    return last_run_window(store, session_id, user_id, slots)[0]


def last_run_window(store: JournalStore, session_id: str, user_id: str | None,
                    slots: list[tuple[int, str]] | None = None
                    ) -> tuple[RunRecord | None, list[tuple[int, str]], list[tuple[int, str]]]:
    """:func:`last_run`, the record slots older than those its choice depends on, and those: every slot from the
    start of the window it was found in to the newest (all slots when it found none). Deleting none of the
    latter keeps the last run the same (what prune spares)."""
    slots = record_slots(store, session_id, user_id) if slots is None else list(slots)
    rest = slots
    while rest:
        window, rest = rest[-_LAST_RUN_WINDOW:], rest[:-_LAST_RUN_WINDOW]
        recs = [r for r in read_records(store, window, session_id, user_id) if r is not None]
        if recs:
            return max(recs, key=lambda r: (r.epoch, r.n)), rest, slots[len(rest):]
    return None, [], slots


def read_records(store: JournalStore, slots: list[tuple[int, str]], session_id: str,
                  user_id: str | None) -> list[RunRecord | None]:
    return store._index.map_io(lambda s: _read_record(store, s[1], s[0], session_id, user_id), slots)


def requests_held(store: JournalStore, slots: list[tuple[int, str]], session_id: str, user_id: str | None,
                  dropped: Callable[[RunRecord], bool]) -> list[str]:
    """Keys of the records of ``slots`` that still hold a request (or its hash) and that ``dropped`` accepts."""
    recs = read_records(store, slots, session_id, user_id)
    return [key for (_, key), rec in zip(slots, recs, strict=True)
            if rec is not None and (rec.request is not None or rec.spec_hash) and dropped(rec)]


def drop_request(store: JournalStore, key: str) -> bool:
    """Rewrite the run record at ``key`` without its request and spec hash (compare-and-swap on what was read).

    What stays is content-free: the run's id, slot, epoch, start time and the ids
    of its base checkpoint and replayed run, which is all that deciding the
    session's last run (and anchoring the next slot) reads. False when the
    record is gone, unreadable, already without a request, or changed meanwhile.
    """
    obj = store.objects.get(key=key)
    if obj is None:
        return False
    try:
        rec = RunRecord.model_validate_json(obj.data)
    except ValueError:
        return False  # unreadable: readers skip it; not ours to rewrite
    if rec.request is None and not rec.spec_hash:
        return False
    bare = rec.model_copy(update={"request": None, "spec_hash": ""})
    try:
        store.objects.put(key=key, data=bare.__pydantic_serializer__.to_json(bare), if_match=obj.etag)
    except PreconditionFailed:
        return False
    return True


def list_runs(store: JournalStore, session_id: str, user_id: str | None) -> list[RunRecord]:
    """Every readable record of the session, by n."""
    return [r for r in read_records(store, record_slots(store, session_id, user_id), session_id, user_id) if r is not None]


@dataclass(frozen=True)
class Unfinished:
    """What recovering a session's unfinished last run needs besides the session's latest checkpoint."""

    run_id: str
    record: RunRecord | None
    base_session_id: str | None
    base_checkpoint_id: str | None
    replay_from: str | None


def last_journal_run(store: JournalStore, session_id: str,
                     user_id: str | None) -> tuple[RunRecord | None, JournalRun | None]:
    """The session's last run record and that run's journal (by run record, else by sorted journal run id);
    ``(None, None)`` when the session has neither."""
    rec = last_run(store, session_id, user_id)
    if rec is not None:
        run_id = rec.run_id
    else:
        runs = store.objects.list_dirs(prefix=layout.journal_prefix(session_id, user_id))
        if not runs:
            return None, None
        run_id = runs[-1]
    return rec, read_run(store, session_id, run_id, user_id)


def unfinished_last_run(store: JournalStore, session_id: str, user_id: str | None) -> Unfinished | None:
    """The session's last run (:func:`last_journal_run`) if it has not finished."""
    rec, run = last_journal_run(store, session_id, user_id)
    if run is None or run.finished or (rec is None and run.start is None):
        return None  # finished, or a journal no run can continue (recovery starts from a run_start or a record)
    out = run.start.output if run.start is not None else {}
    base_ckpt = (rec.base_checkpoint_id if rec is not None else None) or out.get("base_checkpoint_id")
    base_session = (rec.base_session_id if rec is not None else None) or out.get("source_session") or session_id
    replay_from = (rec.replay_from if rec is not None else None) or out.get("replay_from")
    return Unfinished(run.run_id, rec, base_session if base_ckpt else None, base_ckpt, replay_from)

