"""The offline demo model: a deterministic multi-turn research run with KB-sized tool payloads."""

from __future__ import annotations

from loomray import Agent, Tuning
from loomray.models import resolve_model
from loomray.models.research import ResearchModel, research_tools
from loomray.runtime import InProcRuntime


async def test_demo_research_runs_like_a_real_task():
    agent = Agent("researcher", model="demo:research", tools=research_tools(), tuning=Tuning(checkpoint=True))
    assert isinstance(agent.model, ResearchModel) and agent.model.name == "demo:research"
    result = await agent.run("vector clocks in practice", session_id="r")
    assert result.turns == 10 and result.model_calls == 10
    names = [c.name for m in result.messages for c in m.tool_calls]
    assert names == ["search", "fetch_page", "take_note"] * 3
    pages = [m for m in result.messages if m.role == "tool" and m.name == "fetch_page"]
    assert all(2500 <= len(p.content) <= 3500 for p in pages) and not any(m.is_error for m in result.messages)
    assert result.output.startswith("# Report: vector clocks in practice")
    assert result.output.count("\n1. ") == 1 and "3. " in result.output  # cites its three notes
    assert result.usage.cost_usd > 0
    again = await Agent("researcher", model="demo:research", tools=research_tools()).run("vector clocks in practice")
    assert again.messages == result.messages  # deterministic


async def test_research_passes_and_page_size_are_configurable():
    model = resolve_model("demo:research", passes=4, page_kb=1)
    result = await Agent("", model=model, tools=research_tools(), runtime=InProcRuntime()).run("topic")
    assert result.turns == 5
    page = next(m for m in result.messages if m.role == "tool" and m.name == "fetch_page")
    assert len(page.content) == 1024


def test_agent_ships_to_a_worker_without_its_runtime():
    """Ray ships the Agent with cloudpickle; the runtime (live clients) must not travel."""
    from ray import cloudpickle

    agent = Agent("x", model="demo:research", tools=research_tools(), runtime=InProcRuntime())
    clone = cloudpickle.loads(cloudpickle.dumps(agent))
    assert clone.runtime is None and clone.instructions == "x" and sorted(clone.tools) == sorted(agent.tools)
    assert clone.tools["take_note"].key_for({"title": "t", "text": "x"}) == agent.tools["take_note"].key_for(
        {"title": "t", "text": "x"})


async def test_a_follow_up_gets_one_more_research_round_and_a_revised_report():
    agent = Agent("researcher", model="demo:research", tools=research_tools(), tuning=Tuning(checkpoint=True))
    await agent.run("vector clocks", session_id="f")
    more = await agent.resume("Add a section on costs.", session_id="f")
    new_calls = [c for m in more.messages[21:] for c in m.tool_calls]
    assert [c.name for c in new_calls] == ["search", "fetch_page", "take_note"]
    assert "Add a section on costs" in new_calls[0].arguments["query"]
    assert more.model_calls == 4 and more.output.count("\n4. ") == 1  # the fourth note is the follow-up's
    nudged = await agent.resume(session_id="f")  # the nudge is not a new request: just the report again
    assert nudged.model_calls == 1 and nudged.output.startswith("# Report")
