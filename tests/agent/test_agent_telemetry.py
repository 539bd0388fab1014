"""OpenTelemetry GenAI spans from loomray.telemetry: one span per step that really ran, none for replays."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from collections import Counter

import pytest

from loomray import Agent, CheckpointConfig, Tuning, telemetry
from loomray.models import ScriptedModel
from loomray.runtime import InProcRuntime

pytest.importorskip("opentelemetry.sdk")

from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode


@pytest.fixture
def tracing():
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    observer = telemetry.enable_tracing(provider)
    assert telemetry.enable_tracing(provider) is observer  # idempotent per provider
    yield provider, exporter
    telemetry.remove_observer(observer)
    provider.shutdown()


def by_op(spans, op):
    return [s for s in spans if s.attributes.get("gen_ai.operation.name") == op]


def lookup(key: str) -> str:
    """Look something up."""
    return f"value of {key}"


async def test_three_passes_emit_chat_and_tool_spans(tracing):
    provider, exporter = tracing
    model = ScriptedModel([{"tool": "lookup", "args": {"key": "a"}}, {"tool": "lookup", "args": {"key": "b"}},
                           "done"])
    agent = Agent("You look things up.", model=model, tools=[lookup], runtime=InProcRuntime(), name="researcher",
                  tuning=Tuning(checkpoint=CheckpointConfig()))
    outer = provider.get_tracer("test")
    with outer.start_as_current_span("request") as parent:
        result = await agent.run("find a and b", session_id="s1")
    assert result.turns == 3 and model.calls == 3

    spans = [s for s in exporter.get_finished_spans() if s.name != "request"]
    chats, tools, runs = by_op(spans, "chat"), by_op(spans, "execute_tool"), by_op(spans, "invoke_agent")
    assert len(spans) == 6 and len(chats) == 3 and len(tools) == 2 and len(runs) == 1
    run = runs[0]
    assert run.name == "invoke_agent researcher" and run.kind == SpanKind.INTERNAL
    assert run.parent.span_id == parent.get_span_context().span_id  # the caller's span is the run's parent
    assert run.attributes["loomray.stop_reason"] == "completed"
    assert [e.name for e in run.events].count("loomray.checkpoint") == 3

    ckpt = await agent.get_checkpoint("s1")
    common = {"loomray.session_id": "s1", "loomray.run_id": result.run_id, "loomray.epoch": ckpt.epoch,
              "gen_ai.conversation.id": "s1"}
    assert isinstance(ckpt.epoch, int)
    for s in spans:
        assert {k: s.attributes.get(k) for k in common} == common, s.name
        assert s.start_time <= s.end_time
        assert s.context.trace_id == run.context.trace_id
        if s is not run:
            assert s.parent.span_id == run.context.span_id
            assert run.start_time <= s.start_time and s.end_time <= run.end_time

    chats.sort(key=lambda s: s.attributes["loomray.turn"])
    assert [s.attributes["loomray.turn"] for s in chats] == [0, 1, 2]
    for s, _request in zip(chats, model.requests, strict=False):
        assert s.name == "chat scripted" and s.kind == SpanKind.CLIENT
        assert s.attributes["gen_ai.request.model"] == "scripted"
        assert s.attributes["gen_ai.usage.input_tokens"] > 0 and s.attributes["gen_ai.usage.output_tokens"] > 0
        assert s.attributes["loomray.step_key"] == f"t{s.attributes['loomray.turn']:04d}-model"
        assert s.status.status_code == StatusCode.UNSET
    assert sum(s.attributes["gen_ai.usage.input_tokens"] for s in chats) == result.usage.input_tokens
    assert sum(s.attributes["gen_ai.usage.output_tokens"] for s in chats) == result.usage.output_tokens

    tools.sort(key=lambda s: s.attributes["loomray.turn"])
    assert [(s.name, s.attributes["gen_ai.tool.name"], s.attributes["gen_ai.tool.call.id"],
             s.attributes["loomray.turn"]) for s in tools] == [
        ("execute_tool lookup", "lookup", "s0000_0", 0), ("execute_tool lookup", "lookup", "s0001_0", 1)]
    # Each tool span sits between the chat span that asked for it and the next one.
    for i, t in enumerate(tools):
        assert chats[i].end_time <= t.start_time and t.end_time <= chats[i + 1].start_time


class Die(BaseException):
    """Stands in for the process dying inside a tool (not an Exception: nothing reports it as run_error)."""


@pytest.mark.parametrize("checkpoint", [False, True], ids=["journal", "checkpoints"])
async def test_a_rerun_after_a_crash_traces_each_step_once(tracing, checkpoint):
    _, exporter = tracing
    dies = {"left": 1}

    def fetch(key: str) -> str:
        """Fetch a value."""
        if key == "k2" and dies["left"]:
            dies["left"] -= 1
            raise Die()
        return f"value of {key}"

    model = ScriptedModel([{"tool": "fetch", "args": {"key": f"k{i}"}} for i in range(4)] + ["done"])
    agent = Agent("You fetch things.", model=model, tools=[fetch], runtime=InProcRuntime(),
                  tuning=Tuning(checkpoint=CheckpointConfig() if checkpoint else False))
    with pytest.raises(Die):
        await agent.run("fetch k0..k3", session_id="crashy")
    assert model.calls == 3
    first = exporter.get_finished_spans()
    # The crashed run's own span never ends (as when a process dies); the steps that finished were exported.
    assert Counter(s.attributes["gen_ai.operation.name"] for s in first) == {"chat": 3, "execute_tool": 2}

    result = await agent.run("fetch k0..k3", session_id="crashy")  # re-issued: continues the same run
    assert model.calls == 5 and result.turns == 5 and result.replayed_steps > 0

    spans = exporter.get_finished_spans()
    chats, tools, runs = by_op(spans, "chat"), by_op(spans, "execute_tool"), by_op(spans, "invoke_agent")
    assert Counter(s.attributes["loomray.turn"] for s in chats) == {0: 1, 1: 1, 2: 1, 3: 1, 4: 1}
    assert Counter(s.attributes["loomray.turn"] for s in tools) == {0: 1, 1: 1, 2: 1, 3: 1}
    assert len(chats) == model.calls
    assert {s.attributes["loomray.run_id"] for s in spans} == {result.run_id}
    assert len(runs) == 1
    replays = [e for e in runs[0].events if e.name == "loomray.replayed_step"]
    assert len(replays) == result.replayed_steps
    # The re-issue took the lease again: its spans carry the new epoch.
    epochs = {s.attributes["loomray.turn"]: s.attributes["loomray.epoch"] for s in chats}
    assert epochs[0] < epochs[4] and epochs[2] == epochs[0] and epochs[3] == epochs[4]
    # The tool that died was traced once: by the run that really completed it.
    k2 = next(s for s in tools if s.attributes["loomray.turn"] == 2)
    assert k2.attributes["loomray.epoch"] == epochs[4] and k2.status.status_code == StatusCode.UNSET


async def test_a_failed_model_call_ends_its_span_with_an_error(tracing):
    _, exporter = tracing

    def broken(request):
        raise RuntimeError("provider down")

    agent = Agent("x", model=ScriptedModel([{"tool": "lookup", "args": {"key": "a"}}, broken]), tools=[lookup],
                  runtime=InProcRuntime())
    with pytest.raises(RuntimeError):
        await agent.run("go", session_id="bad")
    spans = exporter.get_finished_spans()
    chats, runs = by_op(spans, "chat"), by_op(spans, "invoke_agent")
    assert [(s.attributes["loomray.turn"], s.status.status_code) for s in sorted(
        chats, key=lambda s: s.attributes["loomray.turn"])] == [(0, StatusCode.UNSET), (1, StatusCode.ERROR)]
    failed = next(s for s in chats if s.attributes["loomray.turn"] == 1)
    # The type only: an error's text may quote content, and traces go to a shared backend.
    assert failed.attributes["error.type"] == "RuntimeError" and failed.status.description is None
    assert "gen_ai.usage.input_tokens" not in failed.attributes
    assert runs[0].status.status_code == StatusCode.ERROR and runs[0].attributes["error.type"] == "RuntimeError"


async def test_an_observer_that_fails_never_breaks_a_run(caplog):
    class Broken:
        def on_event(self, event, info):
            raise ValueError("boom")

    seen = []

    class Recorder:
        def on_event(self, event, info):
            seen.append((event.type, info.model, info.epoch))

    broken, recorder = telemetry.add_observer(Broken()), telemetry.add_observer(Recorder())
    try:
        agent = Agent("x", model=ScriptedModel(["hi"]), runtime=InProcRuntime())
        result = await agent.run("hello", session_id="obs")
    finally:
        telemetry.remove_observer(broken)
        telemetry.remove_observer(recorder)
    assert result.output == "hi"
    assert [t for t, _, _ in seen] == ["run_start", "model_call", "model_response", "run_end"]
    assert {m for _, m, _ in seen} == {"scripted"} and all(isinstance(e, int) for _, _, e in seen)
    assert "telemetry observer Broken failed" in caplog.text


def test_import_without_opentelemetry():
    code = textwrap.dedent("""
        import sys
        sys.modules["opentelemetry"] = None  # as if it were not installed
        import loomray, loomray.session, loomray.telemetry
        assert "ray" not in sys.modules
        try:
            loomray.telemetry.enable_tracing()
        except ImportError as e:
            assert "loomray[otel]" in str(e)
        else:
            raise AssertionError("enable_tracing without OpenTelemetry must raise ImportError")
        import asyncio
        from loomray import Agent
        from loomray.models import ScriptedModel
        from loomray.runtime import InProcRuntime
        result = asyncio.run(Agent("x", model=ScriptedModel(["ok"]), runtime=InProcRuntime()).run("go"))
        assert result.output == "ok"
        print("fine")
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         check=False)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "fine"
