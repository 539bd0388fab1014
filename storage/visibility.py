"""The one visibility rule: which checkpoint rows and objects of a session are live.

Every reader and writer of checkpoints decides with this module, so
``list_checkpoints``, "latest", ``get_checkpoint(<id>)``, fork,
``Store.query``, compaction and the table it publishes, retention, delete,
prune and recovery see one and the same history. For one session:

1. **Rows.** An index row is live unless a tombstone (in any index file)
   names its checkpoint id (:func:`live_of`).
2. **Fences.** A takeover records in ``lease.json`` the highest row it
   listed right before its swap (``"checkpoints"``: ``top``, with up to 8
   earlier owners' fences under ``prev``). A row of an epoch below a fence's
   that ranks above that fence's ``top`` landed after the takeover: a fenced
   writer's, never live, whatever index file or table holds it
   (:meth:`Visibility.fenced`, :meth:`Visibility.fenced_mask` for Arrow
   tables). Rows of epoch 0 were written without a lease: nothing fences them.
   When ``lease.json`` is missing or unreadable (deleted by hand, or
   overwritten), the rule reads the copy of the body the last swap kept
   (``leases/{epoch}.json``, :func:`storage.fencing.kept_lease_body`): a fence
   lasts as long as its copy, so no fenced row or tail is shown again.
3. **Tails.** A checkpoint object no index row names (live or retired) is a
   not-yet-indexed tail only when its header is intact, its epoch is the
   session's current one, and it ranks above every row, live *or retired*,
   its epoch indexed (:func:`tail_admitted`): a writer indexes in the order
   it writes, so an older object without a row is one it saw fail, or one
   retired and kept by a pin. A compaction that drops tombstones records, per
   epoch, the highest row they retired in the merged file's metadata
   (:data:`RETIRED_META`, carried by every later merge): that deletion
   watermark keeps a pruned or deleted checkpoint, whose object a fork's pin
   still holds, from ever reading as a tail again.
4. **Pins.** A fork's pin (``pins/{fork}.json``) keeps the objects it names,
   and the fork point itself stays resolvable *for that fork*
   (``pinned_for=``) after its row was retired: it is never live for anyone
   else (not listed, not "latest", not found by id).

Tombstones are honoured as written, whoever wrote them: a tombstone is a
copy of the row it retires and names no writer, and prune, delete and
quarantine write theirs without a lease. So the writers keep them to lease
holders: a leased writer's retention (a checkpoint log's batch,
``put_checkpoint``'s) writes tombstones only after a proof of its lease
that found no higher epoch claimed (:mod:`storage.checkpoint_log`), and a
takeover retires what a fenced writer landed. What remains is the file in
flight: a proof that passed right before a takeover claimed its epoch, and
the tombstones of that batch landing after the takeover's listing. They
retire only what the holder's retention chose at its proof, the oldest
checkpoints beyond its ``keep`` newest (never the newest, which the new
owner restores from), and a pin still keeps a fork point's object. A reader
cannot undo more: the same writer deletes the retired objects right after
its tombstones, and no object store conditions a delete on another key.
The rule here is pure: it reads nothing, so callers decide what to read
(one LIST of the index, one of the objects, one GET of ``lease.json``, and
when that is missing or unreadable one LIST and one GET of its copies) and
it never keeps a cache.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from storage.layout import is_epoch
from storage.rows import CheckpointRow

#: A fence as read back: ``(epoch of the takeover, highest (epoch, checkpoint_id) it listed or None)``.
Fence = tuple[int, tuple[int, str] | None]
#: One index file's rows, each with whether it is a tombstone.
FileRows = list[tuple[CheckpointRow, bool]]


def live_of(files: Iterable[FileRows]) -> dict[str, CheckpointRow]:
    """The rows of ``files`` no tombstone (in any of them) retires, by checkpoint id."""
    live: dict[str, CheckpointRow] = {}
    dead: set[str] = set()
    for rows in files:
        for row, tomb in rows:
            if tomb:
                dead.add(row.checkpoint_id)
            else:
                live[row.checkpoint_id] = row
    return {cid: r for cid, r in live.items() if cid not in dead}


def parse_fences(items: Any) -> list[Fence]:
    """The well-formed checkpoint fences among ``items`` (lease.json is not trusted: the worst a forged fence
    does is hide or retire rows of older epochs, never resurrect one). An epoch is an int in [0, 2**53), as
    every writer writes it: a larger one (10**30) would not even compare with an index's int64 column."""
    out: list[Fence] = []
    for item in items if isinstance(items, list) else ():
        if not isinstance(item, dict):
            continue
        epoch, top = item.get("epoch"), item.get("top")
        if not is_epoch(epoch) or epoch < 1:
            continue
        if top is None:
            out.append((epoch, None))
        elif isinstance(top, list) and len(top) == 2 and is_epoch(top[0]) and isinstance(top[1], str):
            out.append((epoch, (top[0], top[1])))
    return out


def fenced_by(fences: list[Fence]) -> Callable[[CheckpointRow], bool]:
    """True for a row of an epoch below a fence's that ranks above what that takeover listed before its swap."""
    if not fences:
        return lambda row: False
    return lambda row: row.epoch > 0 and any(row.epoch < k and (top is None or row.order > top) for k, top in fences)


def lease_fences(body: dict[str, Any] | None) -> list[Fence]:
    """Every fence a ``lease.json`` body records: its own takeover's and the earlier owners' (none when the
    body is missing, unreadable or records none)."""
    fence = body.get("checkpoints") if body is not None else None
    if body is None or not isinstance(fence, dict) or not is_epoch(body.get("epoch")):
        return []
    prev = fence.get("prev")
    return parse_fences([{"epoch": body["epoch"], "top": fence.get("top")}, *(prev if isinstance(prev, list) else ())])


@dataclass(frozen=True)
class Visibility:
    """The rule for one session, given its ``lease.json`` body as read after its index LIST."""

    #: The session's current epoch as ``lease.json`` says (None: it does not say).
    epoch: int | None
    fences: tuple[Fence, ...]

    @classmethod
    def of(cls, body: dict[str, Any] | None) -> Visibility:
        """The rule a lease body (None: missing or unreadable) sets."""
        epoch = body.get("epoch") if body is not None else None
        return cls(epoch if is_epoch(epoch) else None, tuple(lease_fences(body)))

    def fenced(self, row: CheckpointRow) -> bool:
        """True for a row a fenced writer landed after a takeover (never live)."""
        return fenced_by(list(self.fences))(row)

    def visible(self, rows: dict[str, CheckpointRow]) -> dict[str, CheckpointRow]:
        """``rows`` (live index rows and tails) without the fenced ones."""
        if not self.fences:
            return rows
        fenced = fenced_by(list(self.fences))
        return {cid: r for cid, r in rows.items() if not fenced(r)}

    def fenced_mask(self, table: pa.Table) -> pa.ChunkedArray | pa.Array | None:
        """Per row of ``table`` (one session's rows in ``CHECKPOINT_SCHEMA`` columns): whether it is fenced;
        None when no row can be (no fence). A few column-wide comparisons per fence, no per-row Python."""
        if not self.fences or not table.num_rows:
            return None
        epoch, cid = table["epoch"], table["checkpoint_id"]
        mask = None
        for k, top in self.fences:
            cond = pc.and_(pc.greater(epoch, 0), pc.less(epoch, k))
            if top is not None:
                above = pc.or_(pc.greater(epoch, top[0]),
                               pc.and_(pc.equal(epoch, top[0]), pc.greater(cid, top[1])))
                cond = pc.and_(cond, above)
            mask = cond if mask is None else pc.or_(mask, cond)
        return pc.fill_null(mask, False)


def epoch_tops(indexed: Iterable[CheckpointRow], retired: Tops | None = None) -> Tops:
    """Per epoch, the highest row (live or retired: tombstones are copies of their rows) the index holds, or
    that a compaction recorded as retired (``retired``: the files' deletion watermarks)."""
    tops: Tops = dict(retired or {})
    for r in indexed:
        if r.epoch not in tops or r.order > tops[r.epoch]:
            tops[r.epoch] = r.order
    return tops


#: Schema metadata key of a compacted index file: per epoch, the highest row a tombstone retired (the deletion
#: watermark, rule 3), carried from merge to merge after the tombstones themselves are dropped.
RETIRED_META = b"loomray.retired"
#: Per epoch, the highest ``(epoch, checkpoint_id)``.
Tops = dict[int, tuple[int, str]]


def merge_tops(*many: Tops) -> Tops:
    """Per epoch, the highest of ``many``'s."""
    out: Tops = {}
    for tops in many:
        for epoch, top in tops.items():
            if epoch not in out or top > out[epoch]:
                out[epoch] = top
    return out


def retired_tops(table: pa.Table) -> Tops:
    """The deletion watermark an index file carries in its schema metadata (empty: none, or malformed)."""
    meta = table.schema.metadata
    raw = meta.get(RETIRED_META) if meta else None
    out: Tops = {}
    try:
        items = json.loads(raw) if raw else []
    except ValueError:
        return out
    for item in items if isinstance(items, list) else ():
        if isinstance(item, list) and len(item) == 2 and is_epoch(item[0]) and isinstance(item[1], str):
            out = merge_tops(out, {item[0]: (item[0], item[1])})
    return out


def with_retired_tops(table: pa.Table, tombstones: pa.Table, carried: Tops) -> pa.Table:
    """``table`` (a merged partition) carrying the deletion watermark of ``tombstones`` (the tombstone rows the
    merge read, dropped or kept) and of ``carried`` (the merged files' own)."""
    tops = dict(carried)
    if tombstones.num_rows:
        top = tombstones.select(["epoch", "checkpoint_id"]).group_by("epoch", use_threads=False).aggregate(
            [("checkpoint_id", "max")])
        tops = merge_tops(tops, {e: (e, c) for e, c in zip(top["epoch"].to_pylist(),
                                                           top["checkpoint_id_max"].to_pylist(), strict=True)
                                 if type(e) is int and isinstance(c, str)})
    if not tops:
        return table
    body = json.dumps(sorted([list(t) for t in tops.values()])).encode()
    return table.replace_schema_metadata({**(table.schema.metadata or {}), RETIRED_META: body})


def tail_admitted(row: CheckpointRow, current: int, tops: Tops) -> bool:
    """Whether an unindexed object's row is a not-yet-indexed tail (see rule 3 of the module docstring).

    ``current``: the session's current epoch (``lease.json``'s, else the
    highest epoch indexed); ``tops``: :func:`epoch_tops` of every index row,
    live or retired.
    """
    if row.epoch < current:
        return False  # an older epoch's: a fenced writer's, or adopted (then it has a row)
    top = tops.get(row.epoch)
    return top is None or row.order > top


def sessions_fenced_mask(table: pa.Table, bodies: dict[tuple[str | None, str], dict[str, Any] | None]
                         ) -> pa.ChunkedArray | pa.Array | None:
    """Per row of ``table`` (rows of many sessions): whether its session's lease body fences it (None: none
    is). ``bodies`` maps ``(user_id, session_id)`` to that session's lease body."""
    rules = {s: Visibility.of(b) for s, b in bodies.items()}
    rules = {s: v for s, v in rules.items() if v.fences}
    if not rules or not table.num_rows:
        return None
    mask = pa.array([False] * table.num_rows)
    for (uid, sid), rule in rules.items():
        same = pc.equal(table["session_id"], sid)
        same = pc.and_(same, pc.is_null(table["user_id"]) if uid is None else pc.equal(table["user_id"], uid))
        fenced = rule.fenced_mask(table)
        if fenced is not None:
            mask = pc.or_(mask, pc.fill_null(pc.and_(same, fenced), False))
    return mask


def leased_sessions(table: pa.Table) -> list[tuple[str | None, str]]:
    """The ``(user_id, session_id)`` of ``table``'s sessions that have a row written under a lease (only those
    can hold a fenced row)."""
    leased = table.filter(pc.greater(table["epoch"], 0)).select(["user_id", "session_id"])
    if not leased.num_rows:
        return []
    pairs = leased.group_by(["user_id", "session_id"], use_threads=False).aggregate([])
    return list(zip(pairs["user_id"].to_pylist(), pairs["session_id"].to_pylist(), strict=True))
