"""Steering inside a run: cancel, pause and signals at pass boundaries, approvals before tool calls.

The order at a boundary, and why each consumption is journaled before it takes effect: docs/design.md,
"The loop's invariants"; the requests come from ``LoopOptions.controls`` (:mod:`loomray.control`).
"""

from __future__ import annotations

import logging

from loomray.events import ControlEvent, EmitFn
from loomray.journal import StepRunner, approval_step_key, boundary_step_key, input_hash, model_step_key
from loomray.loop.core import LoopCore
from loomray.loop.state import LoopOptions, LoopState, ToolDecision
from loomray.loop.writer import CheckpointWriter
from loomray.records import Message, RunResult, ToolCall

log = logging.getLogger("loomray.loop")


class RunStopped(Exception):
    """Raised inside a pass to return ``result`` (awaiting approval, cancelled) from the run."""

    def __init__(self, result: RunResult) -> None:
        super().__init__(result.stop_reason)
        self.result = result


class SteeredLoop(LoopCore):
    """A run that honours control requests, where and in the order docs/design.md gives."""

    def __init__(self, state: LoopState, steps: StepRunner, options: LoopOptions,
                 writer: CheckpointWriter | None, emit: EmitFn | None) -> None:
        super().__init__(state, steps, options, writer, emit)
        # The turn of the restored checkpoint (None: started fresh): a pause journaled at that boundary and
        # recorded by that checkpoint ("paused") was honored; resuming goes past it.
        self.restored_turn = state.turn if options.resumed_from_checkpoint else None
        #: Signals to append at this boundary: (request name, text, replayed from the journal).
        self.pending_signals: list[tuple[str, str, bool]] = []

    def needs_approval(self, call: ToolCall) -> bool:
        """True when ``call``'s tool asks for a decision before it runs (``Tool.needs_approval``)."""
        t = self.steps.tools.get(call.name)
        return t is not None and t.needs_approval(call)

    async def decide(self, calls: list[ToolCall]) -> dict[str, ToolDecision]:
        """Decisions on the calls of this pass that need approval; raises :class:`RunStopped` when one is missing.

        A journaled decision is used as is (the policy is not asked again for it); the others come from
        ``controls`` (one look) and are journaled, all of them, before any call of the pass runs.
        """
        out: dict[str, ToolDecision] = {}
        undecided: list[ToolCall] = []
        for call in calls:
            rec = self.steps.journaled(approval_step_key(self.turn, call.id))
            if rec is not None:
                out[call.id] = ToolDecision.from_fields(rec.output)
                await self.emit(ControlEvent(**self.event_fields(), kind="approval", control=rec.output.get("control"),
                                             tool_call_id=call.id, approved=out[call.id].approved,
                                             reason=out[call.id].reason, replayed=True))
            elif self.needs_approval(call):
                undecided.append(call)
        if not undecided:
            return out
        controls = self.options.controls
        if controls is None:
            raise RunStopped(await self.await_approval(undecided))
        snap = await controls.poll()
        if snap.cancelled:
            raise RunStopped(self.cancelled())
        missing = [call for call in undecided if call.id not in snap.decisions]
        if missing:
            raise RunStopped(await self.await_approval(missing))
        for call in undecided:
            name, decision = snap.decisions[call.id]
            await self.steps.record("approval", approval_step_key(self.turn, call.id),
                                    input_hash({"name": call.name, "arguments": call.arguments}),
                                    {"control": name, "call_id": call.id, "tool": call.name, **decision.fields()})
            controls.consume(name)
            out[call.id] = decision
            await self.emit(ControlEvent(**self.event_fields(), kind="approval", control=name,
                                         tool_call_id=call.id, approved=decision.approved, reason=decision.reason))
        return out

    async def await_approval(self, missing: list[ToolCall]) -> RunResult:
        """Stop before the pass's tool calls: checkpoint the assistant message that made them, and return."""
        log.info("session %r run %s waits for approval of %s", self.state.session_id, self.state.run_id,
                 [c.id for c in missing])
        if self.writer is not None and (self.unsaved() or self.saved_status != "awaiting_approval"):
            await self.checkpoint("after_model", status="awaiting_approval", pending=missing)
        if self.writer is not None:
            await self.writer.flush()
        return self.result("awaiting_approval", output="", pending=missing)

    def cancelled(self) -> RunResult:
        """The result of a cancelled run: nothing more is written (queued uploads are dropped)."""
        log.info("session %r run %s cancelled", self.state.session_id, self.state.run_id)
        if self.writer is not None:
            self.writer.abort()
        return self.result("cancelled", output="")

    async def boundary(self) -> RunResult | None:
        """Control at the pass boundary before pass ``turn``: a cancel or a pause stops the run here.

        Also collects the signals to append (:meth:`apply_signals`): the ones journaled at this boundary
        (replay), then, at a live boundary, the new ones. One ``controls.poll()`` at most.
        """
        journaled = self.steps.boundary_records(self.turn)
        self.pending_signals = [(r.output.get("control", ""), str(r.output.get("text", "")), True)
                                for r in journaled if r.kind == "signal"]
        controls = self.options.controls
        if controls is None or self.steps.journaled(model_step_key(self.turn)) is not None:
            return None  # replaying this boundary: its model call is journaled, nothing new may join it
        paused = [r for r in journaled if r.kind == "pause"]
        recorded = (self.restored_turn == self.turn and self.options.resume_status == "paused") or (
            bool(paused) and paused[-1].output.get("stopped") is True)
        if paused and not recorded:
            # Consumed here, but the stop was not recorded (the run died in between): stop now.
            return await self.pause(paused[-1].output.get("control", ""), replayed=True)
        snap = await controls.poll()
        if snap.cancelled:
            return self.cancelled()
        if snap.pauses:
            for name in snap.pauses:
                await self.steps.record("pause", boundary_step_key(self.turn, name), "", {"control": name})
                controls.consume(name)
            return await self.pause(snap.pauses[-1], replayed=False)
        self.pending_signals += [(name, text, False) for name, text in snap.signals]
        return None

    async def pause(self, name: str, *, replayed: bool) -> RunResult:
        """Stop at this boundary for pause request ``name``: checkpoint as "paused" (unless already), flush."""
        await self.emit(ControlEvent(**self.event_fields(), kind="pause", control=name, replayed=replayed))
        log.info("session %r run %s paused at turn %d", self.state.session_id, self.state.run_id, self.turn)
        if self.writer is not None and (self.unsaved() or self.saved_status != "paused"):
            await self.checkpoint("after_tools", status="paused")
        if self.writer is not None:
            await self.writer.flush()
        elif name:
            # No checkpoint records the stop: the journal does (the pause's record again, marked stopped), so a
            # resume goes past this boundary, and a run re-issued after a crash before this record stops here.
            await self.steps.record("pause", boundary_step_key(self.turn, name), "", {"control": name, "stopped": True})
        return self.result("paused", output="")

    async def apply_signals(self) -> bool:
        """Append this boundary's signals as user messages (new ones are journaled first); True if any."""
        signals, self.pending_signals = self.pending_signals, []
        controls = self.options.controls
        for name, text, replayed in signals:
            if not replayed and controls is not None:  # a new signal came from controls.poll()
                await self.steps.record("signal", boundary_step_key(self.turn, name), input_hash(text),
                                        {"control": name, "text": text})
                controls.consume(name)
            self.messages.append(Message(role="user", content=text))
            await self.emit(ControlEvent(**self.event_fields(), kind="signal", control=name, text=text,
                                         replayed=replayed))
        return bool(signals)

