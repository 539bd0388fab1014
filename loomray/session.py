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
crash therefore bills no model call twice; ``resume()`` with no prompt from
"latest" continues such a run the same way, with the run's own stored request.
"Last" is what the store sequenced last (run records), never a node's clock.
Each run's request is stored in its run record beside the session's objects,
never in the session index, and a new owner fences the journal of the runs an
old writer may still append to before it reads them (``storage.journal``).

Sessions remember: a new ``run`` (not the continuation of an unfinished
run) on a session whose latest checkpoint ended a run (``execution_status
"completed"``) starts from that checkpoint's transcript, with its prompt
appended, instead of an empty one; its ``run_start`` and run record name
that checkpoint as the base, so recovery restores the same transcript.

A run the loop stopped before its end (``RunResult.stop_reason`` other than
"completed", e.g. "budget_exceeded", "awaiting_approval", "paused") records
no ``run_end``: it stays unfinished, its status row says why it stopped, and
``resume(None)`` or the same ``run`` continues it.

Control (:mod:`loomray.control`): a run registers itself for in-process
cancels, watches ``cancel.json`` (one GET every few seconds) and hands the
loop the session's control requests, minus those whose consumption the run
it continues or the session's last run journaled. The loop runs in its own
task, so a cancel abandons the step in flight; the run then waits for the
store writes already started, writes the status row "cancelled" and only
then lets the cancel be acknowledged. A cancelled session runs no more: a
request on it returns ``stop_reason="cancelled"`` and writes nothing.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import socket
import time
from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict

from loomray import control
from loomray.errors import CheckpointException, DurabilityLost, LoomrayUserError
from loomray.events import EmitFn, Event, deliver
from loomray.ids import new_id
from loomray.journal import STEP_KINDS, JournalRecord, StepRunner, approval_step_key, input_hash, tool_step_key
from loomray.loop import (
    CONTINUE_NUDGE,
    CheckpointWriter,
    LoopOptions,
    LoopState,
    dangling_tool_calls,
    run_loop,
    run_of_cursor,
)
from loomray.records import Checkpoint, Message, RunResult, load_checkpoint, utcnow
from loomray.tools import as_tools
from storage.errors import CorruptObjectError, LeaseLostError
from storage.journal import FenceNote
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
    #: The request the run executes: the caller's, or for ``resume(None)`` continuing an unfinished run,
    #: that run's own stored request (so its model requests, and their journal hashes, are unchanged).
    request: RunRequest | None = None
    #: ``execution_status`` of the checkpoint the run restores (None: none).
    resume_status: str | None = None
    #: Control requests whose consumption the continued run or the session's last run journaled.
    consumed: set[str] = field(default_factory=set)


def _records(entries: list[JournalEntry]) -> list[JournalRecord]:
    return [JournalRecord(seq=e.seq, step_key=e.step_key, kind=e.kind, input_hash=e.input_hash, output=e.output)
            for e in entries if e.kind in STEP_KINDS]


def _load(store: Any, session_id: str, checkpoint_id: str, user_id: str | None) -> Checkpoint | None:
    """The checkpoint or None; any failure to load it is a :class:`CheckpointException` (storage error as cause)."""
    return load_checkpoint(store, session_id, checkpoint_id, user_id=user_id)


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
    keys = {k for c in pending for k in (tool_step_key(ckpt.turn, c.id), approval_step_key(ckpt.turn, c.id))}
    try:
        entries = store.journal_list(ckpt.session_id, source_run, user_id=user_id)
    except Exception as e:  # the journal is an optimisation here: without it the tools run again
        log.warning("could not read journal of run %s of session %r: %s", source_run, ckpt.session_id, e)
        return []
    return [r for r in _records(entries) if r.step_key in keys]


@dataclass
class _LastRun:
    """The session's last run, by store order (its run record), else by sorted journal run id (old sessions)."""

    run_id: str | None = None
    record: Any = None
    journal: Any = None
    start: JournalEntry | None = None
    done: bool = False
    #: The entries replay may use, as this incarnation's seal will leave them.
    entries: list[JournalEntry] = field(default_factory=list)

    @property
    def spec(self) -> str | None:
        if self.record is not None and self.record.spec_hash:
            return self.record.spec_hash
        return self.start.input_hash if self.start is not None else None

    @property
    def unfinished(self) -> bool:
        return self.run_id is not None and not self.done and (self.record is not None or self.start is not None)


def _last_run(store: Any, sid: str, uid: str | None, lease: Any = None,
              seen: dict[str, frozenset[str]] | None = None, sealed: set[str] = frozenset()) -> _LastRun:
    """The last run as replay will see it once this incarnation sealed it: what a fenced writer appended
    during the takeover, a ``run_end`` included, does not decide whether it finished."""
    record = store.last_run(sid, user_id=uid)
    if record is not None:
        run_id = record.run_id
    else:
        runs = store.journal_runs(sid, user_id=uid)
        run_id = runs[-1] if runs else None
    if run_id is None:
        return _LastRun()
    journal = store.journal_read(sid, run_id, user_id=uid)
    view = journal
    if lease is not None and run_id not in sealed:  # not sealed yet: judge it as its seal will make it
        view = journal.sealed_view(lease, _seen(seen, run_id))
    return _LastRun(run_id, record, journal, view.start, view.finished, view.entries)


def _seen(seen: dict[str, frozenset[str]] | None, run_id: str) -> frozenset[str] | None:
    """The run's keys in the pre-lease listing; a run that listing did not show was empty then (all of it is
    new). None without a listing: then only the seal's seq rule fences."""
    return None if seen is None else seen.get(run_id, frozenset())


def _continues_last(request: RunRequest) -> bool:
    """``resume(None)`` in place: it continues an unfinished last run exactly as a re-issued ``run()`` does."""
    return (request.kind == "resume" and request.prompt is None and request.from_checkpoint == "latest"
            and request.fork_of is None and request.run_id is None)


def _stored_request(last: _LastRun, request: RunRequest) -> RunRequest:
    """The last run's own request (from its run record), with the caller's live context/metadata if given."""
    raw = last.record.request if last.record is not None else None
    if not raw:
        return request
    try:
        stored = RunRequest.model_validate(raw)
    except ValueError as e:
        log.warning("run record of run %s of session %r holds an unreadable request (%s); using the caller's",
                    last.run_id, request.session_id, e)
        return request
    if (stored.session_id, stored.user_id) != (request.session_id, request.user_id):
        log.warning("run record of run %s names session %r/user %r, not %r/%r; using the caller's request",
                    last.run_id, stored.session_id, stored.user_id, request.session_id, request.user_id)
        return request
    update = {k: getattr(request, k) for k in ("context", "metadata") if getattr(request, k) is not None}
    return stored.model_copy(update=update) if update else stored


def pre_lease_listing(store: Any, request: RunRequest) -> Any:
    """What a new owner must fence, listed right before its lease swap (``storage.journal.Listing``).

    The session's last run (the run its old owner may still be appending to)
    and the run the request names. Right after the lease, each is sealed above
    its listed keys (:func:`_plan`), so whatever the old owner appends from
    then on is never replayed.
    """
    return store.journal_listing(request.session_id, user_id=request.user_id, run_id=request.run_id)


def fence_session(store: Any, session_id: str, user_id: str | None, *, owner: str) -> Any:
    """Take the session's lease and seal the runs its old owner may still append to; return the lease.

    What a new owner does before its first step (:func:`execute_request`),
    without running anything: afterwards whatever an older writer does is not
    durable (its checkpoint writes are refused or retired, its journal entries
    above the seals are never replayed). ``loomray cancel`` uses it.
    """
    request = RunRequest(session_id=session_id, user_id=user_id)
    fence = FenceNote(lambda: pre_lease_listing(store, request))
    lease = store.acquire_lease(session_id, user_id=user_id, owner=owner, note=fence)
    for run_id, keys in fence.listing.runs.items():
        store.journal_seal_listed(session_id, run_id, user_id=user_id, lease=lease, listed=keys)
    if fence.chain:
        store.journal_complete_fences(session_id, user_id=user_id, chain=fence.chain, listed=dict(fence.listing.runs))
    return lease


def _plan(agent: Any, request: RunRequest, store: Any, lease: Any = None,
          seen: dict[str, frozenset[str]] | None = None, chain: list[dict[str, Any]] = ()) -> _Plan:
    """Where the run starts: fresh, a checkpoint, a fork, or the continuation of an unfinished run.

    With ``lease`` (``execute_request`` holds it) this also fences and orders.
    First of all, one PUT per run, it seals the runs of ``seen``
    (:func:`pre_lease_listing`) and writes the seals earlier owners recorded
    in the lease (``chain``) but never wrote; then it seals any other
    unfinished run it continues or leaves behind (their old writers may still
    be alive); it records a run that is not the session's last one yet (store
    order); and it proves it still holds the lease before the run's first step.
    """
    sid, uid = request.session_id, request.user_id
    sealed: set[str] = set()
    if lease is not None:
        for run_id, keys in (seen or {}).items():
            store.journal_seal_listed(sid, run_id, user_id=uid, lease=lease, listed=keys)
            sealed.add(run_id)
        if chain:
            store.journal_complete_fences(sid, user_id=uid, chain=chain, listed=seen or {})
    last = _last_run(store, sid, uid, lease, seen, sealed)

    continuing_id = None
    if request.run_id is not None and (request.run_id == last.run_id
                                       or request.run_id in store.journal_runs(sid, user_id=uid)):
        continuing_id = request.run_id
    elif request.run_id is None and last.unfinished and (last.spec == request.spec_hash() or _continues_last(request)):
        continuing_id = last.run_id
        if last.spec != request.spec_hash():
            request = _stored_request(last, request)

    if lease is not None and last.unfinished and last.run_id not in sealed and last.run_id != continuing_id:
        # Not continued by this request: its old incarnation may still append; fence it.
        store.journal_seal(sid, last.run_id, user_id=uid, lease=lease, seen_before=_seen(seen, last.run_id),
                           known=last.journal)

    if continuing_id is not None:
        plan = _continue(agent, request, store, continuing_id, last, lease, seen, sealed)
    else:
        plan = _base(agent, request, store, request.run_id or new_id("run"), last=(last.run_id, last.start))
    plan.request = request
    plan.consumed = control.consumed_names(plan.prior) | control.consumed_names(last.entries)
    if lease is not None:
        if last.record is None or last.record.run_id != plan.run_id:
            out = plan.start_output
            base = out.get("base_checkpoint_id")
            store.run_create(sid, user_id=uid, run_id=plan.run_id, request=_request_json(request),
                             spec_hash=request.spec_hash(), base_session_id=out.get("source_session") if base else None,
                             base_checkpoint_id=base, replay_from=out.get("replay_from"), epoch=lease.epoch)
        # Appends do not read the lease, so prove ownership once before the first step: a takeover that
        # listed the session before this plan's record landed (and so could not seal the run it is about
        # to start) took the lease before this read, which then fences this writer here.
        store.check_lease(lease)
    return plan


def _request_json(request: RunRequest) -> dict[str, Any]:
    # In-process callers may pass live objects as context; the stored request names them instead.
    return json.loads(request.model_dump_json(fallback=lambda v: f"<unserializable {type(v).__name__}>"))


def _continue(agent: Any, request: RunRequest, store: Any, run_id: str, last: _LastRun, lease: Any,
              seen: dict[str, frozenset[str]] | None, sealed: set[str]) -> _Plan:
    """The plan that continues unfinished run ``run_id``: same run id, its journal replayed."""
    sid, uid = request.session_id, request.user_id
    known = last.journal if run_id == last.run_id else None
    if lease is not None and run_id not in sealed:
        journal = store.journal_seal(sid, run_id, user_id=uid, lease=lease, seen_before=_seen(seen, run_id),
                                     known=known)
    else:
        journal = known if known is not None else store.journal_read(sid, run_id, user_id=uid)
    entries = journal.entries
    next_seq = journal.max_seq + 1
    start = journal.start
    if start is None:
        # Recorded, but its run_start is missing (a crash right after the record, or a failed write that
        # was only a warning): begin it as its request says, replaying whatever steps it did journal.
        record = last.record if run_id == last.run_id else None
        if request.kind == "run" and record is not None and record.base_checkpoint_id:
            # It continued a finished conversation: from the checkpoint its record names, not today's latest.
            plan = _restart(agent, request, store, run_id, {
                "kind": "run", "prompt": request.prompt, "base_checkpoint_id": record.base_checkpoint_id,
                "source_session": record.base_session_id or sid})
        else:
            plan = _base(agent, request, store, run_id)
        plan.prior = _records(entries) + plan.prior
        plan.next_seq = next_seq
        return plan
    start_out = dict(start.output)
    prior: list[JournalRecord] = []
    if start_out.get("replay_from"):
        prior += _records(store.journal_list(sid, start_out["replay_from"], user_id=uid))
    prior += _records(entries)
    latest = _load(store, sid, "latest", uid)
    if latest is not None and run_of_cursor(latest.cursor) == run_id:
        # This run already checkpointed: restore its newest snapshot; its prompt is in the transcript.
        plan = _Plan(run_id=run_id, state=_from_checkpoint(agent, request, run_id, latest),
                     prompt=None, prior=prior, next_seq=next_seq, continuing=True, start_output=start_out,
                     resumed_from_checkpoint=True, resume_position=latest.position,
                     resume_status=latest.execution_status)
        plan.state.forked_from = latest.forked_from
        if latest.execution_status == "completed":
            plan.finished = latest
        return plan
    plan = _restart(agent, request, store, run_id, start_out)
    plan.prior = prior + plan.prior
    plan.next_seq, plan.continuing = next_seq, True
    return plan


def _restart(agent: Any, request: RunRequest, store: Any, run_id: str, start_out: dict[str, Any]) -> _Plan:
    """A continued run that has no checkpoint of its own yet begins where its first attempt began (``run_start``)."""
    sid, uid = request.session_id, request.user_id
    prompt = start_out.get("prompt")
    base_id = start_out.get("base_checkpoint_id")
    if base_id:  # a resume or fork, or a run that continued a finished conversation
        source = start_out.get("source_session") or sid
        ckpt = _load(store, source, base_id, uid)
        if ckpt is None:
            raise CheckpointNotFound(f"session {source!r} (user {uid!r}) has no checkpoint {base_id!r}, "
                                     f"where run {run_id} started")
        state = _from_checkpoint(agent, request, run_id, ckpt)
        state.forked_from = source if source != sid else ckpt.forked_from
        return _Plan(run_id=run_id, state=state, prompt=prompt, prior=_pending_tool_records(store, ckpt, uid),
                     resumed_from_checkpoint=True, resume_position=ckpt.position, start_output=start_out,
                     resume_status=ckpt.execution_status)
    # A run from a fresh transcript (a fallback one replays its source run, read by the caller).
    return _Plan(run_id=run_id, state=_fresh(agent, request, run_id), prompt=prompt, start_output=start_out)


def _base(agent: Any, request: RunRequest, store: Any, run_id: str,
          last: tuple[str | None, JournalEntry | None] = (None, None)) -> _Plan:
    """Where a new run begins; ``last`` is the session's last run and its ``run_start`` (for the fallback)."""
    sid, uid = request.session_id, request.user_id
    if request.kind == "run":
        if request.prompt is None:
            raise LoomrayUserError(f"run() on session {sid!r} needs a prompt")
        # Sessions remember: a session that ran before continues its conversation from its latest checkpoint
        # if that checkpoint ended a run. (No run before: a new session, nothing to read.)
        latest = _load(store, sid, "latest", uid) if last[0] is not None else None
        if latest is not None and latest.execution_status == "completed":
            return _Plan(run_id=run_id, state=_from_checkpoint(agent, request, run_id, latest), prompt=request.prompt,
                         resumed_from_checkpoint=True, resume_position=latest.position,
                         resume_status=latest.execution_status,
                         start_output={"kind": "run", "prompt": request.prompt,
                                       "base_checkpoint_id": latest.checkpoint_id, "source_session": sid})
        return _Plan(run_id=run_id, state=_fresh(agent, request, run_id), prompt=request.prompt,
                     start_output={"kind": "run", "prompt": request.prompt})

    source = request.fork_of or sid
    wanted = request.from_checkpoint
    ckpt = _load(store, source, wanted, uid)
    if ckpt is None and (request.fork_of or wanted != "latest"):
        raise CheckpointNotFound(f"session {source!r} (user {uid!r}) has no checkpoint {wanted!r}")
    if ckpt is not None:
        prompt = request.prompt if request.prompt is not None else CONTINUE_NUDGE
        return _Plan(run_id=run_id, state=_from_checkpoint(agent, request, run_id, ckpt), prompt=prompt,
                     prior=_pending_tool_records(store, ckpt, uid), resumed_from_checkpoint=True,
                     resume_position=ckpt.position, resume_status=ckpt.execution_status,
                     start_output={"kind": "resume", "prompt": prompt, "base_checkpoint_id": ckpt.checkpoint_id,
                                   "source_session": source})
    # Fallback: no checkpoint. Re-run against the session's last run, replaying its journaled steps.
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


#: A run whose journal appends do not read the lease still re-reads it this often (seconds).
LEASE_RECHECK_S = 10.0


class _StoreSink:
    """The journal seam: one create-only object per step, stamped with the lease's epoch.

    An append is one PUT: it does not read the lease. Fencing is the next
    incarnation's job: its seal makes replay ignore whatever this writer
    appends once fenced (``storage.journal``). So that a fenced run stops
    anyway, and soon, the lease is read again

    - before a model call (:meth:`before_model_call`), unless it was read
      since the previous one: every checkpoint write reads it
      (:meth:`lease_read_by_checkpoint`), so a run that writes a checkpoint
      every pass pays nothing, and one that does not pays one GET per pass.
      A fenced writer makes at most one more model call (the pass it was in);
    - after an append at most every ``recheck_s`` seconds (a long pass).
    """

    def __init__(self, store: Any, request: RunRequest, run_id: str, lease: Any,
                 recheck_s: float = LEASE_RECHECK_S, inflight: _Inflight | None = None) -> None:
        self.store, self.request, self.run_id, self.lease = store, request, run_id, lease
        self.inflight = inflight or _Inflight()
        self.recheck_s = recheck_s
        self._checked = time.monotonic()
        # Read since the previous model call? The plan read it right before the run's first step.
        self._read = True

    def lease_read_by_checkpoint(self) -> None:
        """A checkpoint write started: it reads the lease (before and after its PUT), and a failed read or
        fencing stops the run before its next step (the write guard), so the next model call needs no read."""
        self._read = True

    async def before_model_call(self) -> None:
        """Read the lease unless it was read since the previous model call; raises if fenced or unreadable."""
        if not self._read:
            # Through the guard: fenced is LeaseLostError, unreadable is DurabilityLost; either stops the run
            # before the model is billed.
            await asyncio.to_thread(self.store.check_lease, self.lease)
            self._checked = time.monotonic()
        self._read = False

    async def append(self, record: JournalRecord) -> None:
        entry = JournalEntry(session_id=self.request.session_id, user_id=self.request.user_id, run_id=self.run_id,
                             seq=record.seq, step_key=record.step_key, kind=record.kind,
                             input_hash=record.input_hash, output=record.output, epoch=self.lease.epoch)
        try:
            await self.inflight.run(self.store.journal_append, entry)
        except LeaseLostError:
            raise
        except Exception as e:  # the step already happened; losing its record only costs a re-run later
            log.warning("journal entry %s of session %r could not be written (the run goes on): %s: %s",
                        record.step_key, self.request.session_id, type(e).__name__, e)
        if time.monotonic() - self._checked >= self.recheck_s:
            self._checked = time.monotonic()
            try:
                await asyncio.to_thread(self.store.check_lease, self.lease)
                self._read = True
            except LeaseLostError:
                raise
            except Exception as e:  # unreadable now: the next checkpoint write or recheck decides
                log.warning("lease of session %r could not be re-read: %s: %s", self.request.session_id,
                            type(e).__name__, e)


class _Inflight:
    """The store writes a run has started: each runs in a worker thread that outlives a cancelled awaiter, so
    a cancel waits for them (:meth:`drain`) before it is acknowledged."""

    def __init__(self) -> None:
        self.tasks: set[asyncio.Future] = set()

    async def run(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        fut = asyncio.ensure_future(asyncio.to_thread(fn, *args, **kwargs))
        self.tasks.add(fut)
        fut.add_done_callback(self._done)
        return await asyncio.shield(fut)

    def _done(self, fut: asyncio.Future) -> None:
        self.tasks.discard(fut)
        if not fut.cancelled():
            fut.exception()  # retrieved: its awaiter may have been cancelled

    async def drain(self) -> None:
        while self.tasks:
            await asyncio.wait(list(self.tasks))


#: Write errors no retry can fix (a bad id, a wrong type, a bug): they stop the run instead of being logged.
_NON_TRANSIENT = (TypeError, ValueError, AttributeError, NotImplementedError)


class _WriteGuard:
    """Decides what a failed checkpoint or journal write means for the run.

    A transient failure while the writer can still prove it holds the lease is
    a warning: the run goes on and recovery redoes what was not recorded. Any
    other failure stops the run before its next step, and the guard remembers
    it so the loop sees it even when the write happened in the background or
    the journal sink swallowed it:

    - fencing (``LeaseLostError``): a newer owner exists;
    - a non-transient error (``InvalidIdError``, ``TypeError``, ...): retrying
      cannot help, and logging it as an ordinary failed write would hide it;
    - the lease cannot be read after the failure, or when the journal sink
      re-reads it (store unreachable, lease unreadable): ownership is
      unprovable, so :class:`DurabilityLost`;
    - ``CorruptObjectError`` on a write, once ownership is proven.

    The lease is read only after a failure, so the happy path costs nothing.
    """

    def __init__(self, store: Any, lease: Any) -> None:
        self.store, self.lease = store, lease
        #: The first error that stopped the run (raised again by :meth:`check`).
        self.fatal: BaseException | None = None
        #: Writes that failed (as warnings) since the last checkpoint written: the run's end is not durable.
        self.undurable = 0

    def failed(self, what: str, error: BaseException) -> None:
        """Classify ``error`` raised by writing ``what``: return if it is only a warning, else raise.

        Synchronous (it may read the lease): call it from a worker thread.
        """
        if self.fatal is not None:
            raise self.fatal
        if isinstance(error, (LeaseLostError, *_NON_TRANSIENT)):
            self.fatal = error
            raise error
        try:
            self.store.check_lease(self.lease)
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


class _GuardedJournal:
    """The store as the journal sink sees it: failed appends and lease re-reads go through the :class:`_WriteGuard`.

    The sink logs and swallows ordinary failures; the guard remembers the
    ones that must stop the run, and the loop checks it before every step.
    """

    def __init__(self, store: Any, guard: _WriteGuard) -> None:
        self._store, self._guard = store, guard

    def __getattr__(self, name: str) -> Any:
        return getattr(self._store, name)

    def journal_append(self, entry: JournalEntry, **kwargs: Any) -> Any:
        try:
            return self._store.journal_append(entry, **kwargs)
        except Exception as e:
            self._guard.failed(f"journal entry {entry.step_key} of run {entry.run_id}", e)
            raise

    def check_lease(self, lease: Any) -> None:
        try:
            self._store.check_lease(lease)
        except LeaseLostError:
            raise
        except Exception as e:
            self._guard.lease_unreadable(e)


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
    # Registered before the cancel check: a cancel either finds this run here or its cancel.json is found below.
    handle = control.register(store, sid, uid)
    try:
        if handle.cancel_requested or await t(control.is_cancelled, store, sid, uid):
            return _cancelled_result(request)
        return await _execute(agent, request, store, handle, max_checkpoints_per_session=max_checkpoints_per_session,
                              emit=emit, extra_tools=extra_tools, output_type=output_type, owner=owner,
                              agent_ref=agent_ref, node_id=node_id)
    finally:
        control.unregister(handle)  # after the run's last write: what a cancel waits for


def _cancelled_result(request: RunRequest, run_id: str | None = None) -> RunResult:
    return RunResult(output="", session_id=request.session_id, user_id=request.user_id, run_id=run_id,
                     stop_reason="cancelled")


async def _execute(agent: Any, request: RunRequest, store: Any, handle: Any, *, max_checkpoints_per_session: int,
                   emit: EmitFn | None, extra_tools: Any, output_type: Any, owner: str | None,
                   agent_ref: str | None, node_id: str | None) -> RunResult:
    t = asyncio.to_thread
    sid, uid = request.session_id, request.user_id
    # Listed right before the lease swap (what the seals go above), and recorded by that swap, so the
    # fence survives this process dying between taking the lease and sealing (storage.journal.FenceNote).
    fence = FenceNote(lambda: pre_lease_listing(store, request))
    lease = await t(store.acquire_lease, sid, user_id=uid, owner=owner or _owner(), note=fence)
    plan = await t(_plan, agent, request, store, lease, dict(fence.listing.runs), fence.chain)
    request = plan.request or request
    inflight = _Inflight()

    async def status(state: str, error: str | None = None) -> None:
        # No request in the row: it may hold secrets, and the index is readable by every query.
        # The request lives in the run's record beside the session's objects (storage.journal).
        row = SessionRow(session_id=sid, user_id=uid, status=state, updated_at=utcnow(), run_id=plan.run_id,
                         agent_ref=agent_ref, spec_json=None, epoch=lease.epoch, node_id=node_id, error=error)
        try:
            await t(store.put_session, row)
        except Exception as e:  # status rows are for observers; the run does not depend on them
            log.warning("session row %s of %r could not be written: %s", state, sid, e)

    from loomray import telemetry  # process-wide observers (traces, Ray metrics); a no-op when none

    async def on_event(event: Event) -> None:
        await deliver(emit, event)
        telemetry.observe(event, agent=agent, epoch=lease.epoch, node_id=node_id)

    tuning = agent.tuning
    ckpt_cfg = tuning.checkpoint_config()
    # Every failed write is judged by one guard: a warning while ownership is proven, else the run stops.
    guard = _WriteGuard(store, lease)
    sink = (_StoreSink(_GuardedJournal(store, guard), request, plan.run_id, lease, inflight=inflight)
            if tuning.journal else None)
    tools = dict(agent.tools)
    tools.update(as_tools(extra_tools))
    steps = StepRunner(agent.model, tools, sink=sink, prior=plan.prior, next_seq=plan.next_seq, emit=on_event,
                       session_id=sid, run_id=plan.run_id, stream=emit is not None,
                       before_model_call=sink.before_model_call if sink is not None else None)
    controls = control.SessionControls(store, sid, uid, consumed=plan.consumed, handle=handle,
                                       journaled=sink is not None, inflight=inflight)
    plan.state.epoch = lease.epoch
    watcher = None
    if getattr(getattr(store, "objects", None), "backend", "memory") != "memory":
        watcher = asyncio.ensure_future(control.watch_cancel(store, sid, uid, handle, control.cancel_poll_s()))
    await status("running")
    try:
        if not plan.continuing and sink is not None:
            await steps.record("run_start", RUN_START, request.spec_hash(), plan.start_output)
        elif not plan.continuing:
            steps.seq += 1
        if plan.finished is not None:
            result = _finished_result(plan)
        else:
            # The session's cumulative cost as of the checkpoint this run last wrote, or started from (in
            # whichever session): a checkpoint's spend is its running total minus that, so the spend of a fork
            # tree's checkpoints sums to what its model calls were billed. Writes are ordered (also with
            # durability="async"); a failed write's spend is carried by the next checkpoint written.
            written_cost = [plan.state.usage.cost_usd]

            async def put(ckpt: Checkpoint, data: bytes) -> None:
                u = ckpt.cumulative_usage
                spend = (None if u.cost_usd is None or written_cost[0] is None
                         else max(0.0, u.cost_usd - written_cost[0]))
                if sink is not None:
                    sink.lease_read_by_checkpoint()
                consumed = controls.durable_mark()  # journaled before this write, which re-reads the lease
                try:
                    await inflight.run(
                        store.put_checkpoint, data, session_id=sid, checkpoint_id=ckpt.checkpoint_id,
                        user_id=uid, turn=ckpt.turn, created_at=ckpt.created_at, position=ckpt.position,
                        execution_status=ckpt.execution_status, message_count=len(ckpt.messages),
                        input_tokens=u.input_tokens, output_tokens=u.output_tokens, cost_usd=u.cost_usd,
                        parent_checkpoint_id=ckpt.parent_checkpoint_id, forked_from=ckpt.forked_from,
                        agent_id=ckpt.agent_id, lease=lease, keep=max_checkpoints_per_session, spend_usd=spend)
                except Exception as e:
                    await t(guard.failed, f"checkpoint {ckpt.checkpoint_id}", e)  # raises unless only a warning
                    raise
                written_cost[0] = u.cost_usd
                guard.durable()
                if consumed:
                    await controls.durable(consumed)

            writer = CheckpointWriter(put, durability=tuning.durability, emit=on_event, is_fatal=guard.is_fatal)
            options = LoopOptions(
                tuning=tuning, checkpoint=ckpt_cfg, prompt=plan.prompt,
                tool_schemas=[x.schema for x in tools.values()], output_schema=request.output_schema,
                output_validator=_output_validator(output_type, request.output_schema), effort=request.effort,
                context=request.context, resumed_from_checkpoint=plan.resumed_from_checkpoint,
                resume_position=plan.resume_position, check_writes=guard.check, controls=controls,
                resume_status=plan.resume_status)
            # Its own task: a cancel abandons the step in flight (see loomray.control).
            loop_task = asyncio.ensure_future(run_loop(plan.state, steps, options, writer=writer, emit=on_event))
            handle.task = loop_task
            if handle.cancel_requested:
                loop_task.cancel()
            try:
                result = await loop_task
            except asyncio.CancelledError:
                me = asyncio.current_task()
                if not (loop_task.cancelled() and handle.cancel_requested and me is not None
                        and not me.cancelling()):
                    raise
                result = _cancelled_result(request, plan.run_id)  # cancelled before its first step
            finally:
                handle.task = None
            if result.stop_reason == "cancelled":
                await inflight.drain()
                await status("cancelled")
                return result
            guard.check()  # a write that failed after the last step: the status must not claim durability
        if guard.undurable:
            # Writes failed after the last checkpoint (warnings while the lease was provable): the run's end is
            # not durable, so neither "completed" nor run_end may claim it. The session stays "running" and a
            # re-issued run continues it from what is durable.
            log.warning("session %r: run %s finished, but %d write(s) since its last checkpoint failed; it is not "
                        "recorded as completed (re-issue the run to record its end)", sid, plan.run_id,
                        guard.undurable)
            return result
        await controls.release(lambda: store.check_lease(lease))
        if result.stop_reason != "completed":
            # Stopped before its end (over budget, awaiting approval, paused): the run stays unfinished, no
            # run_end, so resume(None) or the same run() continues it. The status is not an active one: a
            # supervisor leaves it alone.
            await status(result.stop_reason)
            return result
        # Status first, run_end last: a crash between them re-enters this run and finds it finished.
        await status("completed")
        if sink is not None:
            await steps.record("run_end", RUN_END, "", {"turns": result.turns, "checkpoint_id": result.checkpoint_id,
                                                        "model_calls": result.model_calls})
    except LeaseLostError:
        if handle.cancel_requested or await _cancelled(store, sid, uid):
            # Fenced by the cancel itself (loomray cancel takes the lease): the run ends as cancelled.
            await inflight.drain()
            return _cancelled_result(request, plan.run_id)
        raise  # fenced: a newer incarnation owns the session and its status rows
    except BaseException as e:
        if handle.cancel_requested and isinstance(e, (Exception, asyncio.CancelledError)):
            await inflight.drain()
            await status("cancelled")
            if isinstance(e, asyncio.CancelledError):
                raise
            return _cancelled_result(request, plan.run_id)
        await status("failed", error=f"{type(e).__name__}: {e}")
        raise
    finally:
        if watcher is not None:
            watcher.cancel()
    return result


async def _cancelled(store: Any, sid: str, uid: str | None) -> bool:
    try:
        return await asyncio.to_thread(control.is_cancelled, store, sid, uid)
    except Exception:
        return False


def _finished_result(plan: _Plan) -> RunResult:
    ckpt = plan.finished
    assert ckpt is not None
    return RunResult(output=ckpt.messages[-1].content if ckpt.messages else "", messages=list(ckpt.messages),
                     usage=ckpt.cumulative_usage, session_id=ckpt.session_id, user_id=ckpt.user_id,
                     run_id=plan.run_id, turns=ckpt.turn, checkpoint_id=ckpt.checkpoint_id,
                     resumed_from_checkpoint=True, resume_position=ckpt.position, forked_from=ckpt.forked_from)
