"""Checkpoint fences: what a lease takeover records of the checkpoint index, and the rows it retires.

A checkpoint log never indexes a fenced row, but its objects may land after
a takeover's listing, and buckets may still hold fenced rows from the
removed one-at-a-time write path. So every takeover lists the session's live
rows right before its swap and records a fence in the new ``lease.json``
(``"checkpoints"``: the highest row it listed and up to ``_CHECKPOINT_FENCES``
earlier owners' fences); right after its swap it retires the older-epoch rows
it did not list. Readers apply the fences through :mod:`storage.visibility`.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from typing import Any

from . import envelope, layout
from .checkpoint_rows import CheckpointRows
from .errors import StorageError
from .objects import ObjectStore, StoredObject
from .rows import CheckpointRow, Lease
from .visibility import Visibility, fenced_by, parse_fences

log = logging.getLogger("storage")
#: Earlier owners' checkpoint fences a lease body carries.
_CHECKPOINT_FENCES = 8


def lease_body(data: bytes | None) -> dict[str, Any] | None:
    """A lease object's JSON body as a dict, or None (missing or unreadable)."""
    if not data:
        return None
    try:
        body = json.loads(data)
    except (ValueError, RecursionError):  # RecursionError: JSON nested deeper than the parser recurses
        return None
    return body if isinstance(body, dict) else None


#: A kept copy of a lease body as a LIST shows it: ``(epoch, key, ETag)``.
Copy = tuple[int, str, str]
#: Kept copies already read: key -> (ETag, body). A copy is written once, so its body is read once.
CopyCache = dict[str, tuple[str, dict[str, Any]]]


def lease_copies(objects: ObjectStore, session_id: str, user_id: str | None, below: int | None = None) -> list[Copy]:
    """The kept copies of the session's lease bodies (``leases/{epoch}.json``; only epochs below ``below`` when
    given), newest first: one LIST."""
    prefix = layout.lease_copy_prefix(session_id, user_id)
    listed = []
    for info in objects.list(prefix=prefix):
        name = info.key[len(prefix):-5]
        if (info.key.endswith(".json") and len(name) == 20 and name.isascii() and name.isdigit()
                and (below is None or int(name) < below)):  # the key lease_copy_key names: no foreign object
            listed.append((int(name), info.key, info.etag))
    return sorted(listed, reverse=True)


def newest_body(objects: ObjectStore, copies: list[Copy], cache: CopyCache | None = None,
                fetched: dict[str, StoredObject | None] | None = None) -> dict[str, Any] | None:
    """The body of the newest readable copy among ``copies`` (newest first; up to 3 tried), or None.

    ``cache``: bodies already read; ``fetched``: objects read alongside the
    LIST, each used only if its ETag is the one listed (the very object the
    LIST showed); any other copy is read now.
    """
    for _, key, etag in copies[:3]:
        if cache is not None and key in cache and cache[key][0] == etag:
            return cache[key][1]
        obj = (fetched or {}).get(key)
        if obj is None or obj.etag != etag:
            obj = objects.get(key=key)
        body = lease_body(obj.data if obj is not None else None)
        if body is not None and type(body.get("epoch")) is int:
            if cache is not None and obj is not None:
                cache[key] = (obj.etag, body)
            return body
    return None


def kept_lease_body(objects: ObjectStore, session_id: str, user_id: str | None, below: int | None = None,
                    cache: CopyCache | None = None) -> dict[str, Any] | None:
    """The newest readable copy of a ``lease.json`` body a swap kept (``leases/{epoch}.json``; only epochs
    below ``below`` when given), or None when there is none.

    A fence lives as long as its copy, so deleting or rewriting ``lease.json``
    shows no fenced row again. One LIST and a GET of the newest copy (up to 3
    if unreadable); ``cache``: copies already read.
    """
    return newest_body(objects, lease_copies(objects, session_id, user_id, below), cache)


def _chain_of(body: dict[str, Any] | None) -> list[dict[str, Any]]:
    """The checkpoint fences a lease body records, its own first, as a takeover carries them on."""
    fence = body.get("checkpoints") if body is not None else None
    if body is None or not isinstance(fence, dict) or type(body.get("epoch")) is not int:
        return []
    prev = fence.get("prev")
    return [{"epoch": body["epoch"], **{k: v for k, v in fence.items() if k in ("top", "tombs")}},
            *(c for c in (prev if isinstance(prev, list) else []) if isinstance(c, dict))]


class CheckpointFences:
    """The checkpoint side of a lease takeover (see the module docstring)."""

    def __init__(self, objects: ObjectStore, rows: CheckpointRows, snapshot: Callable[[str, str | None], Any]) -> None:
        self.objects = objects
        self.rows = rows
        #: ``TailReader.snapshot``: the session's live rows with the tail its last writer has not indexed.
        self.snapshot = snapshot

    def view(self, session_id: str, user_id: str | None, previous: dict[str, Any] | None,
             kept: dict[str, Any] | None = None) -> tuple[set[str], dict[str, Any]]:
        """What an acquire lists right before its swap: the live checkpoint ids (what :meth:`retire_fenced`
        spares) and the fence the swap records under ``"checkpoints"``.

        The fence: ``top``, the highest live ``[epoch, checkpoint_id]`` no earlier
        fence covers; ``tombs``, the highest honoured leased tombstone listed;
        ``prev``, up to ``_CHECKPOINT_FENCES`` earlier fences from ``previous``
        (the body being replaced) and ``kept`` (the newest kept copy: a body
        rewritten by hand drops no fence), newest epoch first.
        """
        both = [*_chain_of(previous), *_chain_of(kept)]
        unique = {json.dumps(c, sort_keys=True): c for c in both}.values()
        chain = sorted(unique, key=lambda c: c["epoch"] if type(c.get("epoch")) is int else -1,
                       reverse=True)[:_CHECKPOINT_FENCES]
        snap = self.snapshot(session_id, user_id)
        self._adopt(session_id, user_id, list(snap.tails.values()))
        live = snap.rows
        earlier = fenced_by(parse_fences(chain))  # a fenced writer's row not retired yet sets no top
        top = max((r.order for r in live.values() if not earlier(r)), default=None)
        tombs = snap.tomb_top  # the leased tombstones listed: one landing later is a fenced writer's (visibility)
        return set(live), {"top": list(top) if top is not None else None,
                           "tombs": list(tombs) if tombs is not None else None, "prev": chain}

    def _adopt(self, session_id: str, user_id: str | None, tails: list[CheckpointRow]) -> None:
        """Index the checkpoints the old owner wrote but had not indexed yet (its tail), before the swap that
        ends its epoch: from then on only rows of the current epoch may be missing from the index. Harmless if
        the swap is lost, or the old owner indexes them too (a repeated row is the same row)."""
        if tails:
            log.info("session %r: indexing %d checkpoint(s) its previous owner had not indexed yet",
                     session_id, len(tails))
            self.rows.write(session_id, user_id, sorted(tails, key=lambda r: r.order), tombstone=False)

    def retire_fenced(self, lease: Lease, seen: set[str], fence: dict[str, Any]) -> Lease:
        """Right after ``lease`` was taken: retire the checkpoint rows fenced writers landed; returns ``lease``.

        Retired: every live row of an older epoch this owner did not list before
        its swap, and every row an earlier owner's carried fence hides (a new
        owner that died before this step is covered by the next). Rows of epoch
        0 are fenced by nothing. A row landing after this LIST is retired by the
        next takeover; until then any row of this owner outranks it.
        """
        earlier = fenced_by(parse_fences(fence.get("prev")))
        rule = Visibility.of({"epoch": lease.epoch, "checkpoints": fence})

        def fenced(r: CheckpointRow) -> bool:
            return 0 < r.epoch < lease.epoch and (r.checkpoint_id not in seen or earlier(r))

        try:
            doomed = [r for r in self.rows.live(lease.session_id, lease.user_id, rule).values() if fenced(r)]
            doomed += self._late_tails(lease, seen)
            if doomed:
                log.warning("session %r: retiring %d checkpoint(s) written by a fenced writer after epoch %d was "
                            "taken: %s", lease.session_id, len(doomed), lease.epoch,
                            ", ".join(sorted(r.checkpoint_id for r in doomed)))
                self.rows.retire(lease.session_id, lease.user_id, doomed)
        except StorageError as e:
            # The lease is taken and readers skip such rows already (the fence the swap recorded, see
            # storage.visibility): the next takeover retires them. Raising would leave the new owner not knowing it
            # holds the lease.
            log.warning("session %r: checkpoints a fenced writer may have written before epoch %d was taken are "
                        "not retired yet (%s)", lease.session_id, lease.epoch, e)
        return lease

    def _late_tails(self, lease: Lease, seen: set[str]) -> list[CheckpointRow]:
        """Checkpoints an older epoch's writer landed, unindexed, after the listing (retired with the fenced
        rows, so that no reader looks at them again)."""
        snap = self.snapshot(lease.session_id, lease.user_id)
        return [r for r in _older_unindexed(self.rows, snap, lease.epoch) if r.checkpoint_id not in seen]


def _older_unindexed(rows: CheckpointRows, snap: Any, epoch: int) -> list[CheckpointRow]:
    """Enveloped checkpoint objects of epochs below ``epoch`` that no index row names (read from ``snap``'s
    listing; a snapshot taken after the swap shows only the current epoch's tail)."""
    out = []
    for key in snap.present:
        if key in snap.indexed or any(r.key == key for r in snap.tails.values()):
            continue
        obj = rows.objects.get(key=key)
        header = envelope.header_of(obj.data) if obj is not None else None
        if obj is None or header is None:
            continue
        try:
            row = envelope.row_of_header(header, key, obj.data)
        except (ValueError, TypeError, KeyError):
            continue
        if 0 < row.epoch < epoch:
            out.append(row)
    return out
