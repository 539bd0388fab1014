"""One run's transcript and counters, and what the run writes: checkpoints, condensing, its result.

The passes themselves are :class:`loomray.loop.run.AgentLoop`'s; steering at
pass boundaries is :class:`loomray.loop.steering.SteeredLoop`'s. Both build on
this class.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from loomray.condense import condense, estimate_tokens
from loomray.events import CondenseEvent, EmitFn, Event, deliver
from loomray.ids import new_id
from loomray.journal import StepRunner
from loomray.loop.state import LoopOptions, LoopState
from loomray.loop.transcript import dangling_tool_calls
from loomray.loop.writer import CheckpointWriter, make_cursor
from loomray.records import Checkpoint, ExecutionStatus, Message, Position, RunResult, StopReason, ToolCall

log = logging.getLogger("loomray.loop")


class LoopCore:
    """The state a run carries from pass to pass, and its checkpoint bookkeeping."""

    def __init__(self, state: LoopState, steps: StepRunner, options: LoopOptions,
                 writer: CheckpointWriter | None, emit: EmitFn | None) -> None:
        self.state = state
        self.steps = steps
        self.options = options
        self.writer = writer if options.checkpoint is not None else None
        self._emit = emit
        self.messages = list(state.messages)
        self.turn = state.turn
        self.usage = state.usage
        #: The parent of the next checkpoint: the last one this run wrote, else the one it restored.
        self.parent_checkpoint_id = state.parent_checkpoint_id
        # The transcript as the last checkpoint this run wrote, or restored, holds it (None: not saved yet).
        self.saved: tuple[int, list[Message]] | None = (
            (state.turn, list(state.messages)) if options.resumed_from_checkpoint and self.parent_checkpoint_id
            else None)
        self.saved_status = options.resume_status if self.saved is not None else None

    async def emit(self, event: Event) -> None:
        """Hand ``event`` to the caller's ``emit`` (if any)."""
        await deliver(self._emit, event)

    def event_fields(self) -> dict[str, Any]:
        """The fields every event of this run carries at this point."""
        return {"session_id": self.state.session_id, "run_id": self.state.run_id, "turn": self.turn}

    def check_writes(self) -> None:
        """Stop before the next step if a write failed in a way that must stop the run (docs/design.md)."""
        if self.writer is not None:
            self.writer.check()
        if self.options.check_writes is not None:
            self.options.check_writes()

    async def checkpoint(self, position: Position, status: ExecutionStatus = "active",
                         pending: list[ToolCall] | None = None) -> None:
        """Write the transcript as it is now (no-op without checkpointing); ``pending``: calls awaiting approval."""
        if self.writer is None:
            return
        state = self.state
        ids = self.options.new_checkpoint_id
        ckpt = Checkpoint(
            checkpoint_id=ids() if ids is not None else new_id("ckpt"),
            session_id=state.session_id, user_id=state.user_id, agent_id=state.agent_id,
            turn=self.turn, position=position, execution_status=status,
            cursor=make_cursor(state.run_id, self.turn, position), parent_checkpoint_id=self.parent_checkpoint_id,
            forked_from=state.forked_from, epoch=state.epoch, message_count=len(self.messages),
            cumulative_usage=self.usage, messages=self.messages,
            pending_approvals=[c.id for c in pending] if pending is not None else None,
        )
        self.parent_checkpoint_id = ckpt.checkpoint_id
        self.saved = (self.turn, list(self.messages))
        self.saved_status = status
        await self.writer.save(ckpt)

    def unsaved(self) -> bool:
        """True when the transcript changed since the checkpoint this run last wrote or restored."""
        return self.saved is None or self.saved != (self.turn, self.messages)

    async def maybe_condense(self) -> None:
        """Condense the transcript once it passes ``Tuning.condense_after_tokens`` (never with calls dangling)."""
        budget = self.options.tuning.condense_after_tokens
        if budget is None or dangling_tool_calls(self.messages):
            return
        before = estimate_tokens(self.messages)
        new = condense(self.messages, budget_tokens=budget, keep_last=self.options.tuning.condense_keep_last)
        if new is None:
            return
        n_before = len(self.messages)
        self.messages = new
        await self.emit(CondenseEvent(**self.event_fields(), tokens_before=before,
                                      tokens_after=estimate_tokens(new), messages_before=n_before,
                                      messages_after=len(new)))

    async def stop(self, reason: StopReason, why: str) -> RunResult:
        """Stop before the next model call, leaving the run unfinished and resumable: checkpoint, flush, return."""
        log.info("session %r run %s stops (%s): %s", self.state.session_id, self.state.run_id, reason, why)
        if self.writer is not None and self.unsaved():
            await self.checkpoint("after_tools")
        if self.writer is not None:
            await self.writer.flush()
        return self.result(reason, output="")

    def result(self, reason: StopReason, *, output: str, structured: Any = None,
               pending: Sequence[ToolCall] = ()) -> RunResult:
        """What the run returns, naming the checkpoint that holds its state (if any)."""
        checkpoint_id = None
        if self.writer is not None:
            # Nothing written by this call but nothing changed either: the restored checkpoint is the state.
            checkpoint_id = self.writer.last_ok_id
            if (checkpoint_id is None and self.parent_checkpoint_id == self.state.parent_checkpoint_id
                    and not self.unsaved()):
                checkpoint_id = self.parent_checkpoint_id
        return RunResult(
            output=output,
            structured=structured,
            messages=self.messages,
            usage=self.usage,
            session_id=self.state.session_id,
            user_id=self.state.user_id,
            run_id=self.state.run_id,
            turns=self.turn,
            checkpoint_id=checkpoint_id,
            resumed_from_checkpoint=self.options.resumed_from_checkpoint,
            resume_position=self.options.resume_position,  # type: ignore[arg-type]  # a restored checkpoint's Position
            forked_from=self.state.forked_from,
            model_calls=self.steps.model_calls,
            replayed_steps=self.steps.replayed,
            stop_reason=reason,
            pending_approvals=list(pending),
        )
