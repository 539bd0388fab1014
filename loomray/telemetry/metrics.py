"""loomray's metrics: one set of instruments, recorded into Ray's metrics or OpenTelemetry's (docs/telemetry.md).

The instruments come from a module with Ray's metric API (``Counter``/``Histogram``/``Gauge`` taking
``tag_keys``): ``ray.util.metrics`` in Ray processes, or :class:`OtelInstruments` over an OpenTelemetry
``Meter`` elsewhere, so both report the same series. Labels never hold content or ids a user typed: only
placement, store, and model and tool names, which the agent's author chose.
"""

from __future__ import annotations

import logging
import re
import sys
import threading
from datetime import datetime
from typing import Any

from loomray.events import (
    CheckpointEvent,
    Event,
    ModelCall,
    ModelResponseEvent,
    ReplayedStep,
    RunEnd,
    RunError,
    ToolCallEvent,
    ToolResultEvent,
)
from loomray.telemetry.registry import RunInfo

log = logging.getLogger("loomray.telemetry")

#: The metrics loomray records, as named in ``ray.util.metrics`` (Prometheus: ``ray_`` prefix, counters
#: ``_total`` suffix, e.g. ``ray_loomray_model_calls_total``); OpenTelemetry gets the same names.
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
    "model_call_duration": "loomray_model_call_duration_seconds",
    "tool_call_duration": "loomray_tool_call_duration_seconds",
    "run_stops": "loomray_run_stops",
    "leases_lost": "loomray_leases_lost",
    "restarts": "loomray_session_restarts",
    "active_sessions": "loomray_active_sessions",
    "awaiting_approval": "loomray_sessions_awaiting_approval",
}
_LATENCY_BOUNDARIES = [0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0]
#: Model and tool calls take longer: the buckets of OpenTelemetry's ``gen_ai.client.operation.duration``.
_CALL_BOUNDARIES = [0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12, 10.24, 20.48, 40.96, 81.92]
#: Checkpoint ids are ``ckpt`` + 12 hex digits of creation milliseconds (:func:`loomray.ids.new_id`).
_CKPT_MS = re.compile(r"^ckpt([0-9a-f]{12})")
#: Run errors that mean the run lost its session's lease (another incarnation owns it now).
_LEASE_LOST = frozenset({"LeaseLostError", "DurabilityLost"})


class Instruments:
    """The metric objects, made once from ``module`` (``ray.util.metrics``, :class:`OtelInstruments`, a fake)."""

    def __init__(self, module: Any) -> None:
        C, H, G = module.Counter, module.Histogram, module.Gauge
        n = METRIC_NAMES
        p = ("placement", "store")
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
        self.model_call_duration = H(n["model_call_duration"],
                                     "Seconds per model call that really ran (as gen_ai.client.operation.duration).",
                                     boundaries=_CALL_BOUNDARIES, tag_keys=(*p, "model"))
        self.tool_call_duration = H(n["tool_call_duration"], "Seconds per tool call that really ran.",
                                    boundaries=_CALL_BOUNDARIES, tag_keys=(*p, "tool", "error"))
        self.run_stops = C(n["run_stops"], "Runs that ended, by stop reason (failed: the run raised).",
                           tag_keys=(*p, "reason"))
        self.leases_lost = C(n["leases_lost"], "Runs stopped because another incarnation took their lease.",
                             tag_keys=p)
        self.restarts = C(n["restarts"], "Sessions restarted by the supervisor.", tag_keys=p)
        self.active_sessions = G(n["active_sessions"], "Sessions the supervisor keeps running.", tag_keys=p)
        self.awaiting_approval = G(n["awaiting_approval"], "Sessions whose last run stopped for a person's decision.",
                                   tag_keys=("store",))


def _inc(counter: Any, value: float | None, tags: dict[str, str]) -> None:
    if value is not None and value > 0:  # Ray's Counter refuses 0 and negative increments
        counter.inc(value, tags=tags)


def _seconds(start: datetime | None, end: datetime) -> float | None:
    return None if start is None else max(0.0, (end - start).total_seconds())


class MetricsObserver:
    """Records a run's events into metrics (see the module docstring).

    ``metrics`` is the :class:`Instruments` to record into; by default the
    process's ``ray.util.metrics`` objects, once Ray is initialized here.
    """

    def __init__(self, placement: str | None = None, *, metrics: Instruments | None = None) -> None:
        self.placement = placement or "unknown"
        self._fixed = metrics
        # When each model and tool call in flight started, by (run, step): for the duration histograms.
        self._started: dict[tuple[str | None, str], datetime] = {}
        self._lock = threading.Lock()

    def on_event(self, event: Event, info: RunInfo) -> None:
        m = self._fixed or ray_instruments()
        if m is None:
            return
        p = {"placement": self.placement, "store": info.store or "unknown"}
        if isinstance(event, (ModelCall, ToolCallEvent)):
            key = event.step_key if isinstance(event, ModelCall) else event.tool_call.id
            with self._lock:
                self._started[(event.run_id, key)] = event.at
        elif isinstance(event, ModelResponseEvent):
            self._model_response(m, event, info, p)
        elif isinstance(event, ToolResultEvent):
            self._tool_result(m, event, p)
        elif isinstance(event, ReplayedStep):
            m.replayed_steps.inc(1, tags={**p, "kind": event.kind})
        elif isinstance(event, CheckpointEvent):
            self._checkpoint(m, event, p)
        elif isinstance(event, (RunEnd, RunError)):
            self._run_ended(m, event, p)

    def _pop_start(self, run_id: str | None, key: str) -> datetime | None:
        with self._lock:
            return self._started.pop((run_id, key), None)

    def _model_response(self, m: Instruments, event: ModelResponseEvent, info: RunInfo, p: dict[str, str]) -> None:
        start = self._pop_start(event.run_id, event.step_key) if event.step_key else None
        if event.replayed:
            return
        tags = {**p, "model": info.model or "unknown"}
        m.model_calls.inc(1, tags=tags)
        _inc(m.tokens, event.usage.input_tokens, {**tags, "type": "input"})
        _inc(m.tokens, event.usage.output_tokens, {**tags, "type": "output"})
        _inc(m.spend_usd, event.usage.cost_usd, tags)
        seconds = _seconds(start, event.at)
        if seconds is not None:
            m.model_call_duration.observe(seconds, tags=tags)

    def _tool_result(self, m: Instruments, event: ToolResultEvent, p: dict[str, str]) -> None:
        start = self._pop_start(event.run_id, event.tool_call_id)
        if event.replayed:
            return
        tags = {**p, "tool": event.name, "error": str(event.is_error).lower()}
        m.tool_calls.inc(1, tags=tags)
        seconds = _seconds(start, event.at)
        if seconds is not None:
            m.tool_call_duration.observe(seconds, tags=tags)

    @staticmethod
    def _checkpoint(m: Instruments, event: CheckpointEvent, p: dict[str, str]) -> None:
        if not event.ok:
            m.checkpoint_failures.inc(1, tags=p)
            return
        m.checkpoints_written.inc(1, tags=p)
        _inc(m.checkpoint_bytes, event.size, p)
        latency = _checkpoint_latency(event)
        if latency is not None:
            m.checkpoint_latency.observe(latency, tags=p)

    def _run_ended(self, m: Instruments, event: RunEnd | RunError, p: dict[str, str]) -> None:
        with self._lock:  # what was in flight when the run ended never gets a duration
            for key in [k for k in self._started if k[0] == event.run_id]:
                del self._started[key]
        if isinstance(event, RunEnd):
            m.run_stops.inc(1, tags={**p, "reason": event.stop_reason})
            return
        m.run_stops.inc(1, tags={**p, "reason": "failed"})
        if event.error_type in _LEASE_LOST:
            m.leases_lost.inc(1, tags=p)


def _checkpoint_latency(event: CheckpointEvent) -> float | None:
    """Seconds from the checkpoint's creation (its id's timestamp) to the write finishing (the event)."""
    hit = _CKPT_MS.match(event.checkpoint_id)
    if hit is None:
        return None
    created = int(hit.group(1), 16) / 1000.0
    return max(0.0, event.at.timestamp() - created)


# ----------------------------------------------------------------------------- Ray's instruments

_ray_obj: Instruments | None = None
_ray_lock = threading.Lock()
#: Making Ray's metric objects failed in this process (logged once; Ray metrics stay off).
_ray_broken = False


def ray_instruments() -> Instruments | None:
    """This process's Ray metric objects, or None while Ray is not initialized here (nothing would export them)."""
    global _ray_obj, _ray_broken
    if _ray_obj is None:
        ray = sys.modules.get("ray")
        if _ray_broken or ray is None or not ray.is_initialized():
            return None
        with _ray_lock:
            if _ray_obj is None:
                try:
                    import ray.util.metrics as module  # Ray is optional and heavy: only once it runs here

                    made = Instruments(module)
                    made.active_sessions = HeldGauge(made.active_sessions)
                    made.awaiting_approval = HeldGauge(made.awaiting_approval)
                    _ray_obj = made
                except Exception as e:
                    _ray_broken = True
                    log.warning("Ray metrics are off in this process: %s: %s", type(e).__name__, e)
                    return None
    return _ray_obj


class HeldGauge:
    """A Ray gauge that remembers its last value per label set, to set them all again (:meth:`again`).

    Ray stops exporting a gauge series not set again for a while, and the supervisor sets its gauges only when
    a count changes; :func:`loomray.telemetry.hold_gauges` calls :meth:`again` (docs/telemetry.md).
    """

    def __init__(self, gauge: Any) -> None:
        self.gauge = gauge
        self._last: dict[tuple[tuple[str, str], ...], float] = {}
        self._lock = threading.Lock()

    def set(self, value: float, tags: dict[str, str] | None = None) -> None:
        key = tuple(sorted((tags or {}).items()))
        with self._lock:
            self._last[key] = value
        self.gauge.set(value, tags=dict(key))

    def again(self) -> None:
        """Set every label set's last value again."""
        with self._lock:
            last = list(self._last.items())
        for key, value in last:
            self.gauge.set(value, tags=dict(key))


def use_ray_instruments(instruments: Instruments | None) -> None:
    """Replace this process's Ray instruments (tests record into a fake ``ray.util.metrics``)."""
    global _ray_obj
    _ray_obj = instruments


# ----------------------------------------------------------------------------- OpenTelemetry's instruments


class _OtelInstrument:
    """One OpenTelemetry instrument behind Ray's metric calls (``inc``/``observe``/``set`` with ``tags``)."""

    def __init__(self, instrument: Any) -> None:
        self._instrument = instrument

    def inc(self, value: float = 1.0, tags: dict[str, str] | None = None) -> None:
        self._instrument.add(value, attributes=tags)

    def observe(self, value: float, tags: dict[str, str] | None = None) -> None:
        self._instrument.record(value, attributes=tags)

    def set(self, value: float, tags: dict[str, str] | None = None) -> None:
        self._instrument.set(value, attributes=tags)


class OtelInstruments:
    """Ray's metric API (``Counter``, ``Histogram``, ``Gauge``) over an OpenTelemetry ``Meter``."""

    def __init__(self, meter: Any) -> None:
        self.meter = meter

    def Counter(self, name: str, description: str = "", tag_keys: tuple[str, ...] = ()) -> _OtelInstrument:  # noqa: N802
        return _OtelInstrument(self.meter.create_counter(name, description=description))

    def Histogram(self, name: str, description: str = "", boundaries: list[float] | None = None,  # noqa: N802
                  tag_keys: tuple[str, ...] = ()) -> _OtelInstrument:
        unit = "s" if name.endswith("_seconds") else ""
        return _OtelInstrument(self.meter.create_histogram(
            name, unit=unit, description=description, explicit_bucket_boundaries_advisory=boundaries))

    def Gauge(self, name: str, description: str = "", tag_keys: tuple[str, ...] = ()) -> _OtelInstrument:  # noqa: N802
        return _OtelInstrument(self.meter.create_gauge(name, description=description))
