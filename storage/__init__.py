"""loomray storage: object stores, checkpoints, journal, leases and a Parquet index.

Knows nothing of agents or Ray. ``open_store(url, **options)`` picks a backend
explicitly from the URL and returns a :class:`Store` (API: docs/contracts.md):

- ``memory://[name]``: in-process (a dict and a lock), fresh per call;
- a plain path or ``file:///abs/path``: a local directory;
- ``s3://bucket/prefix``: S3 or any S3-compatible server (``endpoint_url``,
  ``key``, ``secret``, ``region``, ``retry_mode``, ``max_attempts``; else the
  usual AWS environment; ``sse="AES256"|"aws:kms"`` and ``sse_kms_key_id``
  for server-side encryption of every PUT).

Layers: :class:`ObjectStore` (``objects.py``) is the tiny byte interface with
create-only and compare-and-swap puts; ``memory.py``, ``localdir.py`` and
``s3.py`` adapt it (boto3 lives only in ``s3.py``). Everything above it
(``store.py`` and the modules it is made of, ``index.py``, ``maintenance.py``) is one code path for every
backend, so the conformance suite on the local directory means something for
S3 and the reverse. :func:`Store.fsspec` hands external readers an fsspec
filesystem (local or s3fs) over the same root.

The object layout, the index, compaction and fencing: docs/design.md and docs/contracts.md.
"""

from __future__ import annotations

import os
from urllib.parse import unquote, urlparse

from .errors import StorageError
from .localdir import LocalObjectStore
from .memory import MemoryObjectStore
from .objects import ObjectInfo, ObjectStore, StoredObject
from .pruning import PrunePlan, SessionPrunePlan
from .rows import (
    CheckpointInfo,
    CheckpointRow,
    CompactReport,
    JournalEntry,
    Lease,
    PruneReport,
    RunRecord,
    SessionRow,
)
from .store import ANY, Store


class InvalidStoreUrl(StorageError, ValueError):
    """The store URL names no known backend or is malformed."""


def open_store(url: str | os.PathLike, **options) -> Store:
    """Open the store at ``url``: ``memory://``, a path or ``file://``, or ``s3://bucket/prefix``."""
    url = os.fspath(url)
    if not isinstance(url, str) or not url:
        raise InvalidStoreUrl(f"store URL must be a non-empty string, got {url!r}")
    if url.startswith("memory://"):
        _no_options("memory", options)
        return Store(MemoryObjectStore(url[len("memory://"):]), url)
    if url.startswith("s3://"):
        from .s3 import S3ObjectStore  # boto3 (slow to import) loads only for an s3:// store

        parsed = urlparse(url)
        if len(parsed.netloc) < 3:
            raise InvalidStoreUrl(f"S3 store URL {url!r} needs a bucket name of at least 3 characters")
        return Store(S3ObjectStore(parsed.netloc, parsed.path.lstrip("/"), **options), url)
    if url.startswith("file://"):
        path = unquote(urlparse(url).path)
    elif "://" in url:
        raise InvalidStoreUrl(f"unknown store URL scheme in {url!r}; use memory://, file:// or a path, or s3://")
    else:
        path = url
    fsync = options.pop("fsync", False)
    _no_options("file", options)
    local = LocalObjectStore(path, fsync=fsync)
    return Store(local, f"file://{local.root}")


def _no_options(backend: str, options: dict) -> None:
    # S3-only options left at None (e.g. a runtime forwarding endpoint_url=None) are harmless.
    options = {k: v for k, v in options.items() if v is not None}
    if options:
        raise InvalidStoreUrl(f"the {backend} backend takes no options {sorted(options)}")


__all__ = ["ANY", "CheckpointInfo", "CheckpointRow", "CompactReport", "InvalidStoreUrl", "JournalEntry", "Lease", "ObjectInfo",
           "ObjectStore", "PrunePlan", "PruneReport", "RunRecord", "SessionPrunePlan", "SessionRow", "Store", "StoredObject",
           "open_store"]
