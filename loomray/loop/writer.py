"""Checkpoint writes for the loop: serialized once, in order, sync or async; and the cursor they carry."""

from __future__ import annotations

import asyncio
import logging
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
    """Writes checkpoints through ``put(checkpoint, data)``; sync or async (ordered) durability.

    ``put`` gets the bytes serialized once here. Errors for which ``is_fatal``
    is true (fencing) stop the run; any other error is logged as a warning,
    reported as a ``checkpoint`` event with ``ok=False``, and the run goes on.
    """

    def __init__(
        self,
        put: Callable[[Checkpoint, bytes], Awaitable[None]],
        *,
        durability: str = "sync",
        emit: Callable[[Event], Awaitable[None]] | None = None,
        is_fatal: Callable[[BaseException], bool] = lambda e: False,
    ) -> None:
        self._put = put
        self._async = durability == "async"
        self._emit = emit
        self._is_fatal = is_fatal
        self._tail: asyncio.Future[None] | None = None
        self._aborted = False
        self.fatal: BaseException | None = None
        #: The id of the last checkpoint written successfully.
        self.last_ok_id: str | None = None
        self.written = 0
        self.bytes_written = 0

    async def save(self, ckpt: Checkpoint) -> None:
        """Write ``ckpt`` now (sync) or queue it behind the uploads before it (async)."""
        self.check()
        data = ckpt.to_json_bytes()
        if not self._async:
            await self._write(ckpt, data)
            self.check()
            return
        prev = self._tail
        self._tail = asyncio.ensure_future(self._chained(prev, ckpt, data))

    async def _chained(self, prev: asyncio.Future[None] | None, ckpt: Checkpoint, data: bytes) -> None:
        if prev is not None:
            await asyncio.shield(prev)  # keep uploads in order
        if self.fatal is None and not self._aborted:
            await self._write(ckpt, data)

    def abort(self) -> None:
        """Drop every queued upload that has not started (a cancelled run makes nothing more durable)."""
        self._aborted = True

    async def _write(self, ckpt: Checkpoint, data: bytes) -> None:
        try:
            await self._put(ckpt, data)
        except asyncio.CancelledError:
            raise
        except Exception as e:
            if self._is_fatal(e):
                self.fatal = e
                return
            log.warning("checkpoint %s of session %r could not be written (the run goes on): %s: %s",
                        ckpt.checkpoint_id, ckpt.session_id, type(e).__name__, e)
            await self._event(ckpt, len(data), ok=False, error=f"{type(e).__name__}: {e}")
            return
        self.last_ok_id = ckpt.checkpoint_id
        self.written += 1
        self.bytes_written += len(data)
        await self._event(ckpt, len(data), ok=True)

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

    async def flush(self) -> None:
        """Wait for every queued upload; raise a fencing error if one happened."""
        if self._tail is not None:
            await self._tail
        self.check()
