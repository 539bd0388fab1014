"""The compacted table's write phase: one user's partitions and manifest brought up to date (see
:mod:`storage.table` for the protocol and why it is safe with concurrent compactions)."""

from __future__ import annotations

import functools
import logging
import os
import socket
from collections.abc import Callable
from dataclasses import dataclass, replace
from datetime import datetime
from typing import TYPE_CHECKING

import pyarrow as pa
import pyarrow.compute as pc

from . import layout
from .errors import PreconditionFailed, StorageError
from .table import (
    INTENT_TTL,
    TABLE_SCHEMA,
    Manifest,
    SessionState,
    UserTable,
    days_in,
    days_of,
    decode_partition,
    encode_partition,
    sort_rows,
    table_clock,
)

if TYPE_CHECKING:
    from .store import Store

log = logging.getLogger("storage.table")


class _Conflict(Exception):
    """A partition changed under the write phase (another compactor): give the write phase up."""


@dataclass
class SessionRead:
    """One session as a compaction read it: live rows, the per-session file names holding them after the
    compaction's own merge, whether those still carry tombstones, and whether its files differed from the
    manifest's record (its rows may differ from the table's)."""

    rows: pa.Table
    files: tuple[str, ...]
    tombs: bool
    changed: bool
    #: Days on which its rows may differ from the table's (None: any day it has rows on, before or now).
    days_changed: frozenset[str] | None = None
    #: A delta: ``rows`` are only the live rows of files the table has not absorbed, and these are every checkpoint
    #: id those files name (their rows in the table are replaced by ``rows``). None: ``rows`` are all its rows.
    touched: pa.Array | None = None
    #: Its live rows in all (when ``rows`` is a delta).
    count: int | None = None
    #: Checkpoint ids its files' tombstones retire (see :attr:`SessionState.dead`).
    dead: tuple[str, ...] = ()

    @functools.cached_property
    def days(self) -> set[str]:
        """The days ``rows`` are on (asked twice by a write phase)."""
        return days_in(self.rows)


@dataclass
class Published:
    """What one user's write phase did."""

    outcome: str  # "clean" (nothing to do), "committed", "busy", "conflict", "late", "incomplete"
    partitions: int = 0
    rows: int = 0


@dataclass(frozen=True)
class _Changes:
    """What a write phase changes: sessions whose rows changed (``delta``: those of them given as a delta),
    sessions no longer listed, sessions whose files changed but not their rows, and the days to rewrite."""

    changed: set[str]
    gone: set[str]
    renamed: set[str]
    delta: set[str]
    days: set[str]


def _plan(ut: UserTable, base: Manifest, listed: dict[str, tuple[str, ...]], reads: dict[str, SessionRead],
          rebuild: bool, deadline: Callable[[], bool]) -> _Changes | Published:
    """What to rewrite, or why nothing is written ("incomplete", "clean", "late")."""
    if rebuild:
        if set(listed) - set(reads):
            return Published("incomplete")
        changed = set(listed)
    else:
        changed = {s for s, r in reads.items() if r.changed}
    gone = set(base.sessions) - set(listed)
    renamed = {s for s, r in reads.items() if s not in changed and base.sessions.get(s, None) is not None
               and base.sessions[s].files != r.files}
    if not (rebuild or changed or gone or renamed):
        return Published("clean")
    if deadline():
        return Published("late")
    delta = {s for s in changed if reads[s].touched is not None and s in base.sessions and not rebuild}
    if rebuild and any(reads[s].touched is not None for s in changed):
        return Published("incomplete")  # a rebuild needs every session's rows (the planner never sends deltas)
    affected: set[str] = set()
    for s in changed:
        r = reads[s]
        if s in delta and r.days_changed is None:
            return Published("incomplete")
        if r.days_changed is not None and s in base.sessions and not rebuild:
            affected |= r.days_changed  # its rows on other days are in the partitions as they are now
        else:
            affected |= r.days
            if s in base.sessions:
                affected.update(base.sessions[s].days)
    for s in gone:
        affected.update(base.sessions[s].days)
    if rebuild:
        affected |= set(base.partitions) | set(ut.parts)
    return _Changes(changed, gone, renamed, delta, affected)


def _rows_by_day(changes: _Changes, reads: dict[str, SessionRead]) -> dict[str, pa.Table]:
    """The changed sessions' rows, sorted, split by UTC day."""
    pieces = [reads[s].rows for s in sorted(changes.changed) if reads[s].rows.num_rows]
    if not pieces:
        return {}
    fresh = pa.concat_tables(pieces)
    # One sort by time orders the rows within each partition too (a day is a range of created_at).
    fresh = fresh.take(pc.sort_indices(fresh, sort_keys=[("created_at", "ascending"), ("session_id", "ascending"),
                                                          ("checkpoint_id", "ascending")]))
    days = days_of(fresh)
    # Where the day changes: the rows of a day are one run (a missing created_at sorts last, as 1970-01-01).
    starts = [0, *pc.add(pc.indices_nonzero(pc.not_equal(days[1:], days[:-1])), 1).to_pylist(), len(days)]
    by_day: dict[str, pa.Table] = {}
    for a, b in zip(starts, starts[1:], strict=False):
        day = days[a].as_py()
        run = fresh.slice(a, b - a)
        by_day[day] = sort_rows(pa.concat_tables([by_day[day], run])) if day in by_day else run
    return by_day


class _Partitions:
    """The partition writes of one write phase (generation ``generation``, intent ``token``)."""

    def __init__(self, store: Store, ut: UserTable, base: Manifest, reads: dict[str, SessionRead],
                 changes: _Changes, *, rebuild: bool, deadline: Callable[[], bool]) -> None:
        self.store, self.ut, self.base, self.rebuild, self.deadline = store, ut, base, rebuild, deadline
        self.by_day = _rows_by_day(changes, reads)
        self.drop = pa.array(sorted((changes.changed - changes.delta) | changes.gone), pa.string())
        # A delta session's rows are replaced one checkpoint id at a time: "session \x1f checkpoint" keys.
        self.drop_ids = pa.array(sorted({f"{s}\x1f{c}" for s in changes.delta
                                         if (touched := reads[s].touched) is not None for c in touched.to_pylist()}),
                                 pa.string())
        self.generation = base.generation + 1
        self.token = os.urandom(8).hex()

    def take_intent(self) -> str | None:
        """CAS the manifest to record this write phase's intent; its new ETag, or None when another compaction
        committed or started writing since the manifest was read."""
        now = table_clock()
        intent = {"token": self.token, "owner": f"{socket.gethostname()}:{os.getpid()}",
                  "started_at": now.isoformat(), "expires_at": (now + INTENT_TTL).isoformat()}
        mkey = layout.table_manifest_key(self.ut.user_id)
        data = replace(self.base, intent=intent).encode()
        try:
            if self.ut.manifest_etag is None:
                return self.store.objects.put(key=mkey, data=data, if_none_match=True)
            return self.store.objects.put(key=mkey, data=data, if_match=self.ut.manifest_etag)
        except PreconditionFailed:
            log.info("table of user %r: another compaction committed or is writing; skipped", self.ut.segment)
            return None

    def _kept(self, key: str, day: str) -> tuple[pa.Table, str | None]:
        """The rows of the day's partition file that stay, and the ETag its PUT expects (None: create)."""
        rec = self.base.partitions.get(day)
        if rec is None:
            if day in self.ut.parts:
                raise _Conflict(f"{self.store.describe(key)}: a partition file the manifest does not record")
            return TABLE_SCHEMA.empty_table(), None
        obj = self.store.objects.get(key=key)
        if obj is None or obj.etag != rec["etag"]:
            raise _Conflict(f"{self.store.describe(key)}: rewritten since the manifest recorded it")
        kept = decode_partition(obj.data)
        gone_rows = pc.is_in(kept["session_id"], value_set=self.drop)
        if len(self.drop_ids):
            pair = pc.binary_join_element_wise(kept["session_id"], kept["checkpoint_id"], "\x1f")
            gone_rows = pc.or_(gone_rows, pc.is_in(pair, value_set=self.drop_ids))
        return kept.filter(pc.invert(pc.fill_null(gone_rows, False))), rec["etag"]

    def write(self, day: str) -> tuple[str, str, int]:
        """Rewrite one day's partition (CAS on the ETag expected); ``(day, new ETag, rows)``."""
        key = layout.table_partition_key(self.ut.user_id, day)
        if self.deadline():
            raise _Conflict(f"{self.store.describe(key)}: past the compaction's lag limit")
        if self.rebuild:
            rows, expected = self.by_day.get(day, TABLE_SCHEMA.empty_table()), self.ut.parts.get(day)
        else:
            kept, expected = self._kept(key, day)
            new = self.by_day.get(day)
            rows = sort_rows(pa.concat_tables([kept, new])) if new is not None and new.num_rows else kept
        data = encode_partition(rows, self.generation, self.token)
        if expected is None:
            etag = self.store.objects.put(key=key, data=data, if_none_match=True)
        else:
            etag = self.store.objects.put(key=key, data=data, if_match=expected)
        self.store.table_cache[key] = (etag, rows)
        return day, etag, rows.num_rows


def _sessions_after(base: Manifest, reads: dict[str, SessionRead], changes: _Changes) -> dict[str, SessionState]:
    """The manifest's session records once the write phase's partitions are written."""
    sessions = {s: st for s, st in base.sessions.items() if s not in changes.gone}
    for s, r in reads.items():
        count = r.count if r.count is not None else r.rows.num_rows
        if s in changes.delta:
            days = sorted(set(sessions[s].days) | r.days)
            sessions[s] = SessionState(tuple(sorted(r.files)), tuple(days), r.tombs, count, r.dead)
        elif s in changes.changed or s not in sessions:
            days = sorted(r.days)
            sessions[s] = SessionState(tuple(sorted(r.files)), tuple(days), r.tombs, count, r.dead)
        elif s in changes.renamed:
            sessions[s] = SessionState(tuple(sorted(r.files)), sessions[s].days, r.tombs, count, r.dead)
        elif sessions[s].tombs != r.tombs or sessions[s].dead != r.dead:
            sessions[s] = replace(sessions[s], tombs=r.tombs, dead=r.dead)
    return sessions


def publish(store: Store, ut: UserTable, listed: dict[str, tuple[str, ...]], reads: dict[str, SessionRead], *,
            rebuild: bool, listed_wall: datetime, deadline: Callable[[], bool]) -> Published:
    """Bring one user's partitions and manifest up to date with ``reads`` (see the module docstring).

    ``listed``: every session of the user in the compaction's LIST, with its file names then. ``reads``: the
    sessions read. ``rebuild``: rewrite every partition from ``reads`` (which must then cover ``listed``).
    ``deadline()`` true: the reads are too old to publish (the compaction's lag limit); nothing more is written.
    """
    base = ut.manifest or Manifest(ut.user_id)
    reads = _visible(store, reads)
    changes = _plan(ut, base, listed, reads, rebuild, deadline)
    if isinstance(changes, Published):
        return changes
    parts = _Partitions(store, ut, base, reads, changes, rebuild=rebuild, deadline=deadline)
    # Write phase: the intent CAS fails if anyone committed (or started writing) since the manifest was read.
    held = parts.take_intent()
    if held is None:
        return Published("busy")
    mkey = layout.table_manifest_key(ut.user_id)
    try:
        results = store._index.map_io(parts.write, sorted(changes.days))
    except (_Conflict, PreconditionFailed) as e:
        log.warning("table of user %r: write phase given up (%s); the next compaction rebuilds it", ut.segment, e)
        _release(store, mkey, base, held)
        return Published("conflict")
    except BaseException:
        _release(store, mkey, base, held)
        raise
    partitions = {**base.partitions, **{day: {"etag": etag, "rows": n} for day, etag, n in results}}
    final = Manifest(ut.user_id, parts.generation, listed_wall, table_clock(), partitions,
                     _sessions_after(base, reads, changes), None)
    try:
        etag = store.objects.put(key=mkey, data=final.encode(), if_match=held)
    except PreconditionFailed:
        log.warning("table of user %r: another compaction took the write phase over; not committed", ut.segment)
        return Published("conflict")
    store.table_cache[mkey] = (etag, final)
    return Published("committed", len(results), sum(n for _, _, n in results))


def _visible(store: Store, reads: dict[str, SessionRead]) -> dict[str, SessionRead]:
    """``reads`` without the rows a fenced writer landed after a takeover (:mod:`storage.visibility`): the
    table holds what every reader sees. One mask over the changed sessions' rows at once."""
    changed = [s for s, r in reads.items() if r.changed and r.rows.num_rows]
    if not changed:
        return reads
    mask = store._tails.fenced_mask(pa.concat_tables([reads[s].rows for s in changed]))
    if mask is None:
        return reads
    out, at = dict(reads), 0
    for s in changed:
        rows = reads[s].rows
        hidden = mask.slice(at, rows.num_rows)
        at += rows.num_rows
        if pc.any(hidden).as_py():
            out[s] = replace(reads[s], rows=rows.filter(pc.invert(hidden)))
    return out


def _release(store: Store, key: str, base: Manifest, held: str) -> None:
    """Give the write phase up: the manifest as it was (best effort; an expired intent is taken over anyway)."""
    try:
        store.objects.put(key=key, data=base.encode(), if_match=held)
    except (PreconditionFailed, StorageError) as e:
        log.info("table manifest %s not released (%s); its intent expires in %s", store.describe(key), e, INTENT_TTL)
