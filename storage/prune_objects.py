"""What prune deletes and may have to put back: the bytes it reads first, and the puts that restore them.

Prune deletes checkpoint objects before it retires their rows (a run started
meanwhile may need one back: :mod:`storage.pruning`), so it reads them first;
when it fails before the rows are retired, it puts back everything it
deleted, retrying transient failures for a while, so no reader finds an
indexed checkpoint without its object.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import TYPE_CHECKING

from . import backoff
from .errors import PreconditionFailed
from .rows import JournalEntry

if TYPE_CHECKING:
    from .store import Store

log = logging.getLogger("storage")

#: How long a failed prune keeps trying to put back what it deleted (transient failures are retried).
PUT_BACK_S = 10.0


def put_back(store: Store, held: Mapping[str, bytes], entries: Mapping[str, JournalEntry]) -> None:
    """The objects and journal entries a failed prune deleted before it could retire their rows, put back with
    retries for up to :data:`PUT_BACK_S`; what still fails is logged (the failure that stopped prune is raised)."""
    deadline = backoff.clock() + PUT_BACK_S
    for key in [*held, *entries]:
        attempt = 0
        while True:
            try:
                if key in held:
                    store.objects.put(key=key, data=held[key])
                else:
                    restore_entry(store, key, entries[key])
                break
            except Exception as e:
                attempt += 1
                if not backoff.wait(attempt, deadline):
                    log.warning("prune failed, and could not put back %s: %s", store.describe(key), e)
                    break


def read_objects(store: Store, keys: list[str]) -> dict[str, bytes]:
    """The bytes of ``keys`` that exist (read in parallel), to put back what a run started meanwhile needs."""
    def read(key: str) -> bytes | None:
        obj = store.objects.get(key=key)
        return None if obj is None else obj.data

    datas = store._index.map(read, keys) if len(keys) > 2 else map(read, keys)
    return {k: d for k, d in zip(keys, datas, strict=False) if d is not None}


def restore_entry(store: Store, key: str, entry: JournalEntry) -> None:
    try:
        store.objects.put(key=key, data=entry.__pydantic_serializer__.to_json(entry), if_none_match=True)
    except PreconditionFailed:
        pass  # already there again: nothing to put back
