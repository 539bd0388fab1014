"""What a compaction may do with a session's leased tombstones (rule 5 of :mod:`storage.visibility`).

A compaction applies a tombstone for good, so only a settled one: written
without a lease, judged by the session's fences (one a fence ignores is
dropped here), or older than every epoch a LIST of the markers made after
the files were read shows claimed. Otherwise a takeover is under way: the
partition's files stay as they are and the table gets the session's rows as
the rule reads them now, absorbing none of its files, so every later
compaction reads it again until its tombstones are settled. Cost per merged
partition holding one: a GET of ``lease.json`` (a LIST and a GET more when it
is unreadable) and a LIST of the markers for a current-epoch tombstone.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import pyarrow as pa
import pyarrow.compute as pc

if TYPE_CHECKING:
    from .store import Store


def _leased(table: pa.Table) -> pa.Table:
    """The leased tombstones of ``table`` (``tomb_epoch`` and ``tomb_mark`` set)."""
    if "tomb_epoch" not in table.column_names or not table.num_rows:
        return table.slice(0, 0)
    cond = pc.and_(pc.fill_null(table["tombstone"], False), pc.fill_null(pc.greater(table["tomb_epoch"], 0), False))
    return table.filter(pc.and_(cond, pc.is_valid(table["tomb_mark"])))


def settled_files(store: Store, pairs: list[tuple[str, pa.Table]]) -> tuple[list[tuple[str, pa.Table]], bool]:
    """One session partition's files (``(key, table)``, conformed) without the leased tombstones no reader
    honours, and whether every leased tombstone left is settled (else the partition must stay as it is: a
    takeover under way may yet ignore one)."""
    leased = [t for t in (_leased(t) for _, t in pairs) if t.num_rows]
    if not leased:
        return pairs, True
    tombs = pa.concat_tables(leased)
    if any(pc.count_distinct(tombs[c], mode="all").as_py() != 1 for c in ("session_id", "user_id")):
        return pairs, False  # not one session's partition: nothing to judge them by
    session_id, user_id = tombs["session_id"][0].as_py(), tombs["user_id"][0].as_py()
    rule = store._tails.rule_of(session_id, user_id)
    by = list(zip(tombs["tomb_epoch"].to_pylist(), tombs["tomb_mark"].to_pylist(), strict=True))
    judged = [t for t in by if not rule.ignores(t)]
    settled = True
    if any(not rule.settled(t) for t in judged):
        claimed = store._leases.max_marker(session_id, user_id)
        settled = all(rule.settled(t, claimed) for t in judged)
    if len(judged) == len(by):
        return pairs, settled
    out = []
    for key, table in pairs:
        mask = rule.ignored_mask(table)
        out.append((key, table if mask is None else table.filter(pc.invert(mask))))
    return out, settled
