"""Session history across runs (issue 22, paths 9-12): prune keeps no request, a budget holds across runs, a
consumed pause stays consumed without checkpoints, a checkpoint equals its own JSON round trip."""

from __future__ import annotations

import asyncio

import pytest
from agent_helpers import Crash, crash_at
from control_tools import (
    DEADLINE_S,
    Gate,
    effects,
    lookup,
    reset_effects,  # noqa: F401 - an autouse fixture: importing it applies it to this module
)

from loomray import Agent, Tuning, tool
from loomray.models import ScriptedModel
from loomray.models.scripted import count_calls
from loomray.records import Checkpoint


# -- path 12 -------------------------------------------------------------------------------------------------
async def test_a_checkpoint_read_through_the_api_equals_its_json_round_trip(runtime):
    agent = Agent("You help.", model=ScriptedModel(["hello"]), runtime=runtime, tuning=Tuning(checkpoint=True))
    await agent.run("hi", session_id="eq")
    ckpt = await agent.get_checkpoint("eq")
    assert ckpt is not None
    again = Checkpoint.from_json(ckpt.to_json_bytes())
    assert ckpt == again and again == ckpt
    assert ckpt == await agent.get_checkpoint("eq", ckpt.checkpoint_id)
    assert ckpt != again.model_copy(update={"turn": ckpt.turn + 1})  # equality still looks at every field


# -- path 11 -------------------------------------------------------------------------------------------------
async def test_a_consumed_pause_stays_consumed_without_checkpoints(tmp_path, runtime):
    gate = Gate()
    calls = tmp_path / "c"
    script = [{"tool": "slow", "args": {"key": "a"}}, {"tool": "lookup", "args": {"key": "b"}}, "done"]
    agent = Agent("You help.", model=ScriptedModel(script, counter_path=calls), tools=[lookup, tool(gate.async_tool())],
                  runtime=runtime)  # checkpoint=False, the default
    task = asyncio.ensure_future(agent.run("go", session_id="p"))
    await gate.wait_started()
    assert (await agent.pause("p")) is not None
    gate.release.set()
    paused = await asyncio.wait_for(task, DEADLINE_S)
    assert paused.stop_reason == "paused" and count_calls(calls) == [0]
    done = await agent.resume(None, session_id="p")
    assert done.stop_reason == "completed" and done.output == "done"
    assert count_calls(calls) == [0, 1, 2] and effects == ["slow-a", "b"]
    again = await agent.resume(None, session_id="p")  # finished: nothing pauses it again
    assert again.stop_reason == "completed"


async def test_a_pause_consumed_before_a_crash_still_stops_the_rerun_without_checkpoints(tmp_path, runtime):
    """The pause's record landed, the stop's did not: the re-issued run stops there once; resume goes past it."""
    gate = Gate()
    calls = tmp_path / "c"
    script = [{"tool": "slow", "args": {"key": "a"}}, {"tool": "lookup", "args": {"key": "b"}}, "done"]
    agent = Agent("You help.", model=ScriptedModel(script, counter_path=calls), tools=[lookup, tool(gate.async_tool())],
                  runtime=runtime)
    task = asyncio.ensure_future(agent.run("go", session_id="pc", emit=crash_at("control")))
    await gate.wait_started()
    await agent.pause("pc")
    gate.release.set()
    with pytest.raises(Crash):
        await asyncio.wait_for(task, DEADLINE_S)
    stopped = await agent.run("go", session_id="pc")  # re-issued after the crash: the pause still holds
    assert stopped.stop_reason == "paused" and count_calls(calls) == [0]
    done = await agent.resume(None, session_id="pc")
    assert done.stop_reason == "completed" and count_calls(calls) == [0, 1, 2] and effects == ["slow-a", "b"]
