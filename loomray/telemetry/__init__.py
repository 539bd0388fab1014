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
from typing import Any

from loomray.events import CheckpointEvent, Event, ModelResponseEvent, ReplayedStep, ToolResultEvent
from loomray.telemetry.registry import Observer, RunInfo, add_observer, observers, remove_observer
from loomray.telemetry.tracing import TracingObserver, disable_tracing, enable_tracing

log = logging.getLogger("loomray.telemetry")

__all__ = [
    "METRIC_NAMES", "MetricsObserver", "Observer", "RunInfo", "TracingObserver", "add_observer",
    "disable_metrics", "disable_tracing", "enable_metrics", "enable_tracing", "observe", "observers",
    "record_restart", "remove_observer", "set_active_sessions",
]


#: The Ray-worker check of :func:`_auto_enable` ran (once per process).
_auto_checked = False


def observe(event: Event, *, agent: Any = None, epoch: int | None = None, node_id: str | None = None) -> None:
    """Hand ``event`` to every registered observer. Never raises; cheap when none is registered.

    ``loomray.session.execute_request`` calls this for each event of a run,
    after the caller's ``emit`` got it.
    """
    if not _auto_checked:
        _auto_enable()
    obs = observers()
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
_metrics_lock = threading.Lock()
#: Making the metric objects failed in this process (logged once; metrics stay off).
_metrics_broken = False


def _metrics() -> _Metrics | None:
    """This process's metric objects, or None while Ray is not initialized here (nothing would export them)."""
    global _metrics_obj, _metrics_broken
    if _metrics_obj is None:
        ray = sys.modules.get("ray")
        if _metrics_broken or ray is None or not ray.is_initialized():
            return None
        with _metrics_lock:
            if _metrics_obj is None:
                try:
                    import ray.util.metrics as module  # Ray is optional and heavy: only once it runs here

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
    for o in observers():
        if isinstance(o, MetricsObserver):
            return o
    return add_observer(MetricsObserver(placement))


def disable_metrics() -> None:
    """Unregister the metrics observer of this process."""
    for o in observers():
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
        context = ray.get_runtime_context()
        if context.get_actor_id() is None:
            return None  # a driver (or a task): metrics only when asked (enable_metrics)
        name = context.get_actor_name() or ""
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
