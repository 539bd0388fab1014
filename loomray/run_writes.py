"""A run's writes to its store: the journal sink, the write guard, and the writes in flight.

Every failed checkpoint or journal write is judged by one :class:`WriteGuard`; :class:`StoreJournalSink`
proves the lease so that a fenced run stops soon; :class:`InflightWrites` lets a cancel wait for the writes
a run already started.
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import logging
import time
from collections.abc import Callable
from typing import Any, ParamSpec, Protocol, TypeVar

from loomray.errors import DurabilityLost
from loomray.journal import JournalRecord
from loomray.run_request import RunRequest
from loomray.session_store import SessionStore
from loomray.storage.errors import CorruptObjectError, LeaseLostError
from loomray.storage.rows import JournalEntry, Lease

#: The session's logger: a run's warnings keep one name, whichever module logs them.
log = logging.getLogger("loomray.session")

#: A run whose journal appends do not read the lease still re-reads it this often (seconds).
LEASE_RECHECK_S = 10.0
#: Before a model call or a pass's tools, a run proves it still owns its session once it has done this many writes,
#: or this many seconds passed, since the last proof (what a fenced writer can do before it stops; see
#: StoreJournalSink).
LEASE_CHECK_WRITES = 32
LEASE_CHECK_S = 2.0

#: Write errors no retry can fix (a bad id, a wrong type, a bug): they stop the run instead of being logged.
P = ParamSpec("P")
T = TypeVar("T")
_NON_TRANSIENT = (TypeError, ValueError, AttributeError, NotImplementedError)


#: True while :meth:`InflightWrites.run` hands a run's store write to the executor. A process stopping because
#: its node is lost still takes these (they finish what the run already did, and the lease fences them) and
#: nothing else.
STORE_WRITE: contextvars.ContextVar[bool] = contextvars.ContextVar("loomray_store_write", default=False)


class InflightWrites:
    """The store writes a run has started: each runs in a worker thread that outlives a cancelled awaiter, so
    a cancel waits for them (:meth:`drain`) before it is acknowledged."""

    def __init__(self) -> None:
        self.tasks: set[asyncio.Future[Any]] = set()

    async def run(self, fn: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
        """``fn(*args, **kwargs)`` in a worker thread, tracked until it ends; its result."""
        # Submitted to the executor now, in the caller's tick (a Task around ``to_thread`` would submit on the
        # next one): a step whose result just arrived is handed over before anything else on the loop can run,
        # such as the node-loss watchdog freezing the executor (which would lose the record and re-bill the step).
        ctx = contextvars.copy_context()
        marked = STORE_WRITE.set(True)
        try:
            fut = asyncio.get_running_loop().run_in_executor(None, functools.partial(ctx.run, fn, *args, **kwargs))
        finally:
            STORE_WRITE.reset(marked)
        self.tasks.add(fut)
        fut.add_done_callback(self._done)
        return await asyncio.shield(fut)

    def _done(self, fut: asyncio.Future[Any]) -> None:
        self.tasks.discard(fut)
        if not fut.cancelled():
            fut.exception()  # retrieved: its awaiter may have been cancelled

    async def drain(self) -> None:
        while self.tasks:
            await asyncio.wait(list(self.tasks))


class WriteGuard:
    """Decides what a failed checkpoint or journal write means for the run.

    A transient failure while the lease still reads as ours is a warning: recovery redoes what was not
    recorded. Fencing, a non-transient error (retrying cannot help), an unreadable lease
    (:class:`DurabilityLost`) or ``CorruptObjectError`` stops the run before its next step, and the guard
    remembers it so the loop sees it even when the write was in the background. The lease is read only
    after a failure, so the happy path costs nothing.
    """

    def __init__(self, store: SessionStore, lease: Lease) -> None:
        self.store, self.lease = store, lease
        #: The first error that stopped the run (raised again by :meth:`check`).
        self.fatal: BaseException | None = None
        #: Writes that failed (as warnings) since the last checkpoint written: the run's end is not durable.
        self.undurable = 0

    def failed(self, what: str, error: BaseException) -> None:
        """Classify ``error`` raised by writing ``what``: return if it is only a warning, else raise (it may read
        the lease: call it from a worker thread)."""
        if self.fatal is not None:
            raise self.fatal
        if isinstance(error, (LeaseLostError, *_NON_TRANSIENT)):
            self.fatal = error
            raise error
        try:
            self.store.leases.check(self.lease)
        except LeaseLostError as e:
            self.fatal = e
            raise
        except Exception as e:
            self.lease_unreadable(e, after=f"{what} could not be written ({type(error).__name__}: {error})")
        if isinstance(error, CorruptObjectError):
            self.fatal = error
            raise error
        self.undurable += 1  # only a warning: the run goes on, but what it did since its last checkpoint is at risk

    def durable(self) -> None:
        """A checkpoint was written: everything the run did so far is durable again."""
        self.undurable = 0

    def lease_unreadable(self, error: BaseException, *, after: str = "") -> None:
        """Reading the lease failed with ``error`` (not fencing): ownership is unprovable; raise DurabilityLost."""
        if self.fatal is not None:
            raise self.fatal
        lease = self.lease
        self.fatal = DurabilityLost(
            f"session {lease.session_id!r} (user {lease.user_id!r}): {after + ', and ' if after else ''}"
            f"the lease could not be read to prove that this writer ({lease.owner}, epoch {lease.epoch}) still "
            f"owns the session ({type(error).__name__}: {error}); the run stops before its next step")
        raise self.fatal from error

    def is_fatal(self, error: BaseException) -> bool:
        """True for the errors :meth:`failed` raised to stop the run (and for fencing)."""
        return error is self.fatal or isinstance(error, LeaseLostError)

    def check(self) -> None:
        """Raise the error that stopped the run, if any."""
        if self.fatal is not None:
            raise self.fatal


class JournalTarget(Protocol):
    """What the journal sink writes to: appends and lease reads."""

    def append(self, entry: JournalEntry) -> None: ...

    def check_lease(self, lease: Lease) -> None: ...


class GuardedJournal:
    """The store as the journal sink sees it: failed appends and lease re-reads go through the :class:`WriteGuard`,
    which remembers the failures that must stop the run though the sink swallows them."""

    def __init__(self, store: SessionStore, guard: WriteGuard) -> None:
        self._store, self._guard = store, guard

    def append(self, entry: JournalEntry) -> None:
        try:
            self._store.journal.append(entry)
        except Exception as e:
            self._guard.failed(f"journal entry {entry.step_key} of run {entry.run_id}", e)
            raise

    def check_lease(self, lease: Lease) -> None:
        try:
            self._store.leases.check(lease)
        except LeaseLostError:
            raise
        except Exception as e:
            self._guard.lease_unreadable(e)


class StoreJournalSink:
    """The journal seam: one create-only object per step, stamped with the lease's epoch; it does not read the lease.

    Fencing is the next incarnation's seal; so that a fenced run stops anyway, and soon, the run proves its
    lease (docs/design.md, "Proving the lease during a run"): before a step once ``check_writes`` writes or
    ``check_s`` seconds passed since the last proof (:meth:`before_step`), after an append once ``recheck_s``
    passed, and before it reports its end (:meth:`prove`).
    """

    def __init__(self, target: JournalTarget, request: RunRequest, run_id: str, lease: Lease,
                 recheck_s: float = LEASE_RECHECK_S, inflight: InflightWrites | None = None, *,
                 check_writes: int | None = None, check_s: float | None = None) -> None:
        self.target, self.request, self.run_id, self.lease = target, request, run_id, lease
        self.inflight = inflight or InflightWrites()
        self.recheck_s = recheck_s
        self.check_writes = LEASE_CHECK_WRITES if check_writes is None else check_writes
        self.check_s = LEASE_CHECK_S if check_s is None else check_s
        # The plan read the lease right before the run's first step.
        self._writes = 0
        self._proven = time.monotonic()

    def wrote(self) -> None:
        """A write under the lease started (a journal append, a checkpoint)."""
        self._writes += 1

    def proven(self) -> None:
        """The lease was just proven ours (read, or the store acknowledged checkpoints after listing the epochs)."""
        self._writes = 0
        self._proven = time.monotonic()

    async def prove(self) -> None:
        """Read the lease unless nothing was written since it was last proven: before a run reports its end."""
        if self._writes:
            await asyncio.to_thread(self.target.check_lease, self.lease)
            self.proven()

    async def before_step(self) -> None:
        """Before a model call or a pass's tools: read the lease if this run wrote enough, or long enough, since
        it was last proven; raises if fenced or unreadable."""
        if self._writes >= self.check_writes or time.monotonic() - self._proven >= self.check_s:
            # Through the guard: fenced is LeaseLostError, unreadable is DurabilityLost; either stops the run
            # before the step is billed or its tools act.
            await asyncio.to_thread(self.target.check_lease, self.lease)
            self.proven()

    async def append(self, record: JournalRecord) -> None:
        entry = JournalEntry(session_id=self.request.session_id, user_id=self.request.user_id, run_id=self.run_id,
                             seq=record.seq, step_key=record.step_key, kind=record.kind,
                             input_hash=record.input_hash, output=record.output, epoch=self.lease.epoch)
        self.wrote()
        try:
            await self.inflight.run(self.target.append, entry)
        except LeaseLostError:
            raise
        except Exception as e:  # the step already happened; losing its record only costs a re-run later
            log.warning("journal entry %s of session %r could not be written (the run goes on): %s: %s",
                        record.step_key, self.request.session_id, type(e).__name__, e)
        if time.monotonic() - self._proven >= self.recheck_s:
            await self._recheck_lease()

    async def _recheck_lease(self) -> None:
        try:
            await asyncio.to_thread(self.target.check_lease, self.lease)
            self.proven()
        except LeaseLostError:
            raise
        except Exception as e:  # unreadable now: the next checkpoint write or recheck decides
            log.warning("lease of session %r could not be re-read: %s: %s", self.request.session_id,
                        type(e).__name__, e)
