"""In-process object store: the reference backend (a dict and a lock).

Conditional puts are decided under one lock, which is what fencing needs
within a process. State lives on the instance, never in a module global.
"""

from __future__ import annotations

import builtins
import itertools
import threading
from collections.abc import Iterator
from datetime import datetime, timezone

from .errors import PreconditionFailed
from .objects import ObjectInfo, ObjectStore, StoredObject


class MemoryObjectStore(ObjectStore):
    """Objects in a dict; ETags are a per-store counter."""

    backend = "memory"

    def __init__(self, name: str = "") -> None:
        self._name = name
        self._objects: dict[str, tuple[bytes, str, datetime]] = {}
        self._lock = threading.Lock()
        self._counter = itertools.count(1)

    def put(self, *, key: str, data: bytes, if_none_match: bool = False, if_match: str | None = None) -> str:
        data = bytes(data)  # a bytes object is returned as-is (no copy); a bytearray must not alias
        with self._lock:
            current = self._objects.get(key)
            if if_none_match and current is not None:
                raise PreconditionFailed(f"{self.describe(key)} already exists (create-only put)")
            if if_match is not None and (current is None or current[1] != if_match):
                raise PreconditionFailed(f"{self.describe(key)} changed since ETag {if_match} (compare-and-swap put)")
            etag = f'"m{next(self._counter)}"'
            self._objects[key] = (data, etag, datetime.now(timezone.utc))
            return etag

    def get(self, *, key: str) -> StoredObject | None:
        with self._lock:
            current = self._objects.get(key)
        return None if current is None else StoredObject(current[0], current[1])

    def list(self, *, prefix: str) -> Iterator[ObjectInfo]:
        with self._lock:
            hits = sorted((k, v) for k, v in self._objects.items() if k.startswith(prefix))
        for key, (data, etag, modified) in hits:
            yield ObjectInfo(key, len(data), etag, modified)

    def list_dirs(self, *, prefix: str) -> builtins.list[str]:
        with self._lock:
            keys = [k[len(prefix):] for k in self._objects if k.startswith(prefix)]
        return sorted({k.split("/", 1)[0] for k in keys if "/" in k})

    def delete(self, *, keys: builtins.list[str]) -> None:
        with self._lock:
            for key in keys:
                self._objects.pop(key, None)

    def describe(self, key: str | None = None) -> str:
        where = f"memory://{self._name}"
        return where if key is None else f"{where} key {key!r}"
