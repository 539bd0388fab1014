"""A run's plan: what the takeover read (:class:`SessionReads`), the pure decision on it (:func:`decide`), and
the frozen :class:`RunPlan` the run then follows.

:func:`decide` answers with the plan, or with the one thing it still needs read; the takeover reads it and
asks again. So each object is read at most once, and only when the decision uses it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, NamedTuple

from loomray.control import consumed_names
from loomray.journal import JournalRecord
from loomray.loop import LoopState
from loomray.records import Checkpoint, Message, RunResult
from loomray.recovery import (
    CheckpointRef,
    LastRun,
    Start,
    journal_records,
    new_run_checkpoint,
    new_run_start,
    pending_tool_steps,
    recorded_start,
    restart,
    spent_at_start,
    start_checkpoint,
    written_by,
)
from loomray.run_request import RunRequest
from loomray.storage.journal import JournalRun
from loomray.storage.rows import JournalEntry


class JournalRef(NamedTuple):
    """A run's journal to read. ``optional``: a failed read is no journal (the results of a restored checkpoint's
    dangling tool calls, an optimisation), not an error (the steps a run replays)."""

    session_id: str
    run_id: str
    optional: bool = False


#: What :func:`decide` may ask to be read next.
Read = CheckpointRef | JournalRef


@dataclass(frozen=True)
class SessionReads:
    """Everything a plan is decided from: the request, the run it executes, and what the takeover read."""

    #: The request the run executes (for ``resume(None)`` continuing a run: that run's own stored request).
    request: RunRequest
    #: The run: the unfinished one the request continues, else the new run's id.
    run_id: str
    #: The session's last run as replay sees it once this incarnation sealed it.
    last: LastRun
    #: The continued run's journal, as sealed (None: a new run).
    journal: JournalRun | None = None
    #: Checkpoints read so far (None: no such checkpoint).
    checkpoints: Mapping[CheckpointRef, Checkpoint | None] = field(default_factory=dict)
    #: Journals read so far (a failed optional read is empty).
    journals: Mapping[JournalRef, Sequence[JournalEntry]] = field(default_factory=dict)

    def with_read(self, ref: Read, value: Checkpoint | Sequence[JournalEntry] | None) -> SessionReads:
        """These reads plus ``value``, what ``ref`` names (a checkpoint or None; a journal's entries)."""
        if isinstance(ref, CheckpointRef):
            if value is not None and not isinstance(value, Checkpoint):
                raise TypeError(f"{ref} reads as a Checkpoint or None, got {type(value).__name__}")
            return replace(self, checkpoints={**self.checkpoints, ref: value})
        if value is None or isinstance(value, Checkpoint):
            raise TypeError(f"{ref} reads as a sequence of journal entries, got {type(value).__name__}")
        return replace(self, journals={**self.journals, ref: tuple(value)})

    def checkpoint(self, ref: CheckpointRef | None) -> Checkpoint | None:
        """The checkpoint ``ref`` names (None for no ref); ``_Unread`` until it is read."""
        if ref is None:
            return None
        if ref in self.checkpoints:
            return self.checkpoints[ref]
        latest = self.checkpoints.get(CheckpointRef(ref.session_id, "latest"))
        if latest is not None and latest.checkpoint_id == ref.checkpoint_id:
            return latest  # the same immutable objects: read once
        raise _Unread(ref)

    def journal_of(self, ref: JournalRef) -> Sequence[JournalEntry]:
        """The entries of the journal ``ref`` names; ``_Unread`` until it is read."""
        if ref not in self.journals:
            raise _Unread(ref)
        return self.journals[ref]

    def replay(self, run_id: str | None) -> Sequence[JournalEntry]:
        """The entries of the session's run ``run_id`` that a run replays (None: none)."""
        return () if run_id is None else self.journal_of(JournalRef(self.request.session_id, run_id))

    def pending(self, ckpt: Checkpoint | None) -> list[JournalRecord]:
        """Journaled results of ``ckpt``'s dangling tool calls (so they do not run twice)."""
        steps = pending_tool_steps(ckpt) if ckpt is not None else None
        if ckpt is None or steps is None:
            return []
        source_run, keys = steps
        return journal_records(self.journal_of(JournalRef(ckpt.session_id, source_run, optional=True)), keys)


class _Unread(Exception):
    """Raised inside :func:`decide` when it needs a value not read yet."""

    def __init__(self, ref: Read) -> None:
        super().__init__(ref)
        self.ref = ref


def decide(reads: SessionReads) -> RunPlan | Read:
    """The plan of the run ``reads`` describe, or the next thing to read for it. Pure: no I/O."""
    try:
        return _continued(reads) if reads.journal is not None else _new(reads, reads.last)
    except _Unread as unread:
        return unread.ref


def _new(reads: SessionReads, last: LastRun, journal: JournalRun | None = None) -> RunPlan:
    """A new run, or a recorded one whose ``run_start`` is missing (``journal``: its steps, replayed)."""
    request = reads.request
    start = new_run_start(request, reads.checkpoint(new_run_checkpoint(request, last)), last)
    return plan_run(request, reads.run_id, start, journal=journal, replay=reads.replay(start.replay_from),
                    pending=reads.pending(start.checkpoint), last_entries=last.entries)


def _continued(reads: SessionReads) -> RunPlan:
    """The plan that continues the unfinished run: same run id, its journal replayed."""
    request, run_id, journal, last = reads.request, reads.run_id, reads.journal, reads.last
    assert journal is not None
    sid = request.session_id
    if journal.start is None:
        # Recorded, but its run_start is missing: begin it as its request says, replaying what it journaled.
        output = recorded_start(request, last.record if run_id == last.run_id else None)
        if output is None:
            return _new(reads, LastRun(entries=last.entries), journal)
        start = restart(request, run_id, output, reads.checkpoint(start_checkpoint(output, sid)))
        return plan_run(request, run_id, start, journal=journal, last_entries=last.entries,
                        pending=reads.pending(start.checkpoint))
    output = dict(journal.start.output)
    replay = reads.replay(output.get("replay_from"))
    latest = reads.checkpoint(CheckpointRef(sid, "latest"))
    if written_by(latest, run_id):  # this run already checkpointed: restore its newest snapshot
        return plan_run(request, run_id, Start(output), journal=journal, latest=latest, replay=replay,
                        last_entries=last.entries)
    start = restart(request, run_id, output, reads.checkpoint(start_checkpoint(output, sid)))
    return plan_run(request, run_id, start, journal=journal, latest=latest, replay=replay,
                    pending=reads.pending(start.checkpoint), last_entries=last.entries)


@dataclass(frozen=True)
class RunPlan:
    """Where a run starts, decided before its first step; the run reads it and never changes it."""

    run_id: str
    #: The request the run executes: the caller's, or for ``resume(None)`` continuing an unfinished run,
    #: that run's own stored request (so its model requests, and their journal hashes, are unchanged).
    request: RunRequest
    #: The ``run_start`` output (journaled by the run unless it is ``continuing``).
    start_output: dict[str, Any]
    #: Appended to the restored or fresh transcript (None: the restored transcript holds it already).
    prompt: str | None
    #: The checkpoint whose transcript the run restores (None: a fresh transcript).
    restored: Checkpoint | None
    forked_from: str | None
    #: Journal records replay may answer from.
    prior: tuple[JournalRecord, ...] = ()
    #: Where the run's own journal records continue.
    next_seq: int = 0
    #: The run's ``run_start`` is journaled already: it continues an unfinished run.
    continuing: bool = False
    #: The restored checkpoint already finished this run (a crash after its final write).
    finished: bool = False
    #: Control requests whose consumption the continued run or the session's last run journaled.
    consumed: frozenset[str] = field(default_factory=frozenset)

    @property
    def resume_position(self) -> str | None:
        """``position`` of the checkpoint the run restores (None: none)."""
        return self.restored.position if self.restored is not None else None

    @property
    def resume_status(self) -> str | None:
        """``execution_status`` of the checkpoint the run restores (None: none)."""
        return self.restored.execution_status if self.restored is not None else None

    def initial_state(self, *, agent_id: str, instructions: str, epoch: int) -> LoopState:
        """The loop's starting state: the restored transcript, else ``instructions`` as the system message."""
        request, ckpt = self.request, self.restored
        if ckpt is None:
            messages = [Message(role="system", content=instructions)] if instructions else []
            return LoopState(session_id=request.session_id, user_id=request.user_id, run_id=self.run_id,
                             agent_id=agent_id, messages=messages, epoch=epoch,
                             usage=spent_at_start(self.start_output))
        chain = ckpt._chain
        if chain is not None and ckpt.session_id != request.session_id:
            chain = chain.rebased(ckpt.session_id, request.session_id)  # a fork builds on its parent's chain
        return LoopState(session_id=request.session_id, user_id=request.user_id, run_id=self.run_id,
                         agent_id=agent_id, messages=list(ckpt.messages), turn=ckpt.turn, usage=ckpt.cumulative_usage,
                         parent_checkpoint_id=ckpt.checkpoint_id, forked_from=self.forked_from, epoch=epoch,
                         chain=chain)

    def finished_result(self) -> RunResult:
        """The result of a run whose restored checkpoint already finished it."""
        assert self.restored is not None and self.finished
        return final_result(self.restored, self.run_id)


def cancelled_result(session_id: str, user_id: str | None, run_id: str | None = None) -> RunResult:
    """The result of a run that a cancel stopped (or kept from starting): no output, ``stop_reason="cancelled"``."""
    return RunResult(output="", session_id=session_id, user_id=user_id, run_id=run_id, stop_reason="cancelled")


def final_result(ckpt: Checkpoint, run_id: str | None) -> RunResult:
    """The result of run ``run_id``, read back from its final checkpoint ``ckpt``."""
    return RunResult(output=ckpt.messages[-1].content if ckpt.messages else "", messages=list(ckpt.messages),
                     usage=ckpt.cumulative_usage, session_id=ckpt.session_id, user_id=ckpt.user_id,
                     run_id=run_id, turns=ckpt.turn, checkpoint_id=ckpt.checkpoint_id,
                     resumed_from_checkpoint=True, resume_position=ckpt.position, forked_from=ckpt.forked_from)


def plan_run(request: RunRequest, run_id: str, start: Start, *, journal: JournalRun | None = None,
             latest: Checkpoint | None = None, replay: Sequence[JournalEntry] = (),
             pending: Sequence[JournalRecord] = (), last_entries: Sequence[JournalEntry] = ()) -> RunPlan:
    """The plan of run ``run_id`` executing ``request``.

    ``journal``: the continued run's (None: a new run); ``latest``: restored as is when this run wrote it;
    ``replay``: entries of the run ``start`` replays; ``pending``: journaled results of the start checkpoint's
    dangling tool calls; ``last_entries``: the session's last run (for the control requests it consumed).
    """
    continuing = journal is not None and journal.start is not None
    own = continuing and written_by(latest, run_id)
    entries = journal_records(journal.entries) if journal is not None else []
    prior = journal_records(replay) + entries
    restored: Checkpoint | None
    if own:
        assert latest is not None
        restored, prompt, forked_from = latest, None, latest.forked_from
    else:
        restored, prompt, forked_from = start.checkpoint, start.output.get("prompt"), start.forked_from
        prior += pending
    return RunPlan(
        run_id=run_id, request=request, start_output=start.output, prompt=prompt, restored=restored,
        forked_from=forked_from, prior=tuple(prior), next_seq=journal.max_seq + 1 if journal is not None else 0,
        continuing=continuing, finished=own and restored is not None and restored.execution_status == "completed",
        consumed=frozenset(consumed_names(prior) | consumed_names(last_entries)))
