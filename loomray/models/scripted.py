"""``ScriptedModel``: an offline, deterministic model for tests, examples and benches.

It picks its reply from the transcript, not from a private counter: reply
number *n* answers the transcript that already holds *n* assistant messages.
So a session restored from a checkpoint (in another process) gets exactly the
reply that turn would have had. Replies may be strings (a final answer),
:class:`~loomray.records.Message` objects, or tool-call specs::

    ScriptedModel([
        {"tool": "search", "args": {"query": "ray actors"}},            # one call
        {"tool_calls": [{"name": "a", "arguments": {}}, ...], "content": "thinking"},
        "final answer",
    ])

A reply may also be a function ``(request) -> reply`` (sync or async).
Tool-call ids are derived from the reply number (``s0003_0``), which also lets
the model find its place after condensing folded older assistant messages away.
``calls`` counts invocations; ``counter_path`` additionally appends one line per
call to a file, so a count survives a killed process.
"""

from __future__ import annotations

import asyncio
import inspect
import os
import re
from collections.abc import Sequence
from typing import Any

from loomray.condense import estimate_tokens
from loomray.errors import ModelError
from loomray.models.base import ModelRequest, ModelResponse
from loomray.records import Message, ToolCall, Usage

_SCRIPTED_ID = re.compile(r"^s(\d{4,})_\d+$")
_CONDENSED = re.compile(r"\[compacted: \d+ earlier messages, (\d+) from the assistant\]")



def reply_index(messages: Sequence[Message]) -> int:
    """Which scripted reply answers this transcript (robust to condensing)."""
    after = 0
    for m in reversed(messages):
        if m.role != "assistant":
            continue
        for c in m.tool_calls:
            hit = _SCRIPTED_ID.match(c.id)
            if hit:
                return int(hit.group(1)) + 1 + after
        after += 1
    folded = sum(int(hit.group(1)) for m in messages if m.role == "user" for hit in _CONDENSED.finditer(m.content))
    return after + folded


def _to_message(reply: Any, index: int) -> Message:
    if isinstance(reply, Message):
        return reply if reply.role == "assistant" else reply.model_copy(update={"role": "assistant"})
    if isinstance(reply, str):
        return Message(role="assistant", content=reply)
    if isinstance(reply, ToolCall):
        reply = {"tool_calls": [reply]}
    if isinstance(reply, dict):
        if "tool" in reply:
            specs: list[Any] = [{"name": reply["tool"], "arguments": reply.get("args", reply.get("arguments", {}))}]
        else:
            specs = list(reply.get("tool_calls", []))
        calls = [spec if isinstance(spec, ToolCall) else
                 ToolCall(id=spec.get("id") or f"s{index:04d}_{j}", name=spec["name"],
                          arguments=dict(spec.get("arguments", spec.get("args", {})))) for j, spec in enumerate(specs)]
        return Message(role="assistant", content=str(reply.get("content", "")), tool_calls=calls)
    raise TypeError(f"ScriptedModel reply {index} has unsupported type {type(reply).__name__}")


class ScriptedModel:
    """Replays ``responses`` in transcript order; offline and deterministic.

    ``price_per_mtok`` sets a deterministic ``cost_usd`` (input and output alike);
    ``delay`` (seconds) simulates model latency for benchmarks.
    """

    def __init__(self, responses: Sequence[Any], *, name: str = "scripted",
                 counter_path: str | os.PathLike[str] | None = None, price_per_mtok: float = 1.0,
                 delay: float = 0.0) -> None:
        self.responses = list(responses)
        self.name = name
        self.calls = 0
        self.requests: list[ModelRequest] = []
        self.counter_path = os.fspath(counter_path) if counter_path is not None else None
        self.price_per_mtok = price_per_mtok
        self.delay = delay

    async def complete(self, request: ModelRequest) -> ModelResponse:
        index = reply_index(request.messages)
        if index >= len(self.responses):
            raise ModelError(
                f"ScriptedModel has {len(self.responses)} replies but the transcript asks for reply {index}",
                provider="scripted", model=self.name)
        if self.delay:
            await asyncio.sleep(self.delay)
        reply = self.responses[index]
        if callable(reply) and not isinstance(reply, (Message, ToolCall)):
            reply = reply(request)
            if inspect.isawaitable(reply):  # an async reply function (e.g. one that waits on an event)
                reply = await reply
        message = _to_message(reply, index)
        self.calls += 1
        self.requests.append(request)
        if self.counter_path is not None:
            _append_line(self.counter_path, f"{index}\n")
        tokens_in = estimate_tokens(request.messages)
        tokens_out = estimate_tokens([message])
        cost = (tokens_in + tokens_out) * self.price_per_mtok / 1_000_000
        return ModelResponse(message=message,
                             usage=Usage(input_tokens=tokens_in, output_tokens=tokens_out, requests=1, cost_usd=cost),
                             stop_reason="tool_use" if message.tool_calls else "end_turn", model=self.name)


def _append_line(path: str, line: str) -> None:
    # O_APPEND + fsync: the count must survive a SIGKILL right after the call returns.
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        os.write(fd, line.encode())
        os.fsync(fd)
    finally:
        os.close(fd)


def count_calls(path: str | os.PathLike[str]) -> list[int]:
    """The reply indexes a file-backed ScriptedModel served, in call order."""
    try:
        with open(path) as f:
            return [int(x) for x in f.read().split()]
    except FileNotFoundError:
        return []
