"""loomray's Ray metrics: recorded from a run's events (unit tests), and scraped from Ray's Prometheus endpoint.

The unit tests feed :class:`loomray.telemetry.MetricsObserver` a fake
``ray.util.metrics`` and need no cluster. The cluster tests share one
one-node cluster (started with a metrics export port and a short
``metrics_report_interval_ms``) and one session run with ``RayRuntime``; the
job's ``worker_process_setup_hook`` (:func:`worker_setup`, the recipe
docs/telemetry.md gives) enables tracing in every worker, to files. They check
that the session actor traced the run and registered the metrics observer by
itself, and then poll ``http://127.0.0.1:<port>/metrics`` until loomray's
series show the run. Ray serves that endpoint from its dashboard agent's
metrics module, which only a ``ray[default]`` install runs (a minimal ``ray``
starts the agent with ``--minimal`` and exports nothing): without those
packages the scrape test skips.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import sys
import time
import urllib.request
from collections import defaultdict
from pathlib import Path

import pytest

from loomray import Agent, CheckpointConfig, Tuning, telemetry
from loomray.models import ScriptedModel
from loomray.runtime import InProcRuntime
from loomray.testing import free_port

pytestmark = [pytest.mark.timeout(240)]

HERE = Path(__file__).resolve().parent
TELEMETRY_DIR = "LOOMRAY_TEST_TELEMETRY_DIR"


# ------------------------------------------------------------------------------- unit: fake metrics


class _FakeMetric:
    def __init__(self, name, description="", boundaries=None, tag_keys=None):
        self.name, self.tag_keys, self.boundaries = name, tuple(tag_keys or ()), boundaries
        self.records: list[tuple[float, dict]] = []

    def _rec(self, value, tags):
        assert set(tags) == set(self.tag_keys), (self.name, tags)  # Ray refuses missing tags
        assert all(isinstance(v, str) for v in tags.values())
        self.records.append((value, dict(tags)))

    def inc(self, value=1.0, tags=None):
        assert value > 0, f"Ray's Counter refuses {value}"
        self._rec(value, tags)

    def observe(self, value, tags=None):
        self._rec(value, tags)

    def set(self, value, tags=None):
        self._rec(value, tags)

    def total(self, **match):
        return sum(v for v, t in self.records if all(t.get(k) == x for k, x in match.items()))


class FakeRayMetrics:
    Counter = Histogram = Gauge = _FakeMetric


def lookup(key: str) -> str:
    """Look something up."""
    return f"value of {key}"


def intrude(store: str, session: str) -> str:
    """Take the session's lease from the run that called this tool, as a second incarnation would."""
    from loomray.storage import open_store

    open_store(store).leases.acquire(session, owner="intruder")
    return "taken"


def publish() -> str:
    """Publish (waits for a person's approval)."""
    return "published"


class Die(BaseException):
    """The process dying inside a tool."""


async def test_metrics_observer_counts_what_really_ran():
    metrics = telemetry.Instruments(FakeRayMetrics)
    observer = telemetry.add_observer(telemetry.MetricsObserver("actor", metrics=metrics))
    dies = {"left": 1}

    def fetch(key: str) -> str:
        """Fetch a value."""
        if key == "k2" and dies["left"]:
            dies["left"] -= 1
            raise Die()
        return f"value of {key}"

    checkpoints = []

    def emit(event):
        if event.type == "checkpoint":
            checkpoints.append(event)

    try:
        model = ScriptedModel([{"tool": "fetch", "args": {"key": f"k{i}"}} for i in range(4)] + ["done"])
        agent = Agent("x", model=model, tools=[fetch], runtime=InProcRuntime(),
                      tuning=Tuning(checkpoint=CheckpointConfig()))
        with pytest.raises(Die):
            await agent.run("go", session_id="m", emit=emit)
        result = await agent.run("go", session_id="m", emit=emit)  # continues the run, replaying its journal
    finally:
        telemetry.remove_observer(observer)

    p = {"placement": "actor"}
    assert metrics.model_calls.total(**p, model="scripted") == model.calls == 5
    assert metrics.tool_calls.total(**p, tool="fetch", error="false") == 4
    assert metrics.replayed_steps.total(**p) == result.replayed_steps > 0
    # Restored from the checkpoint after pass 1: pass 2's model answer (journaled before k2 died) replays.
    assert metrics.replayed_steps.total(**p, kind="model") == 1
    assert metrics.checkpoints_written.total(**p) == len(checkpoints) == 5  # after passes 0..3, and the final one
    assert metrics.checkpoint_bytes.total(**p) == sum(c.size for c in checkpoints)
    assert len(metrics.checkpoint_latency.records) == 5
    assert all(0 <= v < 30 for v, _ in metrics.checkpoint_latency.records)
    # Each model call billed once: the run's cumulative usage (replays included once) is what was spent.
    assert metrics.spend_usd.total(**p) == pytest.approx(result.usage.cost_usd)
    assert metrics.tokens.total(**p, type="input") == result.usage.input_tokens
    assert metrics.checkpoint_failures.records == []


async def test_spend_and_tokens_match_the_run():
    metrics = telemetry.Instruments(FakeRayMetrics)
    observer = telemetry.add_observer(telemetry.MetricsObserver(None, metrics=metrics))
    try:
        model = ScriptedModel([{"tool": "lookup", "args": {"key": "a"}}, "done"])
        result = await Agent("x", model=model, tools=[lookup], runtime=InProcRuntime()).run("go")
    finally:
        telemetry.remove_observer(observer)
    p = {"placement": "unknown"}
    assert metrics.spend_usd.total(**p) == pytest.approx(result.usage.cost_usd)
    assert metrics.tokens.total(**p, type="input") == result.usage.input_tokens
    assert metrics.tokens.total(**p, type="output") == result.usage.output_tokens
    assert metrics.checkpoints_written.records == []  # checkpointing off


def test_supervisor_metrics_and_auto_enable(monkeypatch):
    metrics = telemetry.Instruments(FakeRayMetrics)
    telemetry.use_ray_instruments(metrics)
    try:
        telemetry.record_restart("dense", "s3://a/x")
        telemetry.record_restart(None)
        telemetry.set_active_sessions("dense", 3, "s3://a/x")
        telemetry.set_active_sessions("dense", 5, "s3://b/y")
        telemetry.set_awaiting_approval(2, "s3://a/x")
    finally:
        telemetry.use_ray_instruments(None)
    assert metrics.restarts.records == [(1, {"placement": "dense", "store": "s3://a/x"}),
                                        (1, {"placement": "unknown", "store": "unknown"})]
    # Two stores on one cluster: two series, never one overwritten by the other.
    assert metrics.active_sessions.records == [(3, {"placement": "dense", "store": "s3://a/x"}),
                                               (5, {"placement": "dense", "store": "s3://b/y"})]
    assert metrics.awaiting_approval.records == [(2, {"store": "s3://a/x"})]

    # A Ray worker registers the metrics observer by itself, once, with its placement.
    monkeypatch.setattr(telemetry, "_auto_checked", False)
    monkeypatch.setattr(telemetry, "ray_placement", lambda: "dense")
    before = telemetry.observers()
    try:
        from loomray.events import RunStart

        telemetry.observe(RunStart(session_id="s"))
        added = [o for o in telemetry.observers() if o not in before]
        assert len(added) == 1 and isinstance(added[0], telemetry.MetricsObserver)
        assert added[0].placement == "dense"
    finally:
        telemetry.disable_metrics()


async def test_the_supervisors_gauges_are_set_again_until_they_change():
    # Ray stops exporting a gauge that is not set again: the supervisor's loop sets its gauges again.
    metrics = telemetry.Instruments(FakeRayMetrics)
    metrics.awaiting_approval = telemetry.HeldGauge(metrics.awaiting_approval)
    metrics.active_sessions = telemetry.HeldGauge(metrics.active_sessions)
    gauge = metrics.awaiting_approval.gauge
    telemetry.use_ray_instruments(metrics)
    holding = asyncio.ensure_future(telemetry.hold_gauges(every_s=0.01))
    try:
        telemetry.set_awaiting_approval(3, "s3://a/x")
        telemetry.set_awaiting_approval(1, "s3://b/y")
        await _until(lambda: len(gauge.records) >= 6, "the gauge set again")
        assert {v for v, t in gauge.records[2:] if t == {"store": "s3://a/x"}} == {3}
        assert {v for v, t in gauge.records[2:] if t == {"store": "s3://b/y"}} == {1}
        telemetry.set_awaiting_approval(0, "s3://a/x")
        seen = len(gauge.records)
        await _until(lambda: (0, {"store": "s3://a/x"}) in gauge.records[seen:], "the new value set again")
    finally:
        holding.cancel()
        telemetry.use_ray_instruments(None)


async def _until(predicate, what, timeout=10.0):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.01)


def test_no_metrics_outside_a_ray_worker(monkeypatch):
    # This test process is no Ray worker: no placement, nothing registered by itself, and without
    # ray.init() the supervisor calls are no-ops.
    assert telemetry.ray_placement() is None
    if "ray" not in sys.modules or not sys.modules["ray"].is_initialized():
        telemetry.record_restart("actor")
        telemetry.set_active_sessions("actor", 1)
        assert telemetry.ray_instruments() is None
    monkeypatch.setenv("LOOMRAY_RAY_METRICS", "0")
    monkeypatch.setattr(telemetry, "_auto_checked", False)
    monkeypatch.setattr(telemetry, "ray_placement", lambda: "actor")
    before = telemetry.observers()
    from loomray.events import RunStart

    telemetry.observe(RunStart(session_id="s"))
    assert telemetry.observers() == before  # opted out


# ---------------------------------------------------------------------------------- cluster tests


def worker_setup() -> None:
    """Runs in every worker process of the test's Ray job: spans and the registered observers, to files."""
    out = os.environ.get(TELEMETRY_DIR)
    if not out:
        return
    try:
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import (
            SimpleSpanProcessor,
            SpanExporter,
            SpanExportResult,
        )
    except ImportError:
        return

    class FileExporter(SpanExporter):
        def export(self, spans):
            with open(os.path.join(out, f"spans-{os.getpid()}.jsonl"), "a") as f:
                f.writelines(json.dumps({
                        "name": s.name, "attributes": dict(s.attributes), "span_id": s.context.span_id,
                        "pid": os.getpid(),
                        "parent": s.parent.span_id if s.parent else None, "status": s.status.status_code.name,
                    }) + "\n" for s in spans)
            return SpanExportResult.SUCCESS

    class Snapshot:
        """At each run's end: which observers this process has registered (the metrics one registers itself)."""

        def on_event(self, event, info):
            if event.type == "run_end":
                with open(os.path.join(out, f"observers-{os.getpid()}.json"), "w") as f:
                    json.dump([[type(o).__name__, getattr(o, "placement", None)] for o in telemetry.observers()], f)

    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(FileExporter()))
    telemetry.enable_tracing(provider)
    telemetry.add_observer(Snapshot())


def _metrics_agent_missing() -> str | None:
    try:
        from ray._private.utils import get_dashboard_dependency_error
    except Exception as e:  # pragma: no cover - Ray moved it
        return f"cannot tell whether Ray's metrics agent runs here ({e})"
    err = get_dashboard_dependency_error()
    if err is None:
        return None
    return (f"Ray's Prometheus endpoint needs ray[default]: this minimal Ray install starts its dashboard agent "
            f"with --minimal, which exports no metrics ({err})")



#: The marker secret of the secrets sweep's Ray channel here.
SECRET = "sk-sweep-2b8d4e6f0a"


@pytest.fixture(scope="module")
def cluster_run(tmp_path_factory):
    """One cluster, one session (3 passes, a checkpoint after each) run by a session actor; on a second
    store (its own supervisor), a session that waits for an approval and one that loses its lease."""
    pytest.importorskip("opentelemetry.sdk")
    from loomray.runtime import RayRuntime
    from loomray.testing.cluster import local_cluster

    root = tmp_path_factory.mktemp("ray-metrics")
    (root / "telemetry").mkdir()
    port = free_port()
    pythonpath = os.pathsep.join(p for p in (str(HERE), os.environ.get("PYTHONPATH")) if p)
    # Ray's workers export every metrics_report_interval_ms (default 10 s; the OTel recorder floors it at 1 s).
    with local_cluster(num_nodes=1, num_cpus_per_node=2, system_config={"metrics_report_interval_ms": 500},
                       head_node_args={"metrics_export_port": port},
                       env={"PYTHONPATH": pythonpath, TELEMETRY_DIR: str(root / "telemetry")},
                       init_kwargs={"runtime_env": {"worker_process_setup_hook": f"{__name__}.worker_setup"}}) as lc:
        # A secret in the session actors' runtime_env: no metric label may carry it (the secrets sweep's Ray
        # channels; see tests/agent/test_agent_secrets_sweep.py for the others).
        secret_env = {"runtime_env": {"env_vars": {"SWEEP_API_KEY": SECRET}}}
        runtime, other = RayRuntime(root / "store", actor_options=secret_env), RayRuntime(root / "other")
        try:
            model = ScriptedModel([{"tool": "lookup", "args": {"key": "a"}}, {"tool": "lookup", "args": {"key": "b"}},
                                   "done"])
            agent = Agent("x", model=model, tools=[lookup], runtime=runtime, name="metered",
                          tuning=Tuning(checkpoint=CheckpointConfig()))
            checkpoints = []
            result = asyncio.run(agent.run("go", session_id="metered",
                                           emit=lambda e: checkpoints.append(e) if e.type == "checkpoint" else None))
            assert result.turns == 3 and len(checkpoints) == 3
            asyncio.run(_approval_and_lost_lease(other))
            yield {"port": port, "result": result, "checkpoints": checkpoints, "dir": root / "telemetry",
                   "store_url": runtime.store.url, "other_url": other.store.url}
        finally:
            runtime.close()
            other.close()
    assert lc.leftover == []


async def _approval_and_lost_lease(runtime) -> None:
    """Two sessions of ``runtime``'s store: one stops for a person's approval (its supervisor's gauge counts
    it), one loses its lease to an intruder mid-run (its session actor counts it)."""
    from loomray import tool
    from loomray.storage.errors import LeaseLostError

    waiting = Agent("x", model=ScriptedModel([{"tool": "publish", "args": {}}, "published"]), runtime=runtime,
                    tools=[tool(publish, requires_approval=True)], tuning=Tuning(checkpoint=CheckpointConfig()))
    assert (await waiting.run("go", session_id="waits")).stop_reason == "awaiting_approval"
    script = [{"tool": "intrude", "args": {"store": runtime.store.url, "session": "fenced"}}, "unreachable"]
    fenced = Agent("x", model=ScriptedModel(script), tools=[intrude], runtime=runtime,
                   tuning=Tuning(checkpoint=CheckpointConfig()))
    with pytest.raises(LeaseLostError):
        await fenced.run("go", session_id="fenced")


@pytest.mark.ray
def test_session_actor_traces_and_registers_metrics_by_itself(cluster_run):
    out, result = cluster_run["dir"], cluster_run["result"]
    spans = [json.loads(line) for f in out.glob("spans-*.jsonl") for line in f.read_text().splitlines()]
    spans = [s for s in spans if s["attributes"]["loomray.session_id"] == "metered"]
    assert len({s["pid"] for s in spans}) == 1  # one process ran the session: its actor
    ops = [s["attributes"]["gen_ai.operation.name"] for s in spans]
    assert sorted(ops) == ["chat", "chat", "chat", "execute_tool", "execute_tool", "invoke_agent"]
    run = next(s for s in spans if s["name"] == "invoke_agent metered")
    assert all(s["parent"] == run["span_id"] for s in spans if s is not run)
    assert {s["attributes"]["loomray.run_id"] for s in spans} == {result.run_id}
    assert run["attributes"]["loomray.node_id"] and run["attributes"]["loomray.epoch"] == 1
    # In the session actor the metrics observer registered itself, with the actor's placement.
    snapshot = json.loads((out / f"observers-{spans[0]['pid']}.json").read_text())
    assert ["MetricsObserver", "actor"] in snapshot and ["TracingObserver", None] in snapshot


_LINE = re.compile(r'^([A-Za-z_:][A-Za-z0-9_:]*)(?:\{(.*)\})?\s+(\S+)$')
_LABEL = re.compile(r'([A-Za-z_][A-Za-z0-9_]*)="((?:[^"\\]|\\.)*)"')


def parse_prometheus(text: str) -> dict[str, list[tuple[dict[str, str], float]]]:
    out: dict[str, list[tuple[dict[str, str], float]]] = defaultdict(list)
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        hit = _LINE.match(line)
        if hit:
            out[hit.group(1)].append((dict(_LABEL.findall(hit.group(2) or "")), float(hit.group(3))))
    return out


def total(series, name, **match) -> float:
    return sum(v for labels, v in series.get(name, ()) if all(labels.get(k) == x for k, x in match.items()))


@pytest.mark.ray
def test_session_metrics_reach_prometheus(cluster_run):
    missing = _metrics_agent_missing()
    if missing:
        pytest.skip(missing)
    import ray

    result, checkpoints = cluster_run["result"], cluster_run["checkpoints"]

    @ray.remote(num_cpus=0)
    class SupervisorSide:
        """A live process that reports as supervisors do (a task's worker may exit, and its gauges with it)."""

        async def hold(self):
            from loomray import telemetry as t

            await t.hold_gauges(1.0)

        def report(self):
            from loomray import telemetry as t

            t.record_restart("test-placement", "s3://one/x")
            t.record_restart("test-placement", "s3://one/x")
            t.set_active_sessions("test-placement", 7, "s3://one/x")
            t.set_active_sessions("test-placement", 2, "s3://two/y")
            t.set_awaiting_approval(4, "s3://one/x")
            return True

    side = SupervisorSide.remote()
    assert ray.get(side.report.remote(), timeout=60)
    side.hold.remote()  # as a supervisor's loop does: the gauges stay while the scrape polls

    mine, other = cluster_run["store_url"], cluster_run["other_url"]
    actor = (("placement", "actor"), ("store", mine))
    expected = {
        ("ray_loomray_model_calls_total", actor): 3,
        ("ray_loomray_tool_calls_total", actor): 2,
        ("ray_loomray_checkpoints_written_total", actor): 3,
        ("ray_loomray_checkpoint_bytes_total", actor): sum(c.size for c in checkpoints),
        ("ray_loomray_checkpoint_latency_seconds_count", actor): 3,
        ("ray_loomray_model_call_duration_seconds_count", actor): 3,
        ("ray_loomray_tool_call_duration_seconds_count", actor): 2,
        ("ray_loomray_run_stops_total", actor): 1,
        ("ray_loomray_session_restarts_total", (("placement", "test-placement"),)): 2,
        ("ray_loomray_active_sessions", (("placement", "test-placement"),)): 9,
        # The other store's supervisor counts its session waiting for approval; its fenced session's actor
        # counts the lease it lost (a run that failed).
        ("ray_loomray_sessions_awaiting_approval", (("store", other),)): 1,
        ("ray_loomray_run_stops_total", (("store", other), ("reason", "awaiting_approval"))): 1,
        ("ray_loomray_leases_lost_total", (("placement", "actor"), ("store", other))): 1,
        ("ray_loomray_run_stops_total", (("store", other), ("reason", "failed"))): 1,
    }
    url = f"http://127.0.0.1:{cluster_run['port']}/metrics"
    deadline = time.monotonic() + 90
    while True:
        try:
            scraped = urllib.request.urlopen(url, timeout=10).read().decode()
            series = parse_prometheus(scraped)
        except OSError:
            scraped, series = "", {}
        got = {k: total(series, k[0], **dict(k[1])) for k in expected}
        if got == expected or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert got == expected, {k: (got[k], v) for k, v in expected.items() if got[k] != v}
    assert SECRET not in scraped
    spend = total(series, "ray_loomray_spend_usd_total", placement="actor", model="scripted", store=mine)
    assert spend == pytest.approx(result.usage.cost_usd, rel=1e-6)
    assert total(series, "ray_loomray_tokens_total", store=mine, type="input") == result.usage.input_tokens
    assert total(series, "ray_loomray_replayed_steps_total") == 0
    # Every session series names its store; two supervisors' gauges stay apart.
    stores = {labels.get("store") for labels, _ in series["ray_loomray_model_calls_total"]}
    assert stores == {mine, other}
    # Ray keeps its WorkerId label on application metrics (it drops it only from its own task and actor
    # series): one series per session actor process, which a dashboard sums over.
    assert all("WorkerId" in labels for labels, _ in series["ray_loomray_model_calls_total"])
    assert total(series, "ray_loomray_active_sessions", store="s3://one/x") == 7
    assert total(series, "ray_loomray_active_sessions", store="s3://two/y") == 2
    assert total(series, "ray_loomray_run_stops_total", reason="completed") == 1
    assert total(series, "ray_loomray_sessions_awaiting_approval", store="s3://one/x") == 4
    assert total(series, "ray_loomray_sessions_awaiting_approval", store=mine) == 0
    assert total(series, "ray_loomray_leases_lost_total", store=mine) == 0
