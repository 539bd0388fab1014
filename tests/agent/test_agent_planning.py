"""The takeover's decision, tested as the pure function it is: :func:`loomray.planning.decide` on values built by
hand (no store). Each case asks for what it needs read, one thing at a time, and then plans."""

from __future__ import annotations

import pytest

from loomray.errors import CheckpointNotFound
from loomray.planning import JournalRef, RunPlan, SessionReads, decide
from loomray.records import Checkpoint, Message
from loomray.recovery import CheckpointRef, LastRun, last_run_of, run_to_continue
from loomray.run_request import RunRequest
from loomray.storage import layout
from loomray.storage.journal import JournalRun
from loomray.storage.rows import JournalEntry, Lease, RunRecord

SID = "s1"


def entry(run_id: str, seq: int, step_key: str, kind: str, output: dict | None = None, *, input_hash: str = "h",
          epoch: int = 1) -> JournalEntry:
    return JournalEntry(session_id=SID, run_id=run_id, seq=seq, step_key=step_key, kind=kind, input_hash=input_hash,
                        output=output or {}, epoch=epoch)


def journal(run_id: str, *entries: JournalEntry) -> JournalRun:
    return JournalRun(SID, None, run_id, {layout.journal_key(SID, None, e.run_id, e.seq, e.step_key): e
                                          for e in entries})


def record(run_id: str, request: RunRequest, n: int = 0) -> RunRecord:
    return RunRecord(session_id=SID, n=n, run_id=run_id, spec_hash=request.spec_hash(),
                     request=request.model_dump(mode="json"))


def checkpoint(checkpoint_id: str, *, run_id: str, status: str = "completed", turn: int = 1) -> Checkpoint:
    return Checkpoint(session_id=SID, checkpoint_id=checkpoint_id, turn=turn, execution_status=status,
                      cursor=f"{run_id}:3", messages=[Message(role="user", content="q"),
                                                      Message(role="assistant", content="a")])


def model_step(run_id: str, seq: int) -> JournalEntry:
    return entry(run_id, seq, f"model-{seq}", "model", {"response": {"message": {"role": "assistant", "content": "x"},
                                                                      "usage": {"input_tokens": 1}}})


def plan_of(reads: SessionReads, answers: dict) -> tuple[RunPlan, list]:
    """Drive ``decide`` as the takeover does, answering each read from ``answers``; returns the plan and the reads
    it asked for, in order."""
    asked = []
    while not isinstance(step := decide(reads), RunPlan):
        assert step not in asked, f"{step} asked for twice"
        asked.append(step)
        reads = reads.with_read(step, answers[step])
    return step, asked


def test_a_new_run_after_a_finished_one_continues_its_conversation():
    first = RunRequest(kind="run", prompt="first", session_id=SID)
    done = journal("run1", entry("run1", 0, "run_start", "run_start", {"kind": "run", "prompt": "first"},
                                 input_hash=first.spec_hash()),
                   model_step("run1", 1), entry("run1", 2, "run_end", "run_end"))
    last = last_run_of(record("run1", first), done)
    assert last.done and not last.unfinished
    request = RunRequest(kind="run", prompt="second", session_id=SID)
    run_id, request = run_to_continue(request, last, ())
    assert run_id is None  # a new run
    latest = checkpoint("c2", run_id="run1")
    plan, asked = plan_of(SessionReads(request, "run2", last), {CheckpointRef(SID, "latest"): latest})
    assert asked == [CheckpointRef(SID, "latest")]
    assert (plan.run_id, plan.restored, plan.prompt, plan.continuing) == ("run2", latest, "second", False)
    assert plan.start_output["base_checkpoint_id"] == "c2"


def test_an_unfinished_run_continues_with_its_journal_and_reads_its_base_once():
    request = RunRequest(kind="run", prompt="again", session_id=SID)
    start = entry("run2", 0, "run_start", "run_start", {"kind": "run", "prompt": "again", "base_checkpoint_id": "c2",
                                                        "source_session": SID}, input_hash=request.spec_hash())
    unfinished = journal("run2", start, model_step("run2", 1))
    last = last_run_of(record("run2", request, n=1), unfinished)
    assert last.unfinished and last.spec == request.spec_hash()
    run_id, request = run_to_continue(request, last, ())
    assert run_id == "run2"
    base = checkpoint("c2", run_id="run1")  # the latest is the base: the run wrote no checkpoint of its own
    plan, asked = plan_of(SessionReads(request, "run2", last, unfinished), {CheckpointRef(SID, "latest"): base})
    assert asked == [CheckpointRef(SID, "latest")]  # c2 by id is the latest already read
    assert plan.continuing and plan.restored is base and plan.prompt == "again"
    assert [r.step_key for r in plan.prior] == ["model-1"] and plan.next_seq == 2


def test_entries_a_fenced_writer_appended_do_not_finish_the_run():
    """The old writer appended a model step and a run_end after the pre-lease listing: the new owner's seal will
    exclude them, so the run is unfinished and replay does not see them."""
    request = RunRequest(kind="run", prompt="go", session_id=SID)
    start = entry("run1", 0, "run_start", "run_start", {"kind": "run", "prompt": "go"}, input_hash=request.spec_hash())
    early = model_step("run1", 1)
    late = [model_step("run1", 2), entry("run1", 3, "run_end", "run_end")]
    read = journal("run1", start, early, *late)
    listed = frozenset(layout.journal_key(SID, None, "run1", e.seq, e.step_key) for e in (start, early))
    lease = Lease(session_id=SID, user_id=None, epoch=2, owner="new")
    last = last_run_of(record("run1", request), read, lease=lease, seen_before=listed)
    assert last.unfinished and [e.step_key for e in last.entries if e.kind == "model"] == ["model-1"]
    assert last_run_of(record("run1", request), read).done  # unsealed and unjudged, it would look finished
    sealed = read.sealed_view(lease, listed)  # what the takeover's seal returns
    plan, _ = plan_of(SessionReads(request, "run1", last, sealed), {CheckpointRef(SID, "latest"): None})
    assert plan.continuing and not plan.finished
    assert [r.step_key for r in plan.prior] == ["model-1"] and plan.next_seq == 5  # after the seal at 4


def test_no_checkpoint_a_resume_replays_the_last_run_and_a_fork_fails():
    first = RunRequest(kind="run", prompt="task", session_id=SID)
    done = journal("run1", entry("run1", 0, "run_start", "run_start", {"kind": "run", "prompt": "task"}),
                   model_step("run1", 1), entry("run1", 2, "run_end", "run_end"))
    last = last_run_of(record("run1", first), done)
    resume = RunRequest(kind="resume", prompt=None, session_id=SID)
    assert run_to_continue(resume, last, ()) == (None, resume)
    plan, asked = plan_of(SessionReads(resume, "run2", last), {CheckpointRef(SID, "latest"): None,
                                                                JournalRef(SID, "run1"): done.entries})
    assert asked == [CheckpointRef(SID, "latest"), JournalRef(SID, "run1")]
    assert plan.restored is None and plan.prompt == "task" and plan.start_output["replay_from"] == "run1"
    assert [r.step_key for r in plan.prior] == ["model-1"]

    fork = RunRequest(kind="resume", prompt="x", session_id="s2", fork_of=SID, from_checkpoint="c9")
    reads = SessionReads(fork, "run3", LastRun())
    assert decide(reads) == CheckpointRef(SID, "c9")
    with pytest.raises(CheckpointNotFound):
        decide(reads.with_read(CheckpointRef(SID, "c9"), None))
