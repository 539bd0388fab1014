"""OpenTelemetry GenAI spans from a run's events: the trace of a session, its incarnations' links and what
content is recorded are in docs/telemetry.md ("Traces").

OpenTelemetry is an optional extra (``loomray[otel]``): it is imported when tracing is enabled, never at
module level, so ``import loomray`` works without it.
"""

from __future__ import annotations

import contextvars
import json
import logging
import os
import threading
from collections import OrderedDict
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from importlib.metadata import version
from typing import Any

from loomray.events import (
    CheckpointEvent,
    CondenseEvent,
    DeterminismViolation,
    Event,
    ModelCall,
    ModelResponseEvent,
    ReplayedStep,
    RunEnd,
    RunError,
    RunStart,
    ToolCallEvent,
    ToolResultEvent,
)
from loomray.records import ToolCall
from loomray.telemetry.context import incarnation_span_id, parse_traceparent, session_root
from loomray.telemetry.registry import RunInfo, add_observer, observers, remove_observer

log = logging.getLogger("loomray.telemetry")

_EPOCH = datetime(1970, 1, 1, tzinfo=timezone.utc)
#: The environment switch OpenTelemetry's GenAI instrumentations share for recording message content.
CAPTURE_CONTENT_ENV = "OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT"


def _ns(at: datetime) -> int:
    """Nanoseconds since the epoch of a timezone-aware datetime (exact to the microsecond)."""
    if at.tzinfo is None:
        at = at.replace(tzinfo=timezone.utc)
    return (at - _EPOCH) // timedelta(microseconds=1) * 1000


def _version() -> str | None:
    try:
        return version("loomray")
    except Exception:
        return None


@dataclass
class _ModelStep:
    """A model call whose span opened at ``model_call`` and closes at its ``model_response``."""

    start_ns: int
    turn: int
    step_key: str | None


@dataclass
class _ToolStep:
    """A tool call whose span opened at ``tool_call`` and closes at its ``tool_result``."""

    start_ns: int
    turn: int
    call: ToolCall


class _RunSpans:
    """One run's ``invoke_agent`` span (None: its ``run_start`` was not seen) and its steps in flight."""

    def __init__(self, span: Any) -> None:
        self.span = span
        self.model: dict[int, _ModelStep] = {}
        self.tools: dict[str, _ToolStep] = {}


class _ChosenSpanIds:
    """A tracer's id generator that hands out a span id chosen by the caller once (a run span's derived id)."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.chosen: contextvars.ContextVar[int | None] = contextvars.ContextVar("loomray_span_id", default=None)

    def generate_span_id(self) -> int:
        chosen = self.chosen.get()
        if chosen is None:
            return int(self.inner.generate_span_id())
        self.chosen.set(None)
        return chosen

    def generate_trace_id(self) -> int:
        return int(self.inner.generate_trace_id())

    def __getattr__(self, name: str) -> Any:  # whatever else the SDK asks of its generator (is_trace_id_random)
        return getattr(self.inner, name)


class TracingObserver:
    """Turns a run's events into OpenTelemetry GenAI spans (see the module docstring)."""

    #: Runs whose spans are tracked at once; older ones (runs that never ended, e.g. cancelled) are forgotten.
    MAX_RUNS = 4096

    def __init__(self, tracer_provider: Any = None, *, capture_content: bool | None = None) -> None:
        from opentelemetry import trace  # the optional extra: only once tracing is enabled

        self._trace = trace
        self.tracer_provider = tracer_provider
        if capture_content is None:
            capture_content = os.environ.get(CAPTURE_CONTENT_ENV, "").strip().lower() in ("1", "true", "yes")
        #: Record model outputs and tool arguments and results on spans (off by default: they may hold secrets).
        self.capture_content = capture_content
        self._tracer = trace.get_tracer("loomray", _version(), tracer_provider=tracer_provider)
        self._ids = self._chosen_ids(self._tracer)
        self._runs: OrderedDict[tuple[str, str | None], _RunSpans] = OrderedDict()
        self._lock = threading.Lock()

    # -- helpers

    @staticmethod
    def _chosen_ids(tracer: Any) -> _ChosenSpanIds | None:
        """The SDK tracer's id generator, wrapped so a run span can get its derived id (None: not the SDK's
        tracer, e.g. a proxy before a global provider is set: run spans get random ids and no incarnation link)."""
        inner = getattr(tracer, "id_generator", None)
        if inner is None or isinstance(inner, _ChosenSpanIds):
            return inner
        tracer.id_generator = _ChosenSpanIds(inner)
        return tracer.id_generator

    def _attrs(self, event: Event, info: RunInfo, **extra: Any) -> dict[str, Any]:
        attrs = {
            "gen_ai.conversation.id": event.session_id,
            "loomray.session_id": event.session_id,
            "loomray.run_id": event.run_id,
            "loomray.epoch": info.epoch,
            "loomray.turn": event.turn,
            **extra,
        }
        return {k: v for k, v in attrs.items() if v is not None}

    def _run(self, event: Event) -> _RunSpans | None:
        with self._lock:
            return self._runs.get((event.session_id, event.run_id))

    def _pop_run(self, event: Event) -> _RunSpans | None:
        with self._lock:
            return self._runs.pop((event.session_id, event.run_id), None)

    def _child(self, run: _RunSpans | None, name: str, kind: Any, start_ns: int, attrs: dict[str, Any]) -> Any:
        context = self._trace.set_span_in_context(run.span) if run is not None and run.span is not None else None
        return self._tracer.start_span(name, context=context, kind=kind, attributes=attrs, start_time=start_ns)

    def _remote(self, trace_id: int, span_id: int, flags: int = 1) -> Any:
        """A span context from another process (or a derived one), to parent or link to."""
        return self._trace.SpanContext(trace_id=trace_id, span_id=span_id, is_remote=True,
                                       trace_flags=self._trace.TraceFlags(flags))

    def _parent_and_links(self, event: RunStart, info: RunInfo) -> tuple[Any, list[Any]]:
        """The run span's parent (the requester's span, else the session's root) and its links."""
        root = self._remote(*session_root(info.store, event.user_id, event.session_id))
        caller = parse_traceparent(event.trace_parent)
        links = []
        if caller is None:
            parent = root
        else:
            parent = self._remote(*caller)
            links.append(self._trace.Link(root, {"loomray.link": "session"}))
        if event.replaying and info.epoch and info.epoch > 1 and self._ids is not None:
            # The same run, continued by a new incarnation (after a crash or a node loss): link to the run span
            # of the lease holder before it, whose id is derived too. That span was never exported when its
            # process died, but its finished steps name it as their parent: the link joins them to this one.
            before = incarnation_span_id(info.store, event.user_id, event.session_id, info.epoch - 1)
            trace_id = caller[0] if caller is not None else root.trace_id
            links.append(self._trace.Link(self._remote(trace_id, before),
                                          {"loomray.link": "previous_incarnation", "loomray.epoch": info.epoch - 1}))
        if event.forked_from:
            base = self._remote(*session_root(info.store, event.user_id, event.forked_from))
            links.append(self._trace.Link(base, {"loomray.link": "fork_base", "loomray.forked_from": event.forked_from}))
        return self._trace.set_span_in_context(self._trace.NonRecordingSpan(parent)), links

    def _error(self, span: Any, error_type: str) -> None:
        # The type only, no description: an error's text may quote content (a tool's error result, a
        # provider's message echoing the prompt, pydantic quoting the model's answer), and traces leave
        # the session's prefix for a shared backend.
        span.set_attribute("error.type", error_type)
        span.set_status(self._trace.Status(self._trace.StatusCode.ERROR))

    # -- the events

    def on_event(self, event: Event, info: RunInfo) -> None:
        if isinstance(event, RunStart):
            self._run_start(event, info)
        elif isinstance(event, ModelCall):
            self._ensure(event).model[event.turn] = _ModelStep(_ns(event.at), event.turn, event.step_key)
        elif isinstance(event, ModelResponseEvent):
            self._model_response(event, info)
        elif isinstance(event, ToolCallEvent):
            self._ensure(event).tools[event.tool_call.id] = _ToolStep(_ns(event.at), event.turn, event.tool_call)
        elif isinstance(event, ToolResultEvent):
            self._tool_result(event, info)
        elif isinstance(event, (CheckpointEvent, ReplayedStep, DeterminismViolation, CondenseEvent)):
            current = self._run(event)
            if current is not None and current.span is not None:
                fields = event.model_dump(mode="json", exclude={"type", "session_id", "run_id", "at"})
                current.span.add_event(f"loomray.{event.type}", {f"loomray.{k}": v for k, v in fields.items()
                                                                 if isinstance(v, (str, bool, int, float))},
                                       timestamp=_ns(event.at))
        elif isinstance(event, RunEnd):
            ended = self._pop_run(event)
            if ended is not None and ended.span is not None:
                span = ended.span
                span.set_attribute("loomray.stop_reason", event.stop_reason)
                span.set_attribute("loomray.model_calls", event.model_calls)
                span.set_attribute("loomray.turns", event.turn)
                span.set_attribute("gen_ai.usage.input_tokens", event.usage.input_tokens)
                span.set_attribute("gen_ai.usage.output_tokens", event.usage.output_tokens)
                span.end(end_time=_ns(event.at))
        elif isinstance(event, RunError):
            self._run_error(event, info)

    def _ensure(self, event: Event) -> _RunSpans:
        """The run's state; a run whose ``run_start`` this observer did not see gets one without a run span."""
        key = (event.session_id, event.run_id)
        with self._lock:
            run = self._runs.get(key)
            if run is None:
                run = self._runs[key] = _RunSpans(None)
                self._trim()
            return run

    def _trim(self) -> None:
        while len(self._runs) > self.MAX_RUNS:
            self._runs.popitem(last=False)

    def _run_start(self, event: RunStart, info: RunInfo) -> None:
        name = f"invoke_agent {info.agent_name}" if info.agent_name else "invoke_agent"
        attrs = self._attrs(event, info, **{
            "gen_ai.operation.name": "invoke_agent", "gen_ai.agent.name": info.agent_name,
            "gen_ai.agent.id": info.agent_name,
            "gen_ai.request.model": info.model, "gen_ai.provider.name": info.provider,
            "server.address": info.server_address, "loomray.run.kind": event.kind,
            "loomray.restored_checkpoint_id": event.restored_checkpoint_id, "loomray.node_id": info.node_id,
            "loomray.forked_from": event.forked_from,
        })
        context, links = self._parent_and_links(event, info)
        ids, token = self._ids, None
        if ids is not None and info.epoch:  # the id the next incarnation links to (see _parent_and_links)
            token = ids.chosen.set(incarnation_span_id(info.store, event.user_id, event.session_id, info.epoch))
        try:
            span = self._tracer.start_span(name, context=context, kind=self._trace.SpanKind.INTERNAL,
                                           attributes=attrs, links=links, start_time=_ns(event.at))
        finally:
            if ids is not None and token is not None:
                ids.chosen.reset(token)
        with self._lock:
            old = self._runs.pop((event.session_id, event.run_id), None)
            self._runs[(event.session_id, event.run_id)] = _RunSpans(span)
            self._trim()
        if old is not None and old.span is not None:  # a run_start without an end before it: not exported
            log.debug("run %s of session %r started again before it ended", event.run_id, event.session_id)

    def _model_response(self, event: ModelResponseEvent, info: RunInfo) -> None:
        run = self._run(event)
        pending = run.model.pop(event.turn, None) if run is not None else None
        if event.replayed:
            return  # answered from the journal: the call that really ran was traced when it ran
        end = _ns(event.at)
        u = event.usage
        content: dict[str, str] = {}
        if self.capture_content:
            content["gen_ai.output.messages"] = json.dumps([event.message.model_dump(mode="json")], ensure_ascii=False)
        span = self._chat_span(run, event, info, pending.start_ns if pending else end, **{
            "gen_ai.usage.input_tokens": u.input_tokens, "gen_ai.usage.output_tokens": u.output_tokens,
            "gen_ai.usage.cache_read.input_tokens": u.cache_read_tokens or None,
            "gen_ai.usage.cache_creation.input_tokens": u.cache_write_tokens or None,
            "gen_ai.usage.reasoning.output_tokens": u.reasoning_tokens or None,
            "gen_ai.response.model": event.response_model, "gen_ai.response.id": event.response_id,
            "gen_ai.response.finish_reasons": [event.finish_reason] if event.finish_reason else None,
            "server.address": info.server_address,
            "loomray.usage.cost_usd": u.cost_usd, "loomray.step_key": pending.step_key if pending else None,
            "loomray.tool_calls": len(event.message.tool_calls), **content,
        })
        span.end(end_time=end)

    def _chat_span(self, run: _RunSpans | None, event: Event, info: RunInfo, start_ns: int, **extra: Any) -> Any:
        attrs = self._attrs(event, info, **{"gen_ai.operation.name": "chat", "gen_ai.request.model": info.model,
                                            "gen_ai.provider.name": info.provider,
                                            "gen_ai.agent.name": info.agent_name, **extra})
        name = f"chat {info.model}" if info.model else "chat"
        return self._child(run, name, self._trace.SpanKind.CLIENT, start_ns, attrs)

    def _tool_span(self, run: _RunSpans | None, pending: _ToolStep, event: Event, info: RunInfo, name: str) -> Any:
        call = pending.call
        attrs = self._attrs(event, info, **{
            "gen_ai.operation.name": "execute_tool", "gen_ai.tool.name": name, "gen_ai.tool.call.id": call.id,
            "gen_ai.tool.type": "function", "gen_ai.agent.name": info.agent_name,
            "loomray.turn": pending.turn,
        })
        return self._child(run, f"execute_tool {name}", self._trace.SpanKind.INTERNAL, pending.start_ns, attrs)

    def _tool_result(self, event: ToolResultEvent, info: RunInfo) -> None:
        run = self._run(event)
        pending = run.tools.pop(event.tool_call_id, None) if run is not None else None
        if event.replayed:
            return
        if pending is None:
            pending = _ToolStep(_ns(event.at), event.turn, ToolCall(id=event.tool_call_id, name=event.name))
        span = self._tool_span(run, pending, event, info, event.name)
        if self.capture_content:
            span.set_attribute("gen_ai.tool.call.arguments", json.dumps(pending.call.arguments, ensure_ascii=False))
            span.set_attribute("gen_ai.tool.call.result", event.content)
        if event.is_error:
            self._error(span, "tool_error")
        span.end(end_time=_ns(event.at))

    def _run_error(self, event: RunError, info: RunInfo) -> None:
        run = self._pop_run(event)
        if run is None:
            return
        end = _ns(event.at)
        # Steps the failure interrupted: they started (e.g. the model call that raised), so they are traced.
        for model_step in run.model.values():
            span = self._chat_span(run, event, info, model_step.start_ns,
                                   **{"loomray.turn": model_step.turn, "loomray.step_key": model_step.step_key})
            self._error(span, event.error_type)
            span.end(end_time=end)
        for tool_step in run.tools.values():
            span = self._tool_span(run, tool_step, event, info, tool_step.call.name)
            self._error(span, event.error_type)
            span.end(end_time=end)
        if run.span is not None:
            self._error(run.span, event.error_type)
            run.span.end(end_time=end)


def enable_tracing(tracer_provider: Any = None, *, capture_content: bool | None = None) -> TracingObserver:
    """Emit OpenTelemetry GenAI spans for the runs executed in this process; returns the observer.

    ``capture_content=True`` records model outputs and tool arguments and results on
    the spans (default: ``OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT``, else off).

    ``tracer_provider`` defaults to the global one (``opentelemetry.trace.
    set_tracer_provider``). Calling it again with the same provider returns the
    observer already registered. Needs ``pip install 'loomray[otel]'``. Runs on
    Ray execute in worker processes: call this there too, e.g. from a
    ``runtime_env={"worker_process_setup_hook": ...}`` function.
    """
    try:
        import opentelemetry.trace  # noqa: F401  - the optional extra: fail here, with the pip hint
    except ImportError as e:
        raise ImportError("loomray tracing needs OpenTelemetry: pip install 'loomray[otel]'") from e
    for o in observers():
        if isinstance(o, TracingObserver) and o.tracer_provider is tracer_provider:
            if capture_content is not None:
                o.capture_content = capture_content
            return o
    return add_observer(TracingObserver(tracer_provider, capture_content=capture_content))


def disable_tracing() -> None:
    """Unregister every tracing observer of this process (spans still open are dropped)."""
    for o in observers():
        if isinstance(o, TracingObserver):
            remove_observer(o)

