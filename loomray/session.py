"""Executing one run request against a store: the entry point every runtime uses.

``execute_request`` takes the session's lease, plans where the run starts (:mod:`loomray.takeover` reads,
:mod:`loomray.planning` decides), runs the loop with the store behind its seams (:mod:`loomray.run_writes`)
and records how it ended. docs/design.md, "A run, end to end", walks through it.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import socket
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel

from loomray import control, telemetry
from loomray.checkpoint_format import ChainEncoder
from loomray.errors import CheckpointNotFound
from loomray.events import EmitFn, Event, deliver
from loomray.fencing import fence_session, take_lease
from loomray.ids import new_id, new_segment, segment_id
from loomray.journal import StepRunner
from loomray.loop import CheckpointWriter, LoopOptions, run_loop
from loomray.planning import RunPlan, cancelled_result
from loomray.records import Checkpoint, RunResult, utcnow
from loomray.run_errors import index_error, record_error
from loomray.run_request import RunRequest
from loomray.run_writes import GuardedJournal, InflightWrites, StoreJournalSink, WriteGuard
from loomray.session_store import SessionStore
from loomray.storage import CheckpointInfo
from loomray.storage.errors import LeaseLostError
from loomray.storage.rows import CheckpointRow, Lease, SessionRow
from loomray.takeover import plan_takeover
from loomray.tools import as_tools
from loomray.variants import agent_for, fork_transcript

if TYPE_CHECKING:  # the Agent module imports this one
    from loomray.agent import Agent

log = logging.getLogger("loomray.session")

#: Also importable from here: ``CheckpointNotFound`` (documented as ``loomray.session.CheckpointNotFound``)
#: and ``fence_session`` (what ``loomray cancel`` calls to fence a session without running it).
__all__ = ["CheckpointNotFound", "RunRequest", "execute_request", "fence_session"]


async def execute_request(
    agent: Agent,
    request: RunRequest,
    store: SessionStore,
    *,
    max_checkpoints_per_session: int = 20,
    emit: EmitFn | None = None,
    extra_tools: Sequence[Any] = (),
    output_type: type[BaseModel] | None = None,
    owner: str | None = None,
    agent_ref: str | None = None,
    node_id: str | None = None,
) -> RunResult:
    """Run ``request`` for ``agent`` against ``store``, holding the session lease.

    ``extra_tools`` and ``output_type`` are live objects for this process only; ``request.output_schema`` is
    the JSON form that crosses process boundaries.
    """
    sid, uid = request.session_id, request.user_id
    # Registered before the cancel check: a cancel either finds this run here or its cancel.json is found below.
    handle = control.register(store, sid, uid)
    try:
        if handle.cancel_requested or await asyncio.to_thread(control.is_cancelled, store, sid, uid):
            return cancelled_result(request.session_id, request.user_id)
        lease, fence = await asyncio.to_thread(take_lease, store, request, owner or _owner())
        plan = await asyncio.to_thread(plan_takeover, store, request, lease, fence, _new_run_id)
        # A fork of a variant runs the variant's agent: the driver's copy, else rebuilt from the stored request.
        run = _SessionRun(agent_for(agent, plan.request.variant), plan, store, lease, handle, max_checkpoints_per_session=max_checkpoints_per_session,
                          emit=emit, extra_tools=extra_tools, output_type=output_type, agent_ref=agent_ref,
                          node_id=node_id)
        return await run.execute()
    finally:
        control.unregister(handle)  # after the run's last write: what a cancel waits for


def _new_run_id() -> str:
    """A new run's id; ``new_id`` is looked up here when called, so a test can replace it (skewed clocks)."""
    return new_id("run")


def _owner() -> str:
    return f"{socket.gethostname()}:{os.getpid()}"


async def _cancelled(store: SessionStore, sid: str, uid: str | None) -> bool:
    try:
        return await asyncio.to_thread(control.is_cancelled, store, sid, uid)
    except Exception:
        return False


def _output_validator(output_type: type[BaseModel] | None,
                      schema: dict[str, Any] | None) -> Callable[[str], Any] | None:
    if output_type is not None:
        return output_type.model_validate_json
    if schema is not None:
        def parse(text: str) -> Any:
            value = json.loads(text)
            if schema.get("type") == "object" and not isinstance(value, dict):
                raise ValueError("expected a JSON object")
            return value
        return parse
    return None


class _SessionRun:
    """One planned run holding the lease: the loop, its store writes and status rows, and how it ends."""

    def __init__(self, agent: Agent, plan: RunPlan, store: SessionStore, lease: Lease, handle: control.RunHandle, *,
                 max_checkpoints_per_session: int, emit: EmitFn | None, extra_tools: Sequence[Any],
                 output_type: type[BaseModel] | None, agent_ref: str | None, node_id: str | None) -> None:
        self.agent, self.plan, self.request = agent, plan, plan.request
        self.store, self.lease, self.handle = store, lease, handle
        self.max_checkpoints_per_session, self.emit, self.output_type = max_checkpoints_per_session, emit, output_type
        self.agent_ref, self.node_id = agent_ref, node_id
        sid, uid = self.request.session_id, self.request.user_id
        self.inflight = InflightWrites()
        # Every failed write is judged by one guard: a warning while ownership is proven, else the run stops.
        self.guard = WriteGuard(store, lease)
        self.sink = (StoreJournalSink(GuardedJournal(store, self.guard), self.request, plan.run_id, lease,
                                      inflight=self.inflight) if agent.tuning.journal else None)
        self.tools = {**agent.tools, **as_tools(extra_tools)}
        self.steps = StepRunner(agent.model, self.tools, sink=self.sink, prior=list(plan.prior),
                                next_seq=plan.next_seq, emit=self.on_event, session_id=sid, run_id=plan.run_id,
                                stream=emit is not None,
                                before_model_call=self.sink.before_step if self.sink is not None else None,
                                before_tools=self.sink.before_step if self.sink is not None else None,
                                journal_tools=not _checkpoint_holds_tool_results(agent.tuning))
        self.controls = control.SessionControls(store, sid, uid, consumed=plan.consumed, handle=handle,
                                                journaled=self.sink is not None, inflight=self.inflight)
        self.state = plan.initial_state(agent_id=agent.name, instructions=agent.instructions, epoch=lease.epoch)
        if self.request.variant is not None and plan.restored is not None and plan.restored.session_id != sid:
            # At the fork point (not when the fork restores a checkpoint of its own): the variant's transcript.
            self.state.messages = fork_transcript(self.state.messages, self.request.variant)
        # Checkpoints build on the restored one's chain (a fork's on its parent's); the store writes one object
        # per checkpoint and acknowledges them in batches (storage.checkpoint_log).
        config = agent.tuning.checkpoint_config()
        self.encoder = ChainEncoder(self.state.chain, full_every=config.full_every if config else 1)
        self.checkpoints = store.checkpoints.log(lease, keep=max_checkpoints_per_session)
        self.consumed_at: dict[str, Any] = {}
        # One id segment per run: its checkpoints are consecutive links, which a chain names as one range.
        self.segment, self.links = new_segment(), 0
        # The session's cumulative cost as of the checkpoint this run last wrote, or started from (in
        # whichever session): a checkpoint's spend is its running total minus that, so the spend of a fork
        # tree's checkpoints sums to what its model calls were billed. Writes are ordered (also with
        # durability="async"); a failed write's spend is carried by the next checkpoint written.
        self.written_cost = self.state.usage.cost_usd
        self.written_turn: int | None = self.state.turn

    async def execute(self) -> RunResult:
        """Run to the end; a fencing, a cancel or a failure ends it with the status row it calls for."""
        watcher = None
        if self.store.objects.backend != "memory":  # in memory, every cancel comes from this process
            watcher = asyncio.ensure_future(control.watch_cancel(
                self.store, self.request.session_id, self.request.user_id, self.handle, control.cancel_poll_s()))
        await self.status("running")
        try:
            return await self._run_and_finalize()
        except LeaseLostError:
            if self.handle.cancel_requested or await _cancelled(self.store, self.request.session_id,
                                                                 self.request.user_id):
                # Fenced by the cancel itself (loomray cancel takes the lease): the run ends as cancelled.
                await self.inflight.drain()
                return cancelled_result(self.request.session_id, self.request.user_id, self.plan.run_id)
            raise  # fenced: a newer incarnation owns the session and its status rows
        except BaseException as e:
            if self.handle.cancel_requested and isinstance(e, (Exception, asyncio.CancelledError)):
                await self.inflight.drain()
                await self.status("cancelled")
                if isinstance(e, asyncio.CancelledError):
                    raise
                return cancelled_result(self.request.session_id, self.request.user_id, self.plan.run_id)
            # The index is read across users: it gets the error's type only; the text stays with the session.
            await asyncio.to_thread(record_error, self.store, self.request.session_id, self.request.user_id,
                                    self.plan.run_id, e)
            await self.status("failed", error=index_error(e))
            raise
        finally:
            if watcher is not None:
                watcher.cancel()

    async def _run_and_finalize(self) -> RunResult:
        if not self.plan.continuing:
            await self.steps.record_run_start(self.request.spec_hash(), self.plan.start_output)
        if self.plan.finished:
            return await self._finalize(self.plan.finished_result())
        result = await self._run_loop()
        if result.stop_reason == "cancelled":
            await self.inflight.drain()
            await self.status("cancelled")
            return result
        self.guard.check()  # a write that failed after the last step: the status must not claim durability
        return await self._finalize(result)

    async def _run_loop(self) -> RunResult:
        """The loop in its own task, so that a cancel abandons the step in flight (see loomray.control)."""
        writer = CheckpointWriter(self.put_checkpoint, durability=self.agent.tuning.durability, emit=self.on_event,
                                  is_fatal=self.guard.is_fatal, flush_store=self.flush_checkpoints)
        self.steps.before_model_record = writer.uploaded  # a model answer is journaled after its inputs are durable
        loop_task = asyncio.ensure_future(run_loop(self.state, self.steps, self._loop_options(), writer=writer,
                                                   emit=self.on_event))
        self.handle.task = loop_task
        if self.handle.cancel_requested:
            loop_task.cancel()
        try:
            return await loop_task
        except asyncio.CancelledError:
            me = asyncio.current_task()
            if not (loop_task.cancelled() and self.handle.cancel_requested and me is not None
                    and not _cancel_pending(me)):
                raise
            return cancelled_result(self.request.session_id, self.request.user_id, self.plan.run_id)  # cancelled before its first step
        finally:
            self.handle.task = None

    def _loop_options(self) -> LoopOptions:
        request, plan, tuning = self.request, self.plan, self.agent.tuning
        return LoopOptions(
            tuning=tuning, checkpoint=tuning.checkpoint_config(), prompt=plan.prompt,
            tool_schemas=[x.schema for x in self.tools.values()], output_schema=request.output_schema,
            output_validator=_output_validator(self.output_type, request.output_schema), effort=request.effort,
            context=request.context, resumed_from_checkpoint=plan.restored is not None,
            resume_position=plan.resume_position, check_writes=self.guard.check, controls=self.controls,
            resume_status=plan.resume_status, new_checkpoint_id=self.new_checkpoint_id,
            trace_parent=plan.request.trace_parent)

    def new_checkpoint_id(self) -> str:
        """The next link of this run's id segment."""
        self.links += 1
        return segment_id(self.segment, self.links)

    async def _finalize(self, result: RunResult) -> RunResult:
        """Record how the run ended: its status row, and for a completed run its ``run_end``."""
        if self.guard.undurable:
            # Writes failed after the last checkpoint (warnings while the lease was provable): the run's end is
            # not durable, so neither "completed" nor run_end may claim it. The session stays "running" and a
            # re-issued run continues it from what is durable.
            log.warning("session %r: run %s finished, but %d write(s) since its last checkpoint failed; it is not "
                        "recorded as completed (re-issue the run to record its end)", self.request.session_id,
                        self.plan.run_id, self.guard.undurable)
            return result
        if self.sink is not None:
            await self.sink.prove()  # a run fenced since its last proof must not report its end (LeaseLostError)
        await self.controls.release(lambda: self.store.leases.check(self.lease))
        if result.stop_reason != "completed":
            # Stopped before its end (over budget, awaiting approval, paused): the run stays unfinished, no
            # run_end, so resume(None) or the same run() continues it. The status is not an active one: a
            # supervisor leaves it alone.
            await self.status(result.stop_reason)
            return result
        # Status first, run_end last: a crash between them re-enters this run and finds it finished.
        await self.status("completed")
        await self.steps.record_run_end({"turns": result.turns, "checkpoint_id": result.checkpoint_id,
                                         "model_calls": result.model_calls})
        return result

    async def status(self, state: str, error: str | None = None) -> None:
        """Write a status row for observers (the supervisor, ``loomray ls``); the run does not depend on it."""
        sid, uid = self.request.session_id, self.request.user_id
        # No request in the row: it may hold secrets, and the index is readable by every query.
        # The request lives in the run's record beside the session's objects (storage.journal).
        row = SessionRow(session_id=sid, user_id=uid, status=state, updated_at=utcnow(), run_id=self.plan.run_id,
                         agent_ref=self.agent_ref, spec_json=None, epoch=self.lease.epoch, node_id=self.node_id,
                         error=error, turn=self.written_turn, cost_usd=self.written_cost,
                         exploration_id=self.request.exploration_id())
        try:
            await asyncio.to_thread(self.store.sessions.put, row)
        except Exception as e:
            log.warning("session row %s of %r could not be written: %s", state, sid, e)

    async def on_event(self, event: Event) -> None:
        """Every event of the run: to the caller's ``emit``, then to the process-wide observers (telemetry)."""
        await deliver(self.emit, event)
        telemetry.observe(event, agent=self.agent, epoch=self.lease.epoch, node_id=self.node_id,
                          store=self.store.url)

    async def put_checkpoint(self, ckpt: Checkpoint) -> list[tuple[str, int]]:
        """The loop's checkpoint seam: one incremental object under the lease (see :mod:`loomray.checkpoint_format`),
        judged by the write guard; returns the checkpoints the store acknowledged meanwhile."""
        sid, uid = self.request.session_id, self.request.user_id
        u = ckpt.cumulative_usage
        spend = (None if u.cost_usd is None or self.written_cost is None
                 else max(0.0, u.cost_usd - self.written_cost))
        encoded = self.encoder.encode(ckpt)
        consumed = self.controls.durable_mark()  # journaled before this write; durable once it is acknowledged
        info = CheckpointInfo(
            session_id=sid, checkpoint_id=ckpt.checkpoint_id, user_id=uid, turn=ckpt.turn, created_at=ckpt.created_at,
            position=ckpt.position, execution_status=ckpt.execution_status, message_count=len(ckpt.messages),
            input_tokens=u.input_tokens, output_tokens=u.output_tokens, cost_usd=u.cost_usd, spend_usd=spend,
            parent_checkpoint_id=ckpt.parent_checkpoint_id, forked_from=ckpt.forked_from, agent_id=ckpt.agent_id,
            chain=encoded.chain)
        if self.sink is not None:
            self.sink.wrote()
        try:
            rows = await self.inflight.run(self.checkpoints.put, encoded.body, info)
        except Exception as e:
            self.encoder.reset()  # the next checkpoint must not build on an object that may not exist
            await asyncio.to_thread(self.guard.failed, f"checkpoint {ckpt.checkpoint_id}", e)  # raises unless a warning
            await self.steps.persist_volatile()  # what this checkpoint was to hold goes to the journal instead
            raise
        self.encoder.commit(encoded)
        self.steps.checkpointed()
        self.written_cost, self.written_turn = u.cost_usd, ckpt.turn
        self.guard.durable()
        if consumed:
            self.consumed_at[ckpt.checkpoint_id] = consumed
        return await self._acknowledged(rows)

    async def flush_checkpoints(self) -> list[tuple[str, int]]:
        """Have the store index and acknowledge the checkpoints it has not yet (the writer's flush)."""
        try:
            rows = await self.inflight.run(self.checkpoints.flush)
        except Exception as e:
            await asyncio.to_thread(self.guard.failed, "checkpoint index", e)  # raises unless a warning
            return []
        return await self._acknowledged(rows)

    async def _acknowledged(self, rows: Sequence[CheckpointRow]) -> list[tuple[str, int]]:
        """``rows`` were acknowledged: the lease was proven after they landed, so what was journaled before them
        is durable too (control requests consumed then may go)."""
        if rows and self.sink is not None:
            self.sink.proven()
        for row in rows:
            consumed = self.consumed_at.pop(row.checkpoint_id, None)
            if consumed:
                await self.controls.durable(consumed)
        return [(r.checkpoint_id, r.size) for r in rows]


def _checkpoint_holds_tool_results(tuning: Any) -> bool:
    """True when every pass's tool results are in a checkpoint written right after them: the journal need not
    hold them as well. With async durability that checkpoint uploads while the next model call runs, and that
    call's answer is journaled only once the upload is done (``StepRunner.before_model_record``): a tool that
    would return something else when run again can never make a journaled answer's inputs differ."""
    config = tuning.checkpoint_config()
    return config is not None and config.saves_after_tools()


def _cancel_pending(task: asyncio.Task[Any]) -> bool:
    """Whether someone cancelled ``task`` itself (``Task.cancelling`` exists from Python 3.11; 3.10 cannot tell)."""
    cancelling = getattr(task, "cancelling", None)
    return bool(cancelling()) if cancelling is not None else False
