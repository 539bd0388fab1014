"""A session's checkpoints as readers see them: the index rows, plus the objects not indexed yet.

A checkpoint log indexes in batches, so a writer's newest checkpoints exist
as self-describing objects before any index file names them: its *tail*. A
reader lists the objects beside the index partition and admits as tail rows
those the visibility rule does (:func:`storage.visibility.tail_admitted`).
A snapshot costs, besides the index LIST and unparsed index files: one LIST
of ``checkpoints/``, one GET of ``lease.json`` (for a leased session one LIST
and one GET of its kept copies), in parallel on a remote store, and one GET
per object without a row (parsed tails are cached).
"""

from __future__ import annotations

import functools
import logging
import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from . import envelope, layout
from .chains import Pins
from .checkpoint_rows import CheckpointRows
from .envelope import row_of_header
from .fencing import kept_lease_body, lease_body
from .index_merge import live_checkpoints
from .rows import CheckpointRow
from .visibility import (
    FileRows,
    Tops,
    Visibility,
    epoch_tops,
    leased_sessions,
    live_of,
    sessions_fenced_mask,
    tail_admitted,
)

log = logging.getLogger("storage")
_TAIL_CACHE = 4096


@dataclass
class Snapshot:
    """One look at a session's checkpoints; :attr:`live` is what every reader sees (:mod:`storage.visibility`)."""

    #: Rows no tombstone retires: indexed and tail, by checkpoint id (fenced ones included: see :attr:`live`).
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
    session_id: str = ""
    user_id: str | None = None
    #: The index files' deletion watermark (:data:`storage.visibility.RETIRED_META`).
    retired: Tops = field(default_factory=dict)
    #: The highest ``(tomb_epoch, tomb_mark)`` of the honoured leased tombstones listed (what a takeover's fence
    #: records: :meth:`storage.visibility.Visibility.tomb_top`).
    tomb_top: tuple[int, str] | None = None
    #: The newest copy of a lease body a swap kept (:func:`storage.fencing.kept_lease_body`); the rule is
    #: both bodies' (:meth:`storage.visibility.Visibility.of`).
    kept: dict[str, Any] | None = None
    #: Listed checkpoint objects: key -> ETag (a new one for every put: what a reader verified stays verified).
    etags: dict[str, str] = field(default_factory=dict)

    @property
    def epoch(self) -> int | None:
        """The session's current epoch as its lease body says (None when it does not say)."""
        return self.rule.epoch

    @functools.cached_property
    def rule(self) -> Visibility:
        """The visibility rule the session's lease body and its newest kept copy set."""
        return Visibility.of(self.lease, self.kept)

    @functools.cached_property
    def live(self) -> dict[str, CheckpointRow]:
        """The live checkpoints, by id: :attr:`rows` without those a takeover's fence hides (worked out once,
        when first asked, after :meth:`TailReader.snapshot` completed the rows)."""
        return self.rule.visible(self.rows)

    @functools.cached_property
    def heads(self) -> list[CheckpointRow]:
        """The rows a writer of the session may build its next incremental checkpoint on, whatever retired them
        since: the newest of the highest epoch (indexed, live or retired, or tail: a running writer's last one)
        and the newest live one (what a new owner restores from). Delete and prune keep their chains' objects
        (:mod:`storage.chains`)."""
        newest = max([*self.indexed.values(), *self.tails.values()], key=lambda r: r.order, default=None)
        latest = max(self.live.values(), key=lambda r: r.order, default=None)
        return list({r.key: r for r in (newest, latest) if r is not None}.values())


class TailReader:
    """Reads snapshots for a :class:`CheckpointRows` (parsed tails cached by key and size; objects are
    never rewritten in place)."""

    def __init__(self, rows: CheckpointRows) -> None:
        self.rows = rows
        self._lock = threading.Lock()
        self._cache: OrderedDict[tuple[str, int], CheckpointRow | None] = OrderedDict()
        self._verified: OrderedDict[tuple[str, str], None] = OrderedDict()
        self._copies: dict[tuple[str, str], dict[str, Any]] = {}  # kept lease body copies, by key and ETag
        self._leased: set[tuple[str | None, str]] = set()  # sessions seen with a lease.json: copies listed at once
        rows.rule_of = self.rule_of  # the rows' writers judge tombstones by the same lease bodies
        rows.wrote = lambda key, etag: self.verified(key, etag, mark=True)  # what this store wrote is verified

    def rule_of(self, session_id: str, user_id: str | None) -> Visibility:
        """The session's visibility rule as its lease body and the newest copy a swap kept set it now (one GET
        of ``lease.json``, one LIST and one GET of the copies)."""
        return self._rule((user_id, session_id))

    def _rule(self, pair: tuple[str | None, str]) -> Visibility:
        objects = self.rows.objects
        obj = objects.get(key=layout.lease_key(pair[1], pair[0]))
        return Visibility.of(lease_body(obj.data if obj is not None else None), self._kept(pair[1], pair[0]))

    def _kept(self, session_id: str, user_id: str | None) -> dict[str, Any] | None:
        """The newest kept copy of the session's lease body (copies read once: they are written once)."""
        if len(self._copies) > _TAIL_CACHE:
            self._copies.clear()
        return kept_lease_body(self.rows.objects, session_id, user_id, cache=self._copies)

    def clear_cache(self) -> None:
        with self._lock:
            self._cache.clear()
            self._verified.clear()
            self._copies.clear()
            self._leased.clear()

    def verified(self, key: str, etag: str | None, *, mark: bool = False) -> bool:
        """Whether the object at ``key`` with ETag ``etag`` was read and verified by this store (``mark``: it
        just was). Every put gives a key a new ETag, so an object overwritten since is read again."""
        if etag is None:
            return False
        with self._lock:
            if mark:
                self._verified[(key, etag)] = None
                while len(self._verified) > _TAIL_CACHE:
                    self._verified.popitem(last=False)
            return (key, etag) in self._verified

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
        known = (user_id, session_id) in self._leased  # its copies are listed in parallel with lease.json

        def part(i: int, keys: list[str], vanished: list[str]) -> Any:
            if i == 0:
                return self.rows.file_rows(keys, vanished), self.rows.retired(keys)
            if i == 1:
                return [o for o in objects.list(prefix=prefix) if o.key.endswith(".json")]
            if i == 3:
                return self._kept(session_id, user_id)
            obj = objects.get(key=lease_key)
            if obj is not None and not known:
                if len(self._leased) > _TAIL_CACHE:
                    self._leased.clear()
                self._leased.add((user_id, session_id))
                got["kept"] = self._kept(session_id, user_id)  # a leased session: its kept copies too (see below)
            return lease_body(obj.data if obj is not None else None)

        def read(keys: list[str], vanished: list[str]) -> None:
            got["kept"] = None
            got["files"], got["present"], got["lease"], *kept = self.rows.index.map_io(
                lambda i: part(i, keys, vanished), range(4 if known else 3))
            if kept:
                got["kept"] = kept[0]

        partition = layout.index_partition(layout.CHECKPOINT_INDEX, session_id, user_id)
        self.rows.index.read_listed(partition, read)
        files: list[FileRows] = got["files"][0]
        listed = got["present"]
        got["present"] = {o.key: o.size for o in listed}
        indexed, kept = _keys(files), got["kept"]
        if got["lease"] is None and kept is None and (any(r.epoch > 0 for r in indexed.values())
                                                      or any(k not in indexed for k in got["present"])):
            # lease.json is gone yet a leased writer may have written here. A session written without a lease
            # pays nothing for this.
            kept = kept_lease_body(objects, session_id, user_id)
        # lease.json may be gone, unreadable, rewritten by hand or restored from an older copy: the fences of
        # the copy the last swap kept hold all the same (storage.visibility, rule 2).
        rule = Visibility.of(got["lease"], kept)
        snap = Snapshot(live_of(files, rule), {}, got["present"], got["lease"], indexed, session_id=session_id,
                        user_id=user_id, retired=got["files"][1], tomb_top=rule.tomb_top(files), kept=kept,
                        etags={o.key: o.etag for o in listed})
        self._read_tail(snap, session_id)
        return snap

    def _read_tail(self, snap: Snapshot, session_id: str) -> None:
        epoch = snap.epoch
        current = epoch if epoch is not None else max((r.epoch for r in snap.rows.values()), default=0)
        tops = epoch_tops(snap.indexed.values(), snap.retired)
        todo = [k for k in snap.present if k not in snap.indexed]
        for row in self.rows.index.map_wide(lambda k: self._tail_row(k, snap), todo):
            if row is None or row.session_id != session_id or not tail_admitted(row, current, tops):
                continue
            snap.tails[row.checkpoint_id] = row
            snap.rows.setdefault(row.checkpoint_id, row)

    def fenced_mask(self, table: pa.Table) -> pa.ChunkedArray | pa.Array | None:
        """Per row of ``table`` (index rows of any sessions, tombstones applied): whether its session's
        takeovers fenced it (rule 2 of :mod:`storage.visibility`); None when none is. One GET of ``lease.json``
        and one LIST and one GET of its kept copies per session with a row written under a lease, in parallel; column-wide masks, no per-row Python."""
        pairs = leased_sessions(table)
        if not pairs:
            return None
        mask = sessions_fenced_mask(table, dict(zip(pairs, self.rows.index.map_io(self._rule, pairs), strict=True)))
        return mask if mask is not None and pc.any(mask).as_py() else None

    def visible_rows(self, table: pa.Table) -> pa.Table:
        """The live rows of ``table`` (index rows and tombstones of any sessions, as files hold them) as every
        reader sees them: tombstones applied unless their session's fences ignore them, fenced rows hidden
        (rules 2 and 5 of :mod:`storage.visibility`). One GET of ``lease.json`` and one LIST and one GET of its
        kept copies per session with a row or a tombstone written under a lease, in parallel."""
        pairs = leased_sessions(table)
        rules = dict(zip(pairs, self.rows.index.map_io(self._rule, pairs), strict=True)) if pairs else {}
        ignored = sessions_fenced_mask(table, rules, ignored=True) if rules else None
        if ignored is not None and pc.any(ignored).as_py():
            table = table.filter(pc.invert(ignored))
        live = live_checkpoints(table)
        fenced = sessions_fenced_mask(live, rules) if rules else None
        return live if fenced is None or not pc.any(fenced).as_py() else live.filter(pc.invert(fenced))

    def pinned_row(self, snap: Snapshot, checkpoint_id: str, dependent: str) -> CheckpointRow | None:
        """The row of checkpoint ``checkpoint_id`` of ``snap``'s session that session ``dependent``'s pin holds:
        a fork point stays resolvable for its fork after the parent retired its row (rule 4 of
        :mod:`storage.visibility`); None when the pin does not name it or its object is gone. Its row is the
        index's (a tombstone is a copy of its row) or the object's own header."""
        row = snap.live.get(checkpoint_id)
        if row is not None:
            return row
        session_id, user_id = snap.session_id, snap.user_id
        key = layout.checkpoint_key(session_id, user_id, checkpoint_id)
        if key not in snap.present or checkpoint_id not in Pins(self.rows.objects).held_for(session_id, user_id,
                                                                                              dependent):
            return None
        row = snap.indexed.get(key) or self._tail_row(key, snap)
        return row if row is not None and row.checkpoint_id == checkpoint_id and not snap.rule.fenced(row) else None

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
