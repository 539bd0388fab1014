"""Invariants of the moves in :mod:`durability_moves` (see :mod:`durability_checks` for the rest):

- ``proof-window``: a writer whose model call spanned a takeover and lasted
  longer than the proof bound (``LEASE_CHECK_S`` since its last proof, which
  came before the call) runs none of that pass's tools;
- ``unproven-end``: after ``lease.json`` became unreadable (and nobody wrote
  a lease again), no run reports its end: no ``completed`` session row, no
  normal return;
- ``fork-resumable``: a fork whose process died before its first checkpoint
  resumes (its re-issued request restores the fork point's transcript),
  unless a delete or prune removed the fork point itself;
- ``prune-records``: after ``prune(before=<future>)`` no run record or
  ``run_end`` entry written before it is left holding the run's request
  (its ``metadata``), except the record of a last run that had not finished
  by then (recovery continues that run from it);
- ``budget-carried`` / ``pause-consumed``: what the controller found.
"""

from __future__ import annotations

import json
from datetime import datetime, timezone
from typing import Any

from durability_explore import check_explore
from durability_history import History, Violation, _incs_by_epoch, _v

from loomray.run_writes import LEASE_CHECK_S
from loomray.storage import layout


def check_moves(world: Any, h: History) -> list[Violation]:
    out: list[Violation] = []
    for check in (_proof_window, _unproven_end, _forks, _prune_records):
        check(world, h, out)
    for invariant, detail in world.control:
        _v(out, invariant, detail)
    return out + check_explore(world)


def _proof_window(world: Any, h: History, out: list[Violation]) -> None:
    _incs_by_epoch(world, h)
    grants = [(i.acquired, i.epoch, i.id) for i in world.incarnations if i.acquired is not None]
    for inc_id, turn, start, end, secs in world.spans:
        inc = next(i for i in world.incarnations if i.id == inc_id)
        if inc.epoch is None or secs < LEASE_CHECK_S:
            continue
        taken = [(g, e, who) for g, e, who in grants if start < g <= end and e > inc.epoch]
        late = [(p, step) for p, _, step, _ in inc.tool_runs if p >= end and int(step[1:5]) == turn]
        if taken and late:
            g, e, who = taken[0]
            _v(out, "proof-window", f"{inc_id} (epoch {inc.epoch}): its model call of pass {turn} lasted {secs:.0f} s "
                                    f"(calls {start}-{end}) while {who} took epoch {e} at call {g}; it then still ran "
                                    f"{', '.join(f'tool {s} at call {p}' for p, s in late)} without proving its lease "
                                    f"(the bound is {LEASE_CHECK_S:.0f} s since the last proof)")


def _lease_written(h: History, after: int, before: int) -> bool:
    return any(after < n < before for n, _ in h.lease_epochs)


def _proven_after_last_write(h: History, actor: str | None, v: int, n: int) -> bool:
    """Whether ``actor`` read its lease (ok) after its last durable write before call ``n`` and before the
    lease became unreadable at ``v``: then reporting its end at ``n`` is proven, whatever came after."""
    writes = [c.n for c in h.calls[:n - 1] if c.actor == actor and c.op == "put" and c.key is not None
              and c.key.startswith("sessions/") and ("/journal/" in c.key or "/checkpoints/" in c.key)]
    last = max(writes, default=0)
    return any(c.actor == actor and c.op == "get" and c.outcome == "ok" and (c.key or "").endswith("/lease.json")
               and last < c.n < v for c in h.calls)


def _unproven_end(world: Any, h: History, out: list[Violation]) -> None:
    for v in world.corruptions:
        for n, actor, row in h.session_rows:
            if (row.get("status") == "completed" and n > v and not _lease_written(h, v, n)
                    and not _proven_after_last_write(h, actor, v, n)):
                _v(out, "unproven-end", f"{actor} wrote session status 'completed' at call {n}, after lease.json was "
                                        f"made unreadable at call {v}")
        for inc in world.incarnations:
            end = inc.end or 0
            if (inc.outcome != "ok" or not inc.start < v < end or _lease_written(h, v, end)
                    or _proven_after_last_write(h, inc.actor, v, end)):
                continue
            done_before = any(row.get("status") == "completed" and actor == inc.actor and inc.start < n < v
                              for n, actor, row in h.session_rows)
            if not done_before:
                _v(out, "unproven-end", f"{inc.id} returned normally (calls {inc.start}-{inc.end}) although lease.json "
                                        f"was unreadable from call {v}")


def _forks(world: Any, h: History, out: list[Violation]) -> None:
    removed = {cid for _, cid, _ in world.deletes}
    for rec in world.forks:
        if rec["outcome"] != "crashed" or rec["resumed"] is None or rec["resumed"] == "ok":
            continue
        if rec["cid"] in removed or rec["resumed"].startswith("transient"):
            continue
        row = h.rows.get(rec["cid"])
        if row is not None and any(before > row.created_at for _, _, _, before, _ in world.prunes):
            continue
        _v(out, "fork-resumable", f"fork {rec['request'].session_id} of checkpoint {rec['cid']} died before its "
                                  f"first checkpoint; re-issuing it: {rec['resumed']}")


def _prune_records(world: Any, h: History, out: list[Violation]) -> None:
    now = datetime.now(timezone.utc)
    ends = [end for _, _, end, before, outcome in world.prunes if before > now and outcome.startswith("ok")]
    if not ends:
        return
    end = max(ends)
    tag = world.tag["durability_tag"].encode()
    prefix = layout.session_prefix(world.spec.session_id, world.spec.user_id)
    needed = _record_recovery_needs(h, prefix, end)
    for o in world.inner.list(prefix=prefix):
        if not ("/runs/" in o.key or o.key.endswith("-run-end.json")) or o.key == needed:
            continue
        puts = [c.n for c in h.calls if c.op == "put" and c.key == o.key and c.applied]
        if puts and max(puts) < end and tag in world.inner.get(key=o.key).data:
            _v(out, "prune-records", f"{o.key} (written at call {max(puts)}) still holds the run's request after "
                                     f"prune(before=<a day ahead>) ended at call {end}")


def _record_recovery_needs(h: History, prefix: str, end: int) -> str | None:
    """The run record prune must leave whole: the session's last one when its run had not finished (no
    ``run_end``) by the time prune ended. Recovery continues that run from its record, request included (a
    run whose end was not durable returns normally yet stays unfinished: ``loomray.session``), so prune keeps
    it by its documented rule (``storage.pruning``); None when the last run had finished."""
    records = {c.key: c.data for c in h.calls if c.op == "put" and c.applied and c.n < end and c.key is not None
               and c.key.startswith(prefix + "runs/") and c.data is not None}
    if not records:
        return None
    last = max(records)
    try:
        run_id = json.loads(records[last]).get("run_id")
    except (ValueError, AttributeError):
        return None
    ended = any(e.run_id == run_id and e.kind == "run_end" and e.n < end for e in h.journal)
    return None if ended else last
