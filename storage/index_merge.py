"""Merging a partition's index rows: duplicates dropped, tombstones applied, what compaction keeps.

Pure functions over Arrow tables in ``CHECKPOINT_SCHEMA`` (readers and
compaction apply the same rules; see :mod:`storage.index`).
"""

from __future__ import annotations

from collections.abc import Collection
from datetime import datetime

import pyarrow as pa
import pyarrow.compute as pc

from .visibility import Tops, with_retired_tops


def _keyed(table: pa.Table) -> pa.Table:
    """Add ``__u`` (user_id with null as "") so joins match "no user" rows: SQL joins never match nulls."""
    return table.append_column("__u", pc.fill_null(table["user_id"], ""))


_JOIN = ["__u", "session_id", "checkpoint_id"]


def _one_session(table: pa.Table) -> bool:
    """All rows name one (user, session) (a partition's own files): tombstones then match by checkpoint id alone."""
    if table.num_rows < 2:
        return True
    return all(pc.count_distinct(table[c], mode="all").as_py() == 1 for c in ("session_id", "user_id"))


def dedupe(table: pa.Table) -> pa.Table:
    """Drop exact repeats of a (user, session, checkpoint, tombstone) row; rows are immutable, repeats are copies."""
    if table.num_rows < 2:
        return table
    # (A table of one session without a repeated id never gets here: _one_session_merge handled it.)
    keyed = _keyed(table)
    cols = _JOIN + ["tombstone"]
    if keyed.group_by(cols, use_threads=False).aggregate([]).num_rows == table.num_rows:
        return table
    numbered = keyed.append_column("__i", pa.array(range(table.num_rows), pa.int64()))
    first = numbered.group_by(cols, use_threads=False).aggregate([("__i", "min")])["__i_min"]
    return table.take(pc.take(first, pc.sort_indices(first)))


def _retire(live: pa.Table, tombs: pa.Table, one_session: bool) -> tuple[pa.Table, int]:
    """``live`` without the rows ``tombs`` retire, and how many they retired."""
    if not tombs.num_rows:
        return live, 0
    if one_session:
        hit = pc.is_in(live["checkpoint_id"], value_set=tombs["checkpoint_id"].combine_chunks())
        applied = pc.sum(hit).as_py() or 0
        return (live.filter(pc.invert(hit)) if applied else live), applied
    applied = live.join(tombs.select(_JOIN), keys=_JOIN, join_type="left semi", use_threads=False).num_rows
    return live.join(tombs.select(_JOIN), keys=_JOIN, join_type="left anti", use_threads=False), applied


def _split(table: pa.Table) -> tuple[pa.Table, pa.Table]:
    table = _keyed(dedupe(table))
    is_tomb = table["tombstone"]
    return table.filter(pc.invert(is_tomb)), table.filter(is_tomb)


def live_checkpoints(table: pa.Table) -> pa.Table:
    """Rows not retired by a tombstone (in any file), without the tombstones themselves (one session's in
    merged-file order, by epoch and checkpoint id)."""
    fast = _one_session_merge(table, None, ())
    if fast is not None:
        return fast[0]
    live, tombs = _split(table)
    live, _ = _retire(live, tombs, _one_session(table))
    return live.drop_columns(["__u"])


def compact_checkpoint_partition(table: pa.Table, *, keep_tombstones_since: datetime | None = None,
                                 young_ids: Collection[str] = (), retired: Tops | None = None
                                 ) -> tuple[pa.Table, int]:
    """Merged rows of one partition and the number of rows tombstones retired.

    A tombstone written at or after ``keep_tombstones_since``, or of an id in
    ``young_ids`` (its file is young by the store's clock), stays: another
    compactor may still write a copy of its row read before it existed
    (:mod:`storage.maintenance`); ``None`` keeps none. The merged table carries
    the deletion watermark (:func:`storage.visibility.with_retired_tops`, with
    ``retired``, the merged files' own), so a dropped tombstone never lets a
    pinned, retired checkpoint read as a tail.
    """
    tombs = table.filter(pc.fill_null(table["tombstone"], False)) if table.num_rows else table
    fast = _one_session_merge(table, keep_tombstones_since, young_ids)
    if fast is not None:
        return with_retired_tops(fast[0], tombs, retired or {}), fast[1]
    live, tombs = _split(table)
    applied = 0
    if tombs.num_rows:
        live, applied = _retire(live, tombs, _one_session(table))
        if keep_tombstones_since is not None:
            keep = _kept_tombstones(tombs, keep_tombstones_since, young_ids)
            live = pa.concat_tables([live, tombs.filter(keep).select(live.column_names)])
    merged = live.drop_columns(["__u"]) if "__u" in live.column_names else live
    return with_retired_tops(merged.sort_by(_MERGED_ORDER), tombs, retired or {}), applied


#: The row order of a merged partition file.
_MERGED_ORDER = [("epoch", "ascending"), ("checkpoint_id", "ascending")]


def _kept_tombstones(table: pa.Table, since: datetime, young_ids: Collection[str]) -> pa.ChunkedArray | pa.Array:
    """Per row of ``table``: whether it would be kept as a tombstone (written at or after ``since``, written_at
    unknown, or a checkpoint id in ``young_ids``); not whether it is one."""
    keep = pc.fill_null(pc.greater_equal(table["written_at"], pa.scalar(since, table["written_at"].type)), True)
    if young_ids:
        keep = pc.or_(keep, pc.is_in(table["checkpoint_id"], value_set=pa.array(sorted(young_ids), pa.string())))
    return keep


def _one_session_merge(table: pa.Table, since: datetime | None,
                       young_ids: Collection[str]) -> tuple[pa.Table, int] | None:
    """:func:`compact_checkpoint_partition` of a table of one (user, session) without repeated keys (the common
    case), or None for any other table.

    Which rows stay is worked out on the few columns it needs, and the table
    is reordered once (one ``take``): every table-wide filter, concatenation
    or sort costs a pass over each of its columns and chunks.
    """
    if not _one_session(table):
        return None
    tomb = pc.fill_null(table["tombstone"], False)
    live = pc.invert(tomb)
    cid = table["checkpoint_id"]
    live_ids, tomb_ids = cid.filter(live), cid.filter(tomb)
    for part in (live_ids, tomb_ids):
        if len(part) > 1 and pc.count_distinct(part, mode="all").as_py() != len(part):
            return None
    keep, applied = live, 0
    if len(tomb_ids):
        hit = pc.and_(live, pc.is_in(cid, value_set=tomb_ids.combine_chunks()))
        applied = pc.sum(hit).as_py() or 0
        if applied:
            keep = pc.and_not(live, hit)
        if since is not None:
            keep = pc.or_(keep, pc.and_(tomb, _kept_tombstones(table, since, young_ids)))
    rows = pc.indices_nonzero(keep)
    order = pc.sort_indices(table.select([k for k, _ in _MERGED_ORDER]).take(rows), sort_keys=_MERGED_ORDER)
    return table.take(pc.take(rows, order)), applied
