"""The one visibility rule: which checkpoint rows and objects of a session are live.

Every reader and writer of checkpoints decides with this module, so listing,
"latest", get by id, fork, ``Store.query``, compaction, retention, delete,
prune and recovery see one history. The five rules (rows, fences, tails,
pins, tombstones) and why each is exact are in docs/design.md "One
visibility rule"; the numbers below refer to them. The rule is pure: it
reads nothing, so callers decide what to read, and it never keeps a cache.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from .layout import is_epoch
from .rows import CheckpointRow, Retired

#: A fence as read back: ``(epoch of the takeover, highest (epoch, checkpoint_id) it listed or None, highest
#: (tomb_epoch, tomb_mark) of the leased tombstones it listed or None)``.
Fence = tuple[int, tuple[int, str] | None, tuple[int, str] | None]
#: One index file's rows, each with what it retires (:data:`storage.rows.Retired`: False for a row).
FileRows = list[tuple[CheckpointRow, Retired]]


def live_of(files: Iterable[FileRows], rule: Visibility | None = None) -> dict[str, CheckpointRow]:
    """The rows of ``files`` no honoured tombstone (in any of them) retires, by checkpoint id (``rule``: the
    session's; None honours every tombstone, as a session without a lease body must)."""
    ignores = rule.ignores if rule is not None and rule.fences else None
    live: dict[str, CheckpointRow] = {}
    dead: set[str] = set()
    for rows in files:
        for row, tomb in rows:
            if not tomb:
                live[row.checkpoint_id] = row
            elif not (ignores is not None and isinstance(tomb, tuple) and ignores(tomb)):
                dead.add(row.checkpoint_id)
    return {cid: r for cid, r in live.items() if cid not in dead}


def _pair(value: Any) -> tuple[int, str] | None:
    """``[epoch, checkpoint_id]`` as read from JSON, or None when malformed."""
    if isinstance(value, list) and len(value) == 2 and is_epoch(value[0]) and isinstance(value[1], str):
        return value[0], value[1]
    return None


def parse_fences(items: object) -> list[Fence]:
    """The well-formed checkpoint fences among ``items`` (lease.json is not trusted: the worst a forged fence
    does is hide or retire rows of older epochs, never resurrect one). An epoch is an int in [0, 2**53), as
    every writer writes it: a larger one (10**30) would not even compare with an index's int64 column.
    A forged ``tombs`` can make readers ignore retention's tombstones below its epoch: rows come back whose
    objects may be gone, and readers skip a row without its object. A fence without ``tombs`` (written before leased tombstones were judged) judges none of them: it reads as
    having listed everything below its epoch."""
    out: list[Fence] = []
    for item in items if isinstance(items, list) else ():
        if not isinstance(item, dict):
            continue
        epoch, top = item.get("epoch"), item.get("top")
        if not is_epoch(epoch) or epoch < 1 or (top is not None and _pair(top) is None):
            continue
        raw = item.get("tombs", [epoch, ""])
        tombs = _pair(raw)
        if raw is not None and tombs is None:
            continue
        out.append((epoch, _pair(top), tombs))
    return out


def fenced_by(fences: list[Fence]) -> Callable[[CheckpointRow], bool]:
    """True for a row of an epoch below a fence's that ranks above what that takeover listed before its swap."""
    if not fences:
        return lambda row: False
    return lambda row: row.epoch > 0 and any(row.epoch < k and (top is None or row.order > top)
                                             for k, top, _ in fences)


def lease_fences(body: dict[str, Any] | None) -> list[Fence]:
    """Every fence a ``lease.json`` body records: its own takeover's and the earlier owners' (none when the
    body is missing, unreadable or records none)."""
    fence = body.get("checkpoints") if body is not None else None
    if body is None or not isinstance(fence, dict) or not is_epoch(body.get("epoch")):
        return []
    prev = fence.get("prev")
    own = {k: v for k, v in fence.items() if k in ("top", "tombs")}
    return parse_fences([{"epoch": body["epoch"], **own}, *(prev if isinstance(prev, list) else ())])


@dataclass(frozen=True)
class Visibility:
    """The rule for one session, given its ``lease.json`` body as read after its index LIST."""

    #: The session's current epoch as ``lease.json`` says (None: it does not say).
    epoch: int | None
    fences: tuple[Fence, ...]

    @classmethod
    def of(cls, body: dict[str, Any] | None, kept: dict[str, Any] | None = None) -> Visibility:
        """The rule a lease body (None: missing or unreadable) and the newest copy a swap kept (``kept``) set
        together: the higher epoch, and every fence either records. A body rewritten by hand without its fences,
        or restored from an older copy, contradicts the copy: it may add fences (hide rows), never drop one."""
        epochs = [e for e in (b.get("epoch") for b in (body, kept) if b is not None) if is_epoch(e)]
        fences = list(dict.fromkeys([*lease_fences(body), *lease_fences(kept)]))
        return cls(max(epochs) if epochs else None, tuple(fences))

    def fenced(self, row: CheckpointRow) -> bool:
        """True for a row a fenced writer landed after a takeover (never live)."""
        return fenced_by(list(self.fences))(row)

    def ignores(self, by: tuple[int, str]) -> bool:
        """True for a leased tombstone (``by``: its ``(tomb_epoch, tomb_mark)``) that landed after a takeover's
        listing, its writer fenced: no reader honours it (rule 5)."""
        return by[0] > 0 and any(by[0] < k and (tombs is None or by > tombs) for k, _, tombs in self.fences)

    def settled(self, by: tuple[int, str], claimed: int | None = None) -> bool:
        """Whether an honoured leased tombstone stays honoured whatever takeover comes: a fence above its epoch
        judged it, or ``claimed`` (the highest epoch marker, listed after the tombstone was read; None: not
        listed) shows no takeover claimed an epoch above it (rule 5)."""
        return any(by[0] < k for k, _, _ in self.fences) or (claimed is not None and claimed <= by[0])

    def tomb_top(self, files: Iterable[FileRows]) -> tuple[int, str] | None:
        """The highest ``(tomb_epoch, tomb_mark)`` of the leased tombstones in ``files`` this rule honours: what a
        takeover's fence records as ``tombs``."""
        marks = [t for rows in files for _, t in rows if isinstance(t, tuple) and not self.ignores(t)]
        return max(marks) if marks else None

    def ignored_mask(self, table: pa.Table) -> pa.ChunkedArray | pa.Array | None:
        """Per row of ``table`` (one session's, ``CHECKPOINT_SCHEMA`` columns): whether it is a leased
        tombstone this rule ignores; None when none can be."""
        if not self.fences or not table.num_rows or "tomb_epoch" not in table.column_names:
            return None
        epoch, mark = table["tomb_epoch"], table["tomb_mark"]
        leased = pc.and_(pc.and_(pc.fill_null(table["tombstone"], False), pc.greater(epoch, 0)), pc.is_valid(mark))
        mask = None
        for k, _, tombs in self.fences:
            cond = pc.less(epoch, k)
            if tombs is not None:
                above = pc.or_(pc.greater(epoch, tombs[0]), pc.and_(pc.equal(epoch, tombs[0]),
                                                                    pc.greater(mark, tombs[1])))
                cond = pc.and_(cond, above)
            mask = cond if mask is None else pc.or_(mask, cond)
        return pc.fill_null(pc.and_(leased, mask), False)

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
        for k, top, _ in self.fences:
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


def sessions_fenced_mask(table: pa.Table, rules: dict[tuple[str | None, str], Visibility], *,
                         ignored: bool = False) -> pa.ChunkedArray | pa.Array | None:
    """Per row of ``table`` (rows of many sessions): whether its session's rule fences it (``ignored``: whether
    it is a tombstone that rule's fences ignore); None: none is. ``rules`` maps ``(user_id, session_id)`` to
    that session's rule."""
    rules = {s: v for s, v in rules.items() if v.fences}
    if not rules or not table.num_rows:
        return None
    mask = pa.array([False] * table.num_rows)
    for (uid, sid), rule in rules.items():
        same = pc.equal(table["session_id"], sid)
        same = pc.and_(same, pc.is_null(table["user_id"]) if uid is None else pc.equal(table["user_id"], uid))
        fenced = rule.ignored_mask(table) if ignored else rule.fenced_mask(table)
        if fenced is not None:
            mask = pc.or_(mask, pc.fill_null(pc.and_(same, fenced), False))
    return mask


def leased_sessions(table: pa.Table) -> list[tuple[str | None, str]]:
    """The ``(user_id, session_id)`` of ``table``'s sessions that have a row or tombstone written under a lease
    (only those can hold a fenced row or an ignored tombstone)."""
    cond = pc.fill_null(pc.greater(table["epoch"], 0), False)
    if "tomb_epoch" in table.column_names:
        cond = pc.or_(cond, pc.fill_null(pc.greater(table["tomb_epoch"], 0), False))
    leased = table.filter(cond).select(["user_id", "session_id"])
    if not leased.num_rows:
        return []
    pairs = leased.group_by(["user_id", "session_id"], use_threads=False).aggregate([])
    return list(zip(pairs["user_id"].to_pylist(), pairs["session_id"].to_pylist(), strict=True))
