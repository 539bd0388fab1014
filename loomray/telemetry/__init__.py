"""Traces and metrics for loomray sessions: observers of the run's events (docs/telemetry.md).

Every event a run emits is also handed, in the process that executes the run, to the observers registered
here; with none registered that costs one function call. Nothing here imports OpenTelemetry or Ray at module
level: ``import loomray`` works without either being importable.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import sys
from collections.abc import Callable
from typing import Any
from urllib.parse import urlparse

from loomray.events import Event
from loomray.telemetry.metrics import (
    METRIC_NAMES,
    HeldGauge,
    Instruments,
    MetricsObserver,
    OtelInstruments,
    ray_instruments,
    use_ray_instruments,
)
from loomray.telemetry.registry import Observer, RunInfo, add_observer, observers, remove_observer
from loomray.telemetry.tracing import TracingObserver, disable_tracing, enable_tracing

log = logging.getLogger("loomray.telemetry")

__all__ = [
    "METRIC_NAMES", "HeldGauge", "Instruments", "MetricsObserver", "Observer", "OtelInstruments", "RunInfo",
    "TracingObserver", "add_observer", "disable_metrics", "disable_tracing", "enable_metrics", "enable_otel_metrics",
    "enable_tracing", "hold_gauges", "observe", "observers", "record_restart", "remove_observer",
    "set_active_sessions", "set_awaiting_approval", "use_ray_instruments",
]


#: The Ray-worker check of :func:`_auto_enable` ran (once per process).
_auto_checked = False


#: Where each provider's API is when an adapter names no ``base_url``.
_DEFAULT_HOSTS = {"anthropic": "api.anthropic.com", "openai": "api.openai.com"}


@functools.lru_cache(maxsize=64)
def server_address(base_url: str | None, provider: str | None) -> str | None:
    """The host a model's API calls go to: its ``base_url``'s, else its provider's default, else None."""
    if isinstance(base_url, str) and base_url:
        return urlparse(base_url).hostname
    return _DEFAULT_HOSTS.get(provider or "")


def observe(event: Event, *, agent: Any = None, epoch: int | None = None, node_id: str | None = None,
            store: str | None = None) -> None:
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
    provider = getattr(model, "provider", None)
    info = RunInfo(agent_name=getattr(agent, "name", None), model=getattr(model, "name", None),
                   provider=provider, epoch=epoch, node_id=node_id, store=store,
                   server_address=server_address(getattr(model, "base_url", None), provider))
    for o in obs:
        try:
            o.on_event(event, info)
        except Exception as e:  # telemetry must never break a run
            log.warning("telemetry observer %s failed on a %s event: %s: %s", type(o).__name__, event.type,
                        type(e).__name__, e)


# -------------------------------------------------------------------------------------------- metrics


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


def enable_otel_metrics(meter_provider: Any = None, placement: str = "local") -> MetricsObserver:
    """Record the same metrics through OpenTelemetry's metrics API for the runs of this process (``loomray[otel]``).

    For runs outside Ray (``LocalRuntime``, ``InProcRuntime``): the instruments
    come from ``meter_provider`` (default: the global one the application set
    up, e.g. with a Prometheus or OTLP exporter). Replaces a metrics observer
    registered before.
    """
    from opentelemetry import metrics  # the [otel] extra: only when asked for

    provider = meter_provider or metrics.get_meter_provider()
    disable_metrics()
    instruments = Instruments(OtelInstruments(provider.get_meter("loomray")))
    return add_observer(MetricsObserver(placement, metrics=instruments))


def disable_metrics() -> None:
    """Unregister the metrics observer of this process."""
    for o in observers():
        if isinstance(o, MetricsObserver):
            remove_observer(o)


def _set_ray_metric(what: str, record: Callable[[Instruments], None]) -> None:
    """``record`` into this process's Ray instruments; nothing without Ray, and a failure only logged."""
    try:
        m = ray_instruments()
        if m is not None:
            record(m)
    except Exception as e:
        log.debug("could not record %s: %s", what, e)


def record_restart(placement: str | None = None, store: str | None = None) -> None:
    """Count one session restarted by the supervisor (no-op unless Ray is initialized in this process)."""
    tags = {"placement": placement or "unknown", "store": store or "unknown"}
    _set_ray_metric("a restart", lambda m: m.restarts.inc(1, tags=tags))


def set_active_sessions(placement: str | None, n: int, store: str | None = None) -> None:
    """Report how many sessions the supervisor of ``store`` keeps running with ``placement`` (no-op without Ray)."""
    tags = {"placement": placement or "unknown", "store": store or "unknown"}
    _set_ray_metric("active sessions", lambda m: m.active_sessions.set(n, tags=tags))


def set_awaiting_approval(n: int, store: str | None = None) -> None:
    """Report how many sessions of ``store`` wait for a person's decision on a tool call (no-op without Ray)."""
    tags = {"store": store or "unknown"}
    _set_ray_metric("sessions awaiting approval", lambda m: m.awaiting_approval.set(n, tags=tags))


async def hold_gauges(every_s: float = 5.0) -> None:
    """Set this process's supervisor gauges again every ``every_s`` seconds, until cancelled.

    Ray stops exporting a gauge series nobody sets again (docs/telemetry.md), and the supervisor sets active
    sessions and sessions awaiting approval only when they change. Never raises but to cancel.
    """
    while True:
        await asyncio.sleep(every_s)
        try:
            m = ray_instruments()
            for gauge in (m.active_sessions, m.awaiting_approval) if m is not None else ():
                if isinstance(gauge, HeldGauge):
                    gauge.again()
        except Exception as e:
            log.debug("could not set the gauges again: %s", e)


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
    if name.startswith("loomray:"):
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
