"""``SessionStore``: the part of :class:`storage.Store` a session run and the runtimes use.

A run takes the session's lease, fences and reads the journal, records its
run, writes checkpoints, journal entries and status rows; a runtime lists and
reads checkpoints; both hand the store to :mod:`loomray.control` for control
requests (objects under ``control/``, status rows). Typing those callers with this protocol instead of the
whole ``Store`` keeps the seam visible: a store wrapper (fault injection, a
write counter) needs only these methods to stand in for the real one.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any, Protocol

from storage.checkpoint_log import CheckpointLog
from storage.journal import JournalRun, Listing
from storage.leases import LeaseNote
from storage.objects import ObjectStore
from storage.rows import CheckpointInfo, CheckpointRow, JournalEntry, Lease, RunRecord, SessionRow


class SessionStore(Protocol):
    """What :func:`loomray.session.execute_request` and :class:`loomray.runtime.Runtime` call on a store."""

    #: The backend: a run on ``memory`` needs no polling for a cancel written by another process.
    objects: ObjectStore
    #: The store's URL: what metrics label the run's series with.
    url: str

    # -- lease ---------------------------------------------------------------
    def acquire_lease(self, session_id: str, *, user_id: str | None = None, owner: str,
                      timeout: float = ..., note: LeaseNote | None = None) -> Lease: ...

    def check_lease(self, lease: Lease) -> None: ...

    # -- journal and run records ---------------------------------------------------
    def journal_listing(self, session_id: str, *, user_id: str | None = None,
                        run_id: str | None = None) -> Listing: ...

    def journal_seal_listed(self, session_id: str, run_id: str, *, user_id: str | None = None, lease: Lease,
                            listed: Collection[str]) -> JournalEntry: ...

    def journal_complete_fences(self, session_id: str, *, user_id: str | None = None, chain: list[dict[str, Any]],
                                listed: dict[str, Collection[str]]) -> int: ...

    def journal_seal(self, session_id: str, run_id: str, *, user_id: str | None = None, lease: Lease,
                     seen_before: Collection[str] | None = None, known: JournalRun | None = None) -> JournalRun: ...

    def journal_read(self, session_id: str, run_id: str, *, user_id: str | None = None) -> JournalRun: ...

    def journal_list(self, session_id: str, run_id: str, *, user_id: str | None = None,
                     include_fenced: bool = False) -> list[JournalEntry]: ...

    def journal_runs(self, session_id: str, *, user_id: str | None = None) -> list[str]: ...

    def journal_append(self, entry: JournalEntry, *, lease: Lease | None = None) -> None: ...

    def last_run(self, session_id: str, *, user_id: str | None = None) -> RunRecord | None: ...

    def run_create(self, session_id: str, *, user_id: str | None = None, run_id: str,
                   **fields: Any) -> RunRecord: ...

    # -- checkpoints and status rows ----------------------------------------------
    def put_checkpoint(self, data: bytes, info: CheckpointInfo, *, lease: Lease | None = None,
                       keep: int = 20) -> CheckpointRow: ...

    def checkpoint_log(self, lease: Lease, *, keep: int = 20, batch: int | None = None) -> CheckpointLog: ...

    def get_checkpoint_chain(self, session_id: str, checkpoint_id: str = "latest", *,
                             user_id: str | None = None, pinned_for: str | None = None) -> list[bytes] | None: ...

    def pin_checkpoint(self, session_id: str, checkpoint_id: str, *, user_id: str | None = None,
                       dependent: str) -> tuple[str, ...]: ...

    def list_checkpoints(self, session_id: str, *, user_id: str | None = None,
                         limit: int | None = 50) -> list[CheckpointRow]: ...

    def get_checkpoint(self, session_id: str, checkpoint_id: str = "latest", *,
                       user_id: str | None = None) -> bytes | None: ...

    def put_session(self, row: SessionRow) -> None: ...

    def get_session(self, session_id: str, *, user_id: str | None = None) -> SessionRow | None: ...

    def get_active(self, session_id: str, *, user_id: str | None = None) -> bytes | None: ...

    # -- the store itself ------------------------------------------------------------
    def describe(self, key: str | None = None) -> str: ...

    def close(self) -> None: ...
