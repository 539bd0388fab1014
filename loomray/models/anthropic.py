"""Anthropic Messages API adapter (``pip install 'loomray[anthropic]'``).

What maps to what: docs/providers.md. :func:`from_anthropic` inverts :func:`to_anthropic` exactly (a tool
message's ``name`` is recovered from the ``tool_use`` it answers); thinking blocks are not kept. The SDK is
imported only here, lazily.
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Iterable
from typing import Any

from loomray.models.base import DeltaCallback, ModelRequest, ModelResponse
from loomray.models.provider import ProviderModel, closed_schema
from loomray.records import Message, ToolCall, Usage

_BAD_ID_CHARS = re.compile(r"[^A-Za-z0-9_-]")

#: ``max_tokens`` is mandatory on this API; this is the default when none is set.
DEFAULT_MAX_TOKENS = 8192


class AnthropicModel(ProviderModel):
    """A Claude model behind the :class:`~loomray.models.base.Model` protocol.

    Settings: ``api_key`` (else ``ANTHROPIC_API_KEY`` / ``ANTHROPIC_AUTH_TOKEN``),
    ``base_url`` (else ``ANTHROPIC_BASE_URL``), ``max_retries`` (SDK retries on
    429/5xx), ``timeout`` (seconds per attempt), ``max_tokens``, ``prices``,
    ``extra_body`` (extra request fields, e.g. ``{"thinking": {...}}``), and
    ``prompt_cache`` (default True: the request asks the API to cache the
    transcript prefix, so each pass of a long session pays cache-read prices
    for the turns the previous pass already sent).
    """

    def __init__(self, model: str, *, prompt_cache: bool = True, **settings: Any):
        self.prompt_cache = bool(prompt_cache)
        super().__init__(model, **settings)

    provider = "anthropic"
    extra = "anthropic"
    sdk_module = "anthropic"
    key_envs = ("ANTHROPIC_API_KEY", "ANTHROPIC_AUTH_TOKEN")

    def _make_client(self, sdk: Any, credential: tuple[str, str]) -> Any:
        source, value = credential
        auth = {"auth_token": value} if source == "ANTHROPIC_AUTH_TOKEN" else {"api_key": value}
        return sdk.AsyncAnthropic(**auth, base_url=self.base_url, max_retries=self.max_retries, timeout=self.timeout)

    def request_params(self, request: ModelRequest) -> dict[str, Any]:
        """The keyword arguments of ``messages.create`` for ``request`` (pure; no I/O)."""
        system, messages = to_anthropic(request.messages)
        params: dict[str, Any] = {"model": self.model, "max_tokens": self.max_tokens or DEFAULT_MAX_TOKENS,
                                  "messages": messages}
        if system:
            params["system"] = system
        if request.tools:
            params["tools"] = [{"name": t["name"], "description": t.get("description") or "",
                                "input_schema": t.get("parameters") or {"type": "object", "properties": {}}}
                               for t in request.tools]
        output_config: dict[str, Any] = {}
        if request.output_schema is not None:
            output_config["format"] = {"type": "json_schema", "schema": closed_schema(request.output_schema)}
        if request.effort is not None:
            output_config["effort"] = request.effort
        # Sent as a raw body field so SDK releases older than output_config still pass it on.
        # The adapter's extra_body is a default; this request's own settings win over it.
        extra_body = {"cache_control": {"type": "ephemeral"}} if self.prompt_cache else {}
        extra_body.update(self.extra_body)
        if output_config:
            extra_body["output_config"] = {**extra_body.get("output_config", {}), **output_config}
        if extra_body:
            params["extra_body"] = extra_body
        return params

    async def complete(self, request: ModelRequest) -> ModelResponse:
        """One Messages API call (the SDK retries 429/5xx); typed errors otherwise."""
        sdk = self._sdk()
        try:
            reply = await self.client().messages.create(**self.request_params(request))
        except sdk.APIError as e:
            raise self.translate_error(sdk, e) from e
        return self._response(reply)

    async def stream(self, request: ModelRequest, on_delta: DeltaCallback) -> ModelResponse:
        """Stream text deltas to ``on_delta`` as they arrive; return the whole reply once."""
        sdk = self._sdk()
        try:
            async with self.client().messages.stream(**self.request_params(request)) as events:
                async for text in events.text_stream:
                    result = on_delta(text)
                    if inspect.isawaitable(result):
                        await result
                reply = await events.get_final_message()
        except sdk.APIError as e:
            raise self.translate_error(sdk, e) from e
        return self._response(reply)

    def _response(self, reply: Any) -> ModelResponse:
        data = reply.model_dump() if hasattr(reply, "model_dump") else dict(reply)
        message = assistant_from_blocks(data.get("content") or [])
        usage = self.priced(usage_from_anthropic(data.get("usage") or {}), served_by=data.get("model"))
        return ModelResponse(message=message, usage=usage, stop_reason=data.get("stop_reason"), model=data.get("model"),
                             id=data.get("id"))


def usage_from_anthropic(usage: dict[str, Any]) -> Usage:
    """Anthropic's usage block in loomray's convention (``input_tokens`` includes cached tokens)."""
    read = int(usage.get("cache_read_input_tokens") or 0)
    write = int(usage.get("cache_creation_input_tokens") or 0)
    return Usage(input_tokens=int(usage.get("input_tokens") or 0) + read + write,
                 output_tokens=int(usage.get("output_tokens") or 0), cache_read_tokens=read, cache_write_tokens=write,
                 requests=1)


def wire_id(call_id: str | None) -> str:
    """A tool call id in the form this API accepts (``[A-Za-z0-9_-]+``).

    Ids minted by other providers may hold other characters; the mapping is a
    pure function of the id, so a call and its result still match.
    """
    return _BAD_ID_CHARS.sub("_", call_id or "") or "_"


def to_anthropic(messages: Iterable[Message]) -> tuple[str | None, list[dict[str, Any]]]:
    """``(system, messages)`` in Messages API form for a neutral transcript."""
    system: list[str] = []
    wire: list[dict[str, Any]] = []
    for m in messages:
        if m.role == "system":
            system.append(m.content)
        elif m.role == "user":
            wire.append({"role": "user", "content": [{"type": "text", "text": m.content}]})
        elif m.role == "assistant":
            if not m.content and not m.tool_calls:
                # The API rejects an empty turn; an empty reply carries nothing to send back.
                continue
            blocks: list[dict[str, Any]] = []
            if m.content:
                blocks.append({"type": "text", "text": m.content})
            blocks.extend({"type": "tool_use", "id": wire_id(c.id), "name": c.name, "input": dict(c.arguments)}
                          for c in m.tool_calls)
            wire.append({"role": "assistant", "content": blocks})
        elif m.role == "tool":
            block: dict[str, Any] = {"type": "tool_result", "tool_use_id": wire_id(m.tool_call_id),
                                     "content": m.content}
            if m.is_error:
                block["is_error"] = True
            last = wire[-1] if wire else None
            # Results of one assistant turn's calls go back together, in one user turn.
            if last is not None and last["role"] == "user" and all(b["type"] == "tool_result" for b in last["content"]):
                last["content"].append(block)
            else:
                wire.append({"role": "user", "content": [block]})
    return ("\n\n".join(system) if system else None), wire


def assistant_from_blocks(blocks: Iterable[dict[str, Any]]) -> Message:
    """An assistant :class:`Message` from response (or request) content blocks."""
    texts: list[str] = []
    calls: list[ToolCall] = []
    for b in blocks:
        kind = b.get("type")
        if kind == "text":
            texts.append(b.get("text") or "")
        elif kind == "tool_use":
            calls.append(ToolCall(id=b["id"], name=b["name"], arguments=dict(b.get("input") or {})))
        # thinking / redacted_thinking / server-tool blocks are provider-only: not kept.
    return Message(role="assistant", content="".join(texts), tool_calls=calls)


def from_anthropic(system: str | None, messages: Iterable[dict[str, Any]]) -> list[Message]:
    """The neutral transcript for Messages API ``(system, messages)``; inverse of :func:`to_anthropic`."""
    out: list[Message] = [Message(role="system", content=system)] if system else []
    names: dict[str, str] = {}
    for m in messages:
        content = m.get("content")
        blocks = [{"type": "text", "text": content}] if isinstance(content, str) else list(content or [])
        if m["role"] == "assistant":
            msg = assistant_from_blocks(blocks)
            names.update({c.id: c.name for c in msg.tool_calls})
            out.append(msg)
            continue
        texts: list[str] = []
        for b in blocks:
            if b.get("type") == "tool_result":
                result = b.get("content")
                if isinstance(result, list):
                    result = "".join(x.get("text", "") for x in result if isinstance(x, dict))
                out.append(Message(role="tool", content=result or "", tool_call_id=b["tool_use_id"],
                                   name=names.get(b["tool_use_id"]), is_error=bool(b.get("is_error", False))))
            elif b.get("type") == "text":
                texts.append(b.get("text") or "")
        if texts:
            out.append(Message(role="user", content="".join(texts)))
    return out
