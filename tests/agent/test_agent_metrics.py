"""Metrics outside Ray: a LocalRuntime run recorded through OpenTelemetry's metrics API, and what each series means."""

from __future__ import annotations

import pytest

from loomray import Agent, CheckpointConfig, Tuning, telemetry
from loomray.events import RunError
from loomray.models import ScriptedModel
from loomray.runtime import LocalRuntime
from loomray.telemetry import RunInfo

sdk_metrics = pytest.importorskip("opentelemetry.sdk.metrics")
export = pytest.importorskip("opentelemetry.sdk.metrics.export")


def lookup(key: str) -> str:
    """Look something up."""
    return f"value of {key}"


@pytest.fixture
def reader():
    reader = export.InMemoryMetricReader()
    provider = sdk_metrics.MeterProvider(metric_readers=[reader])
    observer = telemetry.enable_otel_metrics(provider)
    yield reader, observer
    telemetry.remove_observer(observer)
    provider.shutdown()


def points(reader) -> dict[str, list]:
    """Data points by metric name, from every resource and scope."""
    out: dict[str, list] = {}
    data = reader.get_metrics_data()
    for rm in data.resource_metrics if data else ():
        for sm in rm.scope_metrics:
            for metric in sm.metrics:
                out.setdefault(metric.name, []).extend(metric.data.data_points)
    return out


def total(found: list, **match) -> float:
    picked = [p for p in found if all(p.attributes.get(k) == v for k, v in match.items())]
    return sum(getattr(p, "value", None) if hasattr(p, "value") else p.count for p in picked)


async def test_a_local_run_reports_the_same_series_through_opentelemetry(tmp_path, reader):
    reader, _ = reader
    runtime = LocalRuntime(tmp_path / "store")
    model = ScriptedModel([{"tool": "lookup", "args": {"key": "a"}}, {"tool": "lookup", "args": {"key": "b"}}, "done"])
    agent = Agent("x", model=model, tools=[lookup], runtime=runtime, tuning=Tuning(checkpoint=CheckpointConfig()))
    result = await agent.run("go", session_id="otel")
    found = points(reader)
    tags = {"placement": "local", "store": runtime.store.url}
    assert total(found["loomray_model_calls"], **tags, model="scripted") == model.calls == 3
    assert total(found["loomray_tool_calls"], **tags, tool="lookup", error="false") == 2
    assert total(found["loomray_tokens"], **tags, type="input") == result.usage.input_tokens
    assert total(found["loomray_spend_usd"], **tags) == pytest.approx(result.usage.cost_usd)
    assert total(found["loomray_checkpoints_written"], **tags) == 3
    # One duration per call that really ran, in seconds, and the run's stop reason.
    assert total(found["loomray_model_call_duration_seconds"], **tags, model="scripted") == 3
    assert total(found["loomray_tool_call_duration_seconds"], **tags, tool="lookup") == 2
    assert all(0 <= p.sum < 30 for p in found["loomray_model_call_duration_seconds"])
    assert total(found["loomray_run_stops"], **tags, reason="completed") == 1
    # Labels never carry what the user or the model wrote.
    labels = {str(v) for series in found.values() for p in series for v in p.attributes.values()}
    assert not any("go" == v or "value of" in v or "otel" == v for v in labels), labels


async def test_a_lost_lease_is_counted_as_a_failed_stop_and_adds_no_duration(tmp_path, reader):
    reader, observer = reader
    runtime = LocalRuntime(tmp_path / "store")
    model = ScriptedModel([{"tool": "lookup", "args": {"key": "a"}}, "done"])
    agent = Agent("x", model=model, tools=[lookup], runtime=runtime, tuning=Tuning(checkpoint=CheckpointConfig()))
    await agent.run("go", session_id="twice")
    before = total(points(reader)["loomray_model_call_duration_seconds"])
    observer.on_event(RunError(session_id="s", run_id="r", error_type="LeaseLostError", error="fenced"),
                      RunInfo(store="s3://b/p"))
    found = points(reader)
    assert total(found["loomray_model_call_duration_seconds"]) == before == 2
    assert total(found["loomray_leases_lost"], store="s3://b/p") == 1
    assert total(found["loomray_run_stops"], store="s3://b/p", reason="failed") == 1
