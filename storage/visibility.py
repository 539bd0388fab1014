"""The one visibility rule: which checkpoint rows and objects of a session are live.

Every reader and writer of checkpoints decides with this module, so
``checkpoints.list``, "latest", ``checkpoints.get(<id>)``, fork,
``Store.query``, compaction and the table it publishes, retention, delete,
prune and recovery see one and the same history. For one session:

1. **Rows.** An index row is live unless a tombstone (in any index file)
   that rule 5 honours names its checkpoint id (:func:`live_of`).
2. **Fences.** A takeover records in ``lease.json`` the highest row it
   listed right before its swap (``"checkpoints"``: ``top``, with up to 8
   earlier owners' fences under ``prev``). A row of an epoch below a fence's
   that ranks above that fence's ``top`` landed after the takeover: a fenced
   writer's, never live, whatever index file or table holds it
   (:meth:`Visibility.fenced`, :meth:`Visibility.fenced_mask` for Arrow
   tables). Rows of epoch 0 were written without a lease: nothing fences them.
   ``lease.json`` is not trusted to keep its fences: a body deleted,
   garbled, rewritten by hand without them, or restored from an older copy
   would show fenced rows again. So the rule is the union of the fences of
   ``lease.json`` and of the newest copy of a body a swap kept
   (``leases/{epoch}.json``, create-only, :func:`storage.fencing.kept_lease_body`),
   at the higher of their epochs (:meth:`Visibility.of`), and the next
   takeover carries both on: a fence lasts as long as its copy, so no fenced
   row or tail is shown again. The copies themselves are trusted.
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
5. **Tombstones.** A tombstone is a copy of the row it retires. One that
   prune, delete, quarantine or a takeover wrote (without a lease, or
   retiring only what a fence hides already) is always honoured. One that a
   lease holder's retention wrote carries its writer (``tomb_epoch``, the
   lease epoch, and ``tomb_mark``, that writer's newest checkpoint id when it
   proved its lease: :data:`storage.rows.Retired`), and is honoured only if
   its writer still held the lease when it landed (:meth:`Visibility.ignores`).
   The writer proves its lease before it writes them, so what can go wrong is
   the file in flight: a takeover claims its epoch right after the proof and
   lists the index before the tombstones land. So a takeover records in its
   fence (``tombs``) the highest ``(tomb_epoch, tomb_mark)`` among the
   honoured leased tombstones it listed, and a leased tombstone of an epoch
   below a fence's that ranks above that fence's ``tombs`` (or any, when it
   listed none) is a fenced writer's: ignored by every reader, its row stays
   live, and compaction drops it. Why that is exact: one lease holder writes
   its batches one after another and each batch's mark is its newest
   checkpoint, which ranks above every earlier batch's (checkpoint ids of one
   writer rise, as "latest" assumes); a takeover lists after its claim, so
   every batch that landed before the listing is listed, and the one that
   lands after it (there is at most one: the next proof sees the claim) ranks
   above all of them (a batch whose PUT seemed to fail is written again with
   the next, which ranks above it). Between the takeover's listing and its
   swap a reader finds no fence yet and honours such a tombstone; from the
   swap on none does (compaction applies none meanwhile, see below, and the
   retired objects are still there). A fence from before this rule (no
   ``tombs``) judges no tombstone. Like rule 2 this lasts as long as the fence is among the 8 a
   lease body carries; compaction drops an ignored tombstone for good.

   A leased tombstone no fence judges yet is honoured, and is *settled* (no
   fence can ever ignore it) once a proof of a lease finds no higher epoch
   claimed after it landed: its writer's next proof, or an epoch-marker LIST
   made after reading it that shows no claim above its epoch (what compaction
   does before it applies one: :mod:`storage.tombstone_settle`). So retention
   deletes the objects it retired only after such a proof
   (:mod:`storage.checkpoint_log`): a checkpoint an
   ignored tombstone names keeps its object.

The rule here is pure: it reads nothing, so callers decide what to read
(one LIST of the index, one of the objects, one GET of ``lease.json``, one
LIST and one GET of its copies) and it never keeps a cache.
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


def parse_fences(items: Any) -> list[Fence]:
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
