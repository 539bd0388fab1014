"""The runtime seam: where a run executes and where its state lives (docs/contracts.md).

In-process runtimes call :func:`~loomray.session.execute_request` directly; the Ray runtime overrides
:meth:`Runtime.execute` and :meth:`Runtime.execute_many`. Checkpoint reads and control requests go straight
to ``self.store`` from the caller's process.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel

from loomray import control
from loomray.checkpoint_format import load_checkpoint
from loomray.events import EmitFn
from loomray.records import Checkpoint, CheckpointMeta, RunResult
from loomray.run_request import RunRequest
from loomray.session import execute_request
from loomray.session_store import SessionStore

if TYPE_CHECKING:  # the Agent module imports this one
    from loomray.agent import Agent


def per_request(agent: Agent | Sequence[Agent], requests: Sequence[RunRequest]) -> list[Agent]:
    """The agent of each request: one for all, or one per request (a ``ValueError`` when the counts differ)."""
    if not isinstance(agent, Sequence):
        return [agent] * len(requests)
    if len(agent) != len(requests):
        raise ValueError(f"{len(agent)} agents for {len(requests)} requests")
    return list(agent)


class Runtime:
    """Base runtime: in-process execution against ``self.store``; ``max_checkpoints_per_session`` below 1
    keeps every checkpoint. A runtime built without a store lists no checkpoints and finds none."""

    store: SessionStore
    max_checkpoints_per_session: int

    def __init__(self, store: SessionStore, *, max_checkpoints_per_session: int = 20) -> None:
        if isinstance(max_checkpoints_per_session, bool) or not isinstance(max_checkpoints_per_session, int):
            raise TypeError("max_checkpoints_per_session must be an int")
        self.store = store
        self.max_checkpoints_per_session = max_checkpoints_per_session

    @property
    def keep(self) -> int:
        """Retention passed to the store: 0 (keep everything) when pruning is disabled."""
        return self.max_checkpoints_per_session if self.max_checkpoints_per_session >= 1 else 0

    async def execute(
        self,
        agent: Agent,
        request: RunRequest,
        *,
        emit: EmitFn | None = None,
        extra_tools: Sequence[Any] = (),
        output_type: type[BaseModel] | None = None,
    ) -> RunResult:
        """Run one request to completion and return its result.

        An agent registered by reference (``set_agent_ref``) has its reference stored with the session's
        rows, so the session stays resumable by reference (``loomray resume``) whichever runtime ran it.
        """
        return await execute_request(agent, request, self.store, max_checkpoints_per_session=self.keep,
                                     emit=emit, extra_tools=extra_tools, output_type=output_type,
                                     agent_ref=getattr(agent, "loomray_ref", None))

    async def execute_many(
        self,
        agent: Agent | Sequence[Agent],
        requests: Sequence[RunRequest],
        *,
        emit: EmitFn | None = None,
        extra_tools: Sequence[Any] = (),
        output_type: type[BaseModel] | None = None,
    ) -> list[RunResult]:
        """Run several requests at once (fan-out); results in request order.

        ``agent`` runs every request, or is a list of one agent per request (the forks of variants).
        """
        return list(await asyncio.gather(*(
            self.execute(a, r, emit=emit, extra_tools=extra_tools, output_type=output_type)
            for a, r in zip(per_request(agent, requests), requests, strict=True))))

    # -- reads -------------------------------------------------------------
    async def list_checkpoints(self, session_id: str, *, limit: int | None = 50,
                               user_id: str | None = None) -> list[CheckpointMeta]:
        """Newest first, no payload; ``[]`` for an unknown session or a runtime without a store."""
        if self.store is None:
            return []
        rows = await asyncio.to_thread(self.store.checkpoints.list, session_id, user_id=user_id, limit=limit)
        # Validated as the model's fields say (the index stores statuses and positions as plain strings).
        return [CheckpointMeta.model_validate({
            "session_id": r.session_id, "checkpoint_id": r.checkpoint_id, "turn": r.turn, "created_at": r.created_at,
            "user_id": r.user_id, "execution_status": r.execution_status, "position": r.position,
            "message_count": r.message_count, "epoch": r.epoch}) for r in rows]

    async def get_checkpoint(self, session_id: str, checkpoint_id: str = "latest", *,
                             user_id: str | None = None) -> Checkpoint | None:
        """The checkpoint, or None when it does not exist for this user; a failed load raises CheckpointException."""
        if self.store is None:
            return None
        return await asyncio.to_thread(load_checkpoint, self.store, session_id, checkpoint_id, user_id=user_id)

    # -- steering (loomray.control) ----------------------------------------------------------
    # A runtime whose runs live elsewhere may add a faster path but must keep writing the control objects:
    # they are what makes control durable.
    async def signal(self, session_id: str, text: str, *, user_id: str | None = None) -> str:
        """Store a signal for the session's next pass boundary; returns its id."""
        return await asyncio.to_thread(control.send_signal, self.store, session_id, user_id, text)

    async def pause(self, session_id: str, *, user_id: str | None = None) -> str | None:
        """Ask the session to pause at its next pass boundary; returns the request's id (None: paused already)."""
        return await asyncio.to_thread(control.request_pause, self.store, session_id, user_id)

    async def cancel(self, session_id: str, *, user_id: str | None = None) -> None:
        """Cancel the session; returns once the cancel is acknowledged (see :mod:`loomray.control`)."""
        await control.cancel_session_async(self.store, session_id, user_id)

    async def decide(self, session_id: str, call_id: str, decision: Any, *, user_id: str | None = None,
                     check_pending: bool = True) -> bool:
        """Record a decision on a tool call the session waits on; False when the same one was recorded."""
        return await asyncio.to_thread(control.record_decision, self.store, session_id, user_id, call_id, decision,
                                       source="api", check_pending=check_pending)

    def close(self) -> None:
        """Release the store's clients."""
        if self.store is not None:
            self.store.close()
