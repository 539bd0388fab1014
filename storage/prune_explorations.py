"""What prune does to a session's explorations: the records of those that are over go, running ones stay.

Deleting the record of an exploration still under way would let whoever
continues it take every decision again (re-run branches, re-bill judges), so
only one whose ``result.json`` exists goes (with ``before``: written before
the cutoff), with its id's pointer and a leftover submitted mark.
``result.json`` is deleted last, so a prune that fails half-way leaves an
exploration that still reads as over (docs/exploration.md "Prune").
"""

from __future__ import annotations

import json
from collections import defaultdict
from dataclasses import dataclass
from datetime import datetime

from . import layout
from .ids import validate_id
from .objects import ObjectStore
from .rows import as_utc

#: The object whose presence says an exploration is over.
RESULT = "result.json"


@dataclass(frozen=True)
class ExplorationsPlan:
    """What prune deletes of one session's explorations: their ids, their objects (``results``, each one's
    ``result.json``, go last), and the ids it keeps: not over (or, with a cutoff, over after it)."""

    deleted: tuple[str, ...] = ()
    keys: tuple[str, ...] = ()
    results: tuple[str, ...] = ()
    kept: tuple[str, ...] = ()


def plan_explorations(objects: ObjectStore, session_id: str, user_id: str | None,
                      cutoff: datetime | None) -> ExplorationsPlan:
    """The explorations of session ``session_id`` that prune (with ``cutoff``, or without one) deletes: one LIST,
    plus one GET per deleted exploration (its pointer, to check it names this session)."""
    prefix = layout.session_prefix(session_id, user_id) + "explorations/"
    by_id: dict[str, dict[str, datetime | None]] = defaultdict(dict)
    for info in objects.list(prefix=prefix):
        xid, _, name = info.key[len(prefix):].partition("/")
        if name:
            by_id[xid][name] = info.modified
    deleted, keys, results, kept = [], [], [], []
    for xid, names in sorted(by_id.items()):
        finished = names.get(RESULT)
        over = RESULT in names and (cutoff is None or (finished is not None and as_utc(finished) < cutoff))
        if not over:
            kept.append(xid)
            continue
        deleted.append(xid)
        keys += [f"{prefix}{xid}/{n}" for n in sorted(names) if n != RESULT]
        keys += _marks(objects, session_id, user_id, xid)
        results.append(f"{prefix}{xid}/{RESULT}")
    return ExplorationsPlan(tuple(deleted), tuple(keys), tuple(results), tuple(kept))


def _marks(objects: ObjectStore, session_id: str, user_id: str | None, xid: str) -> list[str]:
    """The submitted mark (if one was left) and the pointer of exploration ``xid``, when they are this session's."""
    try:
        validate_id(xid, "exploration_id")
    except ValueError:
        return []  # not an id an exploration could have: no pointer names it
    out = []
    mark = layout.submitted_exploration_key(user_id, xid)
    if objects.get(key=mark) is not None:
        out.append(mark)  # the exploration is over: its supervisor would only remove the mark
    pointer = layout.exploration_pointer_key(user_id, xid)
    got = objects.get(key=pointer)
    if got is not None and _names(got.data, session_id):
        out.append(pointer)
    return out


def _names(data: bytes, session_id: str) -> bool:
    try:
        doc = json.loads(data)
    except ValueError:
        return False  # unreadable: not ours to judge
    return isinstance(doc, dict) and doc.get("session_id") == session_id


def delete_explorations(objects: ObjectStore, plan: ExplorationsPlan) -> int:
    """Delete what ``plan`` names, the ``result.json`` objects last; how many explorations that is."""
    for keys in (plan.keys, plan.results):
        if keys:
            objects.delete(keys=list(keys))
    return len(plan.deleted)
