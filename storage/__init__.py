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

Object layout (one prefix, human-readable keys)::

    sessions/{user or _}/{session_id}/checkpoints/{checkpoint_id}.json
    sessions/{user or _}/{session_id}/journal/{run_id}/{seq:08d}-{step_key}.json
    sessions/{user or _}/{session_id}/runs/{n:08d}.json   (run records: store-sequenced order, the request)
    sessions/{user or _}/{session_id}/lease.json
    sessions/{user or _}/{session_id}/epochs/{epoch:020d}   (one create-only marker per lease ever acquired)
    sessions/{user or _}/{session_id}/quarantine/{checkpoint_id}.json   (checkpoints moved aside by an operator)
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
(``hive_partitioning``); ``user=_`` is "no user". Ids never contain ``=``,
``%``, ``/``, control or format characters and are at most 128 UTF-8 bytes
(``ids.py``), so every partition value reads back as written.

Compaction. ``compact()`` writes each partition's merged file before it
deletes the files it merged, so a reader never misses a row; and a reader
that finds a listed file gone at GET time knows its LIST predates a merged
file: it LISTs again (a few times, then
:class:`~storage.errors.IndexChangedError`), never reading a vanished file
as "no rows". Two compactions may run at once (the supervisor's loop and a
``loomray compact`` cron, two clusters on one store): a compaction keeps
every tombstone younger than a grace period (one hour;
``compact(tombstone_grace=...)``, judged by the store's clock: the LIST's
modification times, not the ``written_at`` a writer's clock stamped), so a
merged file that another compactor wrote from rows it read before the
tombstone existed can never bring a retired row back; a compaction abandons
a partition whose listed files vanished (another compaction merged them) or
whose merge would land more than half the grace after its LIST, and deletes
again a merge that landed later than that anyway. External readers read the compacted table
(``index/table/``), where the visibility rule is applied; a reader of the per-session files
applies tombstones (rows with ``tombstone`` true retire their ``checkpoint_id``) except a
lease holder's (``tomb_epoch`` set) that the session's fences ignore (:mod:`storage.visibility`).

Fencing. ``leases.acquire`` bumps ``lease.json``'s epoch with a conditional
put (``If-None-Match: *`` / ``If-Match: etag`` on S3, where a 404 answer to
``If-Match`` means the lease vanished meanwhile and counts as a lost swap;
``os.link`` / a ``flock``-guarded replace locally; a lock in memory). A lost
swap is retried with exponential backoff and full jitter, bounded by a total
time (``timeout``), so many concurrent acquirers all get distinct epochs.
Every checkpoint row carries its writer's epoch; "latest" is the highest
``(epoch, checkpoint_id)``. A writer whose lease is older is refused before
its PUT, and one that raced a takeover is detected after it and its write
retired. Epochs rise strictly for the life of a session whatever happens to
``lease.json``: an acquire first claims epoch ``n`` with the create-only
marker ``epochs/{n}``, then swaps ``lease.json`` to ``n``, so every epoch that
ever reached ``lease.json`` has its marker and the highest marker is a safe
floor when ``lease.json`` is missing (a session from before markers: the
epochs its index rows and journal carry). A marker that already exists means
someone took that epoch: it is waited for a few backoff rounds (its claimant
may be about to swap), then gone above, so a crash between marker and swap
never blocks later acquirers; after creating a missing ``lease.json`` the
markers are listed once more. While ``lease.json`` is missing and nobody has
acquired, the holder of the highest marker still owns the session. A
``lease.json`` that does not parse or whose epoch is not an integer in
[0, 2**53) raises :class:`~storage.errors.LeaseCorruptError` (naming the key)
before anything is written; ``leases.repair`` (CLI ``loomray lease repair
SESSION``) rewrites it above every epoch used, which fences every holder.
Cost: an acquire is one GET and two PUTs (marker, lease), plus two LISTs when
``lease.json`` is missing; a checkpoint write is unchanged.

Damaged checkpoints. ``checkpoints.get(explicit id)`` raises
:class:`~storage.errors.CorruptObjectError` when the bytes do not match the
size and sha256 recorded at write time; ``checkpoints.get("latest")`` skips
such a checkpoint with a warning and returns the newest readable one (it
raises only when none is readable). ``checkpoints.quarantine`` (CLI ``loomray
checkpoints quarantine SESSION CKPT``) moves the object to ``quarantine/``
and tombstones its row.
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
