"""A restore reads its checkpoint once: every checkpoint object a resume, a fork or a continued run restores is
fetched a single time (the agent finds the fork point in the index; the run's takeover reads the objects).

The store is a real local directory behind :class:`storage.faults.FaultyObjectStore` with no faults planned,
which logs every call: what it counts are GETs of keys under a session's ``checkpoints/``.
"""

from __future__ import annotations

from collections import Counter

import pytest
from agent_helpers import Crash, crash_at, lookup

from loomray import Agent, Edit, Message, Tuning, Variant
from loomray.errors import CheckpointNotFound
from loomray.models import ScriptedModel
from loomray.runtime import LocalRuntime
from loomray.storage.faults import FaultyObjectStore
from loomray.storage.localdir import LocalObjectStore
from loomray.storage.store import Store


class Counted:
    """A LocalRuntime on a directory whose object calls are logged; ``reads()`` counts checkpoint GETs since the
    last call."""

    def __init__(self, root) -> None:
        self.objects = FaultyObjectStore(LocalObjectStore(root))
        self.runtime = LocalRuntime(Store(self.objects, f"file://{root}"))

    def reads(self) -> Counter[str]:
        got = Counter(c.key for c in self.objects.calls
                      if c.op == "get" and c.key is not None and "/checkpoints/" in c.key)
        self.objects.calls.clear()
        return got


def make_agent(runtime) -> Agent:
    replies = [{"tool": "lookup", "args": {"key": "a"}}, {"tool": "lookup", "args": {"key": "b"}}, "first done",
               "second done", "third done", "fourth done"]
    return Agent("You look things up.", model=ScriptedModel(replies), tools=[lookup], runtime=runtime,
                 tuning=Tuning(checkpoint=True))


@pytest.fixture
def counted(tmp_path):
    c = Counted(tmp_path / "store")
    yield c
    c.runtime.close()


def read_once(reads: Counter[str], checkpoint_id: str) -> None:
    assert reads, "the restore read no checkpoint object"
    assert any(checkpoint_id in key for key in reads), f"{checkpoint_id} was not read: {sorted(reads)}"
    twice = {k: n for k, n in reads.items() if n > 1}
    assert not twice, f"checkpoint objects read more than once: {twice}"


async def test_fork_from_an_older_checkpoint_reads_it_once(counted):
    agent = make_agent(counted.runtime)
    await agent.run("task", session_id="s1")
    older = (await agent.list_checkpoints("s1"))[1].checkpoint_id
    counted.reads()
    [fork] = await agent.fork("s1", from_checkpoint=older, prompts=["go on"])
    assert fork.forked_from == "s1" and fork.stop_reason == "completed"
    read_once(counted.reads(), older)


async def test_fork_of_a_variant_with_edits_reads_the_fork_point_once(counted):
    agent = make_agent(counted.runtime)
    await agent.run("task", session_id="s1")
    point = (await agent.list_checkpoints("s1"))[1]
    counted.reads()
    edit = Edit.insert(-1, Message(role="user", content="mind the budget"))
    [fork] = await agent.fork("s1", from_checkpoint=point.checkpoint_id, variants=[Variant(edits=(edit,))])
    assert fork.stop_reason == "completed"
    assert "mind the budget" in [m.content for m in fork.messages]
    read_once(counted.reads(), point.checkpoint_id)


async def test_resume_from_an_older_checkpoint_reads_it_once(counted):
    agent = make_agent(counted.runtime)
    await agent.run("task", session_id="s1")
    older = (await agent.list_checkpoints("s1"))[-1].checkpoint_id
    counted.reads()
    result = await agent.resume("again", session_id="s1", from_checkpoint=older)
    assert result.session_id != "s1" and result.forked_from == "s1"
    read_once(counted.reads(), older)


async def test_resume_and_run_on_a_finished_session_read_the_latest_once(counted):
    agent = make_agent(counted.runtime)
    await agent.run("task", session_id="s1")
    latest = (await agent.list_checkpoints("s1"))[0].checkpoint_id
    counted.reads()
    await agent.resume("more", session_id="s1")
    read_once(counted.reads(), latest)
    latest = (await agent.list_checkpoints("s1"))[0].checkpoint_id
    counted.reads()
    await agent.run("and more", session_id="s1")
    read_once(counted.reads(), latest)


async def test_a_run_continued_after_a_crash_reads_its_base_once(counted):
    """The re-issued run restarts from the checkpoint its first attempt started from, which is also the
    session's latest: one read serves both questions (is it the run's own? where did the run start?)."""
    agent = make_agent(counted.runtime)
    await agent.run("task", session_id="s1")
    base = (await agent.list_checkpoints("s1"))[0].checkpoint_id
    with pytest.raises(Crash):
        await agent.run("next", session_id="s1", emit=crash_at("model_call"))
    counted.reads()
    result = await agent.run("next", session_id="s1")
    assert result.stop_reason == "completed" and result.output == "second done"
    read_once(counted.reads(), base)


async def test_a_missing_fork_point_fails_before_any_fork_starts(counted):
    agent = make_agent(counted.runtime)
    await agent.run("task", session_id="s1")
    counted.objects.calls.clear()
    with pytest.raises(CheckpointNotFound):
        await agent.fork("s1", from_checkpoint="ckpt-none", prompts=["x"])
    with pytest.raises(CheckpointNotFound):
        await agent.fork("s-empty", from_checkpoint="latest", prompts=["x"])
    with pytest.raises(CheckpointNotFound):
        await agent.resume("x", session_id="s1", from_checkpoint="ckpt-none")
    assert [c.key for c in counted.objects.calls if c.op in ("put", "delete")] == []  # no fork session began
    assert not counted.reads()


async def test_a_fork_reads_its_fork_point_from_the_look_that_checked_its_pin(counted):
    """A fork's takeover lists the parent's checkpoints to pin the fork point, then again to see it still live
    after the pin; the fork point is read from that second look, not from a third listing."""
    agent = make_agent(counted.runtime)
    await agent.run("task", session_id="s1")
    point = (await agent.list_checkpoints("s1"))[1].checkpoint_id
    counted.objects.calls.clear()
    [fork] = await agent.fork("s1", from_checkpoint=point, prompts=["go on"])
    assert fork.forked_from == "s1" and fork.stop_reason == "completed"
    looks = [c.n for c in counted.objects.calls if c.op == "list" and c.key == "sessions/_/s1/checkpoints/"]
    pinned = [c.n for c in counted.objects.calls if c.op == "put" and c.key.startswith("sessions/_/s1/pins/")]
    assert len(pinned) == 1
    # The driver's own look finding the fork point, the pin's look before it writes the pin, the one after.
    assert len([n for n in looks if n < pinned[0]]) == 2 and len([n for n in looks if n > pinned[0]]) == 1, looks
