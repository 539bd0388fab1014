"""One transcript, two providers: what Claude started, GPT continues, and back.

The transcript stays in loomray's neutral records; each adapter converts it to
its own wire form on every call. The local servers reject a tool result that
answers no tool call of the turn before it, exactly as the real APIs do, so a
lost or renamed tool call id fails these tests.
"""

import pytest

pytest.importorskip("anthropic", reason="the anthropic SDK is not installed: pip install 'loomray[anthropic]'")
pytest.importorskip("openai", reason="the openai SDK is not installed: pip install 'loomray[openai]'")

from model_wire import API_KEY, anthropic_message, openai_completion  # noqa: E402

from loomray.errors import ModelConfigError  # noqa: E402
from loomray.models.anthropic import AnthropicModel, from_anthropic, to_anthropic  # noqa: E402
from loomray.models.base import Model, ModelRequest  # noqa: E402
from loomray.models.openai import OpenAIModel, from_openai, to_openai  # noqa: E402
from loomray.records import Checkpoint, Message, ToolCall  # noqa: E402

TOOLS = [{"name": "get_weather", "description": "Weather for a city.",
          "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}]
WEATHER = {"Oslo": "3C, snow", "Rome": "18C, sun"}


async def drive(model: Model, messages: list[Message]) -> list[Message]:
    """A minimal agent loop: call the model, run the tools it asks for, until it answers."""
    messages = list(messages)
    for _ in range(5):
        response = await model.complete(ModelRequest(messages=messages, tools=TOOLS))
        messages.append(response.message)
        if not response.message.tool_calls:
            return messages
        for call in response.message.tool_calls:
            messages.append(Message(role="tool", content=WEATHER[call.arguments["city"]],
                                    tool_call_id=call.id, name=call.name))
    raise AssertionError("model did not stop")


RICH = [
    Message(role="system", content="You are a weather bot."),
    Message(role="user", content="Weather in Oslo and Zürich? ☃"),
    Message(role="assistant", content="Checking both.", tool_calls=[
        ToolCall(id="toolu_01A", name="get_weather", arguments={"city": "Oslo", "units": {"temp": "C"}}),
        ToolCall(id="toolu_01B", name="get_weather", arguments={"city": "Zürich"}),
    ]),
    Message(role="tool", content="3C", tool_call_id="toolu_01A", name="get_weather"),
    Message(role="tool", content="unknown city", tool_call_id="toolu_01B", name="get_weather", is_error=True),
    Message(role="assistant", content="", tool_calls=[ToolCall(id="call_9", name="noargs", arguments={})]),
    Message(role="tool", content="", tool_call_id="call_9", name="noargs"),
    Message(role="assistant", content="Oslo is 3C; Zürich I could not find."),
    Message(role="user", content="Thanks"),
]


def test_anthropic_wire_round_trip_is_lossless():
    system, wire = to_anthropic(RICH)
    assert system == "You are a weather bot."
    # Parallel results share one user turn, as the Messages API requires.
    assert [b["tool_use_id"] for b in wire[2]["content"]] == ["toolu_01A", "toolu_01B"]
    assert wire[2]["content"][1]["is_error"] is True
    assert from_anthropic(system, wire) == RICH


def test_openai_wire_round_trip_is_lossless_but_for_the_error_flag():
    wire = to_openai(RICH)
    assert [m["role"] for m in wire] == ["system", "user", "assistant", "tool", "tool", "assistant", "tool",
                                         "assistant", "user"]
    back = from_openai(wire)
    # Chat Completions has no field for a tool error; everything else comes back.
    expected = [m.model_copy(update={"is_error": False}) if m.role == "tool" else m for m in RICH]
    assert back == expected


async def test_session_moves_between_providers_through_a_checkpoint(anthropic_server, openai_server):
    claude = AnthropicModel("claude-opus-4-7", base_url=anthropic_server.base_url)
    gpt = OpenAIModel("gpt-4o", base_url=openai_server.base_url)

    # 1. Claude runs a tool round trip.
    anthropic_server.reply(anthropic_message("Let me look.", [("toolu_01", "get_weather", {"city": "Oslo"})]))
    anthropic_server.reply(anthropic_message("Oslo: 3C, snow."))
    transcript = await drive(claude, [Message(role="system", content="Weather bot."),
                                      Message(role="user", content="Oslo?")])
    assert [m.role for m in transcript] == ["system", "user", "assistant", "tool", "assistant"]

    # 2. The transcript goes through a checkpoint (JSON), as a resumed session's would.
    ckpt = Checkpoint(session_id="sess-x", turn=2, messages=transcript, message_count=len(transcript))
    restored = Checkpoint.from_json(ckpt.to_json_bytes()).messages
    assert restored == transcript

    # 3. GPT continues it, with Claude's tool call ids in the history.
    openai_server.reply(openai_completion(None, [("call_R", "get_weather", {"city": "Rome"})]))
    openai_server.reply(openai_completion("Rome: 18C, sun."))
    transcript = await drive(gpt, restored + [Message(role="user", content="And Rome?")])
    sent = openai_server.requests[0]["body"]["messages"]
    assert sent == to_openai(restored + [Message(role="user", content="And Rome?")])
    assert sent[2]["tool_calls"][0]["id"] == "toolu_01" and sent[3]["tool_call_id"] == "toolu_01"
    assert transcript[-1].content == "Rome: 18C, sun."

    # 4. And Claude picks it up again, with GPT's ids in the history.
    anthropic_server.reply(anthropic_message("Oslo is colder."))
    transcript = await drive(claude, transcript + [Message(role="user", content="Which is colder?")])
    wire = anthropic_server.requests[-1]["body"]["messages"]
    assert from_anthropic(anthropic_server.requests[-1]["body"]["system"], wire) == transcript[:-1]
    assert wire[4] == {"role": "user", "content": [{"type": "text", "text": "And Rome?"}]}
    assert {"type": "tool_use", "id": "call_R", "name": "get_weather", "input": {"city": "Rome"}} in wire[5]["content"]
    assert wire[6]["content"] == [{"type": "tool_result", "tool_use_id": "call_R", "content": "18C, sun"}]
    assert transcript[-1].content == "Oslo is colder."
    assert all(m.tool_call_id for m in transcript if m.role == "tool")
    assert all(m.name == "get_weather" for m in transcript if m.role == "tool")


@pytest.mark.parametrize("which", ["anthropic", "openai"])
async def test_adapter_pickles_without_client_or_key(which, anthropic_server, openai_server, monkeypatch):
    from ray import cloudpickle

    server = anthropic_server if which == "anthropic" else openai_server
    cls = AnthropicModel if which == "anthropic" else OpenAIModel
    name = "claude-opus-4-7" if which == "anthropic" else "gpt-4o"
    reply = anthropic_message("one") if which == "anthropic" else openai_completion("one")
    server.reply(reply)
    model = cls(name, base_url=server.base_url, max_retries=3, timeout=30)
    await model.complete(ModelRequest(messages=[Message(role="user", content="hi")]))  # builds a client

    blob = cloudpickle.dumps(model)

    assert API_KEY.encode() not in blob
    copy = cloudpickle.loads(blob)
    assert (copy.name, copy.base_url, copy.max_retries, copy.timeout) == (name, server.base_url, 3, 30.0)
    assert copy.prices == model.prices and copy._clients == {}
    server.reply(reply)
    response = await copy.complete(ModelRequest(messages=[Message(role="user", content="hi")]))
    assert response.message.content == "one"


async def test_explicit_key_is_not_shipped_and_receiver_needs_its_own(anthropic_server, monkeypatch):
    from ray import cloudpickle

    monkeypatch.delenv("ANTHROPIC_API_KEY")
    model = AnthropicModel("claude-opus-4-7", api_key=API_KEY, base_url=anthropic_server.base_url)
    blob = cloudpickle.dumps(model)
    assert API_KEY.encode() not in blob
    copy = cloudpickle.loads(blob)
    with pytest.raises(ModelConfigError, match="ANTHROPIC_API_KEY"):
        await copy.complete(ModelRequest(messages=[Message(role="user", content="hi")]))
    assert anthropic_server.requests == []


def test_foreign_ids_are_made_valid_for_anthropic_consistently():
    transcript = [
        Message(role="user", content="x"),
        Message(role="assistant", content="", tool_calls=[ToolCall(id="call:7/a.b", name="t", arguments={})]),
        Message(role="tool", content="ok", tool_call_id="call:7/a.b", name="t"),
        Message(role="assistant", content=""),  # an empty reply: the API rejects empty turns
        Message(role="user", content="y"),
    ]
    _, wire = to_anthropic(transcript)
    assert wire[1]["content"][0]["id"] == "call_7_a_b" == wire[2]["content"][0]["tool_use_id"]
    assert [m["role"] for m in wire] == ["user", "assistant", "user", "user"]
