"""Sessions remember: ``run(prompt, session_id=S)`` on a session whose last run finished continues its conversation."""

from __future__ import annotations

import pytest
from agent_helpers import Crash, crash_at, lookup, tool_calls

from loomray import Agent, Tuning
from loomray.models import ScriptedModel
from loomray.models.scripted import count_calls


def contents(messages) -> list[tuple[str, str]]:
    return [(m.role, m.content) for m in messages]


def agent_for(runtime, model, tuning=None) -> Agent:
    return Agent("You remember.", model=model, tools=[lookup], runtime=runtime,
                 tuning=tuning or Tuning(checkpoint=True))


async def test_a_run_on_a_finished_session_continues_its_conversation(runtime):
    model = ScriptedModel([{"tool": "lookup", "args": {"key": "capital"}}, "Oslo.", "About 709,000."])
    agent = agent_for(runtime, model)
    first = await agent.run("What is the capital of Norway?", session_id="chat")
    assert first.stop_reason == "completed" and first.output == "Oslo."

    second = await agent.run("How many people live there?", session_id="chat")
    assert second.output == "About 709,000." and second.run_id != first.run_id
    # The model saw the whole earlier conversation, then the new prompt.
    seen = contents(model.requests[-1].messages)
    assert seen == contents(first.messages) + [("user", "How many people live there?")]
    assert contents(second.messages) == seen + [("assistant", "About 709,000.")]
    assert second.resumed_from_checkpoint and model.calls == 3 and tool_calls == {"capital": 1}
    # Its spend carries on from the conversation's, and its checkpoint says it finished.
    assert second.usage.cost_usd > first.usage.cost_usd > 0
    latest = await agent.get_checkpoint("chat")
    assert latest.execution_status == "completed" and latest.parent_checkpoint_id == first.checkpoint_id
    assert contents(latest.messages) == contents(second.messages)


async def test_a_crashed_follow_up_run_is_continued_with_the_earlier_conversation(tmp_path, runtime):
    """The follow-up dies after its first model call, before any checkpoint of its own; re-issuing it restores
    the conversation it started from (named by its run_start) and replays that call instead of billing it again."""
    model = ScriptedModel(["Oslo.", {"tool": "lookup", "args": {"key": "population"}}, "About 709,000."],
                          counter_path=tmp_path / "calls")
    agent = agent_for(runtime, model)
    first = await agent.run("What is the capital of Norway?", session_id="chat")
    with pytest.raises(Crash):
        await agent.run("How many people live there?", session_id="chat", emit=crash_at("model_response"))
    assert count_calls(tmp_path / "calls") == [0, 1]
    assert (await agent.get_checkpoint("chat")).checkpoint_id == first.checkpoint_id  # nothing of its own yet

    again = await agent.run("How many people live there?", session_id="chat")
    assert again.output == "About 709,000." and again.replayed_steps >= 1
    assert count_calls(tmp_path / "calls") == [0, 1, 2]  # the journaled call replayed, not repeated
    assert contents(again.messages)[:3] == contents(first.messages)
    assert tool_calls == {"population": 1}


async def test_without_checkpoints_there_is_nothing_to_continue_from(runtime):
    model = ScriptedModel(["first answer", "second answer"])
    agent = agent_for(runtime, model, Tuning())  # checkpointing off (the default)
    await agent.run("one", session_id="plain")
    result = await agent.run("two", session_id="plain")
    assert result.output == "first answer"  # a fresh transcript asks for the script's first reply again
    assert contents(model.requests[-1].messages) == [("system", "You remember."), ("user", "two")]


async def test_a_brand_new_session_starts_empty(runtime):
    model = ScriptedModel(["hi"])
    result = await agent_for(runtime, model).run("hello", session_id="new")
    assert not result.resumed_from_checkpoint
    assert contents(model.requests[0].messages) == [("system", "You remember."), ("user", "hello")]
