"""The whole stack with real adapters: an Agent checkpointed on Claude resumes on GPT.

The provider APIs are the local servers of model_wire.py; the Agent, loop,
journal, tools and in-memory store are loomray's own.
"""

import pytest

pytest.importorskip("anthropic", reason="the anthropic SDK is not installed: pip install 'loomray[anthropic]'")
pytest.importorskip("openai", reason="the openai SDK is not installed: pip install 'loomray[openai]'")

from model_wire import anthropic_message, openai_completion  # noqa: E402

from loomray import Agent, Tuning  # noqa: E402
from loomray.models.anthropic import AnthropicModel  # noqa: E402
from loomray.models.openai import OpenAIModel  # noqa: E402
from loomray.models.pricing import MAINTAINED_SOURCE  # noqa: E402
from loomray.runtime.inproc import InProcRuntime  # noqa: E402


def get_weather(city: str) -> str:
    """Current weather for a city."""
    return {"Oslo": "3C, snow", "Rome": "18C, sun"}[city]


async def test_agent_checkpointed_on_claude_resumes_on_gpt(anthropic_server, openai_server):
    runtime = InProcRuntime()
    claude = Agent("You report the weather.", tools=[get_weather], runtime=runtime, tuning=Tuning(checkpoint=True),
                   model=AnthropicModel("claude-opus-4-7", base_url=anthropic_server.base_url))
    anthropic_server.reply(anthropic_message("Checking.", [("toolu_01", "get_weather", {"city": "Oslo"})],
                                             usage={"input_tokens": 100, "output_tokens": 10}))
    anthropic_server.reply(anthropic_message("Oslo: 3C, snow.", usage={"input_tokens": 150, "output_tokens": 8}))

    first = await claude.run("Weather in Oslo?", session_id="trip")

    assert first.output == "Oslo: 3C, snow." and first.model_calls == 2
    assert first.usage.input_tokens == 250 and first.usage.requests == 2
    assert first.usage.cost_usd == pytest.approx((250 * 5 + 18 * 25) / 1e6)
    tool_result = anthropic_server.requests[1]["body"]["messages"][2]["content"][0]
    assert tool_result == {"type": "tool_result", "tool_use_id": "toolu_01", "content": "3C, snow"}

    gpt = Agent("You report the weather.", tools=[get_weather], runtime=runtime, tuning=Tuning(checkpoint=True),
                model=OpenAIModel("gpt-4o", base_url=openai_server.base_url))
    openai_server.reply(openai_completion(None, [("call_R", "get_weather", {"city": "Rome"})],
                                          usage={"prompt_tokens": 300, "completion_tokens": 12}))
    openai_server.reply(openai_completion("Rome: 18C, sun.", usage={"prompt_tokens": 320, "completion_tokens": 6}))

    second = await gpt.resume("And Rome?", session_id="trip")

    assert second.output == "Rome: 18C, sun." and second.resumed_from_checkpoint and second.model_calls == 2
    sent = openai_server.requests[0]["body"]["messages"]
    # Claude's turns, restored from the checkpoint, reach GPT with their tool call ids intact.
    calls = [m for m in sent if m.get("tool_calls")]
    assert calls[0]["tool_calls"][0]["id"] == "toolu_01"
    assert {"role": "tool", "tool_call_id": "toolu_01", "content": "3C, snow"} in sent
    assert sent[-1] == {"role": "user", "content": "And Rome?"}
    # Restored usage is accounted, not re-billed; GPT's calls add at gpt-4o prices.
    assert second.usage.requests == 4 and second.usage.input_tokens == 250 + 620
    assert second.usage.cost_usd == pytest.approx((250 * 5 + 18 * 25) / 1e6 + (620 * 2.5 + 18 * 10) / 1e6)
    assert len(anthropic_server.requests) == 2
    # The stored usage names where its prices came from, so its cost can be explained later.
    stored = await gpt.get_checkpoint("trip")
    assert stored.cumulative_usage.price_source == second.usage.price_source == MAINTAINED_SOURCE
