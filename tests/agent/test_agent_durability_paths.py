"""Session and loop correctness under faults: ownership, corrupt checkpoints, ids, transcript repair.

Each test names the path it closes: 6 (a writer that cannot prove it owns the
session stops), 10 (an explicit checkpoint id is never rewritten to "latest"),
11 (every failed load is a ``CheckpointException``), 12 (configuration and
non-transient write errors are exceptions, not warnings), 13 (``""`` is not a
session id) and 14 (repair keeps tool results next to their calls).
"""

from __future__ import annotations

import logging
import threading
from datetime import datetime, timezone

import pytest

from loomray import Agent, CheckpointException, Message, ToolCall, Tuning
from loomray.errors import DurabilityLost, InvalidIdError, LoomrayUserError
from loomray.models import ScriptedModel
from loomray.runtime import LocalRuntime
from loomray.session import RunRequest
from loomray.storage import CheckpointInfo
from loomray.storage.errors import CorruptObjectError, StorageError, TransientStorageError
from loomray.storage.objects import ObjectStore
from loomray.storage.store import Store
from loomray.storage.testing import write_checkpoint

calls: list[str] = []
#: Tool calls and injected faults in the order they happened (to prove nothing ran after a fault).
timeline: list[tuple[str, str]] = []


def lookup(key: str) -> str:
    """Look something up."""
    calls.append(key)
    timeline.append(("tool", key))
    return f"value of {key}"


@pytest.fixture(autouse=True)
def _reset():
    calls.clear()
    timeline.clear()


def scripted(n_tool_passes: int = 4) -> ScriptedModel:
    return ScriptedModel([{"tool": "lookup", "args": {"key": f"k{i}"}} for i in range(n_tool_passes)] + ["done"])


def make_agent(runtime, model=None, **tuning) -> Agent:
    return Agent("You look things up.", model=model or scripted(), tools=[lookup], runtime=runtime,
                 tuning=Tuning(checkpoint=True, **tuning))


class FaultyObjects(ObjectStore):
    """A real object store whose calls fail while ``should_fail(op, key)`` says so (a StorageError, as S3 gives)."""

    def __init__(self, inner: ObjectStore) -> None:
        self.inner = inner
        self.backend = inner.backend
        self.should_fail = lambda op, key: False
        self.injected = 0
        self._lock = threading.Lock()

    def _maybe_fail(self, op: str, key: str) -> None:
        if self.should_fail(op, key):
            with self._lock:
                self.injected += 1
                timeline.append(("fault", f"{op} {key}"))
            raise TransientStorageError(f"{self.describe(key)}: {op} failed after retries (injected)")

    def put(self, *, key, data, if_none_match=False, if_match=None):
        self._maybe_fail("put", key)
        return self.inner.put(key=key, data=data, if_none_match=if_none_match, if_match=if_match)

    def get(self, *, key):
        self._maybe_fail("get", key)
        return self.inner.get(key=key)

    def list(self, *, prefix):
        self._maybe_fail("list", prefix)
        return self.inner.list(prefix=prefix)

    def list_dirs(self, *, prefix):
        self._maybe_fail("list", prefix)
        return self.inner.list_dirs(prefix=prefix)

    def delete(self, *, keys):
        self._maybe_fail("delete", keys[0] if keys else "")
        return self.inner.delete(keys=keys)

    def describe(self, key=None):
        return self.inner.describe(key)


def faulty_runtime(tmp_path) -> tuple[LocalRuntime, FaultyObjects]:
    from loomray.storage.localdir import LocalObjectStore

    objects = FaultyObjects(LocalObjectStore(tmp_path / "store"))
    return LocalRuntime(Store(objects, f"file://{tmp_path / 'store'}")), objects


def tools_after_the_first_fault() -> int:
    kinds = [k for k, _ in timeline]
    assert "fault" in kinds, "no fault was injected"
    return kinds[kinds.index("fault"):].count("tool")


def allowed_after_fault(durability: str) -> int:
    """Sync: no tool runs once a write failed. Async: an upload in flight reports at most one pass later."""
    return 0 if durability == "sync" else 1


# -- path 6: a writer that cannot prove it owns the session stops -------------------------------------------------

@pytest.mark.parametrize("durability", ["sync", "async"])
async def test_path6_unreadable_lease_stops_the_run_at_its_next_proof(tmp_path, durability, monkeypatch):
    """Writes go on working, but lease.json can no longer be read: the run learns it when it next has to prove
    it owns the session (after LEASE_CHECK_WRITES writes), stops there and is marked failed, never completed."""
    from loomray import run_writes

    monkeypatch.setattr(run_writes, "LEASE_CHECK_WRITES", 3)
    monkeypatch.setattr(run_writes, "LEASE_CHECK_S", 3600.0)
    rt, objects = faulty_runtime(tmp_path)
    agent = make_agent(rt, durability=durability)

    def emit(event):  # from the first tool result on, the lease can no longer be read
        if event.type == "tool_result" and not objects.injected:
            objects.should_fail = lambda op, key: op == "get" and key.endswith("lease.json")
            timeline.append(("fault", "lease.json"))

    with pytest.raises(DurabilityLost, match="lease could not be read") as info:
        await agent.run("task", session_id="s6", emit=emit)
    assert isinstance(info.value.__cause__, StorageError)
    # Writes since the last proof: run_start and pass 0's model answer, then its checkpoint (sync: the tool result
    # is in it) or its tool result (async); the next model call must prove the lease first.
    assert tools_after_the_first_fault() <= allowed_after_fault(durability), timeline
    assert calls == ["k0"]
    row = rt.store.sessions.get("s6")
    assert row.status == "failed" and "DurabilityLost" in row.error
    rt.close()


async def test_path6_unreachable_s3_store_stops_the_run_and_is_never_reported_completed(s3_server):
    from loomray.storage.testing import FaultInjector

    bucket = s3_server.new_bucket("path6")
    rt = LocalRuntime(f"s3://{bucket}/root", max_attempts=1, **s3_server.options)
    agent = make_agent(rt)
    injector = []

    def emit(event):  # the network goes away after pass 1's tool ran (pass 0 is durable by then)
        if event.type == "tool_result" and event.turn == 1 and not injector:
            injector.append(FaultInjector(rt.store.objects.client, failures=None, kind="reset"))
            timeline.append(("fault", "network"))

    with pytest.raises(DurabilityLost):
        await agent.run("task", session_id="s6", emit=emit)
    assert tools_after_the_first_fault() == 0, timeline
    assert injector[0].injected > 0
    injector[0].remove()
    row = rt.store.sessions.get("s6")
    assert row is not None and row.status != "completed"
    assert [m.turn for m in await agent.list_checkpoints("s6")] == [1]
    rt.close()


async def test_path6_journal_only_run_stops_when_the_store_becomes_unreachable(tmp_path):
    rt, objects = faulty_runtime(tmp_path)
    agent = make_agent(rt)
    agent.tuning = Tuning(checkpoint=False)  # only the journal records the run

    def emit(event):  # every storage call fails once the first tool has answered
        if event.type == "tool_result" and objects.injected == 0:
            objects.should_fail = lambda op, key: True

    with pytest.raises(DurabilityLost) as info:
        await agent.run("task", session_id="s6j", emit=emit)
    assert isinstance(info.value.__cause__, TransientStorageError)
    assert calls == ["k0"] and tools_after_the_first_fault() == 0
    objects.should_fail = lambda op, key: False
    assert rt.store.sessions.get("s6j").status == "running"  # never "completed"; "failed" could not be written
    rt.close()


def test_path6_a_failed_lease_reread_of_the_journal_stops_the_run(tmp_path):
    """The journal's periodic lease re-read is an ownership check too: failing it is not just a warning."""
    from loomray.run_writes import GuardedJournal, WriteGuard

    rt, objects = faulty_runtime(tmp_path)
    lease = rt.store.leases.acquire("s6r", owner="test")
    guard = WriteGuard(rt.store, lease)
    journal = GuardedJournal(rt.store, guard)
    journal.check_lease(lease)  # readable: fine
    guard.check()
    objects.should_fail = lambda op, key: op == "get" and key.endswith("lease.json")
    with pytest.raises(DurabilityLost, match="lease could not be read"):
        journal.check_lease(lease)
    with pytest.raises(DurabilityLost):  # remembered: the loop's check before the next step raises it
        guard.check()
    rt.close()


async def test_path6_transient_write_failures_with_a_proven_lease_warn_and_go_on(tmp_path, caplog):
    rt, objects = faulty_runtime(tmp_path)
    failed = []

    def checkpoint_puts_fail_twice(op, key):
        if op == "put" and "/checkpoints/" in key and len(failed) < 2:
            failed.append(key)
            return True
        return False

    objects.should_fail = checkpoint_puts_fail_twice
    agent = make_agent(rt)
    with caplog.at_level(logging.WARNING, logger="loomray.loop"):
        result = await agent.run("task", session_id="s6t")
    assert result.output == "done" and calls == ["k0", "k1", "k2", "k3"]
    assert len([r for r in caplog.records if "could not be written" in r.getMessage()]) == 2
    assert rt.store.sessions.get("s6t").status == "completed"
    rt.close()


async def test_path6_a_run_whose_end_is_not_durable_is_never_reported_completed(tmp_path):
    rt, objects = faulty_runtime(tmp_path)

    def checkpoints_fail_once_every_tool_ran(op, key):
        return op == "put" and "/checkpoints/" in key and len(calls) == 4

    objects.should_fail = checkpoints_fail_once_every_tool_ran
    agent = make_agent(rt)
    result = await agent.run("task", session_id="s6end")
    assert result.output == "done"
    # The final checkpoint failed (a warning while the lease was provable): nothing durable records the end.
    assert rt.store.sessions.get("s6end").status != "completed"
    objects.should_fail = lambda op, key: False
    again = await agent.run("task", session_id="s6end")  # re-issued: continues the run, replays the answer
    assert again.output == "done" and again.model_calls == 0 and calls == ["k0", "k1", "k2", "k3"]
    assert rt.store.sessions.get("s6end").status == "completed"
    rt.close()


# -- path 10: an explicit checkpoint id is never rewritten to "latest" ----------------------------------------------

async def test_path10_resume_from_an_explicit_older_checkpoint_when_the_newest_is_truncated(runtime):
    agent = make_agent(runtime, model=ScriptedModel(
        [{"tool": "lookup", "args": {"key": f"k{i}"}} for i in range(3)] + ["done", "again"]))
    await agent.run("task", session_id="s10")
    rows = runtime.store.checkpoints.list("s10", limit=None)
    newest, older = rows[0], rows[1]
    data = runtime.store.objects.get(key=newest.key).data
    runtime.store.objects.put(key=newest.key, data=data[: len(data) // 2])  # truncated in place
    older_ckpt = await agent.get_checkpoint("s10", older.checkpoint_id)

    result = await agent.resume("one more", session_id="s10", from_checkpoint=older.checkpoint_id)
    # The newest readable checkpoint continues in place, restored by its id.
    assert result.session_id == "s10" and result.forked_from is None and result.resumed_from_checkpoint
    assert result.messages[: len(older_ckpt.messages)] == older_ckpt.messages
    assert result.messages[len(older_ckpt.messages)].content == "one more"


# -- path 11: every failure to load a checkpoint is a CheckpointException ------------------------------------------

async def test_path11_every_checkpoint_load_failure_is_a_checkpoint_exception(tmp_path):
    from click.testing import CliRunner

    from loomray.cli.main import main

    rt, objects = faulty_runtime(tmp_path)
    agent = make_agent(rt)
    await agent.run("task", session_id="s11")
    rows = rt.store.checkpoints.list("s11", limit=None)
    bad, good = rows[1], rows[2]
    data = bytearray(objects.get(key=bad.key).data)
    data[len(data) // 2] ^= 0x01  # same size, wrong sha256
    objects.put(key=bad.key, data=bytes(data))

    def corrupt(e: BaseException) -> bool:
        return isinstance(e, CheckpointException) and isinstance(e.__cause__, CorruptObjectError)

    with pytest.raises(CheckpointException) as info:  # agent.get_checkpoint
        await agent.get_checkpoint("s11", bad.checkpoint_id)
    assert corrupt(info.value) and bad.checkpoint_id in str(info.value)
    with pytest.raises(CheckpointException) as info:  # resume from it (forks)
        await agent.resume("x", session_id="s11", from_checkpoint=bad.checkpoint_id)
    assert corrupt(info.value)
    with pytest.raises(CheckpointException) as info:  # fork from it
        await agent.fork("s11", from_checkpoint=bad.checkpoint_id, prompts=["x"])
    assert corrupt(info.value)
    with pytest.raises(CheckpointException) as info:  # session planning, as a runtime executes a request
        await rt.execute(agent, RunRequest(kind="resume", prompt="x", session_id="s11",
                                           from_checkpoint=bad.checkpoint_id))
    assert corrupt(info.value)
    assert len(calls) == 4  # nothing ran on corrupt data

    # The CLI reports the same typed error, not the storage one.
    out = CliRunner().invoke(main, ["show", "s11", bad.checkpoint_id, "--store", str(tmp_path / "store")])
    assert out.exit_code != 0 and "CheckpointException" in out.output and "CorruptObjectError" in out.output

    # A storage error while reading it: CheckpointException, the storage error as its cause.
    objects.should_fail = lambda op, key: op == "get" and key == good.key
    with pytest.raises(CheckpointException) as info:
        await agent.get_checkpoint("s11", good.checkpoint_id)
    assert isinstance(info.value.__cause__, TransientStorageError)
    objects.should_fail = lambda op, key: False

    # An unknown schema version.
    raw = b'{"schema_version": "9.9", "session_id": "s11", "turn": 1}'
    lease = rt.store.leases.acquire("s11", owner="a writer of a later release")
    write_checkpoint(rt.store, raw, CheckpointInfo(session_id="s11", checkpoint_id="ckpt-future", turn=1,
                                                created_at=datetime.now(timezone.utc), position="after_tools",
                                                execution_status="active", message_count=0), lease=lease, keep=0)
    with pytest.raises(CheckpointException, match="9.9"):
        await agent.get_checkpoint("s11", "ckpt-future")
    rt.close()


# -- path 12: configuration and non-transient write errors are exceptions -----------------------------------------

@pytest.mark.parametrize("name", ["a/b", "", "..", "x" * 129, "tab\there"])
def test_path12_invalid_agent_name_is_refused_when_the_agent_is_built(name):
    with pytest.raises(ValueError) as info:
        Agent("x", model=scripted(), tools=[lookup], tuning=Tuning(checkpoint=True), name=name)
    assert isinstance(info.value, LoomrayUserError) and isinstance(info.value, InvalidIdError)
    assert Agent("x", model=scripted(), name="researcher-1").name == "researcher-1"
    assert Agent("x", model=scripted()).name == "agent"


@pytest.mark.parametrize("durability", ["sync", "async"])
async def test_path12_non_transient_checkpoint_write_error_is_fatal_not_a_warning(runtime, durability, caplog):
    agent = make_agent(runtime, durability=durability)
    agent.name = "bad/name"  # an agent id no store accepts: every checkpoint write fails the same way
    with caplog.at_level(logging.WARNING, logger="loomray.loop"):
        with pytest.raises(ValueError, match="agent_id"):
            await agent.run("task", session_id="s12")
    assert not [r for r in caplog.records if "could not be written" in r.getMessage()]
    assert len(calls) <= 1 + allowed_after_fault(durability)  # stopped at the first checkpoint write
    assert runtime.store.sessions.get("s12").status == "failed"


# -- path 13: "" is not a session id ---------------------------------------------------------------------------

async def test_path13_empty_session_id_is_a_value_error(runtime):
    agent = make_agent(runtime)
    with pytest.raises(ValueError):
        await agent.run("task", session_id="")
    with pytest.raises(ValueError):
        await agent.resume("x", session_id="")
    with pytest.raises(ValueError):
        await agent.resume("x", session_id="s13", from_checkpoint="")
    with pytest.raises(ValueError):
        await agent.fork("", from_checkpoint="latest", prompts=["x"])
    with pytest.raises(ValueError):
        await agent.list_checkpoints("")
    with pytest.raises(ValueError):
        await agent.get_checkpoint("")
    with pytest.raises(ValueError):
        await agent.run("task", session_id="s13", user_id="")
    assert calls == [] and runtime.store.sessions.list() == []  # nothing ran, nothing was written
    result = await agent.run("task", session_id=None)  # None is what means "a new id"
    assert result.session_id.startswith("sess")


# -- path 14: repair keeps each tool result right after its call ------------------------------------------------

async def test_path14_repair_orders_tool_result_before_user_message(runtime):
    model = ScriptedModel(["(the restored call)", "done"])  # replies are picked by assistant messages so far
    agent = make_agent(runtime, model=model)
    call = ToolCall(id="call-1", name="lookup", arguments={"key": "k0"})
    messages = [Message(role="system", content="You look things up."), Message(role="user", content="task"),
                Message(role="assistant", tool_calls=[call]), Message(role="user", content="are you there?")]
    from loomray import Checkpoint
    from loomray.checkpoint_format import ChainEncoder

    ckpt = Checkpoint(session_id="s14", turn=0, position="after_model", messages=messages, message_count=4)
    write_checkpoint(runtime.store, ChainEncoder(None).encode(ckpt).body, CheckpointInfo(
        session_id="s14", checkpoint_id=ckpt.checkpoint_id, turn=0, created_at=ckpt.created_at,
        position="after_model", execution_status="active", message_count=4))

    result = await agent.resume("go on", session_id="s14")
    assert calls == ["k0"]
    sent = model.requests[0].messages
    assert [(m.role, m.content) for m in sent] == [
        ("system", "You look things up."), ("user", "task"), ("assistant", ""), ("tool", "value of k0"),
        ("user", "are you there?"), ("user", "go on")]
    assert sent[3].tool_call_id == "call-1"
    assert [m.role for m in result.messages] == ["system", "user", "assistant", "tool", "user", "user", "assistant"]
    saved = await agent.get_checkpoint("s14")
    assert saved.messages[3].role == "tool" and saved.messages[4].content == "are you there?"
