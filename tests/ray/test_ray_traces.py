"""One trace across a node loss and across a fork, on the shared multi-node Ray cluster.

The session actors export their spans over OTLP/HTTP to a collector this test
runs on 127.0.0.1 (``otlp_collector``), which feeds an in-memory exporter; the
test's own spans (the requests) go to the same exporter. A worker node running
a session is removed (SIGKILL) while the session is held in a tool step
(``trace_agents.slow_step``): the session continues on the other worker, and
every span of both incarnations is in the trace the run was asked for under,
the survivor's run span linked to the lost one's. A fork asked for under a
span is that span's child, in the same trace as its base when both were asked
for in one operation, and links to its base session's root (docs/telemetry.md).
"""

from __future__ import annotations

import asyncio
import time

import pytest

pytest.importorskip("opentelemetry.exporter.otlp.proto.http")
ray = pytest.importorskip("ray")

from opentelemetry.sdk.trace import TracerProvider  # noqa: E402
from opentelemetry.sdk.trace.export import SimpleSpanProcessor  # noqa: E402

from loomray.telemetry.context import incarnation_span_id, session_root  # noqa: E402
from loomray.testing import wait_for  # noqa: E402

pytestmark = [pytest.mark.ray, pytest.mark.timeout(180)]


@pytest.fixture(scope="module")
def traced(shared_cluster, tmp_path_factory):
    """The cluster, a runtime whose session actors trace to the collector, and the test's own tracer."""
    import trace_agents
    from otlp_collector import Collector

    from loomray.runtime import RayRuntime

    collector, held = Collector(), tmp_path_factory.mktemp("ray-traces-held")
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(collector.exporter))
    options = {"resources": {"loomray_session": 1},
               "runtime_env": {"env_vars": {trace_agents.ENDPOINT: collector.endpoint, trace_agents.HOLD_DIR: str(held),
                                            "SWEEP_API_KEY": SECRET}}}
    runtime = RayRuntime(tmp_path_factory.mktemp("ray-traces") / "store", actor_options=options)
    try:
        yield shared_cluster.lc, runtime, collector, provider.get_tracer("test"), held
    finally:
        runtime.close()
        provider.shutdown()
        collector.close()


#: A secret in the session actors' runtime_env (as docs/providers.md once suggested for an API key).
SECRET = "sk-sweep-7f3a9c1e5b"


def _spans(collector, session_id, op=None):
    return [s for s in collector.exporter.get_finished_spans()
            if s.attributes.get("loomray.session_id") == session_id
            and (op is None or s.attributes.get("gen_ai.operation.name") == op)]


async def _until(predicate, timeout, what):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.05)


async def test_one_trace_across_a_node_loss(traced):
    import trace_agents

    lc, runtime, collector, tracer, held = traced
    sid = "s-node-loss"
    agent = trace_agents.slow("nodeloss")
    agent.runtime = runtime
    with tracer.start_as_current_span("request") as request:
        run = asyncio.create_task(agent.run("go", session_id=sid))
        await _until(lambda: any(held.glob("holding-*")), 60, "the run held in its third tool step")
        first = (await runtime.session(sid))["node_id"]
        victim = lc.node_of(first)
        assert victim is not None and victim is not lc.head
        lc.remove_node(victim)  # SIGKILL: the actor dies with its node, its run span unexported
        result = await asyncio.wait_for(run, 90)
    assert result.turns == trace_agents.TURNS + 1
    wait_for(lambda: _spans(collector, sid, "invoke_agent"), timeout=30, what="the survivor's run span")

    spans = _spans(collector, sid)
    nodes = {s.resource.attributes["loomray.test.node_id"] for s in spans}
    assert first in nodes and len(nodes) == 2  # spans from the lost node and from the survivor
    ctx = request.get_span_context()
    assert {s.context.trace_id for s in spans} == {ctx.trace_id}  # one trace, across the node loss
    [survivor] = _spans(collector, sid, "invoke_agent")  # the lost incarnation's run span never ended
    assert survivor.attributes["loomray.epoch"] == 2 and survivor.parent.span_id == ctx.span_id
    store, lost = runtime.store.url, [s for s in spans if s.attributes["loomray.epoch"] == 1]
    assert lost and all(s.resource.attributes["loomray.test.node_id"] == first for s in lost)
    # The lost incarnation's steps name its run span as their parent; the survivor's run span links to it.
    previous = {lk.attributes["loomray.link"]: lk.context for lk in survivor.links}["previous_incarnation"]
    assert (previous.trace_id, previous.span_id) == (ctx.trace_id, incarnation_span_id(store, None, sid, 1))
    assert {s.parent.span_id for s in lost} == {previous.span_id}
    assert survivor.context.span_id == incarnation_span_id(store, None, sid, 2)
    # Each model call traced once across both incarnations (the survivor's replayed steps have no span).
    turns = sorted(s.attributes["loomray.turn"] for s in spans if s.attributes["gen_ai.operation.name"] == "chat")
    assert turns == list(range(trace_agents.TURNS + 1))


async def test_a_fork_is_the_child_of_the_span_it_was_asked_under_and_links_to_its_base(traced):
    import trace_agents

    _, runtime, collector, tracer, _ = traced
    agent = trace_agents.forking("forker")
    agent.runtime = runtime
    with tracer.start_as_current_span("task") as task:
        await agent.run("start", session_id="s-base")
        point = (await agent.list_checkpoints("s-base"))[-1].checkpoint_id
        with tracer.start_as_current_span("explore") as explore:
            forks = await agent.fork("s-base", from_checkpoint=point, prompts=["left", "right"])
    assert [f.output for f in forks] == ["fork done", "fork done"]
    fork_ids = [f.session_id for f in forks]
    wait_for(lambda: all(_spans(collector, f, "invoke_agent") for f in fork_ids), timeout=30, what="fork run spans")

    trace_id = task.get_span_context().trace_id
    [base] = _spans(collector, "s-base", "invoke_agent")
    assert base.context.trace_id == trace_id and base.parent.span_id == task.get_span_context().span_id
    base_trace, base_root = session_root(runtime.store.url, None, "s-base")
    for fork_id in fork_ids:
        spans = _spans(collector, fork_id)
        [run] = [s for s in spans if s.attributes["gen_ai.operation.name"] == "invoke_agent"]
        # One trace with its base: the operation that ran both; the fork run is the fork call's child.
        assert {s.context.trace_id for s in spans} == {trace_id}
        assert run.parent.span_id == explore.get_span_context().span_id
        assert run.attributes["loomray.forked_from"] == "s-base"
        links = {lk.attributes["loomray.link"]: lk.context for lk in run.links}
        assert (links["fork_base"].trace_id, links["fork_base"].span_id) == (base_trace, base_root)
        own = session_root(runtime.store.url, None, fork_id)
        assert (links["session"].trace_id, links["session"].span_id) == own
    assert len({s.resource.attributes["process.pid"] for f in fork_ids for s in _spans(collector, f)}) == 2


def test_no_span_carries_a_secret_from_the_runtime_env(traced):
    """The secrets sweep's Ray channels, in traces: run after the modules' sessions, every span they exported
    (attributes, events, links, resource) is free of the secret their actors were started with."""
    _, _, collector, _, _ = traced
    spans = collector.exporter.get_finished_spans()
    assert spans, "the module's sessions exported no span"
    for span in spans:
        text = repr((dict(span.attributes), [dict(e.attributes or {}) for e in span.events],
                     [dict(lk.attributes or {}) for lk in span.links], dict(span.resource.attributes)))
        assert SECRET not in text, span.name
