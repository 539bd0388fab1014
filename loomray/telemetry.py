"""Traces and metrics for loomray sessions: observers of the run's events.

Every event a run emits (:mod:`loomray.events`) is also handed, in the process
that executes the run (``loomray.session.execute_request``), to the observers
registered here. With none registered that costs one function call.

**Traces** (``pip install 'loomray[otel]'``): :func:`enable_tracing` registers
an observer that turns each model call and tool call that really ran into an
OpenTelemetry span with the GenAI semantic-convention attributes
(``gen_ai.operation.name`` ``"chat"``/``"execute_tool"``,
``gen_ai.request.model``, ``gen_ai.usage.input_tokens``/``output_tokens``,
``gen_ai.tool.name``, ``gen_ai.tool.call.id``, ...) plus ``loomray.session_id``,
``loomray.run_id``, ``loomray.epoch`` and ``loomray.turn``. A span opens at
``model_call``/``tool_call`` and closes at the matching
``model_response``/``tool_result`` (start and end are the events' times); its
parent is the run's ``invoke_agent`` span (opened at ``run_start``, ended at
``run_end``/``run_error``), itself a child of whatever span is current where
the run was started. A step answered from the journal (``replayed=True``)
emits no span, so a run re-issued after a crash traces each step once. A step
still open when the run fails (``run_error``) ends with an error status; a step
open when the process dies is never exported (nor is that run's span).

**Metrics** (Ray): inside a Ray worker process (a session actor or a dense
host) an observer feeding ``ray.util.metrics`` is registered automatically the
first time a run emits an event (set ``LOOMRAY_RAY_METRICS=0`` to opt out;
:func:`enable_metrics` registers it anywhere else, e.g. a driver running
sessions in process). Ray exports them on each node's metrics port with a
``ray_`` prefix (counters also get ``_total``): model calls, tokens, spend,
tool calls, replayed steps, checkpoints written/failed, checkpoint bytes and
checkpoint latency, tagged with ``placement`` (``actor``/``dense``, else
``unknown``). The supervisor reports restarts and active sessions with
:func:`record_restart` and :func:`set_active_sessions`.

Nothing here imports OpenTelemetry or Ray at module level: ``import loomray``
works without either being importable.
"""

from __future__ import annotations

import logging
import os
import re
import sys
import threading
from collections import OrderedDict
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from typing import Any, Protocol

from loomray.events import (
    CheckpointEvent,
    CompactionEvent,
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

log = logging.getLogger("loomray.telemetry")

__all__ = [
    "METRIC_NAMES", "MetricsObserver", "Observer", "RunInfo", "TracingObserver", "add_observer",
    "disable_metrics", "disable_tracing", "enable_metrics", "enable_tracing", "observe", "observers",
    "record_restart", "remove_observer", "set_active_sessions",
]


@dataclass(frozen=True)
class RunInfo:
    """What the events do not carry: which agent, model and lease epoch the run executes under."""

    agent_name: str | None = None
    model: str | None = None
    provider: str | None = None
    epoch: int | None = None
    node_id: str | None = None


class Observer(Protocol):
    """Anything with ``on_event(event, info)``; called synchronously, in event order, per run."""

    def on_event(self, event: Event, info: RunInfo) -> None: ...


#: Registered observers (copy-on-write: ``observe`` iterates a snapshot without a lock).
_observers: tuple[Any, ...] = ()
_lock = threading.Lock()
#: The Ray-worker check of :func:`_auto_enable` ran (once per process).
_auto_checked = False


def add_observer(observer: Observer) -> Observer:
    """Register ``observer`` for every run executed in this process; returns it."""
    global _observers
    with _lock:
        if observer not in _observers:
            _observers = (*_observers, observer)
    return observer


def remove_observer(observer: Observer) -> None:
    """Unregister ``observer`` (no error if it was not registered)."""
    global _observers
    with _lock:
        _observers = tuple(o for o in _observers if o is not observer)


def observers() -> tuple[Any, ...]:
    """The observers registered in this process."""
    return _observers


def observe(event: Event, *, agent: Any = None, epoch: int | None = None, node_id: str | None = None) -> None:
    """Hand ``event`` to every registered observer. Never raises; cheap when none is registered.

    ``loomray.session.execute_request`` calls this for each event of a run,
    after the caller's ``emit`` got it.
    """
    if not _auto_checked:
        _auto_enable()
    obs = _observers
    if not obs:
        return
    model = getattr(agent, "model", None)
    info = RunInfo(agent_name=getattr(agent, "name", None), model=getattr(model, "name", None),
                   provider=getattr(model, "provider", None), epoch=epoch, node_id=node_id)
    for o in obs:
        try:
            o.on_event(event, info)
        except Exception as e:  # telemetry must never break a run
            log.warning("telemetry observer %s failed on a %s event: %s: %s", type(o).__name__, event.type,
                        type(e).__name__, e)


def _ns(at: datetime) -> int:
    """Nanoseconds since the epoch of a timezone-aware datetime (exact to the microsecond)."""
    if at.tzinfo is None:
        at = at.replace(tzinfo=timezone.utc)
    return (at - _EPOCH) // timedelta(microseconds=1) * 1000


_EPOCH = datetime(1970, 1, 1, tzinfo=timezone.utc)


def _version() -> str | None:
    try:
        from importlib.metadata import version

        return version("loomray")
    except Exception:
        return None


# --------------------------------------------------------------------------------------------- traces


@dataclass
class _Pending:
    start_ns: int
    turn: int
    step_key: str | None = None
    call: Any = None


class _RunSpans:
    def __init__(self, span: Any) -> None:
        self.span = span
        self.model: dict[int, _Pending] = {}
        self.tools: dict[str, _Pending] = {}


class TracingObserver:
    """Turns a run's events into OpenTelemetry GenAI spans (see the module docstring)."""

    #: Runs whose spans are tracked at once; older ones (runs that never ended, e.g. cancelled) are forgotten.
    MAX_RUNS = 4096

    def __init__(self, tracer_provider: Any = None) -> None:
        from opentelemetry import trace

        self._trace = trace
        self.tracer_provider = tracer_provider
        self._tracer = trace.get_tracer("loomray", _version(), tracer_provider=tracer_provider)
        self._runs: OrderedDict[tuple[str, str | None], _RunSpans] = OrderedDict()
        self._lock = threading.Lock()

    # -- helpers

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

    def _error(self, span: Any, error_type: str, description: str | None = None) -> None:
        from opentelemetry.trace import Status, StatusCode

        span.set_attribute("error.type", error_type)
        span.set_status(Status(StatusCode.ERROR, description))

    # -- the events

    def on_event(self, event: Event, info: RunInfo) -> None:
        if isinstance(event, RunStart):
            self._run_start(event, info)
        elif isinstance(event, ModelCall):
            self._ensure(event).model[event.turn] = _Pending(_ns(event.at), event.turn, step_key=event.step_key)
        elif isinstance(event, ModelResponseEvent):
            self._model_response(event, info)
        elif isinstance(event, ToolCallEvent):
            self._ensure(event).tools[event.tool_call.id] = _Pending(_ns(event.at), event.turn, call=event.tool_call)
        elif isinstance(event, ToolResultEvent):
            self._tool_result(event, info)
        elif isinstance(event, (CheckpointEvent, ReplayedStep, DeterminismViolation, CompactionEvent)):
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
        from opentelemetry.trace import SpanKind

        name = f"invoke_agent {info.agent_name}" if info.agent_name else "invoke_agent"
        attrs = self._attrs(event, info, **{
            "gen_ai.operation.name": "invoke_agent", "gen_ai.agent.name": info.agent_name,
            "gen_ai.request.model": info.model, "gen_ai.provider.name": info.provider,
            "loomray.run.kind": event.kind,
            "loomray.restored_checkpoint_id": event.restored_checkpoint_id, "loomray.node_id": info.node_id,
        })
        # Parent: the span current where the run was started (the caller's, in process), if any.
        span = self._tracer.start_span(name, kind=SpanKind.INTERNAL, attributes=attrs, start_time=_ns(event.at))
        with self._lock:
            old = self._runs.pop((event.session_id, event.run_id), None)
            self._runs[(event.session_id, event.run_id)] = _RunSpans(span)
            self._trim()
        if old is not None and old.span is not None:  # a run_start without an end before it: not exported
            log.debug("run %s of session %r started again before it ended", event.run_id, event.session_id)

    def _model_response(self, event: ModelResponseEvent, info: RunInfo) -> None:
        from opentelemetry.trace import SpanKind

        run = self._run(event)
        pending = run.model.pop(event.turn, None) if run is not None else None
        if event.replayed:
            return  # answered from the journal: the call that really ran was traced when it ran
        end = _ns(event.at)
        u = event.usage
        attrs = self._attrs(event, info, **{
            "gen_ai.operation.name": "chat", "gen_ai.request.model": info.model,
            "gen_ai.provider.name": info.provider, "gen_ai.agent.name": info.agent_name,
            "gen_ai.usage.input_tokens": u.input_tokens, "gen_ai.usage.output_tokens": u.output_tokens,
            "gen_ai.usage.cache_read.input_tokens": u.cache_read_tokens or None,
            "gen_ai.usage.cache_creation.input_tokens": u.cache_write_tokens or None,
            "loomray.usage.cost_usd": u.cost_usd, "loomray.step_key": pending.step_key if pending else None,
            "loomray.tool_calls": len(event.message.tool_calls),
        })
        name = f"chat {info.model}" if info.model else "chat"
        span = self._child(run, name, SpanKind.CLIENT, pending.start_ns if pending else end, attrs)
        span.end(end_time=end)

    def _tool_span(self, run: _RunSpans | None, pending: _Pending, event: Event, info: RunInfo, name: str) -> Any:
        from opentelemetry.trace import SpanKind

        call = pending.call
        attrs = self._attrs(event, info, **{
            "gen_ai.operation.name": "execute_tool", "gen_ai.tool.name": name, "gen_ai.tool.call.id": call.id,
            "gen_ai.tool.type": "function", "gen_ai.agent.name": info.agent_name,
            "loomray.turn": pending.turn,
        })
        return self._child(run, f"execute_tool {name}", SpanKind.INTERNAL, pending.start_ns, attrs)

    def _tool_result(self, event: ToolResultEvent, info: RunInfo) -> None:
        run = self._run(event)
        pending = run.tools.pop(event.tool_call_id, None) if run is not None else None
        if event.replayed:
            return
        if pending is None:
            from loomray.records import ToolCall

            pending = _Pending(_ns(event.at), event.turn, call=ToolCall(id=event.tool_call_id, name=event.name))
        span = self._tool_span(run, pending, event, info, event.name)
        if event.is_error:
            self._error(span, "tool_error", event.content[:200])
        span.end(end_time=_ns(event.at))

    def _run_error(self, event: RunError, info: RunInfo) -> None:
        from opentelemetry.trace import SpanKind

        run = self._pop_run(event)
        if run is None:
            return
        end = _ns(event.at)
        # Steps the failure interrupted: they started (e.g. the model call that raised), so they are traced.
        for p in run.model.values():
            attrs = self._attrs(event, info, **{
                "gen_ai.operation.name": "chat", "gen_ai.request.model": info.model,
                "gen_ai.provider.name": info.provider, "gen_ai.agent.name": info.agent_name,
                "loomray.turn": p.turn, "loomray.step_key": p.step_key})
            span = self._child(run, f"chat {info.model}" if info.model else "chat", SpanKind.CLIENT, p.start_ns,
                               attrs)
            self._error(span, event.error_type, event.error)
            span.end(end_time=end)
        for p in run.tools.values():
            span = self._tool_span(run, p, event, info, p.call.name)
            self._error(span, event.error_type, event.error)
            span.end(end_time=end)
        if run.span is not None:
            self._error(run.span, event.error_type, event.error)
            run.span.end(end_time=end)


def enable_tracing(tracer_provider: Any = None) -> TracingObserver:
    """Emit OpenTelemetry GenAI spans for the runs executed in this process; returns the observer.

    ``tracer_provider`` defaults to the global one (``opentelemetry.trace.
    set_tracer_provider``). Calling it again with the same provider returns the
    observer already registered. Needs ``pip install 'loomray[otel]'``. Runs on
    Ray execute in worker processes: call this there too, e.g. from a
    ``runtime_env={"worker_process_setup_hook": ...}`` function.
    """
    try:
        import opentelemetry.trace  # noqa: F401
    except ImportError as e:
        raise ImportError("loomray tracing needs OpenTelemetry: pip install 'loomray[otel]'") from e
    for o in _observers:
        if isinstance(o, TracingObserver) and o.tracer_provider is tracer_provider:
            return o
    return add_observer(TracingObserver(tracer_provider))  # type: ignore[return-value]


def disable_tracing() -> None:
    """Unregister every tracing observer of this process (spans still open are dropped)."""
    for o in _observers:
        if isinstance(o, TracingObserver):
            remove_observer(o)


# -------------------------------------------------------------------------------------------- metrics

#: The metrics loomray records, as named in ``ray.util.metrics`` (Prometheus: ``ray_`` prefix, counters
#: ``_total`` suffix, e.g. ``ray_loomray_model_calls_total``).
METRIC_NAMES = {
    "model_calls": "loomray_model_calls",
    "tokens": "loomray_tokens",
    "spend_usd": "loomray_spend_usd",
    "tool_calls": "loomray_tool_calls",
    "replayed_steps": "loomray_replayed_steps",
    "checkpoints_written": "loomray_checkpoints_written",
    "checkpoint_failures": "loomray_checkpoint_failures",
    "checkpoint_bytes": "loomray_checkpoint_bytes",
    "checkpoint_latency": "loomray_checkpoint_latency_seconds",
    "restarts": "loomray_session_restarts",
    "active_sessions": "loomray_active_sessions",
}
_LATENCY_BOUNDARIES = [0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0]
#: Checkpoint ids are ``ckpt`` + 12 hex digits of creation milliseconds (:func:`loomray.ids.new_id`).
_CKPT_MS = re.compile(r"^ckpt([0-9a-f]{12})")


class _Metrics:
    """The metric objects, made once per process from ``module`` (``ray.util.metrics``, or a test's fake)."""

    def __init__(self, module: Any) -> None:
        C, H, G = module.Counter, module.Histogram, module.Gauge
        n = METRIC_NAMES
        p = ("placement",)
        self.model_calls = C(n["model_calls"], "Model calls that really ran (replays excluded).",
                             tag_keys=(*p, "model"))
        self.tokens = C(n["tokens"], "Tokens of model calls that really ran.", tag_keys=(*p, "model", "type"))
        self.spend_usd = C(n["spend_usd"], "Spend in USD of model calls that really ran (known prices only).",
                           tag_keys=(*p, "model"))
        self.tool_calls = C(n["tool_calls"], "Tool calls that really ran (replays excluded).",
                            tag_keys=(*p, "tool", "error"))
        self.replayed_steps = C(n["replayed_steps"], "Steps answered from the journal instead of executed.",
                                tag_keys=(*p, "kind"))
        self.checkpoints_written = C(n["checkpoints_written"], "Checkpoints written.", tag_keys=p)
        self.checkpoint_failures = C(n["checkpoint_failures"], "Checkpoint writes that failed (run went on).",
                                     tag_keys=p)
        self.checkpoint_bytes = C(n["checkpoint_bytes"], "Bytes of checkpoints written.", tag_keys=p)
        self.checkpoint_latency = H(n["checkpoint_latency"],
                                    "Seconds from a checkpoint's creation to its write finishing.",
                                    boundaries=_LATENCY_BOUNDARIES, tag_keys=p)
        self.restarts = C(n["restarts"], "Sessions restarted by the supervisor.", tag_keys=p)
        self.active_sessions = G(n["active_sessions"], "Sessions the supervisor keeps running.", tag_keys=p)


_metrics_obj: _Metrics | None = None
#: Making the metric objects failed in this process (logged once; metrics stay off).
_metrics_broken = False


def _metrics() -> _Metrics | None:
    """This process's metric objects, or None while Ray is not initialized here (nothing would export them)."""
    global _metrics_obj, _metrics_broken
    if _metrics_obj is None:
        ray = sys.modules.get("ray")
        if _metrics_broken or ray is None or not ray.is_initialized():
            return None
        with _lock:
            if _metrics_obj is None:
                try:
                    import ray.util.metrics as module

                    _metrics_obj = _Metrics(module)
                except Exception as e:
                    _metrics_broken = True
                    log.warning("Ray metrics are off in this process: %s: %s", type(e).__name__, e)
                    return None
    return _metrics_obj


def _inc(counter: Any, value: float | None, tags: dict[str, str]) -> None:
    if value is not None and value > 0:  # Ray's Counter refuses 0 and negative increments
        counter.inc(value, tags=tags)


class MetricsObserver:
    """Records a run's events into Ray metrics (see the module docstring).

    ``metrics`` is for tests (a :class:`_Metrics` over a fake module); by
    default the process's ``ray.util.metrics`` objects are used, once Ray is
    initialized in this process.
    """

    def __init__(self, placement: str | None = None, *, metrics: _Metrics | None = None) -> None:
        self.placement = placement or "unknown"
        self._fixed = metrics

    def on_event(self, event: Event, info: RunInfo) -> None:
        m = self._fixed or _metrics()
        if m is None:
            return
        p = {"placement": self.placement}
        if isinstance(event, ModelResponseEvent):
            if event.replayed:
                return
            tags = {**p, "model": info.model or "unknown"}
            m.model_calls.inc(1, tags=tags)
            _inc(m.tokens, event.usage.input_tokens, {**tags, "type": "input"})
            _inc(m.tokens, event.usage.output_tokens, {**tags, "type": "output"})
            _inc(m.spend_usd, event.usage.cost_usd, tags)
        elif isinstance(event, ToolResultEvent):
            if not event.replayed:
                m.tool_calls.inc(1, tags={**p, "tool": event.name, "error": str(event.is_error).lower()})
        elif isinstance(event, ReplayedStep):
            m.replayed_steps.inc(1, tags={**p, "kind": event.kind})
        elif isinstance(event, CheckpointEvent):
            if not event.ok:
                m.checkpoint_failures.inc(1, tags=p)
                return
            m.checkpoints_written.inc(1, tags=p)
            _inc(m.checkpoint_bytes, event.size, p)
            latency = _checkpoint_latency(event)
            if latency is not None:
                m.checkpoint_latency.observe(latency, tags=p)


def _checkpoint_latency(event: CheckpointEvent) -> float | None:
    """Seconds from the checkpoint's creation (its id's timestamp) to the write finishing (the event)."""
    hit = _CKPT_MS.match(event.checkpoint_id)
    if hit is None:
        return None
    created = int(hit.group(1), 16) / 1000.0
    return max(0.0, event.at.timestamp() - created)


def enable_metrics(placement: str | None = None) -> MetricsObserver:
    """Record Ray metrics for the runs executed in this process; returns the observer.

    Automatic in Ray worker processes (session actors, dense hosts); call it to
    record them elsewhere, e.g. in a driver that runs sessions in process after
    ``ray.init()``. Calling it again returns the observer already registered.
    """
    for o in _observers:
        if isinstance(o, MetricsObserver):
            return o
    return add_observer(MetricsObserver(placement))  # type: ignore[return-value]


def disable_metrics() -> None:
    """Unregister the metrics observer of this process."""
    for o in _observers:
        if isinstance(o, MetricsObserver):
            remove_observer(o)


def record_restart(placement: str | None = None) -> None:
    """Count one session restarted by the supervisor (no-op unless Ray is initialized in this process)."""
    try:
        m = _metrics()
        if m is not None:
            m.restarts.inc(1, tags={"placement": placement or "unknown"})
    except Exception as e:
        log.debug("could not record a restart: %s", e)


def set_active_sessions(placement: str | None, n: int) -> None:
    """Report how many sessions the supervisor keeps running with ``placement`` (no-op without Ray)."""
    try:
        m = _metrics()
        if m is not None:
            m.active_sessions.set(n, tags={"placement": placement or "unknown"})
    except Exception as e:
        log.debug("could not record active sessions: %s", e)


# ------------------------------------------------------------------------- automatic metrics in Ray


def ray_placement() -> str | None:
    """The placement this process runs sessions with when it is a Ray worker (``actor``, ``dense``, or
    ``unknown`` for another worker), else None. Safe anywhere: never imports or initializes Ray."""
    ray = sys.modules.get("ray")
    if ray is None:
        return None
    try:
        if not ray.is_initialized():
            return None
        from ray._private import worker  # noqa: PLC2701 - Ray has no public "am I a worker" query

        if worker.global_worker.mode != worker.WORKER_MODE:
            return None  # a driver: metrics only when asked (enable_metrics)
        name = ray.get_runtime_context().get_actor_name() or ""
    except Exception:
        return None
    if name.startswith("loomray/host/"):
        return "dense"
    if name.startswith(("loomray:", "loomray/standby/")):
        return "actor"
    return "unknown"


def _auto_enable() -> None:
    """Once per process: register the metrics observer when this process is a Ray worker."""
    global _auto_checked
    _auto_checked = True
    if os.environ.get("LOOMRAY_RAY_METRICS", "").strip().lower() in ("0", "false", "no", "off"):
        return
    placement = ray_placement()
    if placement is not None:
        enable_metrics(placement)
        log.debug("Ray metrics enabled in this worker (placement %s)", placement)
