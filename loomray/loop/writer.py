"""Checkpoint writes for the loop: serialized once, in order, sync or async; and the cursor they carry."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

from loomray.events import CheckpointEvent, Event
from loomray.records import Checkpoint

log = logging.getLogger("loomray.loop")


def make_cursor(run_id: str | None, turn: int, position: str) -> str:
    """The re-entry marker stored in a checkpoint: which run wrote it, at which boundary."""
    return f"{run_id or '-'}:t{turn:04d}:{position}"


def run_of_cursor(cursor: str | None) -> str | None:
    """The run id recorded in a checkpoint cursor (None for foreign or missing cursors)."""
    if not cursor:
        return None
    run = cursor.split(":", 1)[0]
    return None if run == "-" else run


class CheckpointWriter:
    """Writes checkpoints through ``put(checkpoint)``, sync or async (ordered), and reports them as acknowledged.

    The seam's contract is in docs/contracts.md, "Loop seams". Async mode overlaps an upload with the next
    model call only while that call can hide it (the last one, :meth:`model_took`, outlasted the last upload):
    an upload overlapping a shorter step competes with it for the interpreter, and writing in line is only
    ever more durable.
    """

    def __init__(
        self,
        put: Callable[[Checkpoint], Awaitable[list[tuple[str, int]]]],
        *,
        durability: str = "sync",
        emit: Callable[[Event], Awaitable[None]] | None = None,
        is_fatal: Callable[[BaseException], bool] = lambda e: False,
        flush_store: Callable[[], Awaitable[list[tuple[str, int]]]] | None = None,
    ) -> None:
        self._put = put
        self._flush_store = flush_store
        self._async = durability == "async"
        self._emit = emit
        self._is_fatal = is_fatal
        self._tail: asyncio.Future[None] | None = None
        self._aborted = False
        self.fatal: BaseException | None = None
        #: Written, not acknowledged yet, by id.
        self._unacked: dict[str, Checkpoint] = {}
        #: The id of the last checkpoint acknowledged.
        self.last_ok_id: str | None = None
        #: How long the last upload and the loop's last model call took (s); None until measured.
        self.upload_s: float | None = None
        self.model_s: float | None = None

    def model_took(self, seconds: float) -> None:
        """The loop's last model call (not a replay) took ``seconds``."""
        self.model_s = seconds

    def _overlaps(self) -> bool:
        """Async mode, and the next model call can be expected to hide this upload."""
        if not self._async:
            return False
        return self.upload_s is None or self.model_s is None or self.model_s >= self.upload_s

    async def save(self, ckpt: Checkpoint) -> None:
        """Write ``ckpt`` now (sync, or async behind a short model call) or queue it behind the uploads before
        it (async)."""
        self.check()
        if not self._overlaps():
            await self.uploaded()  # in order: behind any upload still queued
            await self._write(ckpt)
            self.check()
            return
        prev = self._tail
        self._tail = asyncio.ensure_future(self._chained(prev, ckpt))

    async def _chained(self, prev: asyncio.Future[None] | None, ckpt: Checkpoint) -> None:
        if prev is not None:
            await asyncio.shield(prev)  # keep uploads in order
        if self.fatal is None and not self._aborted:
            await self._write(ckpt)

    def abort(self) -> None:
        """Drop every queued upload that has not started (a cancelled run makes nothing more durable)."""
        self._aborted = True

    async def _write(self, ckpt: Checkpoint) -> None:
        started = time.perf_counter()
        try:
            acked = await self._put(ckpt)
        except asyncio.CancelledError:
            raise
        except Exception as e:
            if self._is_fatal(e):
                self.fatal = e
                return
            log.warning("checkpoint %s of session %r could not be written (the run goes on): %s: %s",
                        ckpt.checkpoint_id, ckpt.session_id, type(e).__name__, e)
            await self._event(ckpt, 0, ok=False, error=f"{type(e).__name__}: {e}")
            return
        self.upload_s = time.perf_counter() - started
        self._unacked[ckpt.checkpoint_id] = ckpt
        await self._acknowledged(acked)

    async def _acknowledged(self, acked: list[tuple[str, int]]) -> None:
        for checkpoint_id, size in acked:
            ckpt = self._unacked.pop(checkpoint_id, None)
            if ckpt is None:
                continue
            self.last_ok_id = checkpoint_id
            await self._event(ckpt, size, ok=True)

    async def _event(self, ckpt: Checkpoint, size: int, *, ok: bool, error: str | None = None) -> None:
        if self._emit is not None:
            await self._emit(CheckpointEvent(
                session_id=ckpt.session_id, run_id=run_of_cursor(ckpt.cursor), turn=ckpt.turn,
                checkpoint_id=ckpt.checkpoint_id, position=ckpt.position,
                execution_status=ckpt.execution_status, size=size, ok=ok, error=error))

    def check(self) -> None:
        """Raise the fencing error a background upload hit, if any."""
        if self.fatal is not None:
            raise self.fatal

    async def uploaded(self) -> None:
        """Wait until every checkpoint saved so far was written (or failed), without asking the store to
        acknowledge them; raise a fencing error if one happened."""
        if self._tail is not None:
            await asyncio.shield(self._tail)
        self.check()

    async def flush(self) -> None:
        """Wait for every queued upload, then have the store acknowledge what it has not yet; raise a fencing
        error if one happened."""
        if self._tail is not None:
            await self._tail
        self.check()
        if self._flush_store is not None and self._unacked:
            try:
                await self._acknowledged(await self._flush_store())
            except asyncio.CancelledError:
                raise
            except Exception as e:
                if not self._is_fatal(e):
                    raise
                self.fatal = e
        self.check()
