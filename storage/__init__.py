"""loomray storage: object stores, checkpoints, journal, leases and a Parquet index.

Knows nothing of agents or Ray. ``open_store(url, **options)`` picks a backend
explicitly from the URL and returns a :class:`Store` (API: docs/contracts.md):

- ``memory://[name]``: in-process (a dict and a lock), fresh per call;
- a plain path or ``file:///abs/path``: a local directory;
- ``s3://bucket/prefix``: S3 or any S3-compatible server (``endpoint_url``,
  ``key``, ``secret``, ``region``, ``retry_mode``, ``max_attempts``; else the
  usual AWS environment).

Layers: :class:`ObjectStore` (``objects.py``) is the tiny byte interface with
create-only and compare-and-swap puts; ``memory.py``, ``localdir.py`` and
``s3.py`` adapt it (boto3 lives only in ``s3.py``). Everything above it
(``store.py``, ``index.py``, ``maintenance.py``) is one code path for every
backend, so the conformance suite on the local directory means something for
S3 and the reverse. :func:`Store.fsspec` hands external readers an fsspec
filesystem (local or s3fs) over the same root.

Object layout (one prefix, human-readable keys)::

    sessions/{user or _}/{session_id}/checkpoints/{checkpoint_id}.json
    sessions/{user or _}/{session_id}/journal/{run_id}/{seq:08d}-{step_key}.json
    sessions/{user or _}/{session_id}/lease.json
    index/checkpoints/user={user or _}/session={session_id}/{written_ns}-{rand}[-c].parquet
    index/sessions/user={user or _}/session={session_id}/{written_ns}-{rand}[-c].parquet

Partitioning choice. The index is partitioned hive-style by user, then by
session. (a) Listing one session among 10,000 is a prefix LIST of that
session's partition and of its ``checkpoints/`` objects (both strongly
consistent on S3), plus GETs of that partition's files, which are immutable
and cached by key, so the cost does not grow with the number of sessions.
(b) A cross-session query lists ``index/checkpoints/`` (or one user's
partition, pruned by prefix), reads the files in parallel and filters in
Arrow. Every write appends one file, so before compaction a query pays one
GET per checkpoint write; ``compact()`` merges each partition to one
zstd file and applies tombstones, so afterwards it pays one GET per session.
A single global time-partitioned layout would make (b) cheaper still but
would turn (a) into a scan or need a second index; per-session partitions
keep both bounded and make compaction a local, per-partition operation
(only the merged files are deleted, so concurrent appends survive). The
same files read straight from the bucket with pyarrow, DuckDB or polars
(``hive_partitioning``); ``user=_`` is "no user".

Fencing. ``acquire_lease`` bumps ``lease.json``'s epoch with a conditional
put (``If-None-Match: *`` / ``If-Match: etag`` on S3; ``os.link`` / a
``flock``-guarded replace locally; a lock in memory). Every checkpoint row
carries its writer's epoch; "latest" is the highest ``(epoch,
checkpoint_id)``. A writer whose lease is older is refused before its PUT,
and one that raced a takeover is detected after it and its write retired.
"""

from __future__ import annotations

import os
from urllib.parse import unquote, urlparse

from storage.errors import StorageError
from storage.objects import ObjectInfo, ObjectStore, StoredObject
from storage.rows import CheckpointRow, CompactReport, JournalEntry, Lease, PruneReport, SessionRow
from storage.store import ANY, Store


class InvalidStoreUrl(StorageError, ValueError):
    """The store URL names no known backend or is malformed."""


def open_store(url: str | os.PathLike, **options) -> Store:
    """Open the store at ``url``: ``memory://``, a path or ``file://``, or ``s3://bucket/prefix``."""
    url = os.fspath(url)
    if not isinstance(url, str) or not url:
        raise InvalidStoreUrl(f"store URL must be a non-empty string, got {url!r}")
    if url.startswith("memory://"):
        from storage.memory import MemoryObjectStore

        _no_options("memory", options)
        return Store(MemoryObjectStore(url[len("memory://"):]), url)
    if url.startswith("s3://"):
        from storage.s3 import S3ObjectStore

        parsed = urlparse(url)
        if len(parsed.netloc) < 3:
            raise InvalidStoreUrl(f"S3 store URL {url!r} needs a bucket name of at least 3 characters")
        objects = S3ObjectStore(parsed.netloc, parsed.path.lstrip("/"), **options)
        return Store(objects, url)
    if url.startswith("file://"):
        path = unquote(urlparse(url).path)
    elif "://" in url:
        raise InvalidStoreUrl(f"unknown store URL scheme in {url!r}; use memory://, file:// or a path, or s3://")
    else:
        path = url
    from storage.localdir import LocalObjectStore

    fsync = options.pop("fsync", False)
    _no_options("file", options)
    objects = LocalObjectStore(path, fsync=fsync)
    return Store(objects, f"file://{objects.root}")


def _no_options(backend: str, options: dict) -> None:
    # S3-only options left at None (e.g. a runtime forwarding endpoint_url=None) are harmless.
    options = {k: v for k, v in options.items() if v is not None}
    if options:
        raise InvalidStoreUrl(f"the {backend} backend takes no options {sorted(options)}")


__all__ = ["ANY", "CheckpointRow", "CompactReport", "InvalidStoreUrl", "JournalEntry", "Lease", "ObjectInfo",
           "ObjectStore", "PruneReport", "SessionRow", "Store", "StoredObject", "open_store"]
