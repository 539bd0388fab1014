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

import io
import json
import re
from collections import defaultdict
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from loomray.checkpoint_format import load_checkpoint
from loomray.errors import CheckpointException
from storage import chains, envelope
from storage.faults import Call

#: Consecutive failed lease reads / writes after which a writer must not run another tool.
BLIND_LIMIT = 4

_JOURNAL = re.compile(r"^sessions/([^/]+)/([^/]+)/journal/([^/]+)/(\d+)-(.+)\.json$")
_CKPT_OBJ = re.compile(r"^sessions/([^/]+)/([^/]+)/checkpoints/([^/]+)\.json$")
_EPOCH_MARK = re.compile(r"/epochs/(\d+)(?:\.json)?$")


@dataclass
class Violation:
    invariant: str
    detail: str

    def __str__(self) -> str:
        return f"[{self.invariant}] {self.detail}"


@dataclass
class JEntry:
    n: int
    actor: str | None
    run_id: str
    seq: int
    step_key: str
    kind: str
    epoch: int
    stamp: int | None
    valid: bool


@dataclass
class RowInfo:
    checkpoint_id: str
    n: int
    actor: str | None
    epoch: int
    created_at: datetime
    key: str
    execution_status: str
    valid: bool
    turn: int = 0


@dataclass
class History:
    """What the call log says happened, in call order."""

    calls: list[Call]
    lease_epochs: list[tuple[int, int]] = field(default_factory=list)
    markers: list[tuple[int, int]] = field(default_factory=list)
    journal: list[JEntry] = field(default_factory=list)
    rows: dict[str, RowInfo] = field(default_factory=dict)
    tombstones: dict[str, int] = field(default_factory=dict)
    obj_puts: dict[str, list[Call]] = field(default_factory=lambda: defaultdict(list))
    obj_deletes: dict[str, list[Call]] = field(default_factory=lambda: defaultdict(list))
    session_rows: list[tuple[int, str | None, dict]] = field(default_factory=list)
    #: Checkpoints some index file names (the others exist only as self-describing objects: a writer's tail).
    indexed: set[str] = field(default_factory=set)

    def max_epoch_before(self, n: int) -> int:
        best = 0
        for m, e in self.lease_epochs:
            if m >= n:
                break
            best = max(best, e)
        return best

    @classmethod
    def build(cls, calls: list[Call]) -> History:
        h = cls(calls)
        for c in calls:
            if c.op == "delete" and c.applied:
                for k in c.keys:
                    h.obj_deletes[k].append(c)
            if c.op != "put" or not c.applied or c.key is None:
                continue
            key = c.key
            if key.endswith("/lease.json") and c.data is not None:
                try:
                    h.lease_epochs.append((c.n, int(json.loads(c.data)["epoch"])))
                except (ValueError, KeyError, TypeError):
                    pass
            elif _EPOCH_MARK.search(key):
                h.markers.append((c.n, int(_EPOCH_MARK.search(key).group(1))))  # type: ignore[union-attr]
            elif _CKPT_OBJ.match(key):
                h.obj_puts[key].append(c)
                header = envelope.header_of(c.data) if c.data is not None else None
                cid = header.get("checkpoint_id") if header else None
                if header and cid and cid not in h.rows:
                    # Its row rides in the object: judged by when the object landed, as readers judge it
                    # (its index row may come a batch later, or from the takeover that adopted it).
                    epoch = int(header.get("epoch") or 0)
                    h.rows[cid] = RowInfo(cid, c.n, c.actor, epoch, datetime.fromisoformat(header["created_at"]),
                                          key, str(header.get("execution_status")),
                                          epoch >= h.max_epoch_before(c.n), int(header.get("turn") or 0))
        for c in calls:
            if c.op != "put" or not c.applied or c.key is None or c.data is None:
                continue
            m = _JOURNAL.match(c.key)
            if m:
                try:
                    body = json.loads(c.data)
                except ValueError:
                    continue
                if not isinstance(body, dict) or "kind" not in body:
                    continue
                epoch = int(body.get("epoch") or 0)
                usage = ((body.get("output") or {}).get("response") or {}).get("usage") or {}
                h.journal.append(JEntry(c.n, c.actor, m.group(3), int(m.group(4)), body.get("step_key", m.group(5)),
                                        body["kind"], epoch, usage.get("cache_read_tokens"),
                                        epoch >= h.max_epoch_before(c.n)))
            elif c.key.startswith("index/checkpoints/") and c.key.endswith(".parquet"):
                table = pq.read_table(io.BytesIO(c.data))
                for r in table.to_pylist():
                    cid = r["checkpoint_id"]
                    h.indexed.add(cid)
                    if r["tombstone"]:
                        h.tombstones.setdefault(cid, c.n)
                    elif cid not in h.rows and not c.key.endswith("-c.parquet"):
                        h.rows[cid] = RowInfo(cid, c.n, c.actor, int(r["epoch"]), r["created_at"], r["key"],
                                              r["execution_status"], int(r["epoch"]) >= h.max_epoch_before(c.n),
                                              int(r.get("turn") or 0))
            elif c.key.startswith("index/sessions/") and c.key.endswith(".parquet"):
                for r in pq.read_table(io.BytesIO(c.data)).to_pylist():
                    h.session_rows.append((c.n, c.actor, r))
        return h


def check_all(world: Any, final: Any) -> list[Violation]:
    """Every invariant over ``world`` (a finished :class:`durability_world.World`); ``final`` is a fault-free Store."""
    h = History.build(world.faulty.calls)
    out: list[Violation] = []
    for check in (_epochs, _acked, _chains, _prune_rule, _readers, _latest, _replay, _billing, _fenced_work, _blind,
                  _status, _root, _errors):
        out.extend(check(world, h, final))
    return out


def _identity(raw: bytes) -> tuple[str, int]:
    """``(checkpoint_id, epoch)`` of a checkpoint object of either format."""
    doc = json.loads(raw)
    head = doc.get("index", doc)
    return head["checkpoint_id"], int(head.get("epoch") or 0)


def _chains(world, h: History, final) -> list[Violation]:
    """``chain-intact``: every checkpoint the final store lists reads back whole (retention, prune and
    compaction never deleted an object a kept checkpoint needs)."""
    out: list[Violation] = []
    spec = world.spec
    for row in final.list_checkpoints(spec.session_id, user_id=spec.user_id, limit=None):
        try:
            load_checkpoint(final, spec.session_id, row.checkpoint_id, user_id=spec.user_id)
        except CheckpointException as e:
            _v(out, "chain-intact", f"listed checkpoint {row.checkpoint_id} does not read back whole: {e}")
    return out


def _v(out: list, invariant: str, detail: str) -> None:
    out.append(Violation(invariant, detail))


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


def _incs_by_epoch(world, h: History) -> dict[int, list]:
    """Incarnations by the epoch they were granted.

    The grant is the ``lease.json`` swap to the epoch of the writer's last
    successful epoch-marker write where the tree writes markers (a marker is
    what arbitrates an epoch; it is claimed before the swap), else its last
    successful ``lease.json`` write. A write whose reply was lost is no grant:
    the acquire failed.
    """
    out: dict[int, list] = defaultdict(list)
    series = h.markers if h.markers else h.lease_epochs
    for inc in world.incarnations:
        end = inc.end if inc.end is not None else 10**12
        mine = [(n, e) for n, e in series
                if inc.start < n <= end and h.calls[n - 1].actor == inc.actor and h.calls[n - 1].outcome == "ok"]
        inc.epoch = mine[-1][1] if mine else None
        inc.acquired = mine[-1][0] if mine else None
        if mine and h.markers:
            # The grant took effect when lease.json was swapped to that epoch: the marker claims the epoch
            # before the swap, and a claim whose swap never happened (lost, or the writer died) is no grant.
            _, e = mine[-1]
            swaps = [n for n, le in h.lease_epochs if le == e and inc.start < n <= end
                     and h.calls[n - 1].actor == inc.actor]
            inc.acquired = swaps[-1] if swaps else None
            inc.epoch = e if swaps else None
        if inc.epoch is not None:
            out[inc.epoch].append(inc)
    return out


def _pruned(h: History, key: str, pruners: set[str]) -> bool:
    return any(c.actor in pruners for c in h.obj_deletes.get(key, ()))


# -- checkpoints -------------------------------------------------------------------
def _acked(world, h: History, final) -> list[Violation]:
    out: list[Violation] = []
    spec = world.spec
    by_epoch = _incs_by_epoch(world, h)
    epoch = max(by_epoch, default=0)  # the current holder: the last epoch granted
    holders = by_epoch.get(epoch, [])
    if not holders:
        return out
    pruners = {name for name, *_ in world.prunes}
    rows = final.list_checkpoints(spec.session_id, user_id=spec.user_id, limit=None)
    listed = {r.checkpoint_id for r in rows}
    latest_raw = final.get_checkpoint(spec.session_id, "latest", user_id=spec.user_id)
    latest_order = None
    if latest_raw is not None:
        latest_id, latest_epoch = _identity(latest_raw)
        row = h.rows.get(latest_id)
        latest_order = (row.epoch if row else latest_epoch, latest_id)
    holder_rows = [r for r in h.rows.values() if r.epoch == epoch and r.valid]
    for inc in holders:
        for pos, cid, _status, _ in inc.acks:
            row = h.rows.get(cid)
            if row is None:
                _v(out, "acked-readable", f"{inc.id}: checkpoint {cid} acknowledged at call {pos} but no index row "
                                          f"for it was ever written")
                continue
            if _pruned(h, row.key, pruners):
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
    pruners = {name for name, *_ in world.prunes}
    for obs in world.readers:
        if obs.error and not obs.transient:
            _v(out, "reader-latest", f"{obs.actor} (calls {obs.start}-{obs.end}) failed: {obs.error}")
            continue
        if obs.transient:
            continue
        # Not owed: what prune removed, and rows retired (retention's tombstone) before the reader started.
        floor = [r for r in _acked_rows_before(world, h, obs.start)
                 if not any(c.actor in pruners and c.n <= obs.end for c in h.obj_deletes.get(r.key, ()))
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
    for o in seen:
        row = h.rows.get(o.latest_id)
        if row is not None and not row.valid:
            _v(out, "latest-fenced", f"{o.actor} (calls {o.start}-{o.end}) read 'latest' = {o.latest_id}, written by "
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
    raw = final.get_checkpoint(spec.session_id, "latest", user_id=spec.user_id)
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


# -- journal -----------------------------------------------------------------------
def _replay(world, h: History, final) -> list[Violation]:
    out: list[Violation] = []
    by_stamp: dict[int, list[JEntry]] = defaultdict(list)
    for e in h.journal:
        if e.stamp is not None:
            by_stamp[e.stamp].append(e)
    for inc in world.incarnations:
        for pos, kind, _run_id, step, stamp in inc.replays:
            if kind == "model":
                entries = [e for e in by_stamp.get(stamp, []) if e.n <= pos]
                if not entries:
                    _v(out, "replay-fenced", f"{inc.id} replayed model step {step} (stamp {stamp}) at call {pos}, "
                                             f"but no journal entry with that answer was written before")
                elif not any(e.valid for e in entries):
                    e = entries[0]
                    _v(out, "replay-fenced", f"{inc.id} replayed model step {step} at call {pos} from the entry "
                                             f"{e.run_id}/{e.seq:08d}-{e.step_key} that {e.actor} wrote at epoch "
                                             f"{e.epoch} at call {e.n}, after epoch {h.max_epoch_before(e.n)} was taken")
            else:
                entries = [e for e in h.journal if e.step_key == step and e.kind == "tool" and e.n <= pos]
                if entries and not any(e.valid for e in entries):
                    e = entries[0]
                    _v(out, "replay-fenced", f"{inc.id} replayed tool step {step} at call {pos}; its only journal "
                                             f"entries were written by fenced writers ({e.actor} at epoch {e.epoch}, "
                                             f"call {e.n})")
    return out


def _target_run(world, inc) -> str | None:
    """The run an incarnation should continue: the run of the latest earlier writer incarnation that had one."""
    earlier = [i for i in world.incarnations if i.start < inc.start and i.run_id is not None and i is not inc]
    return max(earlier, key=lambda i: i.start).run_id if earlier else None


@dataclass
class Seal:
    """A seal entry as the call log shows it landing."""

    n: int
    run_id: str
    seq: int
    epoch: int
    excluded: frozenset[str]
    missing: tuple[tuple[int, int], ...]

    def fences(self, e: JEntry) -> bool:
        """True when this seal makes replay ignore ``e`` (the rule of ``storage.journal``, restated)."""
        return self.run_id == e.run_id and self.epoch > e.epoch and (
            e.seq >= self.seq or f"{e.seq:08d}-{e.step_key}" in self.excluded
            or any(lo <= e.seq <= hi for lo, hi in self.missing))


def _seals(h: History) -> list[Seal]:
    out = []
    for c in h.calls:
        m = _JOURNAL.match(c.key or "") if c.op == "put" and c.applied and c.data is not None else None
        if m is None:
            continue
        try:
            body = json.loads(c.data)
            if body.get("kind") != "seal":
                continue
            output = body.get("output") or {}
            missing = tuple((int(r[0]), int(r[1])) for r in output.get("missing") or ())
            out.append(Seal(c.n, m.group(3), int(m.group(4)), int(body.get("epoch") or 0),
                            frozenset(map(str, output.get("excluded") or ())), missing))
        except (ValueError, TypeError, IndexError, AttributeError):
            continue
    return out


def _last_listing(h: History, j, run_id: str) -> int | None:
    """The call at which takeover ``j`` last listed what could show an entry of ``run_id`` before its swap:
    the run's journal, else (a run it never listed) the session's run records."""
    found: dict[str, int] = {}
    for c in h.calls[j.start:j.acquired - 1]:
        if c.actor == j.actor and c.op in ("list", "list_dirs") and c.outcome == "ok" and c.key:
            if c.key.endswith(f"/journal/{run_id}/"):
                found["journal"] = c.n
            elif c.key.endswith("/runs/"):
                found["records"] = c.n
    return found.get("journal", found.get("records"))


def _writer_of(world, e: JEntry) -> Any:
    return next((i for i in world.incarnations if i.actor == e.actor and i.start < e.n
                 and (i.end is None or e.n <= i.end)), None)


def _ambiguous(world, h: History, e: JEntry, seals: list[Seal]) -> Any:
    """The takeover ``j`` whose listing window holds entry ``e``, if re-running ``e``'s step is excused.

    A taking-over writer lists the journal right before its lease swap and
    seals above what it listed: it cannot tell an entry written between that
    listing and its swap (by a writer that still held the lease) from one a
    zombie wrote after the swap, so it fences both. Re-running such a step is
    the price of not reading the lease per step, not a violation, but only
    when all of this holds:

    - ``e`` was written by a writer that was not fenced then (``e.valid``), of
      an epoch below ``j``'s, after ``j``'s last listing that could have shown
      it and before ``j``'s swap;
    - that writer was alive inside the window (it wrote ``e`` after ``j``'s
      listing, a takeover of a live owner, whether it then learned of ``j``'s
      claim, crashed or kept going); a writer that crashed before the listing
      wrote nothing inside the window;
    - a seal of ``j``'s epoch (``j``'s own, or one a later owner wrote for it
      from the lease note) really fences ``e``.
    """
    if not e.valid:
        return None
    writer = _writer_of(world, e)
    if writer is None:
        return None
    for j in world.incarnations:
        acquired = j.acquired
        if acquired is None or j is writer or j.actor == e.actor or not (e.epoch < (j.epoch or 0) and e.n < acquired):
            continue
        listed = _last_listing(h, j, e.run_id)
        if listed is None or not listed < e.n:
            continue
        if any(s.epoch == j.epoch and s.fences(e) for s in seals):
            return j
    return None


def _billing(world, h: History, final) -> list[Violation]:
    out: list[Violation] = []
    _incs_by_epoch(world, h)
    world.excused = []
    seals = _seals(h)
    for inc in world.incarnations:
        seen_model: dict[int, int] = {}
        for pos, turn, _stamp in inc.model_calls:
            if turn in seen_model:
                _v(out, "rebilled-model", f"{inc.id} called the model twice for turn {turn} (calls {seen_model[turn]}"
                                          f" and {pos})")
            seen_model[turn] = pos
        target = _target_run(world, inc)
        if target is None:
            continue
        acquired = inc.acquired or inc.start
        if any(e.run_id == target and e.kind == "run_end" and e.valid and e.n < acquired for e in h.journal):
            continue  # that run had finished before this writer took the session: this is a new run
        entries = [e for e in h.journal if e.run_id == target and e.n <= inc.start]
        journaled = {e.step_key: e for e in entries if e.valid and e.kind in ("model", "tool")}
        for pos, turn, _stamp in inc.model_calls:
            e = journaled.get(f"t{turn:04d}-model")
            j = _ambiguous(world, h, e, seals) if e is not None else None
            if j is not None:
                world.excused.append(f"{inc.id} model turn {turn}: entry at call {e.n} by live zombie {e.actor} "
                                     f"fenced by {j.id}'s takeover window (listing .. swap at call {j.acquired})")
            elif e is not None:
                _v(out, "rebilled-model", f"{inc.id} ({inc.kind}, started after call {inc.start}) called the model for "
                                          f"turn {turn} at call {pos}; run {target} had journaled that step "
                                          f"(seq {e.seq}, {e.actor}, epoch {e.epoch}, call {e.n})")
        for pos, _run_id, step, n in inc.tool_runs:
            e = journaled.get(step)
            j = _ambiguous(world, h, e, seals) if e is not None else None
            if j is not None:
                world.excused.append(f"{inc.id} tool {step}: entry at call {e.n} by live zombie {e.actor} "
                                     f"fenced by {j.id}'s takeover window (listing .. swap at call {j.acquired})")
            elif e is not None:
                _v(out, "rerun-tool", f"{inc.id} ({inc.kind}, started after call {inc.start}) ran tool step {step} "
                                      f"(effect {n}) again at call {pos}; run {target} had journaled it (seq {e.seq}, "
                                      f"{e.actor}, epoch {e.epoch}, call {e.n})")
    return out


def _fenced_work(world, h: History, final) -> list[Violation]:
    out: list[Violation] = []
    _incs_by_epoch(world, h)
    for inc in world.incarnations:
        epoch = inc.epoch
        if epoch is None:
            continue
        end = inc.end if inc.end is not None else 10**12
        learned = next((c.n for c in h.calls if c.actor == inc.actor and inc.start < c.n <= end and c.op == "get"
                        and c.key is not None and c.key.endswith("/lease.json") and c.outcome == "ok"
                        and h.max_epoch_before(c.n) > epoch), None)
        if learned is None:
            continue
        late = [(p, f"model turn {t}") for p, t, _ in inc.model_calls if p > learned]
        late += [(p, f"tool {s}") for p, _, s, _ in inc.tool_runs if p > learned]
        if late:
            _v(out, "fenced-continued", f"{inc.id} (epoch {epoch}) read at call {learned} a lease of epoch "
                                        f"{h.max_epoch_before(learned)}, then still ran "
                                        + ", ".join(f"{w} at call {p}" for p, w in late))
    return out


def _blind(world, h: History, final) -> list[Violation]:
    out: list[Violation] = []
    for inc in world.incarnations:
        end = inc.end if inc.end is not None else 10**12
        mine = [c for c in h.calls if c.actor == inc.actor and inc.start < c.n <= end and c.key is not None
                and ((c.op == "get" and c.key.endswith("/lease.json"))
                     or (c.op == "put" and ("/journal/" in c.key or "/checkpoints/" in c.key
                                            or c.key.startswith("index/checkpoints/"))))]
        for pos, _, step, _ in inc.tool_runs:
            streak = 0
            for c in mine:
                if c.n > pos:
                    break
                streak = streak + 1 if c.outcome in ("failed", "dropped", "error") else 0
            if streak >= BLIND_LIMIT:
                _v(out, "ran-blind", f"{inc.id} ran tool step {step} at call {pos} after {streak} consecutive failed "
                                     f"lease reads / durable writes")
    return out


def _status(world, h: History, final) -> list[Violation]:
    """A 'completed' status row only after every step the run executed is durable (journal or checkpoint)."""
    out: list[Violation] = []
    for n, actor, row in h.session_rows:
        if row.get("status") != "completed":
            continue
        inc = next((i for i in world.incarnations if i.actor == actor and i.start < n
                    and (i.end is None or n <= i.end)), None)
        if inc is None:
            continue
        covered = max((r.turn for r in h.rows.values() if r.valid and r.actor == actor and inc.start < r.n < n
                       and r.key in h.obj_puts), default=-1)
        journaled = {e.step_key for e in h.journal if e.valid and e.actor == actor and inc.start < e.n < n
                     and e.run_id == inc.run_id}
        steps = [(t, f"t{t:04d}-model") for _, t, _ in inc.model_calls if _ < n]
        steps += [(int(step[1:5]), step) for p, _, step, _ in inc.tool_runs if p < n]
        lost = [step for t, step in steps if t >= covered and step not in journaled]
        if lost:
            _v(out, "status-durable", f"{inc.id} wrote session status 'completed' at call {n}, but steps {lost} "
                                      f"are in no durable journal entry or checkpoint of it")
    return out


def _root(world, h: History, final) -> list[Violation]:
    out: list[Violation] = []
    for key in world.faulty.written:
        if key.startswith("/") or ".." in key.split("/") or key.split("/", 1)[0] not in ("sessions", "index"):
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


# -- the index after compaction ------------------------------------------------------
def index_tables(world, final) -> dict[str, list[dict]]:
    """Checkpoint index rows as pyarrow and DuckDB read them from the directory or bucket (or from bytes)."""
    import duckdb
    import pyarrow.dataset as ds

    cols = "checkpoint_id, key, epoch, tombstone"
    out: dict[str, list[dict]] = {}
    if world.spec.backend == "memory":
        tables = []
        for o in world.inner.list(prefix="index/checkpoints/"):
            if o.key.endswith(".parquet"):
                tables.append(pq.read_table(io.BytesIO(world.inner.get(key=o.key).data)))
        table = pa.concat_tables(tables, promote_options="default") if tables else None
        out["pyarrow"] = table.select(["checkpoint_id", "key", "epoch", "tombstone"]).to_pylist() if table else []
        if table is not None:
            con = duckdb.connect()
            con.register("idx", table)
            out["duckdb"] = [dict(zip(("checkpoint_id", "key", "epoch", "tombstone"), r, strict=False))
                             for r in con.execute(f"select {cols} from idx").fetchall()]
            con.close()
        else:
            out["duckdb"] = []
        return out
    fs, root = final.fsspec()
    base = f"{root}/index/checkpoints"
    if not fs.exists(base):
        return {"pyarrow": [], "duckdb": []}
    if world.spec.backend == "local":
        dataset = ds.dataset(base, format="parquet", partitioning="hive")
    else:
        from pyarrow.fs import FSSpecHandler, PyFileSystem

        dataset = ds.dataset(base, format="parquet", partitioning="hive", filesystem=PyFileSystem(FSSpecHandler(fs)))
    out["pyarrow"] = dataset.to_table(columns=["checkpoint_id", "key", "epoch", "tombstone"]).to_pylist()
    con = duckdb.connect()
    if world.spec.backend == "local":
        rel = con.execute(f"select {cols} from read_parquet('{base}/**/*.parquet', hive_partitioning=true)")
    else:
        con.register("idx", dataset)
        rel = con.execute(f"select {cols} from idx")
    out["duckdb"] = [dict(zip(("checkpoint_id", "key", "epoch", "tombstone"), r, strict=False)) for r in rel.fetchall()]
    con.close()
    return out


def _live(rows: list[dict]) -> set[str]:
    dead = {r["checkpoint_id"] for r in rows if r["tombstone"]}
    return {r["checkpoint_id"] for r in rows if not r["tombstone"] and r["checkpoint_id"] not in dead}


def _needed_objects(world, final) -> set[str]:
    """Checkpoint ids (of the scenario's session) a live row's chain names: their objects stay, rows or not."""
    spec = world.spec
    rows = final.list_checkpoints(spec.session_id, user_id=spec.user_id, limit=None)
    return {cid for r in rows for sid, cid in chains.expand(r.chain, spec.session_id) if sid == spec.session_id}


def check_index(world, final) -> list[Violation]:
    """After a final compaction: live rows (pyarrow and DuckDB) match the checkpoint objects."""
    out: list[Violation] = []
    h = History.build(world.faulty.calls)
    tables = index_tables(world, final)
    live = {name: _live(rows) for name, rows in tables.items()}
    if live.get("pyarrow") != live.get("duckdb"):
        _v(out, "index-objects", f"pyarrow and DuckDB disagree on live rows: "
                                 f"{sorted(live['pyarrow'] ^ live['duckdb'])[:5]}")
    rows_live = live.get("pyarrow", set())
    objects = set()
    for o in world.inner.list(prefix="sessions/"):
        m = _CKPT_OBJ.match(o.key)
        if m:
            objects.add(m.group(3))
    for cid in sorted(rows_live & set(h.tombstones)):
        _v(out, "index-objects", f"row {cid} is live again after its tombstone was written at call "
                                 f"{h.tombstones[cid]} (a retired row came back)")
    for cid in sorted(rows_live - objects - set(h.tombstones)):
        row = h.rows.get(cid)
        deleted = row is not None and row.key in h.obj_deletes
        if not deleted:
            _v(out, "index-objects", f"live row {cid} has no checkpoint object and nothing deleted it")
        # else: a retire deleted the object and never got to write the tombstone (interrupted): explained
    needed = _needed_objects(world, final)
    for cid in sorted(objects - rows_live - needed):
        row = h.rows.get(cid)
        if row is None or cid not in h.indexed:
            continue  # never indexed: a write interrupted between object and row, or a tail (its row rides in it)
        if cid in h.tombstones:
            # Rows are retired before their objects are collected: an object whose collection was interrupted
            # (a failed delete, a writer fenced or dead in between) is garbage a later sweep removes. One that a
            # delete said it removed is not.
            last_delete = max((c.n for c in h.obj_deletes.get(row.key, ())), default=0)
            if last_delete > max((c.n for c in h.obj_puts.get(row.key, ())), default=0):
                _v(out, "index-objects", f"checkpoint object {cid} exists but its row was retired at call "
                                         f"{h.tombstones[cid]} and a delete of it took effect at call {last_delete}")
        else:
            _v(out, "index-objects", f"checkpoint object {cid} exists, its row was written at call {row.n}, "
                                     f"but no live row lists it after compaction")
    return out
