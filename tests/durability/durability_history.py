"""What the storage call log says happened to a durability scenario's session, in call order.

:class:`History` rebuilds, from :class:`storage.faults.FaultyObjectStore`'s log,
the lease epochs granted, the checkpoint rows (from the objects' headers and the
index files), tombstones, journal entries and session rows, each with the call
that wrote it and whether its writer was fenced then (``valid``). The checks
(:mod:`durability_checks`, :mod:`durability_journal_checks`,
:mod:`durability_index`, :mod:`durability_views`) judge from it.
"""

from __future__ import annotations

import io
import json
import re
from collections import defaultdict
from dataclasses import dataclass, field
from datetime import datetime

import pyarrow.parquet as pq

from loomray.storage import envelope
from loomray.storage.faults import Call

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
    #: Every call that landed a tombstone, per checkpoint id (a late one may be ignored, a later one honoured).
    tomb_calls: dict[str, list[int]] = field(default_factory=lambda: defaultdict(list))
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

    def max_marker_before(self, n: int) -> int:
        """The highest epoch claimed (its marker written) before call ``n``: a takeover under way."""
        return max((e for m, e in self.markers if m < n), default=0)

    @classmethod
    def build(cls, calls: list[Call], session_id: str | None = None) -> History:
        """The history of ``session_id`` (None: of every key, for a scenario of one session)."""
        h = cls(calls)
        for c in calls:
            if c.op == "delete" and c.applied:
                for k in c.keys:
                    h.obj_deletes[k].append(c)
            if c.op == "put" and c.applied and c.key in h.obj_deletes:
                del h.obj_deletes[c.key]  # put back (a failed prune restores what it deleted): not deleted now
            if c.op != "put" or not c.applied or c.key is None or not _of_session(c.key, session_id):
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
        h._read_entries(calls, session_id)
        return h

    def _read_entries(self, calls: list[Call], session_id: str | None) -> None:
        """Journal entries, index rows and tombstones, and session rows, from the puts that landed."""
        h = self
        for c in calls:
            if c.op != "put" or not c.applied or c.key is None or c.data is None or not _of_session(c.key, session_id):
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
                if "checkpoint_id" not in table.column_names:
                    continue  # a foreign file someone put there (readers skip it)
                for r in table.to_pylist():
                    cid = r["checkpoint_id"]
                    h.indexed.add(cid)
                    if r["tombstone"]:
                        h.tombstones.setdefault(cid, c.n)
                        h.tomb_calls[cid].append(c.n)
                    elif cid not in h.rows and not c.key.endswith("-c.parquet"):
                        h.rows[cid] = RowInfo(cid, c.n, c.actor, int(r["epoch"]), r["created_at"], r["key"],
                                              r["execution_status"], int(r["epoch"]) >= h.max_epoch_before(c.n),
                                              int(r.get("turn") or 0))
            elif c.key.startswith("index/sessions/") and c.key.endswith(".parquet"):
                for r in pq.read_table(io.BytesIO(c.data)).to_pylist():
                    if "status" in r:
                        h.session_rows.append((c.n, c.actor, r))


def _of_session(key: str, session_id: str | None) -> bool:
    """Whether ``key`` belongs to ``session_id`` (its objects and its index partitions; None: every key)."""
    if session_id is None:
        return True
    parts = key.split("/")
    if parts[0] == "sessions":
        return len(parts) > 2 and parts[2] == session_id
    if parts[0] == "index" and len(parts) > 1 and parts[1] in ("checkpoints", "sessions"):
        return f"/session={session_id}/" in key
    return True


def _identity(raw: bytes) -> tuple[str, int]:
    """``(checkpoint_id, epoch)`` of a checkpoint object of either format."""
    doc = json.loads(raw)
    head = doc.get("index", doc)
    return head["checkpoint_id"], int(head.get("epoch") or 0)


def _v(out: list, invariant: str, detail: str) -> None:
    out.append(Violation(invariant, detail))



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


