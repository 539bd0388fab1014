"""A session's checkpoints as readers see them: the index rows, plus the objects not indexed yet.

A :class:`storage.checkpoint_log.CheckpointLog` indexes its rows in batches,
so the newest checkpoints of a running (or crashed) writer exist as objects
before any index file names them: its *tail*. Their objects are
self-describing (:mod:`storage.envelope`), so a reader lists the session's
checkpoint objects beside its index partition, reads the objects no index row
(live or retired) names, and takes as tail rows those whose header is intact,
whose epoch is the session's current one (from ``lease.json``) and which are
newer than every row that epoch's writer indexed (it indexes in the order it
writes: an older object without a row is one whose write it saw fail). An older
epoch's objects without rows are a fenced writer's, or were adopted into the
index by the takeover that ended that epoch (:mod:`storage.fencing`).

One snapshot costs, besides the index LIST and the GETs of index files not
parsed yet: one LIST of ``checkpoints/``, one GET of ``lease.json`` (both in
parallel with the index LIST on a remote store) and one GET per object
without a row (a tail is at most one batch per writer; parsed tails are
cached).
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from storage import envelope, layout
from storage.checkpoint_rows import CheckpointRows, FileRows, live_of
from storage.envelope import row_of_header
from storage.fencing import lease_body
from storage.rows import CheckpointRow

log = logging.getLogger("storage")
_TAIL_CACHE = 4096


@dataclass
class Snapshot:
    """One look at a session's checkpoints (fences not applied: see ``CheckpointFences.filter``)."""

    #: Live rows: indexed (no tombstone) and tail, by checkpoint id.
    rows: dict[str, CheckpointRow]
    #: The tail rows among them (objects no index file names yet).
    tails: dict[str, CheckpointRow]
    #: Listed checkpoint objects: key -> size.
    present: dict[str, int]
    #: ``lease.json``'s body (None: missing or unreadable).
    lease: dict[str, Any] | None
    #: Keys some index row names, live or retired, with that row.
    indexed: dict[str, CheckpointRow] = field(default_factory=dict)
    #: Object bytes read while looking for the tail, by key.
    data: dict[str, bytes] = field(default_factory=dict)

    @property
    def epoch(self) -> int | None:
        """The session's current epoch as ``lease.json`` says (None when it does not say)."""
        epoch = self.lease.get("epoch") if self.lease is not None else None
        return epoch if type(epoch) is int else None


class TailReader:
    """Reads snapshots for a :class:`CheckpointRows` (parsed tails cached by key and size; objects are
    never rewritten in place)."""

    def __init__(self, rows: CheckpointRows) -> None:
        self.rows = rows
        self._lock = threading.Lock()
        self._cache: OrderedDict[tuple[str, int], CheckpointRow | None] = OrderedDict()

    def clear_cache(self) -> None:
        with self._lock:
            self._cache.clear()

    def snapshot(self, session_id: str, user_id: str | None) -> Snapshot:
        """Index rows, the checkpoint objects and ``lease.json``, then the tail.

        The objects and ``lease.json`` are read after the index LIST (with the
        index files, in parallel on a remote store): a row that LIST shows
        whose object is gone was retired meanwhile (the reader lists again),
        and a row that landed after a takeover is judged by that takeover's
        fence.
        """
        objects = self.rows.objects
        prefix = layout.session_prefix(session_id, user_id) + "checkpoints/"
        lease_key = layout.lease_key(session_id, user_id)
        got: dict[str, Any] = {}

        def part(i: int, keys: list[str], vanished: list[str]) -> Any:
            if i == 0:
                return self.rows.file_rows(keys, vanished)
            if i == 1:
                return {o.key: o.size for o in objects.list(prefix=prefix) if o.key.endswith(".json")}
            obj = objects.get(key=lease_key)
            return lease_body(obj.data if obj is not None else None)

        def read(keys: list[str], vanished: list[str]) -> None:
            got["files"], got["present"], got["lease"] = self.rows.index.map_io(
                lambda i: part(i, keys, vanished), range(3))

        partition = layout.index_partition(layout.CHECKPOINT_INDEX, session_id, user_id)
        self.rows.index.read_listed(partition, read)
        files: list[FileRows] = got["files"]
        snap = Snapshot(live_of(files), {}, got["present"], got["lease"], _keys(files))
        self._read_tail(snap, session_id)
        return snap

    def _read_tail(self, snap: Snapshot, session_id: str) -> None:
        epoch = snap.epoch
        floor = max((r.epoch for r in snap.rows.values()), default=0)
        # A writer indexes its checkpoints in the order it wrote them: its tail is newer than all it indexed.
        # An older object without a row is one whose write the writer saw fail (it moved on without it).
        indexed_top: dict[int, tuple[int, str]] = {}
        for r in snap.indexed.values():
            indexed_top[r.epoch] = max(indexed_top.get(r.epoch, r.order), r.order)
        todo = [k for k in snap.present if k not in snap.indexed]
        for row in self.rows.index.map_wide(lambda k: self._tail_row(k, snap), todo):
            if row is None or row.session_id != session_id:
                continue
            if row.epoch < (epoch if epoch is not None else floor):
                continue  # an older epoch's: a fenced writer's, or adopted (then it has a row)
            if row.epoch in indexed_top and row.order < indexed_top[row.epoch]:
                continue
            snap.tails[row.checkpoint_id] = row
            snap.rows.setdefault(row.checkpoint_id, row)

    def _tail_row(self, key: str, snap: Snapshot) -> CheckpointRow | None:
        size = snap.present[key]
        with self._lock:
            if (key, size) in self._cache:
                return self._cache[(key, size)]
        obj = self.rows.objects.get(key=key)
        if obj is None:
            return None  # deleted meanwhile
        row = None
        header = envelope.header_of(obj.data)
        if header is not None and envelope.intact(obj.data):
            try:
                row = row_of_header(header, key, obj.data)
            except (ValueError, TypeError, KeyError) as e:
                log.warning("skipping a checkpoint object with a malformed header: %s: %s",
                            self.rows.objects.describe(key), e)
            snap.data[key] = obj.data
        with self._lock:
            self._cache[(key, len(obj.data))] = row
            while len(self._cache) > _TAIL_CACHE:
                self._cache.popitem(last=False)
        return row


def _keys(files: list[FileRows]) -> dict[str, CheckpointRow]:
    return {row.key: row for rows in files for row, _ in rows}
