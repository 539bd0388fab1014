"""Recovery planning: where a run starts, decided from what the store holds, without reading it.

The recovery rule is in docs/contracts.md; which run each call starts, in docs/api.md. Everything here
is a pure function of values the takeover read (:mod:`loomray.takeover`), in the order
:func:`loomray.planning.decide` needs them.
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

from loomray.errors import CheckpointNotFound, LoomrayUserError
from loomray.journal import STEP_KINDS, JournalRecord, approval_step_key, tool_step_key
from loomray.loop import CONTINUE_NUDGE, dangling_tool_calls, run_of_cursor
from loomray.records import Checkpoint, Usage
from loomray.run_request import RunRequest
from loomray.storage.journal import JournalRun
from loomray.storage.rows import JournalEntry, Lease, RunRecord

#: The session's logger: a run's warnings keep one name, whichever module logs them.
log = logging.getLogger("loomray.session")


def journal_records(entries: Iterable[JournalEntry], keys: Iterable[str] | None = None) -> list[JournalRecord]:
    """The steps among ``entries`` replay may answer from (only those of ``keys`` when given)."""
    wanted = None if keys is None else set(keys)
    return [JournalRecord(seq=e.seq, step_key=e.step_key, kind=e.kind, input_hash=e.input_hash, output=e.output)
            for e in entries if e.kind in STEP_KINDS and (wanted is None or e.step_key in wanted)]


@dataclass(frozen=True)
class LastRun:
    """The session's last run, by store order (its run record), else by sorted journal run id (old sessions).

    ``start``, ``done`` and ``entries`` are the run as replay sees it once this incarnation sealed it: what
    a fenced writer appended during the takeover, a ``run_end`` included, does not decide whether it finished.
    """

    run_id: str | None = None
    record: RunRecord | None = None
    journal: JournalRun | None = None
    start: JournalEntry | None = None
    done: bool = False
    entries: tuple[JournalEntry, ...] = ()

    @property
    def spec(self) -> str | None:
        """The spec hash of the request that started the run."""
        if self.record is not None and self.record.spec_hash:
            return self.record.spec_hash
        return self.start.input_hash if self.start is not None else None

    @property
    def unfinished(self) -> bool:
        """A run that started (recorded or journaled) and did not journal its end: recovery may continue it."""
        return self.run_id is not None and not self.done and (self.record is not None or self.start is not None)


def last_run_of(record: RunRecord | None, journal: JournalRun | None, *, lease: Lease | None = None,
                seen_before: Collection[str] = ()) -> LastRun:
    """The session's last run from its record and journal as read (no record: the journal names the run).

    With ``lease`` (the run is not sealed yet) it is judged as this incarnation's seal will make it: entries
    a fenced writer appended after the pre-lease listing (``seen_before``: the run's keys then) do not count.
    """
    run_id = record.run_id if record is not None else journal.run_id if journal is not None else None
    if run_id is None:
        return LastRun()
    view = journal if journal is None or lease is None else journal.sealed_view(lease, seen_before)
    if view is None:
        return LastRun(run_id, record)
    return LastRun(run_id, record, journal, view.start, view.finished, tuple(view.entries))


def run_to_continue(request: RunRequest, last: LastRun, known_runs: Sequence[str]) -> tuple[str | None, RunRequest]:
    """The run ``request`` continues (None: a new one), and the request it executes; ``known_runs`` (journaled
    run ids) matter only for a request naming a ``run_id`` other than the last run's."""
    if request.run_id is not None:
        known = request.run_id == last.run_id or request.run_id in known_runs
        return (request.run_id if known else None), request
    if not last.unfinished:
        return None, request
    if last.spec == request.spec_hash():
        return last.run_id, request
    if request.continues_last_run():
        return last.run_id, stored_request(last, request)
    return None, request


def stored_request(last: LastRun, request: RunRequest) -> RunRequest:
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


class CheckpointRef(NamedTuple):
    """A checkpoint to read: its session and its id (or ``"latest"``)."""

    session_id: str
    checkpoint_id: str


@dataclass(frozen=True)
class Start:
    """Where a run's transcript begins: what its ``run_start`` records, and the checkpoint that names."""

    #: The ``run_start`` output: kind, prompt, and the base (``base_checkpoint_id``, ``source_session``,
    #: ``replay_from``, ``fallback``) recovery reads to begin the run the same way again.
    output: dict[str, Any]
    #: The checkpoint whose transcript the run restores (None: a fresh transcript).
    checkpoint: Checkpoint | None = None
    #: ``forked_from`` of the restored state.
    forked_from: str | None = None

    @property
    def replay_from(self) -> str | None:
        """The run whose journaled steps this run may replay (a fallback run re-runs its source run)."""
        return self.output.get("replay_from")


def new_run_checkpoint(request: RunRequest, last: LastRun) -> CheckpointRef | None:
    """The checkpoint a new run may start from, read before :func:`new_run_start` (None: nothing to read)."""
    sid = request.session_id
    if request.kind == "run":
        if request.prompt is None:
            raise LoomrayUserError(f"run() on session {sid!r} needs a prompt")
        # Sessions remember: a session that ran before continues its conversation from its latest checkpoint
        # if that checkpoint ended a run. (No run before: a new session, nothing to read.)
        return CheckpointRef(sid, "latest") if last.run_id is not None else None
    return CheckpointRef(request.fork_of or sid, request.from_checkpoint)


def new_run_start(request: RunRequest, found: Checkpoint | None, last: LastRun) -> Start:
    """Where a new run begins, given the checkpoint :func:`new_run_checkpoint` named (None: absent or unread)."""
    sid, uid = request.session_id, request.user_id
    if request.kind == "run":
        if found is not None and found.execution_status == "completed":
            return Start({"kind": "run", "prompt": request.prompt, "base_checkpoint_id": found.checkpoint_id,
                          "source_session": sid}, found, request.fork_of or found.forked_from)
        return Start(_with_spend({"kind": "run", "prompt": request.prompt}, session_spend(found, last)))
    source, wanted = request.fork_of or sid, request.from_checkpoint
    if found is None and (request.fork_of or wanted != "latest"):
        raise CheckpointNotFound(f"session {source!r} (user {uid!r}) has no checkpoint {wanted!r}")
    if found is not None:
        nudged = request.prompt if request.prompt is not None else CONTINUE_NUDGE
        return Start({"kind": "resume", "prompt": nudged, "base_checkpoint_id": found.checkpoint_id,
                      "source_session": source}, found, request.fork_of or found.forked_from)
    # Fallback: no checkpoint. Re-run against the session's last run, replaying its journaled steps.
    last_prompt = last.start.output.get("prompt") if last.start is not None else None
    prompt = request.prompt if request.prompt is not None else last_prompt
    if prompt is None:
        raise LoomrayUserError(f"session {sid!r} (user {uid!r}) has no checkpoint and no run to resume; pass a prompt")
    output: dict[str, Any] = {"kind": "run", "prompt": prompt, "fallback": True}
    if last.run_id is not None and prompt == last_prompt:
        output["replay_from"] = last.run_id  # its replayed calls count again: it starts where that run started
        return Start(_with_spend(output, spent_at_start(last.start.output if last.start is not None else {})))
    return Start(_with_spend(output, session_spend(None, last)))


def session_spend(latest: Checkpoint | None, last: LastRun) -> Usage:
    """What the session spent before a new run on a fresh transcript (a budget is per session): ``latest``'s
    cumulative usage whatever its status; without one, the last run's starting spend plus its journaled calls."""
    if latest is not None:
        return latest.cumulative_usage
    if last.start is None:
        return Usage()
    total = spent_at_start(last.start.output)
    calls = {e.step_key: e for e in sorted(last.entries, key=lambda e: e.seq) if e.kind == "model"}
    for e in calls.values():  # by step key: a re-made call replaces its stale record, as in replay
        try:
            total += Usage.model_validate(e.output["response"]["usage"])
        except (KeyError, TypeError, ValueError):
            log.warning("journaled model call %s of run %s holds no readable usage; not counted", e.step_key,
                        last.run_id)
    return total


def spent_at_start(start_output: dict[str, Any]) -> Usage:
    """The spend a run without a restored checkpoint starts with (its ``run_start``'s ``spent``; none: zero)."""
    raw = start_output.get("spent")
    try:
        return Usage.model_validate(raw) if raw else Usage()
    except ValueError:
        log.warning("run_start holds an unreadable spend %r; counting from zero", raw)
        return Usage()


def _with_spend(output: dict[str, Any], spent: Usage) -> dict[str, Any]:
    """``output`` naming ``spent`` (left out when nothing was spent, as before spends were recorded)."""
    if spent != Usage():
        output["spent"] = spent.model_dump(mode="json")
    return output


def recorded_start(request: RunRequest, record: RunRecord | None) -> dict[str, Any] | None:
    """The ``run_start`` output of a recorded run whose ``run_start`` is missing (a crash right after the
    record); None: begin it as new. It begins from the checkpoint its record names, not today's latest."""
    if request.kind == "run" and record is not None and record.base_checkpoint_id:
        return {"kind": "run", "prompt": request.prompt, "base_checkpoint_id": record.base_checkpoint_id,
                "source_session": record.base_session_id or request.session_id}
    return None


def start_checkpoint(start_output: dict[str, Any], session_id: str) -> CheckpointRef | None:
    """The checkpoint a ``run_start`` output names as the run's base (None: a fresh transcript)."""
    base_id = start_output.get("base_checkpoint_id")
    return CheckpointRef(start_output.get("source_session") or session_id, base_id) if base_id else None


def restart(request: RunRequest, run_id: str, start_output: dict[str, Any], found: Checkpoint | None) -> Start:
    """Where a continued run without a checkpoint of its own begins: where its first attempt began (``found``:
    the checkpoint :func:`start_checkpoint` named, as read)."""
    base = start_checkpoint(start_output, request.session_id)
    if base is None:  # a fresh transcript (a fallback one replays its source run)
        return Start(start_output)
    if found is None:
        raise CheckpointNotFound(f"session {base.session_id!r} (user {request.user_id!r}) has no checkpoint "
                                 f"{base.checkpoint_id!r}, where run {run_id} started")
    forked_from = base.session_id if base.session_id != request.session_id else found.forked_from
    return Start(start_output, found, forked_from)


def written_by(checkpoint: Checkpoint | None, run_id: str) -> bool:
    """True when ``run_id`` wrote ``checkpoint`` (its cursor names the run)."""
    return checkpoint is not None and run_of_cursor(checkpoint.cursor) == run_id


def pending_tool_steps(checkpoint: Checkpoint) -> tuple[str, frozenset[str]] | None:
    """The run whose journal may hold the results of ``checkpoint``'s dangling tool calls (replayed, so they do
    not run twice), and their step keys; None when there are none."""
    pending = dangling_tool_calls(list(checkpoint.messages))
    source_run = run_of_cursor(checkpoint.cursor)
    if not pending or not source_run:
        return None
    turn = checkpoint.turn
    return source_run, frozenset(k for c in pending for k in (tool_step_key(turn, c.id), approval_step_key(turn, c.id)))
