"""The agent loop: model call, tool calls, repeat. No Ray, no storage.

A *pass* is one model call plus the tool calls it asked for; ``turn`` counts
completed passes. Persistence is injected: the loop hands finished
:class:`~loomray.records.Checkpoint` records to a :class:`CheckpointWriter`
(serialized once, as bytes) and asks a :class:`~loomray.journal.StepRunner`
for model answers and tool results, which may be replayed from the journal.

Invariants the loop keeps:

- a transcript with dangling tool calls (an assistant message whose calls
  have no results yet, e.g. restored from an "after_model" checkpoint) is
  never sent to a model: the missing tool calls run (or replay) first;
- compaction happens at pass boundaries, before the checkpoint of that
  boundary, so a snapshot holds the compacted transcript;
- a failed checkpoint write logs a warning and the run goes on; an error
  the writer's ``is_fatal`` accepts (fencing, lost ownership, a non-transient
  error) stops the run before its next model or tool call once the write has
  reported it (with ``durability="async"`` an upload still in flight reports
  later: at the latest at the next checkpoint). ``LoopOptions.check_writes``
  covers writes the loop does not see, such as journal appends;
- repairing a transcript puts the results of dangling tool calls right after
  the assistant message that made the calls, before any later message;
- a spend limit (``Tuning.max_cost_usd``/``max_tokens``) is checked before
  every model call, after compaction: once the spend so far reached a limit
  the run checkpoints (unless nothing changed since the checkpoint it wrote or
  restored last) and returns ``stop_reason="budget_exceeded"`` without
  calling the model.

Control (``LoopOptions.controls``, see :mod:`loomray.control`). A *pass
boundary* is the top of a pass, right before its model call. At a boundary
the loop, in this order: stops for a cancel (nothing more is written);
stops for a pause (journals its consumption, then writes a checkpoint with
``execution_status="paused"``); stops over budget; then appends pending
signals as user messages, journaling each consumption. So no checkpoint is
ever written at a boundary after its signals: a restored boundary checkpoint
never holds them, and replay re-applies the journaled ones at the same
boundary, in journal order, before the (replayed) model call. A boundary
whose model step is journaled (replay) asks no new control request: adding
one would change the model input. Before tool calls that need approval
(``Tool.needs_approval``) the loop looks for a journaled decision, else asks
``controls`` for one; if any is missing, nothing of the pass runs and the
run returns ``stop_reason="awaiting_approval"`` after a checkpoint
(``position="after_model"``, ``execution_status="awaiting_approval"``). A
decision is journaled before the call runs (approved) or is answered with
the denial (denied). A cancel the caller requested while a step was in
flight (``controls.cancel_requested`` and the run's task cancelled) returns
``stop_reason="cancelled"``: queued checkpoint uploads are dropped, nothing
is flushed.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from loomray.compaction import compact, estimate_tokens
from loomray.config import CheckpointConfig, Tuning
from loomray.errors import LoomrayRunError, MaxTurnsExceeded
from loomray.events import (
    CheckpointEvent,
    CompactionEvent,
    ControlEvent,
    EmitFn,
    Event,
    ModelCall,
    ModelResponseEvent,
    RunEnd,
    RunError,
    RunStart,
    ToolCallEvent,
    ToolResultEvent,
    deliver,
)
from loomray.journal import StepRunner, approval_step_key, boundary_step_key, input_hash, model_step_key
from loomray.models.base import ModelRequest
from loomray.records import Checkpoint, Message, RunResult, StopReason, ToolCall, Usage
from loomray.tools import ToolContext

log = logging.getLogger("loomray.loop")

CONTINUE_NUDGE = "Continue the interrupted task."


class OutputValidationError(LoomrayRunError):
    """The model's final answer did not satisfy ``output_schema`` after the allowed retries."""


@dataclass
class LoopState:
    """Where a run starts: a fresh transcript or a restored checkpoint."""

    session_id: str
    messages: list[Message]
    turn: int = 0
    usage: Usage = field(default_factory=Usage)
    user_id: str | None = None
    run_id: str | None = None
    agent_id: str | None = None
    parent_checkpoint_id: str | None = None
    forked_from: str | None = None
    epoch: int | None = None


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
        self._tail: asyncio.Task | None = None
        self._aborted = False
        self.fatal: BaseException | None = None
        #: The id of the last checkpoint written successfully.
        self.last_ok_id: str | None = None
        self.written = 0
        self.bytes_written = 0

    async def save(self, ckpt: Checkpoint) -> None:
        self.check()
        data = ckpt.to_json_bytes()
        if not self._async:
            await self._write(ckpt, data)
            self.check()
            return
        prev = self._tail
        self._tail = asyncio.ensure_future(self._chained(prev, ckpt, data))

    async def _chained(self, prev: asyncio.Task | None, ckpt: Checkpoint, data: bytes) -> None:
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
                session_id=ckpt.session_id, run_id=_run_of(ckpt.cursor), turn=ckpt.turn,
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


def make_cursor(run_id: str | None, turn: int, position: str) -> str:
    """The re-entry marker stored in a checkpoint: which run wrote it, at which boundary."""
    return f"{run_id or '-'}:t{turn:04d}:{position}"


def _run_of(cursor: str | None) -> str | None:
    if not cursor:
        return None
    run = cursor.split(":", 1)[0]
    return None if run == "-" else run


def run_of_cursor(cursor: str | None) -> str | None:
    """The run id recorded in a checkpoint cursor (None for foreign or missing cursors)."""
    return _run_of(cursor)


def dangling_tool_calls(messages: list[Message]) -> list[ToolCall]:
    """Tool calls of the last assistant message that have no tool result after it."""
    for i in range(len(messages) - 1, -1, -1):
        m = messages[i]
        if m.role == "assistant":
            if not m.tool_calls:
                return []
            answered = {x.tool_call_id for x in messages[i + 1:] if x.role == "tool"}
            return [c for c in m.tool_calls if c.id not in answered]
    return []


def tool_results_slot(messages: list[Message]) -> int:
    """Where results for the last assistant message's tool calls belong.

    Right after that message and the tool results already following it, so a
    repaired transcript (a dangling call followed by a later user message)
    keeps every result next to its call, the order provider APIs require.
    """
    for i in range(len(messages) - 1, -1, -1):
        if messages[i].role == "assistant":
            j = i + 1
            while j < len(messages) and messages[j].role == "tool":
                j += 1
            return j
    return len(messages)


@dataclass
class ControlSnapshot:
    """The control requests pending for a session, as one look at them (``controls.poll()``) found them.

    Names are the requests' ids (their object names); ``signals`` are oldest first.
    """

    cancelled: bool = False
    pauses: list[str] = field(default_factory=list)
    signals: list[tuple[str, str]] = field(default_factory=list)
    #: tool call id -> (request name, approved, reason)
    decisions: dict[str, tuple[str, bool, str | None]] = field(default_factory=dict)


class _Stopped(Exception):
    """Raised inside a pass to return ``result`` (awaiting approval, cancelled) from :meth:`_Loop.run`."""

    def __init__(self, result: RunResult) -> None:
        super().__init__(result.stop_reason)
        self.result = result


def denial_message(call: ToolCall, reason: str | None) -> Message:
    """The error result a denied tool call returns to the model."""
    text = f"Tool call denied by the user: {reason}" if reason else "Tool call denied by the user."
    return Message(role="tool", content=text, tool_call_id=call.id, name=call.name, is_error=True)


@dataclass
class LoopOptions:
    """Per-run inputs that are not state."""

    tuning: Tuning
    checkpoint: CheckpointConfig | None
    prompt: str | None = None
    tool_schemas: list[dict[str, Any]] = field(default_factory=list)
    output_schema: dict[str, Any] | None = None
    #: Turns the final answer into the structured value, raising on invalid output.
    output_validator: Callable[[str], Any] | None = None
    effort: str | None = None
    context: Any = None
    resumed_from_checkpoint: bool = False
    resume_position: str | None = None
    #: Raises when a write outside the loop (the journal) failed in a way that must stop the run.
    check_writes: Callable[[], None] | None = None
    #: Where control requests come from (None: none). Duck-typed: ``await poll() -> ControlSnapshot``
    #: (one look, e.g. one LIST), ``consume(name)`` (the request was journaled as consumed), and a
    #: ``cancel_requested`` bool. See :mod:`loomray.control`.
    controls: Any = None
    #: ``execution_status`` of the restored checkpoint (with ``resumed_from_checkpoint``).
    resume_status: str | None = None


async def run_loop(
    state: LoopState,
    steps: StepRunner,
    options: LoopOptions,
    *,
    writer: CheckpointWriter | None = None,
    emit: EmitFn | None = None,
) -> RunResult:
    """Run passes until the model answers without tool calls; return the result."""
    loop = _Loop(state, steps, options, writer, emit)
    return await loop.run()


class _Loop:
    def __init__(self, state: LoopState, steps: StepRunner, options: LoopOptions,
                 writer: CheckpointWriter | None, emit: EmitFn | None) -> None:
        self.s = state
        self.steps = steps
        self.o = options
        self.writer = writer if options.checkpoint is not None else None
        self._emit = emit
        self.msgs = list(state.messages)
        self.turn = state.turn
        self.usage = state.usage
        self.parent = state.parent_checkpoint_id
        # The transcript as the last checkpoint this run wrote, or restored, holds it (None: not saved yet).
        self._saved: tuple[int, list[Message]] | None = (
            (state.turn, list(state.messages)) if options.resumed_from_checkpoint and self.parent else None)
        self._saved_status = options.resume_status if self._saved is not None else None
        # The turn of the restored checkpoint (None: started fresh): a pause journaled at that boundary and
        # recorded by that checkpoint ("paused") was honored; resuming goes past it.
        self._restored_turn = state.turn if options.resumed_from_checkpoint else None
        self._signals: list[tuple[str, str, bool]] = []

    async def emit(self, event: Event) -> None:
        await deliver(self._emit, event)

    def _ev(self) -> dict[str, Any]:
        return {"session_id": self.s.session_id, "run_id": self.s.run_id, "turn": self.turn}

    def check_writes(self) -> None:
        """Stop before the next step if a write failed in a way that must stop the run (see the module docstring)."""
        if self.writer is not None:
            self.writer.check()
        if self.o.check_writes is not None:
            self.o.check_writes()

    async def checkpoint(self, position: str, status: str = "active", pending: list[ToolCall] | None = None) -> None:
        if self.writer is None:
            return
        ckpt = Checkpoint(
            session_id=self.s.session_id, user_id=self.s.user_id, agent_id=self.s.agent_id,
            turn=self.turn, position=position, execution_status=status,  # type: ignore[arg-type]
            cursor=make_cursor(self.s.run_id, self.turn, position), parent_checkpoint_id=self.parent,
            forked_from=self.s.forked_from, epoch=self.s.epoch, message_count=len(self.msgs),
            cumulative_usage=self.usage, messages=self.msgs,
            pending_approvals=[c.id for c in pending] if pending is not None else None,
        )
        self.parent = ckpt.checkpoint_id
        self._saved = (self.turn, list(self.msgs))
        self._saved_status = status
        await self.writer.save(ckpt)

    def unsaved(self) -> bool:
        """True when the transcript changed since the checkpoint this run last wrote or restored."""
        return self._saved is None or self._saved != (self.turn, self.msgs)

    async def maybe_compact(self) -> None:
        budget = self.o.tuning.compact_after_tokens
        if budget is None or dangling_tool_calls(self.msgs):
            return
        before = estimate_tokens(self.msgs)
        new = compact(self.msgs, budget_tokens=budget, keep_last=self.o.tuning.compact_keep_last)
        if new is None:
            return
        n_before = len(self.msgs)
        self.msgs = new
        await self.emit(CompactionEvent(**self._ev(), tokens_before=before, tokens_after=estimate_tokens(new),
                                        messages_before=n_before, messages_after=len(new)))

    def needs_approval(self, call: ToolCall) -> bool:
        t = self.steps.tools.get(call.name)
        return t is not None and t.needs_approval(call)

    async def decide(self, calls: list[ToolCall]) -> dict[str, tuple[bool, str | None]]:
        """Decisions on the calls of this pass that need approval; raises :class:`_Stopped` when one is missing.

        A journaled decision is used as is (the policy is not asked again for it); the others come from
        ``controls`` (one look) and are journaled, all of them, before any call of the pass runs.
        """
        out: dict[str, tuple[bool, str | None]] = {}
        undecided: list[ToolCall] = []
        for call in calls:
            rec = self.steps.journaled(approval_step_key(self.turn, call.id))
            if rec is not None:
                out[call.id] = (bool(rec.output.get("approved")), rec.output.get("reason"))
                await self.emit(ControlEvent(**self._ev(), kind="approval", control=rec.output.get("control"),
                                             tool_call_id=call.id, approved=out[call.id][0],
                                             reason=out[call.id][1], replayed=True))
            elif self.needs_approval(call):
                undecided.append(call)
        if not undecided:
            return out
        c = self.o.controls
        snap = await c.poll() if c is not None else ControlSnapshot()
        if snap.cancelled:
            raise _Stopped(self.cancelled())
        missing = [call for call in undecided if call.id not in snap.decisions]
        if missing:
            raise _Stopped(await self.await_approval(missing))
        for call in undecided:
            name, approved, reason = snap.decisions[call.id]
            await self.steps.record("approval", approval_step_key(self.turn, call.id),
                                    input_hash({"name": call.name, "arguments": call.arguments}),
                                    {"control": name, "call_id": call.id, "tool": call.name, "approved": approved,
                                     "reason": reason})
            c.consume(name)
            out[call.id] = (approved, reason)
            await self.emit(ControlEvent(**self._ev(), kind="approval", control=name, tool_call_id=call.id,
                                         approved=approved, reason=reason))
        return out

    async def await_approval(self, missing: list[ToolCall]) -> RunResult:
        """Stop before the pass's tool calls: checkpoint the assistant message that made them, and return."""
        log.info("session %r run %s waits for approval of %s", self.s.session_id, self.s.run_id,
                 [c.id for c in missing])
        if self.writer is not None and (self.unsaved() or self._saved_status != "awaiting_approval"):
            await self.checkpoint("after_model", status="awaiting_approval", pending=missing)
        if self.writer is not None:
            await self.writer.flush()
        return self.result("awaiting_approval", output="", pending=missing)

    def cancelled(self) -> RunResult:
        """The result of a cancelled run: nothing more is written (queued uploads are dropped)."""
        log.info("session %r run %s cancelled", self.s.session_id, self.s.run_id)
        if self.writer is not None:
            self.writer.abort()
        return self.result("cancelled", output="")

    async def run_tools(self, calls: list[ToolCall]) -> None:
        """Run (or replay) ``calls`` concurrently; put their results, in call order, right after the calls."""
        self.check_writes()
        decisions = await self.decide(calls)

        async def one(call: ToolCall) -> Message:
            await self.emit(ToolCallEvent(**self._ev(), tool_call=call))
            decided = decisions.get(call.id)
            if decided is not None and not decided[0]:
                msg = denial_message(call, decided[1])
                await self.emit(ToolResultEvent(**self._ev(), tool_call_id=call.id, name=call.name,
                                                content=msg.content, is_error=True, replayed=False))
                return msg
            ctx = ToolContext(session_id=self.s.session_id, user_id=self.s.user_id, run_id=self.s.run_id,
                              turn=self.turn, tool_call_id=call.id, context=self.o.context)
            msg, replayed = await self.steps.call_tool(call, ctx, turn=self.turn)
            await self.emit(ToolResultEvent(**self._ev(), tool_call_id=call.id, name=call.name,
                                            content=msg.content, is_error=msg.is_error, replayed=replayed))
            return msg

        results = await asyncio.gather(*(one(c) for c in calls))
        at = tool_results_slot(self.msgs)
        self.msgs[at:at] = results

    async def finish_pass_with_tools(self, calls: list[ToolCall]) -> None:
        await self.run_tools(calls)
        self.turn += 1
        await self.maybe_compact()
        if self.o.checkpoint and self.o.checkpoint.saves_after_tools():
            await self.checkpoint("after_tools")

    async def run(self) -> RunResult:
        await self.emit(RunStart(**self._ev(), prompt=self.o.prompt,
                                 restored_checkpoint_id=self.s.parent_checkpoint_id if self.o.resumed_from_checkpoint else None,
                                 replaying=self.steps.replaying))
        try:
            try:
                result = await self._run()
            except _Stopped as stopped:
                result = stopped.result
        except asyncio.CancelledError:
            c = self.o.controls
            if c is None or not c.cancel_requested:
                if self.writer is not None:
                    try:
                        await self.writer.flush()
                    except Exception:
                        pass
                raise
            # Cancelled on request while a step was in flight: the step is abandoned, nothing more is written.
            task = asyncio.current_task()
            if task is not None and hasattr(task, "uncancel"):
                task.uncancel()
            result = self.cancelled()
        except BaseException as e:
            if self.writer is not None:
                try:
                    await self.writer.flush()
                except Exception:
                    pass
            if isinstance(e, Exception):
                await self.emit(RunError(**self._ev(), error_type=type(e).__name__, error=str(e)))
            raise
        await self.emit(RunEnd(**self._ev(), output=result.output, usage=result.usage,
                               model_calls=result.model_calls, stop_reason=result.stop_reason))
        return result

    async def _run(self) -> RunResult:
        start_turn = self.turn
        # A half-written pass (restored "after_model" checkpoint) completes before anything else.
        pending = dangling_tool_calls(self.msgs)
        if pending:
            await self.finish_pass_with_tools(pending)
        if self.o.prompt is not None:
            self.msgs.append(Message(role="user", content=self.o.prompt))
        retries = 0
        structured = None
        while True:
            if self.turn - start_turn >= self.o.tuning.max_turns:
                if self.writer is not None and not (self.o.checkpoint and self.o.checkpoint.saves_after_tools()):
                    await self.checkpoint("after_tools")
                if self.writer is not None:
                    await self.writer.flush()
                raise MaxTurnsExceeded(
                    f"session {self.s.session_id!r} hit max_turns={self.o.tuning.max_turns} before the model "
                    "stopped; resume() continues it")
            await self.maybe_compact()
            assert not dangling_tool_calls(self.msgs), "never send dangling tool calls to a model"
            self.check_writes()
            stopped = await self.boundary()
            if stopped is not None:
                return stopped
            over = self.o.tuning.over_budget(self.usage)
            if over is not None:
                return await self.stop("budget_exceeded", over)
            if await self.apply_signals():
                await self.maybe_compact()
            request = ModelRequest(messages=self.msgs, tools=self.o.tool_schemas,
                                   output_schema=self.o.output_schema, effort=self.o.effort)
            await self.emit(ModelCall(**self._ev(), message_count=len(self.msgs), step_key=model_step_key(self.turn)))
            response, replayed = await self.steps.complete(request, turn=self.turn)
            message = response.message
            if message.role != "assistant":
                message = message.model_copy(update={"role": "assistant"})
            self.usage = self.usage + response.usage
            self.msgs.append(message)
            await self.emit(ModelResponseEvent(**self._ev(), message=message, usage=response.usage, replayed=replayed))
            if message.tool_calls:
                if self.o.checkpoint and self.o.checkpoint.saves_after_model():
                    await self.checkpoint("after_model")
                await self.finish_pass_with_tools(list(message.tool_calls))
                continue
            self.turn += 1
            if self.o.output_validator is not None:
                try:
                    structured = self.o.output_validator(message.content)
                except Exception as e:
                    if retries >= self.o.tuning.output_retries:
                        raise OutputValidationError(
                            f"session {self.s.session_id!r}: final answer does not match output_schema: {e}") from e
                    retries += 1
                    self.msgs.append(Message(role="user", content=(
                        f"Your answer did not match the required JSON schema ({e}). "
                        "Reply with only a JSON object that matches it.")))
                    continue
            break
        await self.checkpoint("after_tools", status="completed")
        if self.writer is not None:
            await self.writer.flush()
        return self.result("completed", output=self.msgs[-1].content, structured=structured)

    async def boundary(self) -> RunResult | None:
        """Control at the pass boundary before pass ``turn``: a cancel or a pause stops the run here.

        Also collects the signals to append (:meth:`apply_signals`): the ones journaled at this boundary
        (replay), then, at a live boundary, the new ones. One ``controls.poll()`` at most.
        """
        journaled = self.steps.boundary_records(self.turn)
        self._signals = [(r.output.get("control", ""), str(r.output.get("text", "")), True)
                         for r in journaled if r.kind == "signal"]
        c = self.o.controls
        if c is None or self.steps.journaled(model_step_key(self.turn)) is not None:
            return None  # replaying this boundary: its model call is journaled, nothing new may join it
        paused = [r for r in journaled if r.kind == "pause"]
        if paused and not (self._restored_turn == self.turn and self.o.resume_status == "paused"):
            # Consumed here, but the stop was not recorded (the run died in between): stop now.
            return await self.pause(paused[-1].output.get("control", ""), replayed=True)
        snap = await c.poll()
        if snap.cancelled:
            return self.cancelled()
        if snap.pauses:
            for name in snap.pauses:
                await self.steps.record("pause", boundary_step_key(self.turn, name), "", {"control": name})
                c.consume(name)
            return await self.pause(snap.pauses[-1], replayed=False)
        self._signals += [(name, text, False) for name, text in snap.signals]
        return None

    async def pause(self, name: str, *, replayed: bool) -> RunResult:
        await self.emit(ControlEvent(**self._ev(), kind="pause", control=name, replayed=replayed))
        log.info("session %r run %s paused at turn %d", self.s.session_id, self.s.run_id, self.turn)
        if self.writer is not None and (self.unsaved() or self._saved_status != "paused"):
            await self.checkpoint("after_tools", status="paused")
        if self.writer is not None:
            await self.writer.flush()
        return self.result("paused", output="")

    async def apply_signals(self) -> bool:
        """Append this boundary's signals as user messages (new ones are journaled first); True if any."""
        signals, self._signals = self._signals, []
        for name, text, replayed in signals:
            if not replayed:
                await self.steps.record("signal", boundary_step_key(self.turn, name), input_hash(text),
                                        {"control": name, "text": text})
                self.o.controls.consume(name)
            self.msgs.append(Message(role="user", content=text))
            await self.emit(ControlEvent(**self._ev(), kind="signal", control=name, text=text, replayed=replayed))
        return bool(signals)

    async def stop(self, reason: StopReason, why: str) -> RunResult:
        """Stop before the next model call, leaving the run unfinished and resumable: checkpoint, flush, return."""
        log.info("session %r run %s stops (%s): %s", self.s.session_id, self.s.run_id, reason, why)
        if self.writer is not None and self.unsaved():
            await self.checkpoint("after_tools")
        if self.writer is not None:
            await self.writer.flush()
        return self.result(reason, output="")

    def result(self, reason: StopReason, *, output: str, structured: Any = None,
               pending: list[ToolCall] = ()) -> RunResult:  # type: ignore[assignment]
        checkpoint_id = None
        if self.writer is not None:
            # Nothing written by this call but nothing changed either: the restored checkpoint is the state.
            checkpoint_id = self.writer.last_ok_id
            if checkpoint_id is None and self.parent == self.s.parent_checkpoint_id and not self.unsaved():
                checkpoint_id = self.parent
        return RunResult(
            output=output,
            structured=structured,
            messages=self.msgs,
            usage=self.usage,
            session_id=self.s.session_id,
            user_id=self.s.user_id,
            run_id=self.s.run_id,
            turns=self.turn,
            checkpoint_id=checkpoint_id,
            resumed_from_checkpoint=self.o.resumed_from_checkpoint,
            resume_position=self.o.resume_position,  # type: ignore[arg-type]
            forked_from=self.s.forked_from,
            model_calls=self.steps.model_calls,
            replayed_steps=self.steps.replayed,
            stop_reason=reason,
            pending_approvals=list(pending),
        )
