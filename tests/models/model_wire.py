"""Local stand-ins for the Anthropic and OpenAI HTTP APIs, on 127.0.0.1 only.

Each server speaks its API's wire format (JSON bodies, server-sent events for
streams, the providers' error bodies), checks the credential header, and
rejects a transcript the real API would reject (a tool result that answers no
tool call of the turn before it). The real SDK clients talk to it through
their base-URL option; nothing in these tests reaches the internet.

Tests script replies with :meth:`WireServer.reply`, :meth:`WireServer.error`
and :meth:`WireServer.stream`; every request is recorded in ``.requests``.
A ``threading.Event`` inside a stream is a gate: the server stops there until
the test sets it (or 5 s pass), which proves a client handled the earlier
events before the later ones existed.
"""

from __future__ import annotations

import json
import threading
from collections import deque
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

API_KEY = "test-key-not-secret"
GATE_TIMEOUT = 5.0


@dataclass
class Scripted:
    status: int = 200
    body: Any = None
    headers: dict[str, str] = field(default_factory=dict)
    #: For streams: a list of (event name or None, JSON-able data or raw str) and threading.Event gates.
    events: list[Any] | None = None
    #: Hold the reply until this event is set (to provoke a client timeout).
    hold: threading.Event | None = None


class _QuietServer(ThreadingHTTPServer):
    """Does not print a traceback when a client hangs up mid-reply (the timeout tests do that on purpose)."""

    def handle_error(self, request, client_address):
        import sys

        if isinstance(sys.exc_info()[1], (BrokenPipeError, ConnectionResetError)):
            return
        super().handle_error(request, client_address)


class WireServer:
    """A ThreadingHTTPServer on 127.0.0.1:0 answering scripted replies in the provider's format."""

    def __init__(self, provider: str):
        self.provider = provider
        self.script: deque[Scripted] = deque()
        self.requests: list[dict[str, Any]] = []
        self.gates_passed: list[bool] = []
        self._holds: list[threading.Event] = []
        self._httpd = _QuietServer(("127.0.0.1", 0), self._handler_class())
        self._httpd.daemon_threads = True
        self._thread = threading.Thread(target=self._httpd.serve_forever, kwargs={"poll_interval": 0.02}, name=f"fake-{provider}", daemon=True)
        self._thread.start()

    @property
    def port(self) -> int:
        return self._httpd.server_address[1]

    @property
    def base_url(self) -> str:
        root = f"http://127.0.0.1:{self.port}"
        return root if self.provider == "anthropic" else root + "/v1"

    # -- scripting -------------------------------------------------------

    def reply(self, body: dict[str, Any], status: int = 200, headers: dict[str, str] | None = None) -> None:
        self.script.append(Scripted(status=status, body=body, headers=headers or {}))

    def error(self, status: int, message: str, headers: dict[str, str] | None = None) -> None:
        self.script.append(Scripted(status=status, body=self.error_body(status, message), headers=headers or {}))

    def stream(self, events: list[Any]) -> None:
        self.script.append(Scripted(events=events))

    def hang(self) -> threading.Event:
        """Script a reply that never comes until the returned event is set (set at teardown)."""
        event = threading.Event()
        self._holds.append(event)
        self.script.append(Scripted(body={}, hold=event))
        return event

    def error_body(self, status: int, message: str) -> dict[str, Any]:
        if self.provider == "anthropic":
            kind = {400: "invalid_request_error", 401: "authentication_error", 429: "rate_limit_error",
                    529: "overloaded_error"}.get(status, "api_error")
            return {"type": "error", "error": {"type": kind, "message": message}}
        code = {401: "invalid_api_key", 429: "rate_limit_exceeded"}.get(status)
        return {"error": {"message": message, "type": "invalid_request_error", "param": None, "code": code}}

    def close(self) -> None:
        for event in self._holds:
            event.set()
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(timeout=5)

    # -- validation, like the real APIs ----------------------------------

    def _auth_ok(self, headers: Any) -> bool:
        if self.provider == "anthropic":
            return headers.get("x-api-key") == API_KEY or headers.get("authorization") == f"Bearer {API_KEY}"
        return headers.get("authorization") == f"Bearer {API_KEY}"

    def _invalid(self, path: str, body: Any) -> str | None:
        expected = "/v1/messages" if self.provider == "anthropic" else "/v1/chat/completions"
        if path != expected:
            return f"unknown path {path}"
        if not isinstance(body, dict) or not body.get("model") or not isinstance(body.get("messages"), list):
            return "model and messages are required"
        if self.provider == "anthropic":
            if "max_tokens" not in body:
                return "max_tokens: Field required"
            open_ids: set[str] = set()
            for m in body["messages"]:
                blocks = m["content"] if isinstance(m["content"], list) else []
                if m["role"] == "assistant":
                    open_ids = {b["id"] for b in blocks if b.get("type") == "tool_use"}
                    continue
                for b in blocks:
                    if b.get("type") == "tool_result" and b.get("tool_use_id") not in open_ids:
                        return f"unexpected tool_use_id found in tool_result blocks: {b.get('tool_use_id')}"
            return None
        open_ids = set()
        for m in body["messages"]:
            if m["role"] == "assistant":
                if open_ids:
                    return f"tool_call_ids did not have response messages: {sorted(open_ids)}"
                open_ids = {c["id"] for c in m.get("tool_calls") or []}
            elif m["role"] == "tool":
                if m.get("tool_call_id") not in open_ids:
                    return "messages with role 'tool' must be a response to a preceding message with 'tool_calls'"
                open_ids.discard(m["tool_call_id"])
            elif open_ids:
                return f"tool_call_ids did not have response messages: {sorted(open_ids)}"
        return None

    # -- HTTP ------------------------------------------------------------

    def _handler_class(self):
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):  # keep test output clean
                pass

            def _send_json(self, status: int, body: Any, headers: dict[str, str]) -> None:
                raw = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(raw)))
                for k, v in headers.items():
                    self.send_header(k, v)
                self.end_headers()
                self.wfile.write(raw)

            def do_POST(self):
                length = int(self.headers.get("content-length") or 0)
                raw = self.rfile.read(length)
                try:
                    body = json.loads(raw)
                except ValueError:
                    body = None
                server.requests.append({"path": self.path, "headers": dict(self.headers.items()), "body": body})
                if not server._auth_ok(self.headers):
                    return self._send_json(401, server.error_body(401, "invalid x-api-key"), {})
                problem = server._invalid(self.path, body)
                if problem:
                    return self._send_json(400, server.error_body(400, problem), {})
                if not server.script:
                    return self._send_json(400, server.error_body(400, "test server: no scripted reply left"), {})
                item = server.script.popleft()
                if item.hold is not None:
                    item.hold.wait(GATE_TIMEOUT * 4)
                if item.events is None:
                    return self._send_json(item.status, item.body, item.headers)
                self.send_response(200)
                self.send_header("content-type", "text/event-stream")
                self.send_header("cache-control", "no-cache")
                self.send_header("connection", "close")
                self.end_headers()
                for ev in item.events:
                    if isinstance(ev, threading.Event):
                        server.gates_passed.append(ev.wait(GATE_TIMEOUT))
                        continue
                    name, data = ev
                    payload = data if isinstance(data, str) else json.dumps(data)
                    chunk = (f"event: {name}\n" if name else "") + f"data: {payload}\n\n"
                    self.wfile.write(chunk.encode())
                    self.wfile.flush()
                self.close_connection = True

        return Handler


# -- reply builders, in each API's own shapes ------------------------------


def anthropic_message(
    text: str = "",
    tool_uses: list[tuple[str, str, dict]] = (),
    *,
    model: str = "claude-opus-4-7",
    usage: dict[str, int] | None = None,
    stop_reason: str | None = None,
) -> dict[str, Any]:
    """A Messages API response body."""
    content: list[dict[str, Any]] = []
    if text:
        content.append({"type": "text", "text": text})
    content += [{"type": "tool_use", "id": i, "name": n, "input": a} for i, n, a in tool_uses]
    return {
        "id": "msg_test",
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": content,
        "stop_reason": stop_reason or ("tool_use" if tool_uses else "end_turn"),
        "stop_sequence": None,
        "usage": {"input_tokens": 10, "output_tokens": 5, "cache_creation_input_tokens": 0,
                  "cache_read_input_tokens": 0, **(usage or {})},
    }


def anthropic_events(message: dict[str, Any], pieces: list[str], gate: threading.Event | None = None) -> list[Any]:
    """The SSE events of a streamed Messages API reply whose text is ``pieces`` joined.

    ``gate`` is placed after the first text delta.
    """
    start = dict(message, content=[], stop_reason=None,
                 usage=dict(message["usage"], output_tokens=1))
    events: list[Any] = [("message_start", {"type": "message_start", "message": start}), ("ping", {"type": "ping"})]
    index = 0
    if pieces:
        events.append(("content_block_start", {"type": "content_block_start", "index": 0,
                                               "content_block": {"type": "text", "text": ""}}))
        for n, piece in enumerate(pieces):
            events.append(("content_block_delta", {"type": "content_block_delta", "index": 0,
                                                   "delta": {"type": "text_delta", "text": piece}}))
            if n == 0 and gate is not None:
                events.append(gate)
        events.append(("content_block_stop", {"type": "content_block_stop", "index": 0}))
        index = 1
    for block in message["content"]:
        if block["type"] != "tool_use":
            continue
        events.append(("content_block_start", {"type": "content_block_start", "index": index,
                                               "content_block": dict(block, input={})}))
        args = json.dumps(block["input"])
        for part in (args[: len(args) // 2], args[len(args) // 2:]):
            events.append(("content_block_delta", {"type": "content_block_delta", "index": index,
                                                   "delta": {"type": "input_json_delta", "partial_json": part}}))
        events.append(("content_block_stop", {"type": "content_block_stop", "index": index}))
        index += 1
    events.append(("message_delta", {"type": "message_delta",
                                     "delta": {"stop_reason": message["stop_reason"], "stop_sequence": None},
                                     "usage": {"output_tokens": message["usage"]["output_tokens"]}}))
    events.append(("message_stop", {"type": "message_stop"}))
    return events


def openai_completion(
    text: str | None = "",
    tool_calls: list[tuple[str, str, dict]] = (),
    *,
    model: str = "gpt-4o",
    usage: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """A Chat Completions response body."""
    calls = [{"id": i, "type": "function", "function": {"name": n, "arguments": json.dumps(a)}}
             for i, n, a in tool_calls]
    return {
        "id": "chatcmpl-test",
        "object": "chat.completion",
        "created": 1764460800,
        "model": model,
        "choices": [{
            "index": 0,
            "message": {"role": "assistant", "content": text if (text or not calls) else None,
                        "tool_calls": calls or None, "refusal": None},
            "finish_reason": "tool_calls" if calls else "stop",
            "logprobs": None,
        }],
        "usage": {"prompt_tokens": 10, "completion_tokens": 5, "total_tokens": 15, **(usage or {})},
    }


def openai_chunks(
    pieces: list[str],
    tool_calls: list[tuple[str, str, dict]] = (),
    *,
    model: str = "gpt-4o",
    usage: dict[str, Any] | None = None,
    gate: threading.Event | None = None,
) -> list[Any]:
    """The SSE events of a streamed Chat Completions reply (``include_usage`` on)."""

    def chunk(delta: dict[str, Any], finish: str | None = None, choices: bool = True) -> tuple[None, dict]:
        body = {"id": "chatcmpl-test", "object": "chat.completion.chunk", "created": 1764460800, "model": model,
                "choices": [{"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}]
                if choices else []}
        return (None, body)

    events: list[Any] = [chunk({"role": "assistant", "content": ""})]
    for n, piece in enumerate(pieces):
        events.append(chunk({"content": piece}))
        if n == 0 and gate is not None:
            events.append(gate)
    for index, (call_id, name, args) in enumerate(tool_calls):
        events.append(chunk({"tool_calls": [{"index": index, "id": call_id, "type": "function",
                                             "function": {"name": name, "arguments": ""}}]}))
        raw = json.dumps(args)
        for part in (raw[: len(raw) // 2], raw[len(raw) // 2:]):
            events.append(chunk({"tool_calls": [{"index": index, "function": {"arguments": part}}]}))
    events.append(chunk({}, "tool_calls" if tool_calls else "stop"))
    final = chunk({}, choices=False)[1]
    final["usage"] = {"prompt_tokens": 10, "completion_tokens": 5, "total_tokens": 15, **(usage or {})}
    events.append((None, final))
    events.append((None, "[DONE]"))
    return events
