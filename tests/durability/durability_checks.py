"""Invariants checked after every durability scenario, from the storage call log and the agent ledger.

The log of :class:`storage.faults.FaultyObjectStore` says, in one total order,
which object was written or deleted by which actor and whether the operation
took effect; the ledger says which model calls and tool effects really ran,
which steps were replayed and which checkpoints were acknowledged. From them
(plus a fault-free read of the final state):

- ``epochs-rise``: lease epochs rise strictly per session;
- ``acked-readable``: every checkpoint acknowledged to the current lease holder
  is readable by ``get``, ``list`` and "latest" unless retention (newer rows
  of that holder beyond ``keep``) or prune (``created_at < before``) removed it;
- ``prune-rule``: prune removed only checkpoints older than its cutoff;
- ``reader-latest`` / ``reader-list``: a cold reader's "latest" (and the head
  of ``list_checkpoints``) is never older than the newest checkpoint
  acknowledged before it started (unless prune removed it), and it saw no error
  other than a transient one;
- ``latest-epoch`` / ``latest-fenced``: "latest" never moves to a lower epoch,
  nor to a row a fenced writer wrote (its epoch below the lease's when written);
- ``replay-fenced``: replay never uses a journal entry a fenced writer wrote;
- ``rebilled-model`` / ``rerun-tool``: a run continued after a crash or by a
  takeover never calls the model, nor runs a tool, for a step a non-fenced
  writer journaled before the continuation started (the step in flight, never
  journaled, may run once more; so may a step a live zombie journaled inside
  an earlier takeover's listing window, after that takeover's last listing
  and before its lease swap, which the takeover had to fence: see
  :func:`_ambiguous`);
- ``fenced-continued``: a writer that read a lease showing it was fenced makes
  no further model call and runs no further tool;
- ``ran-blind``: a writer runs no tool after several consecutive failed lease
  reads or journal/checkpoint writes (it cannot prove it owns the session);
- ``status-durable``: a ``completed`` session row is written only when every
  step the run executed is durable (in a journal entry or a checkpoint);
- ``index-objects``: after a final compaction, live index rows (tombstones
  applied) as pyarrow and DuckDB read them equal the checkpoint objects, up to
  what an interrupted write or retire explains; no retired row comes back;
- ``outside-root``: nothing was written outside the store root;
- ``lease-liveness``: contention alone never makes a writer give up on the lease;
- ``unexpected-error`` / ``stall``: no actor died of an unexpected exception
  (an untyped storage error is one) or hung.
"""


from __future__ import annotations

from typing import Any

from durability_history import History, RowInfo, Violation, _identity, _incs_by_epoch, _pruned, _v
from durability_journal_checks import _billing, _blind, _fenced_work, _replay, _status

from loomray.checkpoint_format import load_checkpoint
from loomray.errors import CheckpointException


def check_all(world: Any, final: Any) -> list[Violation]:
    """Every invariant over ``world`` (a finished :class:`durability_world.World`); ``final`` is a fault-free Store."""
    h = History.build(world.faulty.calls, world.spec.session_id)
    out: list[Violation] = []
    for check in (_epochs, _acked, _chains, _prune_rule, _readers, _latest, _replay, _billing, _fenced_work, _blind,
                  _status, _root, _errors):
        out.extend(check(world, h, final))
    return out



def _chains(world, h: History, final) -> list[Violation]:
    """``chain-intact``: every checkpoint the final store lists reads back whole (retention, prune and
    compaction never deleted an object a kept checkpoint needs)."""
    out: list[Violation] = []
    spec = world.spec
    for row in final.checkpoints.list(spec.session_id, user_id=spec.user_id, limit=None):
        try:
            load_checkpoint(final, spec.session_id, row.checkpoint_id, user_id=spec.user_id)
        except CheckpointException as e:
            _v(out, "chain-intact", f"listed checkpoint {row.checkpoint_id} does not read back whole: {e}")
    return out



# -- epochs ----------------------------------------------------------------------
def _epochs(world, h: History, final) -> list[Violation]:
    out: list[Violation] = []
    # Granted epochs (see _incs_by_epoch), in the order they took effect, rise strictly: no epoch is granted
    # twice and none below an earlier grant. (An acquirer may write lease.json and then find, through an epoch
    # marker, that its epoch was taken, and go above it: that write is not a grant.) Epoch markers, where a
    # tree writes them, are "someone took n" records: their order does not matter, their values are unique.
    _incs_by_epoch(world, h)
    grants = sorted((i.acquired, i.epoch, i.id) for i in world.incarnations if i.acquired is not None)
    for (n1, e1, a), (n2, e2, b) in zip(grants, grants[1:], strict=False):
        if e2 <= e1:
            _v(out, "epochs-rise", f"{b} was granted epoch {e2} at call {n2}, after {a} was granted epoch {e1} "
                                   f"at call {n1}")
    seen: dict[int, int] = {}
    for n, e in h.markers:
        if e in seen:
            _v(out, "epochs-rise", f"epoch marker {e} written twice (calls {seen[e]} and {n})")
        seen[e] = n
    return out



# -- checkpoints -------------------------------------------------------------------
def _acked(world, h: History, final) -> list[Violation]:
    out: list[Violation] = []
    spec = world.spec
    by_epoch = _incs_by_epoch(world, h)
    epoch = max(by_epoch, default=0)  # the current holder: the last epoch granted
    holders = by_epoch.get(epoch, [])
    if not holders:
        return out
    pruners = _removers(world)
    rows = final.checkpoints.list(spec.session_id, user_id=spec.user_id, limit=None)
    listed = {r.checkpoint_id for r in rows}
    latest_raw = final.checkpoints.get(spec.session_id, "latest", user_id=spec.user_id)
    latest_order = None
    if latest_raw is not None:
        latest_id, latest_epoch = _identity(latest_raw)
        row = h.rows.get(latest_id)
        latest_order = (row.epoch if row else latest_epoch, latest_id)
    holder_rows = [r for r in h.rows.values() if r.epoch == epoch and r.valid]
    for inc in holders:
        for pos, cid, _st, _ in inc.acks:
            row = h.rows.get(cid)
            if row is None:
                _v(out, "acked-readable", f"{inc.id}: checkpoint {cid} acknowledged at call {pos} but no index row "
                                          f"for it was ever written")
                continue
            if (_pruned(h, row.key, pruners) or cid in {d for _, d, _ in world.deletes}
                    or any(before > row.created_at for _, _, _, before, _ in world.prunes)):
                continue
            if spec.keep >= 1 and sum(1 for r in holder_rows if (r.epoch, r.checkpoint_id) > (row.epoch, cid)) >= spec.keep:
                continue  # retention may have removed it: the holder wrote keep newer ones
            order = (row.epoch, cid)
            problems = []
            if cid not in listed:
                problems.append("missing from list_checkpoints")
            try:  # read back whole: every object of its chain is there and intact
                got = load_checkpoint(final, spec.session_id, cid, user_id=spec.user_id)
            except CheckpointException as e:
                got, problems = None, [*problems, f"it does not read back whole ({e})"]
            if got is None and not problems:
                problems.append("get_checkpoint(id) returned None")
            if latest_order is None or latest_order < order:
                problems.append(f"'latest' is {latest_order}")
            if problems:
                _v(out, "acked-readable", f"{inc.id} (epoch {epoch}): checkpoint {cid} acknowledged at call {pos}: "
                                          + "; ".join(problems))
    return out


def _removers(world) -> set[str]:
    """The actors whose deletes are rules (prune, delete_checkpoint), not retention."""
    return {name for name, *_ in world.prunes} | {name for name, _, _ in world.deletes}


def _prune_rule(world, h: History, final) -> list[Violation]:
    out: list[Violation] = []
    by_key = {r.key: r for r in h.rows.values()}
    for name, start, end, before, _ in world.prunes:
        for key, dels in h.obj_deletes.items():
            for c in dels:
                if c.actor == name and start < c.n <= end and key in by_key and by_key[key].created_at >= before:
                    _v(out, "prune-rule", f"{name} (before={before.isoformat()}) deleted {key} created "
                                          f"{by_key[key].created_at.isoformat()} at call {c.n}")
    return out


def _acked_rows_before(world, h: History, n: int) -> list[RowInfo]:
    """Non-fenced rows whose checkpoint was acknowledged at or before call ``n``."""
    rows = []
    for inc in world.incarnations:
        for pos, cid, _, _ in inc.acks:
            row = h.rows.get(cid)
            if pos <= n and row is not None and row.valid:
                rows.append(row)
    return rows


def _readers(world, h: History, final) -> list[Violation]:
    out: list[Violation] = []
    pruners = _removers(world)
    for obs in world.readers:
        if obs.error and not obs.transient:
            _v(out, "reader-latest", f"{obs.actor} (calls {obs.start}-{obs.end}) failed: {obs.error}")
            continue
        if obs.transient:
            continue
        # Not owed: what prune removed, and rows retired (retention's tombstone) before the reader started.
        floor = [r for r in _acked_rows_before(world, h, obs.start)
                 if not any(c.actor in pruners and c.n <= obs.end for c in h.obj_deletes.get(r.key, ()))
                 and r.checkpoint_id not in {d for _, d, _ in world.deletes}
                 and h.tombstones.get(r.checkpoint_id, obs.start + 1) > obs.start]
        if not floor:
            continue
        best = max(floor, key=lambda r: (r.epoch, r.checkpoint_id))
        need = (best.epoch, best.checkpoint_id)
        for what, cid in (("latest", obs.latest_id), ("list head", obs.head_id)):
            row = h.rows.get(cid) if cid else None
            got = (row.epoch, cid) if row else None
            if got is None or got < need:
                _v(out, "reader-latest" if what == "latest" else "reader-list", f"{obs.actor} (calls {obs.start}-{obs.end}): {what} is {cid} "
                                         f"{'' if row is None else f'(epoch {row.epoch})'}, but {best.checkpoint_id} "
                                         f"(epoch {best.epoch}) was acknowledged at or before call {obs.start}")
    return out


def _latest(world, h: History, final) -> list[Violation]:
    out: list[Violation] = []
    seen = [o for o in world.readers if not o.error and o.latest_id]
    for o in world.readers:
        for what, cid in (("'latest'", o.latest_id), ("the list head", o.head_id)):  # each its own look
            row = h.rows.get(cid) if cid and not o.error else None
            if row is not None and not row.valid:
                _v(out, "latest-fenced", f"{o.actor} (calls {o.start}-{o.end}) read {what} = {cid}, written by "
                                         f"{row.actor} at epoch {row.epoch} at call {row.n} after epoch "
                                         f"{h.max_epoch_before(row.n)} was taken")
    for a in seen:
        for b in seen:
            ra, rb = h.rows.get(a.latest_id), h.rows.get(b.latest_id)
            if ra and rb and a.end < b.start and rb.epoch < ra.epoch:
                _v(out, "latest-epoch", f"'latest' moved from {a.latest_id} (epoch {ra.epoch}, read by {a.actor} "
                                        f"by call {a.end}) to {b.latest_id} (epoch {rb.epoch}, read by {b.actor} "
                                        f"from call {b.start})")
    spec = world.spec
    raw = final.checkpoints.get(spec.session_id, "latest", user_id=spec.user_id)
    if raw is not None:
        cid = _identity(raw)[0]
        row = h.rows.get(cid)
        if row is not None and not row.valid:
            _v(out, "latest-fenced", f"final 'latest' = {cid}, written by {row.actor} at epoch {row.epoch} at call "
                                     f"{row.n} after epoch {h.max_epoch_before(row.n)} was taken")
        top = max((r.epoch for r in h.rows.values() if r.valid and r.key not in h.obj_deletes), default=None)
        if row is not None and top is not None and row.epoch < top:
            _v(out, "latest-epoch", f"final 'latest' = {cid} at epoch {row.epoch}, while a checkpoint of epoch "
                                    f"{top} exists")
    return out


#: The store layout's top-level prefixes (``storage/layout.py``); ``changed`` holds the session-status
#: change markers the compacted session table is behind on.
_TOP_PREFIXES = ("sessions", "index", "live", "active", "changed", "explorations", "submitted-explorations")


# -- journal -----------------------------------------------------------------------
def _root(world, h: History, final) -> list[Violation]:
    out: list[Violation] = []
    for key in world.faulty.written:
        if key.startswith("/") or ".." in key.split("/") or key.split("/", 1)[0] not in _TOP_PREFIXES:
            _v(out, "outside-root", f"wrote key {key!r} outside the store layout")
    if world.tmp is not None:
        extra = sorted(p.name for p in world.tmp.iterdir() if p.name != "store")
        if extra:
            _v(out, "outside-root", f"files next to the store root: {extra}")
    if world.bucket is not None:
        client = world.inner.client
        keys = [o["Key"] for page in client.get_paginator("list_objects_v2").paginate(Bucket=world.bucket)
                for o in page.get("Contents", ())]
        stray = [k for k in keys if not k.startswith("root/")]
        if stray:
            _v(out, "outside-root", f"objects outside the prefix: {stray[:5]}")
    return out


def _errors(world, h: History, final) -> list[Violation]:
    out: list[Violation] = []
    for who, tb in world.unexpected:
        _v(out, "unexpected-error", f"{who}: {tb.strip().splitlines()[-1]}\n{tb}")
    for a in world.sched.actors.values():
        if a.error is not None:
            _v(out, "unexpected-error", f"actor {a.name} died: {a.error!r}\n{a.error_tb}")
    _incs_by_epoch(world, h)
    for inc in world.incarnations:
        if inc.outcome == "fenced" and inc.epoch is None:
            _v(out, "lease-liveness", f"{inc.id} gave up acquiring the lease: {inc.error}")
    for s in world.sched.stalls:
        _v(out, "stall", f"actor {s.actor} blocked outside storage calls\n{s.stacks[-3000:]}")
    return out


