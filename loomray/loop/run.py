"""The passes of a run: model call, tool calls, repeat, until the model answers without tool calls."""

from __future__ import annotations

import asyncio

from loomray.errors import MaxTurnsExceeded, OutputValidationError
from loomray.events import (
    EmitFn,
    ModelCall,
    ModelResponseEvent,
    RunEnd,
    RunError,
    RunStart,
    ToolCallEvent,
    ToolResultEvent,
)
from loomray.journal import StepRunner, model_step_key
from loomray.loop.state import LoopOptions, LoopState
from loomray.loop.steering import RunStopped, SteeredLoop
from loomray.loop.transcript import dangling_tool_calls, denial_message, tool_results_slot
from loomray.loop.writer import CheckpointWriter
from loomray.models.base import ModelRequest
from loomray.records import Message, RunResult, ToolCall
from loomray.tools import ToolContext


async def run_loop(
    state: LoopState,
    steps: StepRunner,
    options: LoopOptions,
    *,
    writer: CheckpointWriter | None = None,
    emit: EmitFn | None = None,
) -> RunResult:
    """Run passes until the model answers without tool calls; return the result."""
    loop = AgentLoop(state, steps, options, writer, emit)
    return await loop.run()


class AgentLoop(SteeredLoop):
    """One run of the loop, from its start (or restored checkpoint) to its result."""

    async def run(self) -> RunResult:
        """The run with its ``run_start`` and ``run_end``/``run_error`` events around it."""
        await self.emit(RunStart(**self.event_fields(), prompt=self.options.prompt,
                                 restored_checkpoint_id=(self.state.parent_checkpoint_id
                                                         if self.options.resumed_from_checkpoint else None),
                                 replaying=self.steps.replaying, user_id=self.state.user_id,
                                 forked_from=self.state.forked_from, trace_parent=self.options.trace_parent))
        try:
            try:
                result = await self.run_passes()
            except RunStopped as stopped:
                result = stopped.result
        except asyncio.CancelledError:
            controls = self.options.controls
            if controls is None or not controls.cancel_requested:
                await self.flush_quietly()
                raise
            # Cancelled on request while a step was in flight: the step is abandoned, nothing more is written.
            task = asyncio.current_task()
            if task is not None and hasattr(task, "uncancel"):
                task.uncancel()
            result = self.cancelled()
        except BaseException as e:
            await self.flush_quietly()
            if isinstance(e, Exception):
                await self.emit(RunError(**self.event_fields(), error_type=type(e).__name__, error=str(e)))
            raise
        await self.emit(RunEnd(**self.event_fields(), output=result.output, usage=result.usage,
                               model_calls=result.model_calls, stop_reason=result.stop_reason))
        return result

    async def flush_quietly(self) -> None:
        """Wait for queued uploads of a run that is failing anyway; their own errors do not mask its error."""
        if self.writer is not None:
            try:
                await self.writer.flush()
            except Exception:
                pass

    async def run_passes(self) -> RunResult:
        """Finish a half-written pass, add the prompt, then pass after pass until a final answer or a stop."""
        start_turn = self.turn
        # A half-written pass (restored "after_model" checkpoint) completes before anything else.
        pending = dangling_tool_calls(self.messages)
        if pending:
            await self.finish_pass_with_tools(pending)
        if self.options.prompt is not None:
            self.messages.append(Message(role="user", content=self.options.prompt))
        retries = 0
        structured = None
        while True:
            if self.turn - start_turn >= self.options.tuning.max_turns:
                await self.stop_at_max_turns()
            stopped = await self.before_model_call()
            if stopped is not None:
                return stopped
            message = await self.call_model()
            if message.tool_calls:
                if self.options.checkpoint and self.options.checkpoint.saves_after_model():
                    await self.checkpoint("after_model")
                await self.finish_pass_with_tools(list(message.tool_calls))
                continue
            self.turn += 1
            if self.options.output_validator is not None:
                try:
                    structured = self.options.output_validator(message.content)
                except Exception as e:
                    if retries >= self.options.tuning.output_retries:
                        raise OutputValidationError(f"session {self.state.session_id!r}: final answer does not "
                                                    f"match output_schema: {e}") from e
                    retries += 1
                    self.messages.append(Message(role="user", content=(
                        f"Your answer did not match the required JSON schema ({e}). "
                        "Reply with only a JSON object that matches it.")))
                    continue
            break
        await self.checkpoint("after_tools", status="completed")
        if self.writer is not None:
            await self.writer.flush()
        return self.result("completed", output=self.messages[-1].content, structured=structured)

    async def stop_at_max_turns(self) -> None:
        """Checkpoint what the run has (unless the last pass just did), then raise :class:`MaxTurnsExceeded`."""
        saves_after_tools = self.options.checkpoint and self.options.checkpoint.saves_after_tools()
        if self.writer is not None and not saves_after_tools:
            await self.checkpoint("after_tools")
        if self.writer is not None:
            await self.writer.flush()
        raise MaxTurnsExceeded(
            f"session {self.state.session_id!r} hit max_turns={self.options.tuning.max_turns} before the model "
            "stopped; resume() continues it")

    async def before_model_call(self) -> RunResult | None:
        """The pass boundary: condensing, control, the spend limit, then signals. A result stops the run."""
        await self.maybe_condense()
        assert not dangling_tool_calls(self.messages), "never send dangling tool calls to a model"
        self.check_writes()
        stopped = await self.boundary()
        if stopped is not None:
            return stopped
        over = self.options.tuning.over_budget(self.usage)
        if over is not None:
            return await self.stop("budget_exceeded", over)
        if await self.apply_signals():
            await self.maybe_condense()
        return None

    async def call_model(self) -> Message:
        """Ask (or replay) the model for this pass; append and return its assistant message."""
        request = ModelRequest(messages=self.messages, tools=self.options.tool_schemas,
                               output_schema=self.options.output_schema, effort=self.options.effort)
        await self.emit(ModelCall(**self.event_fields(), message_count=len(self.messages),
                                  step_key=model_step_key(self.turn)))
        response, replayed = await self.steps.complete(request, turn=self.turn)
        if self.writer is not None and not replayed:
            self.writer.model_took(self.steps.model_s)
        message = response.message
        if message.role != "assistant":
            message = message.model_copy(update={"role": "assistant"})
        self.usage = self.usage + response.usage
        self.messages.append(message)
        await self.emit(ModelResponseEvent(**self.event_fields(), message=message, usage=response.usage,
                                           replayed=replayed, step_key=model_step_key(self.turn),
                                           response_model=response.model, response_id=response.id,
                                           finish_reason=response.stop_reason))
        return message

    async def run_tools(self, calls: list[ToolCall]) -> None:
        """Run (or replay) ``calls`` concurrently; put their results, in call order, right after the calls."""
        self.check_writes()
        decisions = await self.decide(calls)
        running = [len(calls)]  # calls of this pass not finished: the last one's result goes to the checkpoint

        async def one(call: ToolCall) -> Message:
            try:
                return await run_one(call)
            finally:
                running[0] -= 1

        async def run_one(call: ToolCall) -> Message:
            decided = decisions.get(call.id)
            if decided is not None and decided.arguments is not None:
                call = call.model_copy(update={"arguments": decided.arguments})  # approved with edited arguments
            await self.emit(ToolCallEvent(**self.event_fields(), tool_call=call))
            if decided is not None and not decided.approved:
                # Answered in the tool's place (it does not run), or denied.
                msg = (Message(role="tool", content=decided.response, tool_call_id=call.id, name=call.name)
                       if decided.response is not None else denial_message(call, decided.reason))
                await self.emit(ToolResultEvent(**self.event_fields(), tool_call_id=call.id, name=call.name,
                                                content=msg.content, is_error=msg.is_error, replayed=False))
                return msg
            ctx = ToolContext(session_id=self.state.session_id, user_id=self.state.user_id,
                              run_id=self.state.run_id, turn=self.turn, tool_call_id=call.id,
                              context=self.options.context)
            msg, replayed = await self.steps.call_tool(call, ctx, turn=self.turn, last=lambda: running[0] == 1)
            await self.emit(ToolResultEvent(**self.event_fields(), tool_call_id=call.id, name=call.name,
                                            content=msg.content, is_error=msg.is_error, replayed=replayed))
            return msg

        await self.steps.before_tool_pass()  # a run fenced while its model call ran stops before its tools act
        results = await asyncio.gather(*(one(c) for c in calls))
        at = tool_results_slot(self.messages)
        self.messages[at:at] = results

    async def finish_pass_with_tools(self, calls: list[ToolCall]) -> None:
        """Run the pass's tool calls and close the pass: count it, condense, checkpoint "after_tools"."""
        await self.run_tools(calls)
        self.turn += 1
        await self.maybe_condense()
        if self.options.checkpoint and self.options.checkpoint.saves_after_tools():
            await self.checkpoint("after_tools")
