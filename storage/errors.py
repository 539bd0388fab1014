"""Storage exceptions.

One root (:class:`StorageError`); messages name the backend, the bucket or
root, and the key. Every exception pickles cleanly (plain message argument),
so it can cross a Ray actor boundary unchanged.
"""

from __future__ import annotations


class StorageError(Exception):
    """Base of every storage failure; the message names backend, root and key."""


class ObjectNotFound(StorageError, KeyError):
    """A key that does not exist, where absence is an error."""

    def __str__(self) -> str:  # KeyError would otherwise repr() the message
        return str(self.args[0]) if self.args else ""


class PreconditionFailed(StorageError):
    """A conditional put lost: the object exists (create-only) or its ETag changed (compare-and-swap)."""


class CorruptObjectError(StorageError):
    """Stored bytes are unreadable, truncated or do not match their recorded size/sha256."""


class LeaseCorruptError(CorruptObjectError):
    """A session's ``lease.json`` (or an epoch marker) is unreadable or holds an epoch outside [0, 2**53).

    Raised before anything is written. Repair: ``store.leases.repair`` (CLI:
    ``loomray lease repair SESSION``) rewrites it above every epoch the session used.
    """


class LeaseLostError(StorageError):
    """Fencing: the writer holds an older epoch than the session's current lease."""


class InvalidIdError(StorageError, ValueError):
    """An id (session, user, checkpoint, run, step key) is not safe to use as a key segment."""


class StorageConfigError(StorageError):
    """The store is configured wrong for this request (credentials, permissions, region): retrying cannot help,
    a change of configuration can. A command line reports it as the user's mistake, not as an outage."""


class TransientStorageError(StorageError):
    """A transient backend failure (503 SlowDown, timeout, connection reset) outlived its retries."""


class IndexChangedError(TransientStorageError):
    """Index files listed for a read kept vanishing before their GET (a compaction merging them) after re-LISTs.

    Never read as "no rows": the caller retries later or fails.
    """
