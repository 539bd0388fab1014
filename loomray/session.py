"""Executing one run request against a store: the entry point every runtime uses.

``execute_request(agent, request, store)`` is what ``InProcRuntime`` and
``LocalRuntime`` call in this process and what the Ray session actor calls in
its own. It owns the session's lease for the duration of the run (every write
carries it; a :class:`storage.errors.LeaseLostError` stops the run), plans
where the run starts (fresh, a checkpoint, a fork, or the continuation of an
unfinished run), adapts the store to the loop's journal and checkpoint seams,
and writes session status rows for the supervisor.

Recovery rule (docs/contracts.md): a request whose spec equals the session's
last, unfinished run continues that run under the same ``run_id``: the latest
checkpoint of that run is restored (if any) and every journaled step with the
same inputs is answered from the journal. Re-issuing the same ``run`` after a
crash therefore bills no model call twice.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import socket
from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict

from loomray.errors import CheckpointException, LoomrayUserError
from loomray.events import EmitFn, Event, deliver
from loomray.ids import new_id
from loomray.journal import JournalRecord, StepRunner, input_hash, tool_step_key
from loomray.loop import (
    CONTINUE_NUDGE, CheckpointWriter, LoopOptions, LoopState, dangling_tool_calls, run_loop, run_of_cursor,
)
from loomray.records import Checkpoint, Message, RunResult, utcnow
from loomray.tools import as_tools

from storage.errors import LeaseLostError
from storage.rows import JournalEntry, SessionRow

log = logging.getLogger("loomray.session")

RUN_START = "run-start"
RUN_END = "run-end"


class RunRequest(BaseModel):
    """One run or resume, as plain JSON (it crosses process and actor boundaries).

    ``fork_of`` names the source session when this request starts a fork:
    ``from_checkpoint`` is then a checkpoint of that session and
    ``session_id`` the fork's new id.
    """

    model_config = ConfigDict(frozen=True)

    kind: Literal["run", "resume"] = "run"
    prompt: str | None = None
    session_id: str
    user_id: str | None = None
    from_checkpoint: str = "latest"
    run_id: str | None = None
    metadata: dict[str, Any] | None = None
    context: Any = None
    output_schema: dict[str, Any] | None = None
    effort: str | None = None
    fork_of: str | None = None

    def spec_hash(self) -> str:
        """What makes two requests "the same run" for the recovery rule."""
        return input_hash(self.model_dump(mode="json", include={
            "kind", "prompt", "session_id", "user_id", "from_checkpoint", "fork_of", "output_schema", "effort"}))


@dataclass
class _Plan:
    run_id: str
    state: LoopState
    prompt: str | None
    prior: list[JournalRecord] = field(default_factory=list)
    next_seq: int = 0
    continuing: bool = False
    start_output: dict[str, Any] = field(default_factory=dict)
    resumed_from_checkpoint: bool = False
    resume_position: str | None = None
    #: A restored checkpoint that already finished this run (crash after its final write).
    finished: Checkpoint | None = None


def _records(entries: list[JournalEntry]) -> list[JournalRecord]:
    return [JournalRecord(seq=e.seq, step_key=e.step_key, kind=e.kind, input_hash=e.input_hash, output=e.output)
            for e in entries if e.kind in ("model", "tool")]


def _load(store: Any, session_id: str, checkpoint_id: str, user_id: str | None) -> Checkpoint | None:
    raw = store.get_checkpoint(session_id, checkpoint_id, user_id=user_id)
    if raw is None:
        return None
    return Checkpoint.from_json(raw)


def _fresh(agent: Any, request: RunRequest, run_id: str) -> LoopState:
    messages = [Message(role="system", content=agent.instructions)] if agent.instructions else []
    return LoopState(session_id=request.session_id, user_id=request.user_id, run_id=run_id,
                     agent_id=agent.name, messages=messages)


def _from_checkpoint(agent: Any, request: RunRequest, run_id: str, ckpt: Checkpoint) -> LoopState:
    return LoopState(session_id=request.session_id, user_id=request.user_id, run_id=run_id, agent_id=agent.name,
                     messages=list(ckpt.messages), turn=ckpt.turn, usage=ckpt.cumulative_usage,
                     parent_checkpoint_id=ckpt.checkpoint_id,
                     forked_from=request.fork_of if request.fork_of else ckpt.forked_from)


def _pending_tool_records(store: Any, ckpt: Checkpoint, user_id: str | None) -> list[JournalRecord]:
    """Journaled results of the restored checkpoint's dangling tool calls (so they are not run twice)."""
    pending = dangling_tool_calls(list(ckpt.messages))
    source_run = run_of_cursor(ckpt.cursor)
    if not pending or not source_run:
        return []
    keys = {tool_step_key(ckpt.turn, c.id) for c in pending}
    try:
        entries = store.journal_list(ckpt.session_id, source_run, user_id=user_id)
    except Exception as e:  # the journal is an optimisation here: without it the tools run again
        log.warning("could not read journal of run %s of session %r: %s", source_run, ckpt.session_id, e)
        return []
    return [r for r in _records(entries) if r.step_key in keys]


def _plan(agent: Any, request: RunRequest, store: Any) -> _Plan:
    sid, uid = request.session_id, request.user_id
    spec = request.spec_hash()
    runs = store.journal_runs(sid, user_id=uid)
    last_id = runs[-1] if runs else None
    last_entries = store.journal_list(sid, last_id, user_id=uid) if last_id else []
    last_start = next((e for e in last_entries if e.kind == "run_start"), None)
    last_done = any(e.kind == "run_end" for e in last_entries)

    continuing_id = None
    if request.run_id is not None and request.run_id in runs:
        continuing_id = request.run_id
    elif request.run_id is None and last_start is not None and not last_done and last_start.input_hash == spec:
        continuing_id = last_id

    if continuing_id is not None:
        entries = last_entries if continuing_id == last_id else store.journal_list(sid, continuing_id, user_id=uid)
        start = next((e for e in entries if e.kind == "run_start"), None)
        start_out = dict(start.output) if start else {}
        prior: list[JournalRecord] = []
        if start_out.get("replay_from"):
            prior += _records(store.journal_list(sid, start_out["replay_from"], user_id=uid))
        prior += _records(entries)
        next_seq = max((e.seq for e in entries), default=-1) + 1
        latest = _load(store, sid, "latest", uid)
        if latest is not None and run_of_cursor(latest.cursor) == continuing_id:
            # This run already checkpointed: restore its newest snapshot; its prompt is in the transcript.
            plan = _Plan(run_id=continuing_id, state=_from_checkpoint(agent, request, continuing_id, latest),
                         prompt=None, prior=prior, next_seq=next_seq, continuing=True, start_output=start_out,
                         resumed_from_checkpoint=True, resume_position=latest.position)
            plan.state.forked_from = latest.forked_from
            if latest.execution_status == "completed":
                plan.finished = latest
            return plan
        base = _base(agent, request, store, continuing_id, start_out)
        base.prior = prior + base.prior
        base.next_seq, base.continuing, base.start_output = next_seq, True, start_out
        return base

    run_id = request.run_id or new_id("run")
    plan = _base(agent, request, store, run_id, None, last=(last_id, last_start))
    return plan


def _base(agent: Any, request: RunRequest, store: Any, run_id: str, start_out: dict | None,
          last: tuple[str | None, JournalEntry | None] = (None, None)) -> _Plan:
    """Where a run begins (first attempt, or a continuation that has no checkpoint of its own yet)."""
    sid, uid = request.session_id, request.user_id
    if request.kind == "run":
        if request.prompt is None:
            raise LoomrayUserError(f"run() on session {sid!r} needs a prompt")
        return _Plan(run_id=run_id, state=_fresh(agent, request, run_id), prompt=request.prompt,
                     start_output={"kind": "run", "prompt": request.prompt})

    source = request.fork_of or sid
    wanted = (start_out or {}).get("base_checkpoint_id") or request.from_checkpoint
    ckpt = _load(store, source, wanted, uid)
    if ckpt is None and (request.fork_of or wanted != "latest"):
        raise CheckpointNotFound(f"session {source!r} (user {uid!r}) has no checkpoint {wanted!r}")
    if ckpt is not None:
        prompt = request.prompt if request.prompt is not None else CONTINUE_NUDGE
        return _Plan(run_id=run_id, state=_from_checkpoint(agent, request, run_id, ckpt), prompt=prompt,
                     prior=_pending_tool_records(store, ckpt, uid), resumed_from_checkpoint=True,
                     resume_position=ckpt.position,
                     start_output={"kind": "resume", "prompt": prompt, "base_checkpoint_id": ckpt.checkpoint_id,
                                   "source_session": source})
    # Fallback: no checkpoint. Re-run against the session's last run, replaying its journaled steps.
    if start_out is not None:  # continuing a fallback run: same prompt and replay source as at its start
        prompt = start_out.get("prompt")
        return _Plan(run_id=run_id, state=_fresh(agent, request, run_id), prompt=prompt, start_output=start_out)
    last_id, last_start = last
    last_prompt = last_start.output.get("prompt") if last_start is not None else None
    prompt = request.prompt if request.prompt is not None else last_prompt
    if prompt is None:
        raise LoomrayUserError(f"session {sid!r} (user {uid!r}) has no checkpoint and no run to resume; pass a prompt")
    out: dict[str, Any] = {"kind": "run", "prompt": prompt, "fallback": True}
    prior: list[JournalRecord] = []
    if last_id is not None and prompt == last_prompt:
        out["replay_from"] = last_id
        prior = _records(store.journal_list(sid, last_id, user_id=uid))
    return _Plan(run_id=run_id, state=_fresh(agent, request, run_id), prompt=prompt, prior=prior, start_output=out)


class CheckpointNotFound(LoomrayUserError, CheckpointException):
    """The checkpoint a resume or fork names does not exist (for this user)."""


class _StoreSink:
    """The journal seam: one create-only object per step, carrying the lease."""

    def __init__(self, store: Any, request: RunRequest, run_id: str, lease: Any) -> None:
        self.store, self.request, self.run_id, self.lease = store, request, run_id, lease

    async def append(self, record: JournalRecord) -> None:
        entry = JournalEntry(session_id=self.request.session_id, user_id=self.request.user_id, run_id=self.run_id,
                             seq=record.seq, step_key=record.step_key, kind=record.kind,
                             input_hash=record.input_hash, output=record.output, epoch=self.lease.epoch)
        try:
            await asyncio.to_thread(self.store.journal_append, entry, lease=self.lease)
        except LeaseLostError:
            raise
        except Exception as e:  # the step already happened; losing its record only costs a re-run later
            log.warning("journal entry %s of session %r could not be written (the run goes on): %s: %s",
                        record.step_key, self.request.session_id, type(e).__name__, e)


def _owner() -> str:
    return f"{socket.gethostname()}:{os.getpid()}"


def _output_validator(output_type: Any, schema: dict[str, Any] | None):
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


async def execute_request(
    agent: Any,
    request: RunRequest,
    store: Any,
    *,
    max_checkpoints_per_session: int = 20,
    emit: EmitFn | None = None,
    extra_tools: Any = (),
    output_type: Any = None,
    owner: str | None = None,
    agent_ref: str | None = None,
    node_id: str | None = None,
) -> RunResult:
    """Run ``request`` for ``agent`` against ``store``, holding the session lease. See the module docstring.

    ``extra_tools`` and ``output_type`` (a pydantic class) are live objects and
    only work in the process that holds them; ``request.output_schema`` is
    the JSON form that crosses process boundaries.
    """
    t = asyncio.to_thread
    sid, uid = request.session_id, request.user_id
    lease = await t(store.acquire_lease, sid, user_id=uid, owner=owner or _owner())
    plan = await t(_plan, agent, request, store)
    # In-process callers may pass live objects as context; the stored spec names them instead.
    spec_json = request.model_dump_json(fallback=lambda v: f"<unserializable {type(v).__name__}>")

    async def status(state: str, error: str | None = None) -> None:
        row = SessionRow(session_id=sid, user_id=uid, status=state, updated_at=utcnow(), run_id=plan.run_id,
                         agent_ref=agent_ref, spec_json=spec_json, epoch=lease.epoch, node_id=node_id, error=error)
        try:
            await t(store.put_session, row)
        except Exception as e:  # status rows are for observers; the run does not depend on them
            log.warning("session row %s of %r could not be written: %s", state, sid, e)

    async def on_event(event: Event) -> None:
        await deliver(emit, event)

    tuning = agent.tuning
    ckpt_cfg = tuning.checkpoint_config()
    sink = _StoreSink(store, request, plan.run_id, lease) if tuning.journal else None
    tools = dict(agent.tools)
    tools.update(as_tools(extra_tools))
    steps = StepRunner(agent.model, tools, sink=sink, prior=plan.prior, next_seq=plan.next_seq, emit=on_event,
                       session_id=sid, run_id=plan.run_id, stream=emit is not None)
    plan.state.epoch = lease.epoch
    await status("running")
    try:
        if not plan.continuing and sink is not None:
            await steps.record("run_start", RUN_START, request.spec_hash(), plan.start_output)
        elif not plan.continuing:
            steps.seq += 1
        if plan.finished is not None:
            result = _finished_result(plan)
        else:
            async def put(ckpt: Checkpoint, data: bytes) -> None:
                u = ckpt.cumulative_usage
                await t(store.put_checkpoint, data, session_id=sid, checkpoint_id=ckpt.checkpoint_id, user_id=uid,
                        turn=ckpt.turn, created_at=ckpt.created_at, position=ckpt.position,
                        execution_status=ckpt.execution_status, message_count=len(ckpt.messages),
                        input_tokens=u.input_tokens, output_tokens=u.output_tokens, cost_usd=u.cost_usd,
                        parent_checkpoint_id=ckpt.parent_checkpoint_id, forked_from=ckpt.forked_from,
                        agent_id=ckpt.agent_id, lease=lease, keep=max_checkpoints_per_session)

            writer = CheckpointWriter(put, durability=tuning.durability, emit=on_event,
                                      is_fatal=lambda e: isinstance(e, LeaseLostError))
            options = LoopOptions(
                tuning=tuning, checkpoint=ckpt_cfg, prompt=plan.prompt,
                tool_schemas=[x.schema for x in tools.values()], output_schema=request.output_schema,
                output_validator=_output_validator(output_type, request.output_schema), effort=request.effort,
                context=request.context, resumed_from_checkpoint=plan.resumed_from_checkpoint,
                resume_position=plan.resume_position)
            result = await run_loop(plan.state, steps, options, writer=writer, emit=on_event)
        # Status first, run_end last: a crash between them re-enters this run and finds it finished.
        await status("completed")
        if sink is not None:
            await steps.record("run_end", RUN_END, "", {"turns": result.turns, "checkpoint_id": result.checkpoint_id,
                                                        "model_calls": result.model_calls})
    except LeaseLostError:
        raise  # fenced: a newer incarnation owns the session and its status rows
    except BaseException as e:
        await status("failed", error=f"{type(e).__name__}: {e}")
        raise
    return result


def _finished_result(plan: _Plan) -> RunResult:
    ckpt = plan.finished
    assert ckpt is not None
    return RunResult(output=ckpt.messages[-1].content if ckpt.messages else "", messages=list(ckpt.messages),
                     usage=ckpt.cumulative_usage, session_id=ckpt.session_id, user_id=ckpt.user_id,
                     run_id=plan.run_id, turns=ckpt.turn, checkpoint_id=ckpt.checkpoint_id,
                     resumed_from_checkpoint=True, resume_position=ckpt.position, forked_from=ckpt.forked_from)
