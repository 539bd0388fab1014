"""Streaming: text deltas reach ``emit`` as they arrive; a replayed turn is not streamed or billed again."""

from __future__ import annotations

from loomray import Agent, Message, Usage
from loomray.models import ModelRequest, ModelResponse
from loomray.runtime import InProcRuntime


class StreamingModel:
    """A model that streams its answer in three pieces; ``complete`` must not be used while streaming."""

    name = "test:streaming"

    def __init__(self) -> None:
        self.streamed = 0
        self.completed = 0

    async def complete(self, request: ModelRequest) -> ModelResponse:
        self.completed += 1
        return ModelResponse(message=Message(role="assistant", content="alpha beta gamma"), usage=Usage(requests=1))

    async def stream(self, request: ModelRequest, on_delta) -> ModelResponse:
        self.streamed += 1
        for piece in ("alpha ", "beta ", "gamma"):
            await on_delta(piece)
        return ModelResponse(message=Message(role="assistant", content="alpha beta gamma"), usage=Usage(requests=1))


async def test_deltas_reach_emit_before_the_response_event():
    model = StreamingModel()
    events = []
    result = await Agent("sys", model=model, runtime=InProcRuntime()).run("hi", session_id="s", emit=events.append)
    types = [e.type for e in events]
    deltas = [e for e in events if e.type == "text_delta"]
    assert "".join(d.text for d in deltas) == result.output == "alpha beta gamma"
    assert types.index("text_delta") < types.index("model_response")
    assert deltas[0].step_key == "t0000-model"
    assert (model.streamed, model.completed) == (1, 0)


async def test_without_a_listener_the_model_is_not_streamed():
    model = StreamingModel()
    await Agent("sys", model=model, runtime=InProcRuntime()).run("hi", session_id="s")
    assert (model.streamed, model.completed) == (0, 1)


async def test_a_replayed_turn_is_neither_streamed_nor_billed():
    model = StreamingModel()
    agent = Agent("sys", model=model, runtime=InProcRuntime())
    await agent.run("hi", session_id="s", emit=lambda e: None)
    events = []
    result = await agent.resume(session_id="s", emit=events.append)  # no checkpoint: journal replay
    assert not [e for e in events if e.type == "text_delta"]
    assert result.model_calls == 0 and model.streamed == 1
