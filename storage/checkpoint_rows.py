"""The checkpoint index as rows: parsed index files, each session's live rows, and retirement.

Index files are immutable, so a parsed file is cached by key (LRU) for as
long as a LIST shows it.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable

import pyarrow as pa
import pyarrow.compute as pc

from . import chains, layout
from .index import ParquetIndex, conform
from .objects import ObjectStore
from .rows import CHECKPOINT_SCHEMA, CheckpointRow, checkpoint_rows_from_table, checkpoint_rows_table, utcnow
from .visibility import FileRows, Tops, Visibility, live_of, merge_tops, retired_tops

log = logging.getLogger("storage")
_ROW_CACHE_FILES = 16384


class CheckpointRows:
    """Reads and writes checkpoint index rows through a :class:`ParquetIndex`; thread-safe."""

    def __init__(self, objects: ObjectStore, index: ParquetIndex) -> None:
        self.objects = objects
        self.index = index
        self._lock = threading.RLock()
        #: Parsed rows per immutable index file key (LRU).
        self._files: OrderedDict[str, FileRows] = OrderedDict()
        #: The deletion watermarks of parsed files that carry one (compacted ones), by key.
        self._retired: dict[str, Tops] = {}
        #: The session's visibility rule as its lease body sets it, read afresh (one GET, made only when the
        #: session's index holds a lease holder's tombstone; set by :class:`storage.tails.TailReader`, which
        #: reads lease bodies): which tombstones are honoured.
        self.rule_of: Callable[[str, str | None], Visibility] = lambda session_id, user_id: Visibility(None, ())
        #: Called with the key and ETag of each checkpoint object a writer of this store put: its bytes are the
        #: ones its row records, so a listing of this store need not read them back (set by the tail reader).
        self.wrote: Callable[[str, str], object] = lambda key, etag: None
        #: The rows of a session its writer may build its next checkpoint on besides the indexed live ones
        #: (:func:`storage.heads.writer_rows`, set by the store, which reads run records): what
        #: :func:`storage.chains.release_pins` keeps the chains of, on both sides of a pin.
        self.writer_rows: Callable[[str, str | None], list[CheckpointRow]] = lambda session_id, user_id: []

    def clear_cache(self) -> None:
        """Forget every parsed file (a cold reader parses them again)."""
        with self._lock:
            self._files.clear()
            self._retired.clear()

    def file_rows(self, keys: list[str], vanished: list[str] | None = None) -> list[FileRows]:
        """Parsed rows of each readable index file; files are immutable, so parsing is cached by key.

        Keys gone at GET time are noted in ``vanished`` (see :meth:`ParquetIndex.read_listed`).
        """
        with self._lock:
            parsed = {k: self._files[k] for k in keys if k in self._files}
        missing = [k for k in keys if k not in parsed]
        for key, table in self.index.read_files(missing, cache=False, vanished=vanished):
            try:
                parsed[key] = checkpoint_rows_from_table(self._ranked(conform(table, CHECKPOINT_SCHEMA), key))
                tops = retired_tops(table)
                if tops:
                    with self._lock:
                        self._retired[key] = tops
            except (KeyError, ValueError, TypeError, pa.ArrowInvalid) as e:
                log.warning("skipping index file with a foreign schema: %s: %s", self.objects.describe(key), e)
        with self._lock:
            for key in missing:
                if key in parsed:
                    self._remember(key, parsed[key])
        return [parsed[k] for k in keys if k in parsed]

    def _ranked(self, table: pa.Table, key: str) -> pa.Table:
        """The rows of index file ``key`` that have an epoch: one without cannot be ranked against the session's
        other rows (nor fenced), so it is dropped with a warning, never read as epoch 0 or compared with None."""
        if table["epoch"].null_count == 0:
            return table
        log.warning("dropping index rows without an epoch from %s", self.objects.describe(key))
        return table.filter(pc.is_valid(table["epoch"]))

    def _remember(self, key: str, rows: FileRows) -> None:
        self._files[key] = rows
        self._files.move_to_end(key)
        while len(self._files) > _ROW_CACHE_FILES:
            self._retired.pop(self._files.popitem(last=False)[0], None)

    def retired(self, keys: list[str]) -> Tops:
        """The deletion watermark the index files ``keys`` carry (parsed by :meth:`file_rows`)."""
        with self._lock:
            return merge_tops(*(self._retired[k] for k in keys if k in self._retired))

    def write(self, session_id: str, user_id: str | None, rows: list[CheckpointRow], *, tombstone: bool | list[bool],
              retired_by: tuple[int, str] | None = None) -> None:
        """Append ``rows`` as one file in the session's partition, stamped ``written_at`` now (``tombstone``: for
        all rows, or one flag per row; ``retired_by``: a lease holder's retention writes the tombstones, see
        :func:`checkpoint_rows_table`)."""
        table = checkpoint_rows_table(rows, tombstone=tombstone, written_at=utcnow(), retired_by=retired_by)
        flags = tombstone if isinstance(tombstone, list) else [tombstone] * len(rows)
        partition = layout.index_partition(layout.CHECKPOINT_INDEX, session_id, user_id)
        key = self.index.write(partition, table, cache=False)
        with self._lock:
            self._remember(key, [(r, (retired_by or True) if t else False) for r, t in zip(rows, flags, strict=True)])

    def partition_rows(self, session_id: str, user_id: str | None) -> list[FileRows]:
        """Rows and tombstones of every file of the session's partition, as of one fresh LIST.

        A listed file that vanished before its GET (merged by a compaction)
        means the LIST is stale: LIST again, never read it as "no rows";
        :class:`IndexChangedError` when that keeps happening.
        """
        partition = layout.index_partition(layout.CHECKPOINT_INDEX, session_id, user_id)
        return self.index.read_listed(partition, self.file_rows)[1]

    def live(self, session_id: str, user_id: str | None, rule: Visibility | None = None) -> dict[str, CheckpointRow]:
        """The session's live rows from a fresh LIST of its partition (strongly consistent).
        ``rule``: the session's visibility rule (which tombstones are honoured), else read after the LIST."""
        files = self.partition_rows(session_id, user_id)
        return live_of(files, rule if rule is not None else self._rule_for(files, session_id, user_id))

    def _rule_for(self, files: list[FileRows], session_id: str, user_id: str | None) -> Visibility | None:
        """The session's rule when ``files`` hold a lease holder's tombstone (only those can be ignored); else
        None, and no read."""
        leased = any(isinstance(t, tuple) for rows in files for _, t in rows)
        return self.rule_of(session_id, user_id) if leased else None

    def retire(self, session_id: str, user_id: str | None, rows: list[CheckpointRow], *, collect: bool = True,
               also_needed: Iterable[CheckpointRow] = (), live: dict[str, CheckpointRow] | None = None) -> None:
        """Tombstone ``rows``, then (with ``collect``) delete their objects and their chains' that nothing needs:
        no row that stays (``live``, else a fresh LIST), no ``also_needed`` row (a writer's unindexed ones), no
        pin (:mod:`storage.chains`). A crash between tombstones and deletes leaves garbage a sweep or prune
        removes."""
        if not rows:
            return
        self.write(session_id, user_id, rows, tombstone=True)
        if collect:
            self.collect(session_id, user_id, rows, also_needed=also_needed, live=live)

    def collect(self, session_id: str, user_id: str | None, retired: list[CheckpointRow], *,
                also_needed: Iterable[CheckpointRow] = (), live: dict[str, CheckpointRow] | None = None) -> None:
        """Delete what retiring ``retired`` (tombstones written) left unneeded, here and in pinned sessions."""
        also = list(also_needed)
        if live is None:
            live = self.live(session_id, user_id)
        chains.collect(self, session_id, user_id, retired, also_needed=also, live=live)
        chains.release_pins(self, session_id, user_id, [*live.values(), *also], retired)

    def sweep(self, session_id: str, user_id: str | None, also_needed: Iterable[CheckpointRow] = ()) -> dict[str, CheckpointRow]:
        """Collect objects of retired rows that a collection left behind (it failed, or its writer was fenced or
        died between the tombstones and the deletes); returns the session's live rows (from the fresh LIST)."""
        files = self.partition_rows(session_id, user_id)
        live = live_of(files, self._rule_for(files, session_id, user_id))
        dead = {r.key for rows in files for r, _ in rows} - {r.key for r in live.values()}
        if dead:
            prefix = layout.session_prefix(session_id, user_id) + "checkpoints/"
            present = {o.key for o in self.objects.list(prefix=prefix)}
            chains.collect(self, session_id, user_id, (), extra=dead & present, also_needed=also_needed, live=live)
        return live


def over_keep(rows: dict[str, CheckpointRow], keep: int) -> list[CheckpointRow]:
    """The oldest of ``rows`` beyond the ``keep`` newest (none when ``keep`` < 1)."""
    if keep < 1 or len(rows) <= keep:
        return []
    ordered = sorted(rows.values(), key=lambda r: r.order)
    return ordered[:len(ordered) - keep]
