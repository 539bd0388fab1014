"""OpenAIModel through the real ``openai`` SDK against a local Chat Completions server."""

import json
import threading

import pytest

pytest.importorskip("openai", reason="the openai SDK is not installed: pip install 'loomray[openai]'")

from model_wire import openai_chunks, openai_completion  # noqa: E402

from loomray.errors import ModelAuthError, ModelBadRequestError, ModelError  # noqa: E402
from loomray.models.base import ModelRequest, complete_with_stream  # noqa: E402
from loomray.models.openai import OpenAIModel  # noqa: E402
from loomray.records import Message, ToolCall  # noqa: E402

WEATHER_TOOL = {
    "name": "get_weather",
    "description": "Current weather for a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}


def make(server, **settings) -> OpenAIModel:
    settings.setdefault("max_retries", 2)
    return OpenAIModel("gpt-4o", base_url=server.base_url, **settings)


async def test_plain_reply_maps_system_usage_and_cost(openai_server):
    openai_server.reply(openai_completion(
        "Paris.", usage={"prompt_tokens": 1100, "completion_tokens": 20,
                         "prompt_tokens_details": {"cached_tokens": 1000}}))
    request = ModelRequest(messages=[Message(role="system", content="Be terse."),
                                     Message(role="user", content="Capital of France?")])

    response = await make(openai_server).complete(request)

    assert response.message == Message(role="assistant", content="Paris.")
    assert response.stop_reason == "stop" and response.model == "gpt-4o"
    sent = openai_server.requests[0]["body"]
    assert sent["messages"] == [{"role": "system", "content": "Be terse."},
                                {"role": "user", "content": "Capital of France?"}]
    u = response.usage
    assert (u.input_tokens, u.output_tokens, u.cache_read_tokens, u.requests) == (1100, 20, 1000, 1)
    # gpt-4o: $2.50 in, $1.25 cached in, $10 out per MTok; prompt_tokens already includes the cached ones.
    assert u.cost_usd == pytest.approx((100 * 2.5 + 1000 * 1.25 + 20 * 10) / 1e6)


async def test_tool_call_round_trip(openai_server):
    openai_server.reply(openai_completion(None, [("call_abc", "get_weather", {"city": "Oslo"})]))
    openai_server.reply(openai_completion("It is 3 degrees in Oslo."))
    model = make(openai_server)
    transcript = [Message(role="user", content="Weather in Oslo?")]

    first = await model.complete(ModelRequest(messages=transcript, tools=[WEATHER_TOOL]))
    assert first.message == Message(role="assistant", content="", tool_calls=[
        ToolCall(id="call_abc", name="get_weather", arguments={"city": "Oslo"})])
    assert first.stop_reason == "tool_calls"
    transcript += [first.message, Message(role="tool", content="3C", tool_call_id="call_abc", name="get_weather")]
    second = await model.complete(ModelRequest(messages=transcript, tools=[WEATHER_TOOL]))

    assert second.message.content == "It is 3 degrees in Oslo."
    assert openai_server.requests[0]["body"]["tools"] == [{"type": "function", "function": WEATHER_TOOL}]
    wire = openai_server.requests[1]["body"]["messages"]
    assert wire[1]["role"] == "assistant" and wire[1]["content"] is None
    assert wire[1]["tool_calls"][0]["id"] == "call_abc"
    assert json.loads(wire[1]["tool_calls"][0]["function"]["arguments"]) == {"city": "Oslo"}
    assert wire[2] == {"role": "tool", "tool_call_id": "call_abc", "content": "3C"}


async def test_structured_output_and_effort(openai_server):
    openai_server.reply(openai_completion('{"city": "Oslo", "temp_c": 3}', model="o4-mini"))
    schema = {"title": "Weather report", "type": "object",
              "properties": {"city": {"type": "string"}, "temp_c": {"type": "integer"}},
              "required": ["city", "temp_c"]}
    model = OpenAIModel("o4-mini", base_url=openai_server.base_url, max_tokens=500)

    response = await model.complete(
        ModelRequest(messages=[Message(role="user", content="Oslo?")], output_schema=schema, effort="high"))

    sent = openai_server.requests[0]["body"]
    assert sent["reasoning_effort"] == "high"
    assert sent["max_completion_tokens"] == 500
    assert sent["response_format"] == {"type": "json_schema", "json_schema": {
        "name": "Weather_report", "schema": dict(schema, additionalProperties=False), "strict": True}}
    assert json.loads(response.message.content) == {"city": "Oslo", "temp_c": 3}


async def test_optional_fields_turn_strict_mode_off(openai_server):
    openai_server.reply(openai_completion("{}"))
    schema = {"type": "object", "properties": {"note": {"type": "string"}}}
    await make(openai_server).complete(ModelRequest(messages=[Message(role="user", content="x")],
                                                    output_schema=schema))
    assert openai_server.requests[0]["body"]["response_format"]["json_schema"]["strict"] is False


async def test_stream_delivers_deltas_as_they_arrive(openai_server):
    gate = threading.Event()
    openai_server.stream(openai_chunks(["Hel", "lo"], [("call_1", "get_weather", {"city": "Rome"}),
                                                       ("call_2", "get_weather", {"city": "Oslo"})],
                                       usage={"completion_tokens": 9}, gate=gate))
    deltas: list[str] = []

    def on_delta(text: str) -> None:  # a sync callback works too
        deltas.append(text)
        gate.set()

    response = await complete_with_stream(
        make(openai_server), ModelRequest(messages=[Message(role="user", content="hi")]), on_delta)

    assert openai_server.gates_passed == [True]
    assert deltas == ["Hel", "lo"]
    assert response.message.content == "Hello"
    assert response.message.tool_calls == [ToolCall(id="call_1", name="get_weather", arguments={"city": "Rome"}),
                                           ToolCall(id="call_2", name="get_weather", arguments={"city": "Oslo"})]
    assert response.usage.output_tokens == 9 and response.usage.cost_usd is not None
    assert response.stop_reason == "tool_calls"
    sent = openai_server.requests[0]["body"]
    assert sent["stream"] is True and sent["stream_options"] == {"include_usage": True}


async def test_429_is_retried_by_the_sdk(openai_server):
    openai_server.error(429, "Rate limit reached", headers={"retry-after-ms": "5"})
    openai_server.error(503, "busy", headers={"retry-after-ms": "5"})
    openai_server.reply(openai_completion("finally"))

    response = await make(openai_server, max_retries=2).complete(
        ModelRequest(messages=[Message(role="user", content="hi")]))

    assert response.message.content == "finally"
    assert [r["headers"].get("x-stainless-retry-count") for r in openai_server.requests] == ["0", "1", "2"]


async def test_retries_exhausted_is_a_model_error_with_status(openai_server):
    for _ in range(3):
        openai_server.error(429, "Rate limit reached", headers={"retry-after-ms": "5"})
    with pytest.raises(ModelError) as info:
        await make(openai_server, max_retries=2).complete(ModelRequest(messages=[Message(role="user", content="x")]))
    assert len(openai_server.requests) == 3
    assert (info.value.status, info.value.provider, info.value.model) == (429, "openai", "gpt-4o")


async def test_401_is_a_typed_auth_error_naming_provider_and_model(openai_server):
    with pytest.raises(ModelAuthError) as info:
        await make(openai_server, api_key="wrong").complete(ModelRequest(messages=[Message(role="user", content="x")]))
    err = info.value
    assert (err.provider, err.model, err.status) == ("openai", "gpt-4o", 401)
    assert "openai" in str(err) and "gpt-4o" in str(err) and "OPENAI_API_KEY" in str(err)
    assert len(openai_server.requests) == 1


async def test_400_is_a_typed_bad_request_error(openai_server):
    bad = [Message(role="user", content="hi"), Message(role="tool", content="x", tool_call_id="call_nope")]
    with pytest.raises(ModelBadRequestError) as info:
        await make(openai_server).complete(ModelRequest(messages=bad))
    assert info.value.status == 400 and "tool" in str(info.value)


async def test_malformed_tool_arguments_are_kept_not_dropped(openai_server):
    body = openai_completion(None, [("call_x", "get_weather", {})])
    body["choices"][0]["message"]["tool_calls"][0]["function"]["arguments"] = '{"city": "Os'
    openai_server.reply(body)
    response = await make(openai_server).complete(ModelRequest(messages=[Message(role="user", content="x")]))
    assert response.message.tool_calls[0].arguments == {"_raw_arguments": '{"city": "Os'}


async def test_per_call_timeout(openai_server):
    openai_server.hang()
    with pytest.raises(ModelError, match="timed out"):
        await make(openai_server, max_retries=0, timeout=0.3).complete(
            ModelRequest(messages=[Message(role="user", content="x")]))
