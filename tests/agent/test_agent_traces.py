"""Traces that outlive a process: one trace for a session across a SIGKILL and a restart in a new process,
an incarnation linked to the one before, a fork linked to its base, the requester's span carried in the
request, and content off unless asked for. tests/ray/test_ray_traces.py does it across a Ray node loss."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from crash_procs import run_child

from loomray import Agent, CheckpointConfig, Tuning, telemetry
from loomray.models import ScriptedModel
from loomray.run_request import RunRequest
from loomray.runtime import LocalRuntime
from loomray.telemetry.context import incarnation_span_id, session_root

pytest.importorskip("opentelemetry.sdk")

from opentelemetry.sdk.trace import TracerProvider  # noqa: E402
from opentelemetry.sdk.trace.export import SimpleSpanProcessor  # noqa: E402
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
SECRET = "card 4111-1111-1111-1111"


@pytest.fixture
def tracing():
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    observer = telemetry.enable_tracing(provider)
    yield provider, exporter, observer
    telemetry.remove_observer(observer)
    provider.shutdown()


def lookup(key: str) -> str:
    """Look something up."""
    return f"value of {key}: {SECRET}"


def _child(data_dir: Path, out: Path, kill: str, trace_file: Path) -> int:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
           "CRASH_TRACE_FILE": str(trace_file)}
    return run_child([str(data_dir), "sess-trace", str(out), kill], env, out.with_suffix(".log")).returncode


def test_one_trace_across_a_killed_process_and_its_successor(tmp_path):
    data, trace_file = tmp_path / "data", tmp_path / "spans.jsonl"
    data.mkdir()
    assert _child(data, tmp_path / "first.json", "tool:3", trace_file) == -9  # SIGKILLed inside its third tool
    assert _child(data, tmp_path / "second.json", "", trace_file) == 0  # a new process continues the session
    spans = [json.loads(line) for line in trace_file.read_text().splitlines()]
    pids = {s["pid"] for s in spans}
    assert len(pids) == 2  # both incarnations exported spans
    assert len({s["trace_id"] for s in spans}) == 1  # one trace, across the kill
    run_spans = [s for s in spans if s["attributes"].get("gen_ai.operation.name") == "invoke_agent"]
    assert len(run_spans) == 1  # the killed incarnation's run span never ended: only the survivor's
    # that trace is the session's own (no span was current where the runs were asked for)
    root_trace, root_span = session_root(LocalRuntime(data / "store").store.url, None, "sess-trace")
    assert spans[0]["trace_id"] == root_trace and run_spans[0]["parent"] == root_span
    first = spans[0]["pid"]
    assert any(s["pid"] == first and s["attributes"].get("gen_ai.operation.name") == "chat" for s in spans)
    assert {s["attributes"].get("loomray.epoch") for s in spans if s["attributes"].get("loomray.epoch")} == {1, 2}


async def test_a_fork_links_to_its_base_and_every_run_of_a_session_shares_its_trace(tmp_path, tracing):
    _, exporter, _ = tracing
    runtime = LocalRuntime(tmp_path / "store")
    script = [{"tool": "lookup", "args": {"key": "a"}}, "first done", {"tool": "lookup", "args": {"key": "b"}},
              "second done", "forked done"]
    agent = Agent("x", model=ScriptedModel(script), tools=[lookup], runtime=runtime, name="tracer",
                  tuning=Tuning(checkpoint=CheckpointConfig()))
    await agent.run("first", session_id="base")
    await agent.resume("second", session_id="base")  # another run, no span current: the session's trace
    base_point = (await agent.list_checkpoints("base"))[-1].checkpoint_id
    forks = await agent.fork("base", from_checkpoint=base_point, prompts=["try this"])
    spans = exporter.get_finished_spans()
    runs = [s for s in spans if s.attributes.get("gen_ai.operation.name") == "invoke_agent"]
    base_runs = [s for s in runs if s.attributes["loomray.session_id"] == "base"]
    fork_run = next(s for s in runs if s.attributes["loomray.session_id"] == forks[0].session_id)
    base_trace, base_root = session_root(runtime.store.url, None, "base")
    assert len(base_runs) == 2 and {s.context.trace_id for s in base_runs} == {base_trace}
    assert all(s.parent.span_id == base_root for s in base_runs)
    links = {link.attributes["loomray.link"]: link.context for link in fork_run.links}
    assert links["fork_base"].trace_id == base_trace and links["fork_base"].span_id == base_root
    assert fork_run.attributes["loomray.forked_from"] == "base"
    # the GenAI attributes a dashboard groups by
    chat = next(s for s in spans if s.attributes.get("gen_ai.operation.name") == "chat")
    assert chat.attributes["gen_ai.response.finish_reasons"] and "gen_ai.response.model" in chat.attributes
    assert base_runs[0].attributes["gen_ai.agent.id"] == "tracer"
    assert base_runs[0].attributes["gen_ai.usage.output_tokens"] > 0
    # content capture is off by default: nothing a tool returned or the model wrote is on a span
    assert not any(SECRET in str(v) for s in spans for v in s.attributes.values())


async def test_a_requesters_span_travels_with_the_request_and_content_is_captured_on_request(tmp_path, tracing):
    provider, exporter, observer = tracing
    observer.capture_content = True
    runtime = LocalRuntime(tmp_path / "store")
    agent = Agent("x", model=ScriptedModel([{"tool": "lookup", "args": {"key": "a"}}, "done"]), tools=[lookup],
                  runtime=runtime, tuning=Tuning(checkpoint=CheckpointConfig()))
    with provider.get_tracer("test").start_as_current_span("request") as outer:
        request = RunRequest(session_id="asked")
        await agent.run("go", session_id="asked")
    # what a Ray actor or a later incarnation reads: the requester's span, as a W3C traceparent
    ctx = outer.get_span_context()
    assert request.trace_parent == f"00-{ctx.trace_id:032x}-{ctx.span_id:016x}-{int(ctx.trace_flags):02x}"
    assert RunRequest.model_validate_json(request.model_dump_json()).trace_parent == request.trace_parent
    run = next(s for s in exporter.get_finished_spans() if s.attributes.get("gen_ai.operation.name") == "invoke_agent")
    assert run.context.trace_id == ctx.trace_id and run.parent.span_id == ctx.span_id
    session_trace, session_span = session_root(runtime.store.url, None, "asked")
    assert [(lk.context.trace_id, lk.context.span_id) for lk in run.links] == [(session_trace, session_span)]
    tool = next(s for s in exporter.get_finished_spans() if s.attributes.get("gen_ai.operation.name") == "execute_tool")
    assert SECRET in tool.attributes["gen_ai.tool.call.result"]
    assert json.loads(tool.attributes["gen_ai.tool.call.arguments"]) == {"key": "a"}


class Die(BaseException):
    """The process dying inside a tool: nothing after it runs, not even the run's error event."""


async def test_an_incarnation_continuing_a_run_links_to_the_one_before(tmp_path, tracing):
    _, exporter, _ = tracing
    runtime = LocalRuntime(tmp_path / "store")
    dies = {"left": 1}

    def fetch(key: str) -> str:
        """Fetch a value."""
        if key == "b" and dies["left"]:
            dies["left"] -= 1
            raise Die()
        return f"value of {key}"

    script = [{"tool": "fetch", "args": {"key": "a"}}, {"tool": "fetch", "args": {"key": "b"}}, "done"]
    agent = Agent("x", model=ScriptedModel(script), tools=[fetch], runtime=runtime,
                  tuning=Tuning(checkpoint=CheckpointConfig()))
    with pytest.raises(Die):
        await agent.run("go", session_id="twice")
    lost = list(exporter.get_finished_spans())  # the first incarnation's finished steps, not its run span
    assert lost and not [s for s in lost if s.attributes["gen_ai.operation.name"] == "invoke_agent"]
    await agent.run("go", session_id="twice")  # a new incarnation (epoch 2) continues the run
    [run] = [s for s in exporter.get_finished_spans() if s.attributes["gen_ai.operation.name"] == "invoke_agent"]
    store = runtime.store.url
    assert run.attributes["loomray.epoch"] == 2 and run.context.span_id == incarnation_span_id(store, None, "twice", 2)
    [link] = [lk for lk in run.links if lk.attributes["loomray.link"] == "previous_incarnation"]
    assert link.context.trace_id == run.context.trace_id and link.attributes["loomray.epoch"] == 1
    assert {s.parent.span_id for s in lost} == {link.context.span_id} == {incarnation_span_id(store, None, "twice", 1)}
