"""Tools: schemas from signatures and docstrings, sync and async, errors go back to the model."""

from __future__ import annotations

import asyncio

import pytest

from loomray import Agent, ToolContext, tool
from loomray.models import ScriptedModel
from loomray.runtime import InProcRuntime


def get_weather(city: str, days: int = 1) -> str:
    """Look up the forecast.

    Args:
        city: the city name.
        days: how many days ahead.
    """
    return f"{city}: sunny for {days} day(s)"


async def slow_double(x: int) -> int:
    """Double a number, slowly."""
    await asyncio.sleep(0)
    return 2 * x


def explode(reason: str) -> str:
    """Always fails."""
    raise RuntimeError(f"boom: {reason}")


def test_schema_from_signature_and_docstring():
    t = tool(get_weather)
    s = t.schema
    assert s["name"] == "get_weather" and s["description"] == "Look up the forecast."
    props = s["parameters"]["properties"]
    assert props["city"] == {"type": "string", "description": "the city name."}
    assert props["days"]["type"] == "integer" and props["days"]["default"] == 1
    assert s["parameters"]["required"] == ["city"]


def test_tool_context_parameter_is_injected_not_in_schema():
    @tool(name="whoami")
    def who(ctx: ToolContext, greeting: str = "hi") -> str:
        """Say who is asking."""
        return f"{greeting} {ctx.user_id} in {ctx.session_id} ({ctx.context})"

    assert list(who.schema["parameters"]["properties"]) == ["greeting"]
    model = ScriptedModel([{"tool": "whoami", "args": {}}, "ok"])
    agent = Agent("", model=model, tools=[who], runtime=InProcRuntime())
    result = agent.run_sync("go", session_id="s1", user_id="alice", context={"team": "red"})
    assert result.messages[-2].content == "hi alice in s1 ({'team': 'red'})"


def test_sync_and_async_tools_and_errors_go_back_to_the_model():
    model = ScriptedModel([
        {"tool_calls": [{"name": "get_weather", "arguments": {"city": "Oslo", "days": 3}},
                        {"name": "slow_double", "arguments": {"x": 21}}]},
        {"tool": "explode", "args": {"reason": "testing"}},
        {"tool": "get_weather", "args": {"city": "Oslo", "days": "many"}},
        {"tool": "no_such_tool", "args": {}},
        "all done",
    ])
    agent = Agent("", model=model, tools=[get_weather, slow_double, explode], runtime=InProcRuntime())
    result = agent.run_sync("go")
    tool_msgs = [m for m in result.messages if m.role == "tool"]
    assert [m.content for m in tool_msgs[:2]] == ["Oslo: sunny for 3 day(s)", "42"]
    assert [m.is_error for m in tool_msgs] == [False, False, True, True, True]
    assert tool_msgs[2].content == "RuntimeError: boom: testing"
    assert "invalid arguments for get_weather" in tool_msgs[3].content
    assert "unknown tool 'no_such_tool'" in tool_msgs[4].content
    # The model saw every error (they are in the transcript it was sent) and the run completed.
    assert result.output == "all done" and result.turns == 5 and model.calls == 5
    assert model.requests[-1].messages[-1].is_error


def test_duplicate_tool_names_and_bad_names_rejected():
    with pytest.raises(ValueError, match="two tools"):
        Agent("", model=ScriptedModel(["x"]), tools=[get_weather, tool(get_weather)])
    with pytest.raises(ValueError):
        tool(get_weather, name="bad name!")


def test_idempotency_key_skips_a_repeated_effect():
    effects = []

    @tool(idempotency_key=lambda args: f"charge-{args['order']}")
    def charge(order: str, ctx: ToolContext) -> str:
        """Charge an order once."""
        effects.append((order, ctx.idempotency_key))
        return f"charged {order}"

    # The model asks twice for the same effect under different call ids.
    model = ScriptedModel([{"tool": "charge", "args": {"order": "A1"}},
                           {"tool": "charge", "args": {"order": "A1"}},
                           {"tool": "charge", "args": {"order": "B2"}}, "done"])
    agent = Agent("", model=model, tools=[charge], runtime=InProcRuntime())
    result = agent.run_sync("go")
    assert effects == [("A1", "charge-A1"), ("B2", "charge-B2")]
    tool_msgs = [m for m in result.messages if m.role == "tool"]
    assert [m.content for m in tool_msgs] == ["charged A1", "charged A1", "charged B2"]
    assert tool_msgs[1].tool_call_id == "s0001_0"  # answered under the second call's own id
