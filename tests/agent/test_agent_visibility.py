"""Issue 22, path 4, through the public API: a fork that crashed before its first checkpoint resumes after the
parent's retention retired its fork point's row (the fork's pin keeps the object; storage.visibility rule 4)."""

from __future__ import annotations

import pytest
from agent_helpers import Crash, crash_at, lookup

from loomray import Agent, CheckpointConfig, Tuning
from loomray.errors import CheckpointNotFound
from loomray.models import ScriptedModel
from loomray.storage import layout


def echo_last_user(request):
    last = [m for m in request.messages if m.role == "user"][-1]
    return f"answer to: {last.content}"


def agent_for(runtime) -> Agent:
    """Four lookups, then answers: the script is by position in the transcript, so every run and fork of the
    session tree reads the same one."""
    model = ScriptedModel([{"tool": "lookup", "args": {"key": f"k{i}"}} for i in range(4)] + [echo_last_user] * 12)
    return Agent("You look things up.", model=model, tools=[lookup], runtime=runtime,
                 tuning=Tuning(checkpoint=CheckpointConfig(position="after_tools")))


async def test_path04_a_fork_that_crashed_before_its_first_checkpoint_resumes_after_the_parents_retention(
        runtime_factory):
    runtime = runtime_factory(max_checkpoints_per_session=3)
    agent = agent_for(runtime)
    await agent.run("task", session_id="orig")
    point = (await agent.list_checkpoints("orig"))[-1]  # the oldest checkpoint retention kept
    base = await agent.get_checkpoint("orig", point.checkpoint_id)
    with pytest.raises(Crash):  # the fork dies at its first model call, before any checkpoint of its own
        await agent.resume("try another way", session_id="orig", from_checkpoint=point.checkpoint_id,
                                           emit=crash_at("model_call", 1))
    pins = [o.key for o in runtime.store.objects.list(prefix=layout.pin_prefix("orig", None))]
    assert len(pins) == 1
    fork_id = pins[0].rsplit("/", 1)[1].removesuffix(".json")
    # The parent goes on; its retention retires the fork point's row (the fork's pin keeps the object).
    await agent.run("more", session_id="orig")
    assert point.checkpoint_id not in [m.checkpoint_id for m in await agent.list_checkpoints("orig")]
    assert await agent.get_checkpoint("orig", point.checkpoint_id) is None

    result = await agent.resume(session_id=fork_id)
    assert result.session_id == fork_id and result.forked_from == "orig" and result.resumed_from_checkpoint
    assert result.messages[: len(base.messages)] == base.messages
    assert result.output == "answer to: try another way"
    # Nobody else may start from the retired checkpoint.
    with pytest.raises(CheckpointNotFound):
        await agent.resume("again", session_id="orig", from_checkpoint=point.checkpoint_id)


async def test_path05_delete_through_the_store_the_run_wrote_with(runtime):
    """``runtime.store`` is the store the run's checkpoint log wrote through: deleting the newest checkpoint, then
    a middle one, leaves every other checkpoint loadable (incremental ones build on the older objects)."""
    agent = agent_for(runtime)
    await agent.run("task", session_id="s5")
    metas = await agent.list_checkpoints("s5")
    assert len(metas) == 5
    assert runtime.store.checkpoints.delete("s5", metas[0].checkpoint_id)
    assert runtime.store.checkpoints.delete("s5", metas[2].checkpoint_id)
    left = [m.checkpoint_id for m in await agent.list_checkpoints("s5")]
    assert left == [metas[1].checkpoint_id, metas[3].checkpoint_id, metas[4].checkpoint_id]
    for cid in left:
        ckpt = await agent.get_checkpoint("s5", cid)
        assert ckpt is not None and ckpt.checkpoint_id == cid
    assert (await agent.get_checkpoint("s5")).checkpoint_id == metas[1].checkpoint_id
