"""The object-store interface: a tiny ABC every backend implements.

Shaped like Temporal's S3 driver: keyword-only ``put`` / ``get`` / ``list`` /
``delete`` plus ``describe()`` for error context. Conditional writes are part
of the interface because fencing needs them: ``if_none_match=True`` is
create-only, ``if_match=etag`` is compare-and-swap. Keys are relative to the
backend's root and always built by :mod:`storage.layout` from validated ids.
No SDK type appears here; each adapter lives in its own module.
"""

from __future__ import annotations

import builtins
from abc import ABC, abstractmethod
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime
from typing import Any


@dataclass(frozen=True)
class ObjectInfo:
    """One listed object: key relative to the root, size in bytes, opaque ETag, last modification."""

    key: str
    size: int
    etag: str
    modified: datetime | None = None


@dataclass(frozen=True)
class StoredObject:
    """The bytes of one object and the ETag they were read at (for compare-and-swap)."""

    data: bytes
    etag: str


class ObjectStore(ABC):
    """Bytes under string keys, with create-only and compare-and-swap puts."""

    #: Short backend name for messages: "memory", "file", "s3".
    backend: str = "?"

    @abstractmethod
    def put(self, *, key: str, data: bytes, if_none_match: bool = False, if_match: str | None = None) -> str:
        """Store ``data`` under ``key`` and return its new ETag.

        ``if_none_match=True`` fails with :class:`~storage.errors.PreconditionFailed` when the
        key exists; ``if_match`` fails the same way unless the current ETag equals it.
        """

    @abstractmethod
    def get(self, *, key: str) -> StoredObject | None:
        """The object's bytes and ETag, or ``None`` when the key does not exist."""

    @abstractmethod
    def list(self, *, prefix: str) -> Iterator[ObjectInfo]:
        """Every object whose key starts with ``prefix``, in key order."""

    @abstractmethod
    def list_dirs(self, *, prefix: str) -> builtins.list[str]:
        """The next path segments below ``prefix`` (which ends in ``/``) that hold objects, sorted."""

    @abstractmethod
    def delete(self, *, keys: builtins.list[str]) -> None:
        """Delete ``keys``; a key that is already gone is not an error."""

    @abstractmethod
    def describe(self, key: str | None = None) -> str:
        """A human description (backend, bucket/root, and ``key`` if given) for error messages."""

    def fsspec(self) -> tuple[Any, str]:
        """``(fsspec filesystem, root path)`` for external readers (pyarrow, DuckDB, polars)."""
        raise NotImplementedError(f"{self.describe()} has no fsspec filesystem")

    def close(self) -> None:  # noqa: B027 - an optional hook, a no-op by default
        """Release clients or connections (optional)."""
