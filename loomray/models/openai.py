"""OpenAI Chat Completions adapter (``pip install 'loomray[openai]'``); works with any server that speaks the API.

What maps to what, and the one field the wire has no place for (a tool result's ``is_error``):
docs/providers.md. :func:`from_openai` inverts :func:`to_openai`. The SDK is imported only here, lazily.
"""

from __future__ import annotations

import inspect
import json
import re
from collections.abc import Iterable
from typing import Any

from loomray.models.base import DeltaCallback, ModelRequest, ModelResponse
from loomray.models.provider import ProviderModel, all_required, closed_schema
from loomray.records import Message, ToolCall, Usage


class OpenAIModel(ProviderModel):
    """A model served by the Chat Completions API behind the :class:`~loomray.models.base.Model` protocol.

    Settings: ``api_key`` (else ``OPENAI_API_KEY``), ``base_url`` (else
    ``OPENAI_BASE_URL``), ``max_retries`` (SDK retries on 429/5xx), ``timeout``
    (seconds per attempt), ``max_tokens`` (sent as ``max_completion_tokens``),
    ``prices``, ``extra_body``.
    """

    provider = "openai"
    extra = "openai"
    sdk_module = "openai"
    key_envs = ("OPENAI_API_KEY",)

    def _make_client(self, sdk: Any, credential: tuple[str, str]) -> Any:
        return sdk.AsyncOpenAI(api_key=credential[1], base_url=self.base_url, max_retries=self.max_retries,
                               timeout=self.timeout)

    def request_params(self, request: ModelRequest) -> dict[str, Any]:
        """The keyword arguments of ``chat.completions.create`` for ``request`` (pure; no I/O)."""
        params: dict[str, Any] = {"model": self.model, "messages": to_openai(request.messages)}
        if request.tools:
            params["tools"] = [{"type": "function", "function": {
                "name": t["name"], "description": t.get("description") or "",
                "parameters": t.get("parameters") or {"type": "object", "properties": {}}}} for t in request.tools]
        if request.output_schema is not None:
            schema = closed_schema(request.output_schema)
            # Strict mode rejects optional properties; fall back to best effort for those.
            params["response_format"] = {"type": "json_schema", "json_schema": {
                "name": _schema_name(schema), "schema": schema, "strict": all_required(schema)}}
        if request.effort is not None:
            params["reasoning_effort"] = request.effort
        if self.max_tokens:
            params["max_completion_tokens"] = self.max_tokens
        if self.extra_body:
            params["extra_body"] = dict(self.extra_body)
        return params

    async def complete(self, request: ModelRequest) -> ModelResponse:
        """One Chat Completions call (the SDK retries 429/5xx); typed errors otherwise."""
        sdk = self._sdk()
        try:
            reply = await self.client().chat.completions.create(**self.request_params(request))
        except sdk.APIError as e:
            raise self.translate_error(sdk, e) from e
        data = reply.model_dump()
        choice = (data.get("choices") or [{}])[0]
        return ModelResponse(message=assistant_from_openai(choice.get("message") or {}),
                             usage=self.priced(usage_from_openai(data.get("usage")), served_by=data.get("model")),
                             stop_reason=choice.get("finish_reason"), model=data.get("model"), id=data.get("id"))

    async def stream(self, request: ModelRequest, on_delta: DeltaCallback) -> ModelResponse:
        """Stream text deltas to ``on_delta`` as they arrive; return the whole reply once."""
        sdk = self._sdk()
        params = self.request_params(request)
        params["stream"] = True
        params["stream_options"] = {"include_usage": True}
        text: list[str] = []
        calls: dict[int, dict[str, Any]] = {}
        usage: dict[str, Any] | None = None
        finish: str | None = None
        served_by: str | None = None
        reply_id: str | None = None
        try:
            chunks = await self.client().chat.completions.create(**params)
            async for chunk in chunks:
                served_by = chunk.model or served_by
                reply_id = chunk.id or reply_id
                if chunk.usage is not None:
                    usage = chunk.usage.model_dump()
                for choice in chunk.choices:
                    delta = choice.delta
                    finish = choice.finish_reason or finish
                    if delta.content:
                        text.append(delta.content)
                        result = on_delta(delta.content)
                        if inspect.isawaitable(result):
                            await result
                    # Tool calls arrive in fragments keyed by index: id and name once, arguments piecewise.
                    for part in delta.tool_calls or ():
                        slot = calls.setdefault(part.index, {"id": None, "name": "", "arguments": ""})
                        slot["id"] = part.id or slot["id"]
                        if part.function is not None:
                            slot["name"] += part.function.name or ""
                            slot["arguments"] += part.function.arguments or ""
        except sdk.APIError as e:
            raise self.translate_error(sdk, e) from e
        message = assistant_from_openai({"content": "".join(text), "tool_calls": [
            {"id": c["id"], "type": "function", "function": {"name": c["name"], "arguments": c["arguments"]}}
            for _, c in sorted(calls.items())]})
        return ModelResponse(message=message, usage=self.priced(usage_from_openai(usage), served_by=served_by),
                             stop_reason=finish, model=served_by, id=reply_id)


def _schema_name(schema: dict[str, Any]) -> str:
    """A ``response_format`` name (``[A-Za-z0-9_-]{1,64}``) from the schema's title."""
    name = re.sub(r"[^A-Za-z0-9_-]", "_", str(schema.get("title") or "output"))[:64]
    return name or "output"


def usage_from_openai(usage: dict[str, Any] | None) -> Usage:
    """OpenAI's usage block in loomray's convention (``prompt_tokens`` already includes cached tokens)."""
    usage = usage or {}
    details = usage.get("prompt_tokens_details") or {}
    output_details = usage.get("completion_tokens_details") or {}
    return Usage(input_tokens=int(usage.get("prompt_tokens") or 0),
                 output_tokens=int(usage.get("completion_tokens") or 0),
                 cache_read_tokens=int(details.get("cached_tokens") or 0),
                 cache_write_tokens=int(details.get("cache_write_tokens") or 0),
                 reasoning_tokens=int(output_details.get("reasoning_tokens") or 0), requests=1)


def _arguments(raw: str | None) -> dict[str, Any]:
    """Parse a tool call's JSON arguments. Malformed JSON is kept verbatim, never dropped,
    under ``_raw_arguments`` so the tool layer reports it back to the model."""
    if not raw:
        return {}
    try:
        value = json.loads(raw)
    except ValueError:
        return {"_raw_arguments": raw}
    return value if isinstance(value, dict) else {"_raw_arguments": raw}


def assistant_from_openai(message: dict[str, Any]) -> Message:
    """An assistant :class:`Message` from a Chat Completions message (response or request form)."""
    content = message.get("content")
    if content is None:
        content = message.get("refusal") or ""
    calls = [
        ToolCall(id=c["id"], name=c["function"]["name"], arguments=_arguments(c["function"].get("arguments")))
        for c in message.get("tool_calls") or ()
        if c.get("type", "function") == "function"
    ]
    return Message(role="assistant", content=content, tool_calls=calls)


def to_openai(messages: Iterable[Message]) -> list[dict[str, Any]]:
    """Chat Completions ``messages`` for a neutral transcript."""
    wire: list[dict[str, Any]] = []
    for m in messages:
        if m.role in ("system", "user"):
            wire.append({"role": m.role, "content": m.content})
        elif m.role == "assistant":
            out: dict[str, Any] = {"role": "assistant", "content": m.content or (None if m.tool_calls else "")}
            if m.tool_calls:
                out["tool_calls"] = [{"id": c.id, "type": "function", "function": {
                    "name": c.name, "arguments": json.dumps(c.arguments, ensure_ascii=False)}} for c in m.tool_calls]
            wire.append(out)
        elif m.role == "tool":
            wire.append({"role": "tool", "tool_call_id": m.tool_call_id, "content": m.content})
    return wire


def from_openai(messages: Iterable[dict[str, Any]]) -> list[Message]:
    """The neutral transcript for Chat Completions ``messages``; inverse of :func:`to_openai`."""
    out: list[Message] = []
    names: dict[str, str] = {}
    for m in messages:
        role = m["role"]
        if role == "developer":
            role = "system"
        if role == "assistant":
            msg = assistant_from_openai(m)
            names.update({c.id: c.name for c in msg.tool_calls})
            out.append(msg)
        elif role == "tool":
            out.append(Message(role="tool", content=_text(m.get("content")), tool_call_id=m["tool_call_id"],
                               name=names.get(m["tool_call_id"])))
        else:
            out.append(Message(role=role, content=_text(m.get("content"))))
    return out


def _text(content: Any) -> str:
    """Message content as text: a string, or the text parts of a content-part list."""
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict))
    return content or ""
