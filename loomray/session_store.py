"""``SessionStore``: the part of :class:`storage.Store` a session run and the runtimes use.

Typing those callers with these protocols instead of the whole ``Store`` keeps the seam visible: a store
wrapper (fault injection, a write counter) needs only these sub-stores and methods to stand in for the real one.
"""

from __future__ import annotations

import builtins
from collections.abc import Collection
from typing import Any, Protocol

from loomray.storage.checkpoint_log import CheckpointLog
from loomray.storage.journal import JournalRun, Listing
from loomray.storage.leases import LeaseNote
from loomray.storage.objects import ObjectStore
from loomray.storage.rows import CheckpointRow, JournalEntry, Lease, RunRecord, SessionRow
from loomray.storage.tails import Snapshot


class CheckpointStore(Protocol):
    """What runs and runtimes call on ``store.checkpoints`` (:class:`storage.checkpoints.Checkpoints`)."""

    def log(self, lease: Lease, *, keep: int = 20, batch: int | None = None) -> CheckpointLog: ...

    def get(self, session_id: str, checkpoint_id: str = "latest", *, user_id: str | None = None) -> bytes | None: ...

    def get_chain(self, session_id: str, checkpoint_id: str = "latest", *, user_id: str | None = None,
                  pinned_for: str | None = None, snapshot: Snapshot | None = None) -> builtins.list[bytes] | None: ...

    def pin(self, session_id: str, checkpoint_id: str, *, user_id: str | None = None,
            dependent: str) -> tuple[str, ...]: ...

    def pin_and_look(self, session_id: str, checkpoint_id: str, *, user_id: str | None = None,
                     dependent: str) -> tuple[tuple[str, ...], Snapshot | None]: ...

    def list(self, session_id: str, *, user_id: str | None = None,
             limit: int | None = 50) -> builtins.list[CheckpointRow]: ...


class JournalStore(Protocol):
    """What runs call on ``store.journal`` (:class:`storage.journaling.Journal`)."""

    def listing(self, session_id: str, *, user_id: str | None = None, run_id: str | None = None) -> Listing: ...

    def seal_listed(self, session_id: str, run_id: str, *, user_id: str | None = None, lease: Lease,
                    listed: Collection[str]) -> JournalEntry: ...

    def complete_fences(self, session_id: str, *, user_id: str | None = None,
                        chain: builtins.list[dict[str, Any]], listed: dict[str, Collection[str]]) -> int: ...

    def seal(self, session_id: str, run_id: str, *, user_id: str | None = None, lease: Lease,
             seen_before: Collection[str] | None = None, known: JournalRun | None = None) -> JournalRun: ...

    def read(self, session_id: str, run_id: str, *, user_id: str | None = None) -> JournalRun: ...

    def list(self, session_id: str, run_id: str, *, user_id: str | None = None,
             include_fenced: bool = False) -> builtins.list[JournalEntry]: ...

    def runs(self, session_id: str, *, user_id: str | None = None) -> builtins.list[str]: ...

    def append(self, entry: JournalEntry, *, lease: Lease | None = None) -> None: ...


class RunStore(Protocol):
    """What runs call on ``store.runs`` (:class:`storage.journaling.Runs`)."""

    def last(self, session_id: str, *, user_id: str | None = None) -> RunRecord | None: ...

    def create(self, session_id: str, *, user_id: str | None = None, run_id: str,
               request: dict[str, Any] | None = None, spec_hash: str = "", base_session_id: str | None = None,
               base_checkpoint_id: str | None = None, replay_from: str | None = None,
               epoch: int = 0) -> RunRecord: ...

    def list(self, session_id: str, *, user_id: str | None = None) -> builtins.list[RunRecord]: ...


class LeaseStore(Protocol):
    """What runs call on ``store.leases`` (:class:`storage.leasing.Leases`)."""

    def acquire(self, session_id: str, *, user_id: str | None = None, owner: str,
                timeout: float = ..., note: LeaseNote | None = None) -> Lease: ...

    def check(self, lease: Lease) -> None: ...

    def current_epoch(self, session_id: str, *, user_id: str | None = None) -> int: ...


class SessionIndex(Protocol):
    """What runs and control requests call on ``store.sessions`` (:class:`storage.sessions.Sessions`)."""

    def put(self, row: SessionRow) -> None: ...

    def get(self, session_id: str, *, user_id: str | None = None) -> SessionRow | None: ...


class ActiveStore(Protocol):
    """What runtimes call on ``store.active`` (:class:`storage.sessions.ActiveMarks`)."""

    def get(self, session_id: str, *, user_id: str | None = None) -> bytes | None: ...


class SessionStore(Protocol):
    """What :func:`loomray.session.execute_request` and :class:`loomray.runtime.Runtime` call on a store."""

    #: The backend: a run on ``memory`` needs no polling for a cancel written by another process.
    objects: ObjectStore
    #: The store's URL: what metrics label the run's series with.
    url: str

    @property
    def checkpoints(self) -> CheckpointStore: ...

    @property
    def journal(self) -> JournalStore: ...

    @property
    def runs(self) -> RunStore: ...

    @property
    def leases(self) -> LeaseStore: ...

    @property
    def sessions(self) -> SessionIndex: ...

    @property
    def active(self) -> ActiveStore: ...

    def describe(self, key: str | None = None) -> str: ...

    def close(self) -> None: ...
