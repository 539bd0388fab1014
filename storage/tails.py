"""A session's checkpoints as readers see them: the index rows, plus the objects not indexed yet.

A checkpoint log indexes in batches, so a writer's newest checkpoints exist
as self-describing objects before any index file names them: its *tail*. A
reader lists the objects beside the index partition and admits as tail rows
those the visibility rule does (:func:`storage.visibility.tail_admitted`).
A snapshot costs: the index LIST with one LIST of ``checkpoints/``; the
unparsed index files with one GET of ``lease.json``; then, for a leased
session, one LIST and one GET of its kept lease copies, with one GET per
object without a row (parsed tails are cached) and the objects the caller
reads next; each round in parallel on a remote store. Every LIST precedes
the ``lease.json`` GET (:meth:`TailReader._look`).
"""

from __future__ import annotations

import functools
import logging
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from . import envelope, layout
from .chains import Pins
from .checkpoint_rows import CheckpointRows
from .envelope import row_of_header
from .fencing import CopyCache, kept_lease_body, lease_body, lease_copies, newest_body
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


#: Given a snapshot before its tail and kept lease copy are read: the keys of the objects its caller reads next.
Ahead = Callable[[Snapshot], Iterable[str]]


class TailReader:
    """Reads snapshots for a :class:`CheckpointRows` (parsed tails cached by key and size; objects are
    never rewritten in place)."""

    def __init__(self, rows: CheckpointRows) -> None:
        self.rows = rows
        self._lock = threading.Lock()
        self._cache: OrderedDict[tuple[str, int], CheckpointRow | None] = OrderedDict()
        self._verified: OrderedDict[tuple[str, str], None] = OrderedDict()
        self._copies: CopyCache = {}  # kept lease body copies read, by key (with their ETag)
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

    def snapshot(self, session_id: str, user_id: str | None, ahead: Ahead | None = None) -> Snapshot:
        """Index rows, the checkpoint objects and ``lease.json``, then the tail and the kept lease copy.

        The objects are listed with the index, and ``lease.json`` is read after
        both LISTs (with the index files, in parallel on a remote store): a row
        whose object is not listed was retired meanwhile, or is a writer's newest
        put after the objects' LIST (a writer puts in order: the reader lists
        again), and a row or tail object that landed after a takeover is judged
        by that takeover's fence and epoch. The kept copies are listed after ``lease.json`` was read, as the
        fence needs, and in one round with the tail's objects, the newest copy
        (read at the epoch ``lease.json`` names, kept only if the LIST shows
        that very object newest) and the objects ``ahead`` names.

        ``ahead``: given the snapshot as it stands before the tail and the kept
        copy are read, the keys of the objects the caller will read next
        (its "latest" and that one's chain); they land in :attr:`Snapshot.data`.
        Asked only when the session has no tail, whose newest would be "latest".
        """
        got = self._look(session_id, user_id)
        files: list[FileRows] = got["files"][0]
        objects, listed, indexed = self.rows.objects, got["present"], _keys(files)
        present = {o.key: o.size for o in listed}
        lease, kept = got["lease"], got["kept"]
        # lease.json may be gone, unreadable, rewritten by hand or restored from an older copy: the fences of
        # the copy the last swap kept hold all the same (storage.visibility, rule 2). lease.json gone yet a
        # leased writer may have written here: its copies too. A session written without a lease pays nothing.
        todo = [k for k in present if k not in indexed]
        copies = got["leased"] or (lease is None and kept is None and (any(r.epoch > 0 for r in indexed.values())
                                                                          or bool(todo)))
        snap = _snapshot(files, got["files"][1], present, lease, kept, indexed, session_id, user_id,
                         {o.key: o.etag for o in listed})
        guess = _copy_guess(lease, session_id, user_id) if copies else None
        if guess is not None and guess in self._copies:
            guess = None  # read before: the LIST's ETag says whether it still is that copy
        tasks: list[Callable[[], Any]] = []
        if copies:
            tasks.append(lambda: lease_copies(objects, session_id, user_id))
        if guess is not None:
            tasks.append(lambda: objects.get(key=guess))
        at = len(tasks)
        tasks += [functools.partial(self._tail_row, k, snap) for k in todo]
        # Asked only without a tail: then no row joins snap.rows after ahead worked out snap.live.
        wanted = [k for k in (ahead(snap) if ahead is not None and not todo else ()) if k not in snap.data]
        tasks += [functools.partial(self._read_ahead, k, snap.data) for k in wanted]
        done = self.rows.index.map_wide(lambda task: task(), tasks)
        if copies:
            if len(self._copies) > _TAIL_CACHE:
                self._copies.clear()
            fetched = {guess: done[1]} if guess is not None else None
            kept = newest_body(objects, done[0], self._copies, fetched)
            if Visibility.of(lease, kept) != snap.rule:
                snap = _snapshot(files, got["files"][1], present, lease, kept, indexed, session_id, user_id,
                                 snap.etags, snap.data)
            snap.kept = kept
        self._admit_tails(snap, done[at:at + len(todo)])
        return snap

    def _look(self, session_id: str, user_id: str | None) -> dict[str, Any]:
        """The index LIST with the checkpoint objects' LIST, then the index files and ``lease.json`` in one round
        (and the kept copies, for a session known to be leased): ``files``, ``present``, ``lease``, ``kept``,
        and ``leased`` (lease.json exists and its copies are still to be read).

        Every LIST comes before the ``lease.json`` GET: an object or row a
        fenced writer landed after a takeover's swap is then listed only with
        that swap's body (or a newer one) read, whose fence judges it.
        """
        objects = self.rows.objects
        prefix = layout.session_prefix(session_id, user_id) + "checkpoints/"
        lease_key = layout.lease_key(session_id, user_id)
        got: dict[str, Any] = {}
        known = (user_id, session_id) in self._leased  # its copies are listed in parallel with lease.json

        def list_objects() -> None:
            got["present"] = [o for o in objects.list(prefix=prefix) if o.key.endswith(".json")]

        def part(i: int, keys: list[str], vanished: list[str]) -> Any:
            if i == 0:
                return self.rows.file_rows(keys, vanished), self.rows.retired(keys)
            if i == 2:
                return self._kept(session_id, user_id)
            obj = objects.get(key=lease_key)
            if obj is not None and not known:
                if len(self._leased) > _TAIL_CACHE:
                    self._leased.clear()
                self._leased.add((user_id, session_id))
                got["leased"] = True  # a leased session: its kept copies too, listed once lease.json was read
            return lease_body(obj.data if obj is not None else None)

        def read(keys: list[str], vanished: list[str]) -> None:
            got["kept"], got["leased"] = None, False
            got["files"], got["lease"], *kept = self.rows.index.map_io(
                lambda i: part(i, keys, vanished), range(3 if known else 2))
            if kept:
                got["kept"] = kept[0]

        partition = layout.index_partition(layout.CHECKPOINT_INDEX, session_id, user_id)
        self.rows.index.read_listed(partition, read, alongside=list_objects)
        return got

    def _read_ahead(self, key: str, data: dict[str, bytes]) -> None:
        """Read the object at ``key`` into ``data`` (nothing when it is gone: its reader looks again)."""
        obj = self.rows.objects.get(key=key)
        if obj is not None:
            data[key] = obj.data

    def _admit_tails(self, snap: Snapshot, found: list[CheckpointRow | None]) -> None:
        """Add to ``snap`` the rows ``found`` in its unindexed objects that are its writer's tail (rule 3)."""
        epoch = snap.epoch
        current = epoch if epoch is not None else max((r.epoch for r in snap.rows.values()), default=0)
        tops = epoch_tops(snap.indexed.values(), snap.retired)
        for row in found:
            if row is None or row.session_id != snap.session_id or not tail_admitted(row, current, tops):
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


def _snapshot(files: list[FileRows], retired: Tops, present: dict[str, int], lease: dict[str, Any] | None,
              kept: dict[str, Any] | None, indexed: dict[str, CheckpointRow], session_id: str, user_id: str | None,
              etags: dict[str, str], data: dict[str, bytes] | None = None) -> Snapshot:
    """The snapshot of what was read, before its tail: the rule ``lease`` and ``kept`` set applied to ``files``."""
    rule = Visibility.of(lease, kept)
    return Snapshot(live_of(files, rule), {}, present, lease, indexed, data if data is not None else {},
                    session_id=session_id, user_id=user_id, retired=retired, tomb_top=rule.tomb_top(files),
                    kept=kept, etags=etags)


def _copy_guess(lease: dict[str, Any] | None, session_id: str, user_id: str | None) -> str | None:
    """The key of the copy the swap that wrote ``lease`` kept: the newest copy unless ``lease.json`` was rewritten
    or restored by hand since (None: ``lease`` names no epoch a swap writes)."""
    epoch = lease.get("epoch") if lease is not None else None
    return layout.lease_copy_key(session_id, user_id, epoch) if layout.is_epoch(epoch) and epoch > 0 else None


def _keys(files: list[FileRows]) -> dict[str, CheckpointRow]:
    return {row.key: row for rows in files for row, _ in rows}
