"""AnthropicModel through the real ``anthropic`` SDK against a local Messages API server."""

import threading

import pytest

pytest.importorskip("anthropic", reason="the anthropic SDK is not installed: pip install 'loomray[anthropic]'")

from model_wire import anthropic_events, anthropic_message  # noqa: E402

from loomray.errors import ModelAuthError, ModelBadRequestError, ModelError  # noqa: E402
from loomray.models.anthropic import AnthropicModel  # noqa: E402
from loomray.models.base import ModelRequest, complete_with_stream  # noqa: E402
from loomray.records import Message, ToolCall  # noqa: E402

WEATHER_TOOL = {
    "name": "get_weather",
    "description": "Current weather for a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}


def make(server, **settings) -> AnthropicModel:
    settings.setdefault("max_retries", 2)
    return AnthropicModel("claude-opus-4-7", base_url=server.base_url, **settings)


async def test_plain_reply_maps_system_usage_and_cost(anthropic_server):
    anthropic_server.reply(anthropic_message(
        "Paris.", usage={"input_tokens": 100, "output_tokens": 20,
                         "cache_read_input_tokens": 1000, "cache_creation_input_tokens": 200}))
    model = make(anthropic_server)
    request = ModelRequest(messages=[Message(role="system", content="Be terse."),
                                     Message(role="user", content="Capital of France?")])

    response = await model.complete(request)

    assert response.message == Message(role="assistant", content="Paris.")
    assert response.stop_reason == "end_turn"
    sent = anthropic_server.requests[0]["body"]
    assert sent["system"] == "Be terse."
    assert sent["messages"] == [{"role": "user", "content": [{"type": "text", "text": "Capital of France?"}]}]
    assert sent["model"] == "claude-opus-4-7" and sent["max_tokens"] > 0
    u = response.usage
    assert (u.input_tokens, u.output_tokens, u.cache_read_tokens, u.cache_write_tokens, u.requests) == (
        1300, 20, 1000, 200, 1)
    # claude-opus-4-7: $5 in, $25 out, $0.50 cache read, $6.25 cache write per MTok.
    assert u.cost_usd == pytest.approx((100 * 5 + 20 * 25 + 1000 * 0.5 + 200 * 6.25) / 1e6)


async def test_tool_use_round_trip(anthropic_server):
    anthropic_server.reply(anthropic_message(
        "Let me check.", [("toolu_01", "get_weather", {"city": "Oslo"})]))
    anthropic_server.reply(anthropic_message("It is 3 degrees in Oslo."))
    model = make(anthropic_server)
    transcript = [Message(role="user", content="Weather in Oslo?")]

    first = await model.complete(ModelRequest(messages=transcript, tools=[WEATHER_TOOL]))
    assert first.message.tool_calls == [ToolCall(id="toolu_01", name="get_weather", arguments={"city": "Oslo"})]
    assert first.message.content == "Let me check."
    assert first.stop_reason == "tool_use"
    transcript += [first.message, Message(role="tool", content="3C", tool_call_id="toolu_01", name="get_weather")]
    second = await model.complete(ModelRequest(messages=transcript, tools=[WEATHER_TOOL]))

    assert second.message.content == "It is 3 degrees in Oslo."
    tools_sent = anthropic_server.requests[0]["body"]["tools"]
    assert tools_sent == [{"name": "get_weather", "description": "Current weather for a city.",
                           "input_schema": WEATHER_TOOL["parameters"]}]
    wire = anthropic_server.requests[1]["body"]["messages"]
    assert wire[1] == {"role": "assistant", "content": [
        {"type": "text", "text": "Let me check."},
        {"type": "tool_use", "id": "toolu_01", "name": "get_weather", "input": {"city": "Oslo"}}]}
    assert wire[2] == {"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "toolu_01", "content": "3C"}]}


async def test_structured_output_and_effort(anthropic_server):
    anthropic_server.reply(anthropic_message('{"city": "Oslo", "temp_c": 3}'))
    schema = {"title": "Weather", "type": "object",
              "properties": {"city": {"type": "string"}, "temp_c": {"type": "integer"}},
              "required": ["city", "temp_c"]}
    response = await make(anthropic_server).complete(
        ModelRequest(messages=[Message(role="user", content="Oslo?")], output_schema=schema, effort="low"))

    sent = anthropic_server.requests[0]["body"]["output_config"]
    assert sent["effort"] == "low"
    assert sent["format"]["type"] == "json_schema"
    assert sent["format"]["schema"] == dict(schema, additionalProperties=False)
    assert response.message.content == '{"city": "Oslo", "temp_c": 3}'


async def test_stream_delivers_deltas_as_they_arrive(anthropic_server):
    gate = threading.Event()
    message = anthropic_message("Hello, world", [("toolu_09", "get_weather", {"city": "Rome"})],
                                usage={"output_tokens": 7})
    anthropic_server.stream(anthropic_events(message, ["Hello", ", ", "world"], gate=gate))
    deltas: list[str] = []

    async def on_delta(text: str) -> None:
        deltas.append(text)
        gate.set()  # the server holds the rest of the stream until the first delta got here

    response = await complete_with_stream(
        make(anthropic_server), ModelRequest(messages=[Message(role="user", content="hi")]), on_delta)

    assert anthropic_server.gates_passed == [True]
    assert deltas == ["Hello", ", ", "world"]
    assert response.message.content == "Hello, world"
    assert response.message.tool_calls == [ToolCall(id="toolu_09", name="get_weather", arguments={"city": "Rome"})]
    assert response.usage.output_tokens == 7 and response.usage.requests == 1
    assert anthropic_server.requests[0]["body"]["stream"] is True


async def test_429_is_retried_by_the_sdk(anthropic_server):
    anthropic_server.error(429, "slow down", headers={"retry-after-ms": "5"})
    anthropic_server.error(529, "overloaded", headers={"retry-after-ms": "5"})
    anthropic_server.reply(anthropic_message("finally"))

    response = await make(anthropic_server, max_retries=2).complete(
        ModelRequest(messages=[Message(role="user", content="hi")]))

    assert response.message.content == "finally"
    assert len(anthropic_server.requests) == 3
    assert {r["headers"].get("x-stainless-retry-count") for r in anthropic_server.requests} == {"0", "1", "2"}


async def test_retries_exhausted_is_a_model_error_with_status(anthropic_server):
    for _ in range(2):
        anthropic_server.error(429, "slow down", headers={"retry-after-ms": "5"})

    with pytest.raises(ModelError) as info:
        await make(anthropic_server, max_retries=1).complete(
            ModelRequest(messages=[Message(role="user", content="hi")]))

    assert len(anthropic_server.requests) == 2  # one try + max_retries=1
    assert info.value.status == 429 and info.value.provider == "anthropic"
    assert "claude-opus-4-7" in str(info.value) and "slow down" in str(info.value)


async def test_401_is_a_typed_auth_error_naming_provider_and_model(anthropic_server):
    model = make(anthropic_server, api_key="wrong-key")

    with pytest.raises(ModelAuthError) as info:
        await model.complete(ModelRequest(messages=[Message(role="user", content="hi")]))

    err = info.value
    assert (err.provider, err.model, err.status) == ("anthropic", "claude-opus-4-7", 401)
    assert "anthropic" in str(err) and "claude-opus-4-7" in str(err) and "ANTHROPIC_API_KEY" in str(err)
    assert len(anthropic_server.requests) == 1  # a 401 is never retried


async def test_400_is_a_typed_bad_request_error(anthropic_server):
    # A tool result that answers no tool call: the server rejects it like the real API.
    bad = [Message(role="user", content="hi"),
           Message(role="tool", content="x", tool_call_id="toolu_nope", name="t")]
    with pytest.raises(ModelBadRequestError) as info:
        await make(anthropic_server).complete(ModelRequest(messages=bad))
    assert info.value.status == 400 and "toolu_nope" in str(info.value)


async def test_per_call_timeout(anthropic_server):
    anthropic_server.hang()
    model = make(anthropic_server, max_retries=0, timeout=0.3)
    with pytest.raises(ModelError, match="timed out"):
        await model.complete(ModelRequest(messages=[Message(role="user", content="hi")]))


async def test_unknown_model_costs_none(anthropic_server):
    anthropic_server.reply(anthropic_message("ok", model="claude-unreleased-9"))
    model = AnthropicModel("claude-unreleased-9", base_url=anthropic_server.base_url)
    response = await model.complete(ModelRequest(messages=[Message(role="user", content="hi")]))
    assert response.usage.input_tokens == 10 and response.usage.cost_usd is None


async def test_extra_body_is_a_default_the_request_refines(anthropic_server):
    anthropic_server.reply(anthropic_message("ok"))
    model = make(anthropic_server, extra_body={"output_config": {"effort": "max"}, "metadata": {"user_id": "u1"}})
    await model.complete(ModelRequest(messages=[Message(role="user", content="hi")], effort="low"))
    body = anthropic_server.requests[0]["body"]
    assert body["output_config"] == {"effort": "low"} and body["metadata"] == {"user_id": "u1"}


async def test_429_without_retry_after_uses_the_sdk_backoff(anthropic_server):
    anthropic_server.error(429, "slow down")  # no retry-after: the SDK's own exponential backoff
    anthropic_server.reply(anthropic_message("ok"))
    response = await make(anthropic_server, max_retries=1).complete(
        ModelRequest(messages=[Message(role="user", content="hi")]))
    assert response.message.content == "ok" and len(anthropic_server.requests) == 2


async def test_prompt_cache_is_requested_unless_turned_off(anthropic_server):
    anthropic_server.reply(anthropic_message("a"))
    anthropic_server.reply(anthropic_message("b"))
    request = ModelRequest(messages=[Message(role="user", content="hi")])
    await make(anthropic_server).complete(request)
    await make(anthropic_server, prompt_cache=False).complete(request)
    assert anthropic_server.requests[0]["body"]["cache_control"] == {"type": "ephemeral"}
    assert "cache_control" not in anthropic_server.requests[1]["body"]
