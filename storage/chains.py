"""Checkpoint chains: which objects a checkpoint needs, the pins forks hold, and collecting what nothing needs.

A chain entry is a checkpoint id of the same session, ``"{session_id}/{id}"``
in another session of the user (a fork shares its parent's chain), or a
range ``"{first}..{last}"`` of one writer's consecutive links (:func:`expand`).
An object is deleted only when nothing needs it: no live or unindexed row's
chain, no pin, no session head a running writer builds on; collection reads
the pins after the tombstones it relies on are written, and a fork pins
before it checks its fork point is live (docs/design.md "Checkpoints:
incremental objects in chains").
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING

from . import layout
from .errors import StorageError
from .ids import validate_id
from .objects import ObjectStore
from .rows import CheckpointRow

if TYPE_CHECKING:
    from .checkpoint_rows import CheckpointRows

log = logging.getLogger("storage")


#: A checkpoint id made for a chain: ``ckpt``, a 20-hex-digit segment (time-ordered, one per writer), then a
#: 6-hex-digit link number. Consecutive links of one segment are written as one range ``"{first}..{last}"``.
_SEGMENT = re.compile(r"^(ckpt[0-9a-f]{20})([0-9a-f]{6})$")


def ref_parts(ref: str, session_id: str) -> tuple[str, str]:
    """``(session_id, checkpoint_id)`` a single chain ref of session ``session_id`` names."""
    sid, sep, cid = ref.rpartition("/")
    return (validate_id(sid, "chain session_id") if sep else session_id), validate_id(cid, "chain checkpoint_id")


def ref_of(session_id: str, checkpoint_id: str, from_session_id: str) -> str:
    """The ref session ``from_session_id`` uses for checkpoint ``checkpoint_id`` of ``session_id``."""
    return checkpoint_id if session_id == from_session_id else f"{session_id}/{checkpoint_id}"


#: The most links a chain may name. A writer starts a new chain (a full snapshot) once its chain reaches
#: ``full_every`` links, which loomray's ``CheckpointConfig`` keeps at or below this; so a longer chain is one no
#: writer wrote (a hand-made header naming, say, a range of 16.7 million links) and is refused before anything
#: is expanded or fetched, in time and memory proportional to its entries.
MAX_LINKS = 4096


def expand(chain: Iterable[str], session_id: str) -> list[tuple[str, str]]:
    """The ``(session_id, checkpoint_id)`` of every link a chain names, oldest first: entries are single refs or
    ranges ``"[{session}/]{first}..{last}"`` of one segment's consecutive links (``ValueError`` if malformed, or
    if it names more than :data:`MAX_LINKS` links)."""
    parsed: list[tuple[str, tuple[str, str, int, int] | None]] = []
    total = 0
    for entry in chain:
        span = _span(entry, session_id)
        total += 1 if span is None else span[3] - span[2] + 1
        if total > MAX_LINKS:
            raise ValueError(f"a chain of more than {MAX_LINKS} links, more than any writer writes")
        parsed.append((entry, span))
    out: list[tuple[str, str]] = []
    for entry, span in parsed:
        if span is None:
            out.append(ref_parts(entry, session_id))
            continue
        sid, seg, lo, hi = span
        out.extend((sid, f"{seg}{n:06x}") for n in range(lo, hi + 1))
    return out


def _span(entry: str, session_id: str) -> tuple[str, str, int, int] | None:
    """``(session, segment, first, last)`` of a range entry; None for a single ref (``ValueError`` if malformed)."""
    first, dots, last = entry.partition("..")
    if not dots:
        return None
    sid, cid = ref_parts(first, session_id)
    a, b = _SEGMENT.match(cid), _SEGMENT.match(last)
    if a is None or b is None or a.group(1) != b.group(1) or int(a.group(2), 16) > int(b.group(2), 16):
        raise ValueError(f"malformed chain range {entry!r:.300}")
    lo, hi = int(a.group(2), 16), int(b.group(2), 16)
    if hi - lo >= MAX_LINKS:
        raise ValueError(f"chain range {entry!r:.300} names {hi - lo + 1} links, more than any writer writes "
                         f"({MAX_LINKS})")
    return sid, a.group(1), lo, hi


def compress(refs: Iterable[str]) -> tuple[str, ...]:
    """Single refs (oldest first) as chain entries: runs of consecutive links of one segment become ranges."""
    out: list[str] = []
    run: list[str] = []

    def close() -> None:
        if len(run) > 2:
            out.append(f"{run[0]}..{run[-1].rpartition('/')[2]}")
        else:
            out.extend(run)
        run.clear()

    for ref in refs:
        if run and _follows(run[-1], ref):
            run.append(ref)
            continue
        close()
        run.append(ref)
    close()
    return tuple(out)


def extend(entries: tuple[str, ...], ref: str) -> tuple[str, ...]:
    """``compress((*expanded entries, ref))`` in O(1): ``entries`` are already compressed."""
    if entries:
        first, dots, last = entries[-1].partition("..")
        if dots:
            sid, _, _ = first.rpartition("/")
            if _follows(f"{sid}/{last}" if sid else last, ref):
                return (*entries[:-1], f"{first}..{ref.rpartition('/')[2]}")
        elif len(entries) >= 2 and ".." not in entries[-2] and _follows(entries[-2], entries[-1]) \
                and _follows(entries[-1], ref):
            return (*entries[:-2], f"{entries[-2]}..{ref.rpartition('/')[2]}")
    return (*entries, ref)


def _follows(prev: str, ref: str) -> bool:
    """True when ``ref`` is the link right after ``prev`` in the same segment of the same session."""
    ps, _, pc = prev.rpartition("/")
    rs, _, rc = ref.rpartition("/")
    a, b = _SEGMENT.match(pc), _SEGMENT.match(rc)
    return (ps == rs and a is not None and b is not None and a.group(1) == b.group(1)
            and int(b.group(2), 16) == int(a.group(2), 16) + 1)


class LinkSet:
    """Checkpoints of chains: spans of link numbers per (session, segment), and single ids.

    Chains of a session's rows share most of their links, and a range stands
    for hundreds of them: a LinkSet answers "is it needed?" and "what is left
    once the needed ones are taken away?" in time proportional to the ranges,
    not the links.
    """

    def __init__(self) -> None:
        self.singles: set[tuple[str, str]] = set()
        self.spans: dict[tuple[str, str], list[tuple[int, int]]] = {}

    def add(self, session_id: str, checkpoint_id: str) -> None:
        m = _SEGMENT.match(checkpoint_id)
        if m is None:
            self.singles.add((session_id, checkpoint_id))
        else:
            n = int(m.group(2), 16)
            self.spans.setdefault((session_id, m.group(1)), []).append((n, n))

    def add_row(self, row: CheckpointRow) -> None:
        """``row`` and the links its chain names."""
        self.add(row.session_id, row.checkpoint_id)
        for entry in row.chain:
            span = _span(entry, row.session_id)
            if span is None:
                self.add(*ref_parts(entry, row.session_id))
            else:
                sid, seg, lo, hi = span
                self.spans.setdefault((sid, seg), []).append((lo, hi))

    def covers(self, session_id: str, checkpoint_id: str) -> bool:
        m = _SEGMENT.match(checkpoint_id)
        if m is None:
            return (session_id, checkpoint_id) in self.singles
        n = int(m.group(2), 16)
        return any(lo <= n <= hi for lo, hi in self.spans.get((session_id, m.group(1)), ()))

    def minus(self, other: LinkSet) -> Iterator[tuple[str, str]]:
        """The links of this set that ``other`` does not cover, one by one."""
        for sid, cid in self.singles:
            if not other.covers(sid, cid):
                yield sid, cid
        for (sid, seg), spans in self.spans.items():
            taken = sorted(other.spans.get((sid, seg), ()))
            for n in sorted({n for lo, hi in spans for n in _uncovered(lo, hi, taken)}):
                yield sid, f"{seg}{n:06x}"


def _uncovered(lo: int, hi: int, taken: list[tuple[int, int]]) -> Iterator[int]:
    """Numbers in [lo, hi] outside the sorted spans ``taken``."""
    n = lo
    for a, b in taken:
        if b < n:
            continue
        if a > hi:
            break
        yield from range(n, min(a, hi + 1))
        n = max(n, b + 1)
        if n > hi:
            return
    yield from range(n, hi + 1)


def links_of(rows: Iterable[CheckpointRow]) -> LinkSet:
    """``rows`` and the links their chains name."""
    out = LinkSet()
    for row in rows:
        out.add_row(row)
    return out


def unneeded_keys(retired: Iterable[CheckpointRow], kept: Iterable[CheckpointRow], session_id: str,
                  user_id: str | None, extra: Iterable[str] = ()) -> set[str]:
    """Keys of this session's objects that ``retired`` rows (themselves and their chains) and ``extra`` (keys of
    this session's checkpoint objects) name, which none of ``kept`` needs."""
    needed = links_of(kept)
    candidates = links_of(retired)
    prefix = layout.session_prefix(session_id, user_id) + "checkpoints/"
    for key in extra:
        if key.startswith(prefix) and key.endswith(".json"):
            candidates.add(session_id, key[len(prefix):-5])
    # Ids of ranges are ours (a segment and a link number): only single ids need the full validation.
    return {prefix + cid + ".json" if _SEGMENT.match(cid) else layout.checkpoint_key(sid, user_id, cid)
            for sid, cid in candidates.minus(needed) if sid == session_id}


def chain_keys(rows: Iterable[CheckpointRow], session_id: str) -> set[str]:
    """Keys of this session's objects named by the chains of ``rows`` (not the rows' own objects)."""
    out: set[str] = set()
    for row in rows:
        for sid, cid in expand(row.chain, row.session_id):
            if sid == session_id:
                out.add(layout.checkpoint_key(sid, row.user_id, cid))
    return out


def needed_keys(rows: Iterable[CheckpointRow], session_id: str) -> set[str]:
    """Keys of this session's objects that ``rows`` (of this session) need: their own and their chains'."""
    rows = list(rows)
    return {r.key for r in rows} | chain_keys(rows, session_id)


def foreign_refs(rows: Iterable[CheckpointRow]) -> dict[str, set[str]]:
    """Per other session, the checkpoint ids of it that the chains of ``rows`` name."""
    out: dict[str, set[str]] = {}
    for row in rows:
        if not any("/" in e for e in row.chain):
            continue
        for sid, cid in expand(row.chain, row.session_id):
            if sid != row.session_id:
                out.setdefault(sid, set()).add(cid)
    return out


class Pins:
    """The pins of a user's sessions on each other's objects (one JSON object per dependent session)."""

    def __init__(self, objects: ObjectStore) -> None:
        self.objects = objects

    def write(self, session_id: str, user_id: str | None, dependent: str, checkpoint_ids: Iterable[str]) -> None:
        """Pin ``checkpoint_ids`` of ``session_id`` for session ``dependent`` (replaces its earlier pin)."""
        ids = sorted({validate_id(c, "checkpoint_id") for c in checkpoint_ids})
        body = {"type": "pin", "v": 1, "session_id": session_id, "user_id": user_id, "dependent": dependent,
                "checkpoints": ids}
        self.objects.put(key=layout.pin_key(session_id, user_id, dependent), data=json.dumps(body).encode())

    def pinned(self, session_id: str, user_id: str | None, *, but_writer: bool = False) -> set[str] | None:
        """Keys of the session's objects that pins hold (other sessions', and its own writer's unless
        ``but_writer``: it is being dropped); None when a pin could not be read (then nothing may be collected:
        an unreadable pin protects everything)."""
        out: set[str] = set()
        writer = layout.pin_key(session_id, user_id, session_id)
        for info in self.objects.list(prefix=layout.pin_prefix(session_id, user_id)):
            if but_writer and info.key == writer:
                continue
            obj = self.objects.get(key=info.key)
            if obj is None:
                continue  # released meanwhile
            try:
                ids = json.loads(obj.data).get("checkpoints")
                if not isinstance(ids, list) or len(ids) > MAX_LINKS + 1:  # a pin names a chain and its fork point
                    raise ValueError(f"a pin's checkpoints must be a list of at most {MAX_LINKS + 1} ids")
                out.update(layout.checkpoint_key(session_id, user_id, c) for c in ids)
            except (ValueError, TypeError, AttributeError, RecursionError, StorageError):
                log.warning("unreadable pin %s: nothing of the session is collected", self.objects.describe(info.key))
                return None
        return out

    def write_writer(self, session_id: str, user_id: str | None, heads: Iterable[CheckpointRow]) -> None:
        """Pin what ``heads`` are read from for the session's own running writer (a prune retires them and
        deletes the run's records): their objects here, and in ``sessions`` the links of others they name."""
        heads = list(heads)
        own: set[str] = set()
        for row in heads:
            own.add(row.checkpoint_id)
            own.update(cid for sid, cid in expand(row.chain, session_id) if sid == session_id)
        body = {"type": "pin", "v": 1, "session_id": session_id, "user_id": user_id, "dependent": session_id,
                "checkpoints": sorted(own), "sessions": {o: sorted(ids) for o, ids in foreign_refs(heads).items()}}
        self.objects.put(key=layout.pin_key(session_id, user_id, session_id), data=json.dumps(body).encode())

    def writer_refs(self, session_id: str, user_id: str | None) -> dict[str, set[str]] | None:
        """Per other session, the checkpoint ids the chains of the session's writer pin name there (empty: no
        writer pin; None: unreadable, so everything it may name must stay)."""
        obj = self.objects.get(key=layout.pin_key(session_id, user_id, session_id))
        if obj is None:
            return {}
        try:
            named = json.loads(obj.data).get("sessions", {})
            return {validate_id(s, "session_id"): {validate_id(c, "checkpoint_id") for c in ids}
                    for s, ids in named.items()}
        except (ValueError, TypeError, AttributeError, RecursionError, StorageError):
            return None

    def held_for(self, session_id: str, user_id: str | None, dependent: str) -> set[str]:
        """The checkpoint ids of ``session_id`` that ``dependent``'s pin holds (empty: no pin, or unreadable)."""
        obj = self.objects.get(key=layout.pin_key(session_id, user_id, dependent))
        try:
            ids = json.loads(obj.data).get("checkpoints") if obj is not None else None
        except (ValueError, AttributeError):
            ids = None
        return {c for c in ids if isinstance(c, str)} if isinstance(ids, list) else set()

    def release(self, session_id: str, user_id: str | None, dependent: str) -> None:
        """Drop ``dependent``'s pin on ``session_id``."""
        self.objects.delete(keys=[layout.pin_key(session_id, user_id, dependent)])


def collect(rows: CheckpointRows, session_id: str, user_id: str | None, retired: Iterable[CheckpointRow], *,
            extra: Iterable[str] = (), also_needed: Iterable[CheckpointRow] = (),
            live: dict[str, CheckpointRow] | None = None) -> list[str]:
    """Delete the objects of this session that ``retired`` rows (themselves and their chains) and ``extra`` keys
    name, if nothing needs them; the keys deleted.

    Needed: live rows' objects and chains (``live``, else a fresh LIST), those
    of ``also_needed`` (a writer's rows not indexed yet), and pinned objects.
    Call it after the tombstones of ``retired`` were written.
    """
    retired = list(retired)
    extra = list(extra)
    if not retired and not extra:
        return []
    if live is None:
        live = rows.live(session_id, user_id)
    doomed = unneeded_keys(retired, [*live.values(), *also_needed], session_id, user_id, extra)
    if doomed:
        pinned = Pins(rows.objects).pinned(session_id, user_id)
        doomed = set() if pinned is None else doomed - pinned
    if doomed:
        rows.objects.delete(keys=sorted(doomed))
    return sorted(doomed)


def release_pins(rows: CheckpointRows, session_id: str, user_id: str | None,
                 remaining: Iterable[CheckpointRow], released: Iterable[CheckpointRow]) -> None:
    """Drop this session's pins on sessions that none of ``remaining`` (its live and unindexed rows) builds on
    any more, which ``released`` (rows just retired) did; then collect what the pins alone kept there.

    A running writer builds on its head even when prune or delete retired it: the rows a writer may build on
    (:attr:`CheckpointRows.writer_rows`) and its writer pin count here, and in the session collected.
    """
    kept = set(foreign_refs(remaining))
    _release(rows, session_id, user_id, {o: ids for o, ids in foreign_refs(released).items() if o not in kept})


def drop_writer_pin(rows: CheckpointRows, session_id: str, user_id: str | None) -> None:
    """Drop the session's writer pin (its run finished), then its pins on others only that pin still needed."""
    pins = Pins(rows.objects)
    reached = pins.writer_refs(session_id, user_id)
    if reached is None:
        log.warning("unreadable writer pin of session %r: kept, with what it holds", session_id)
        return
    pins.release(session_id, user_id, session_id)
    kept = set(foreign_refs(rows.live(session_id, user_id).values()))
    _release(rows, session_id, user_id, {o: ids for o, ids in reached.items() if o not in kept})


def _release(rows: CheckpointRows, session_id: str, user_id: str | None, gone: dict[str, set[str]]) -> None:
    """Release this session's pins on ``gone`` (session -> ids held) its writer and writer pin do not reach."""
    if not gone:
        return
    pins = Pins(rows.objects)
    try:
        held = pins.writer_refs(session_id, user_id)
        if held is None:
            raise StorageError(f"unreadable writer pin of session {session_id!r}")
        kept = {*foreign_refs(rows.writer_rows(session_id, user_id)), *held}
    except StorageError as e:
        log.warning("pins of session %r not released yet (%s); the next retention or prune retries", session_id, e)
        return
    for other, ids in gone.items():
        if other in kept:
            continue
        try:
            pins.release(other, user_id, session_id)
            collect(rows, other, user_id, (), extra=[layout.checkpoint_key(other, user_id, c) for c in ids],
                    also_needed=rows.writer_rows(other, user_id))
        except StorageError as e:
            log.warning("pin of session %r on %r not released yet (%s); the next retention or prune retries",
                        session_id, other, e)
