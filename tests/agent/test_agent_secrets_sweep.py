"""The secrets sweep: a marker passed through every input channel stays under its own session's prefix.

Each channel (prompt, instructions, ``context=``, ``metadata=``, tool
arguments, results and errors, model errors, validation errors, approval
reasons, signals) gets a marker of its own and a session of its own. After
the runs and a compaction every object of the store is read, Parquet and
gzip included, and each marker must appear only under
``sessions/{user}/{its session}/``: never in the session index, the table,
``active/``, or another session's objects. Neither may it appear in what the
CLI prints about other sessions, in metric labels, or in trace attributes and
statuses (loomray has no content capture). The Ray-only channels
(``runtime_env``, actor options) are swept in tests/ray/test_ray_tenancy.py.
"""

from __future__ import annotations

import gzip
import io
import json
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner
from pydantic import BaseModel

from loomray import Agent, CheckpointConfig, Tuning, tool
from loomray.cli.main import main
from loomray.errors import ModelError
from loomray.models import ScriptedModel
from loomray.runtime import LocalRuntime
from loomray.telemetry import Instruments as Metrics
from loomray.telemetry import MetricsObserver, add_observer, remove_observer

USER = "tenant"
CHANNELS = ("prompt", "instructions", "context", "metadata", "tool_args", "tool_result", "tool_error",
            "model_error", "validation_error", "approval_reason", "signal")


def marker(channel: str) -> str:
    return f"MARKER-{channel.replace('_', '-')}-7f3a9c"


class Card(BaseModel):
    number: int


@tool
def echo(text: str) -> str:
    """Echo the text back."""
    return "ok"


@tool
def fetch() -> str:
    """Fetch a secret page."""
    return f"the page says {marker('tool_result')}"


@tool
def explode() -> str:
    """Fail loudly."""
    raise ValueError(f"cannot: {marker('tool_error')}")


@tool(requires_approval=True)
def pay(amount: int) -> str:
    """Pay; needs approval."""
    return "paid"


class FailingModel:
    """A provider whose error message quotes what it was sent (as real ones sometimes do)."""

    name = "failing"

    async def complete(self, request):
        raise ModelError(f"400: could not parse {marker('model_error')}", provider="test", model="failing")


class _FakeMetric:
    def __init__(self, name, description="", boundaries=None, tag_keys=()):
        self.tags: list[dict] = []

    def inc(self, value=1, tags=None):
        self.tags.append(dict(tags or {}))

    observe = set = inc


class _FakeModule:
    Counter = Histogram = Gauge = _FakeMetric


def _agent(runtime, model, *, instructions="You help.", tools=(echo, fetch, explode, pay)) -> Agent:
    return Agent(instructions, model=model, tools=list(tools), runtime=runtime,
                 tuning=Tuning(checkpoint=CheckpointConfig(position="after_tools")))


async def _run_every_channel(runtime) -> None:
    def run(channel, script, prompt="go", **kwargs):
        return _agent(runtime, ScriptedModel(script)).run(prompt, session_id=f"s-{channel}", user_id=USER, **kwargs)

    await run("prompt", ["fine"], prompt=f"my key is {marker('prompt')}")
    await _agent(runtime, ScriptedModel(["fine"]), instructions=f"You help. {marker('instructions')}").run(
        "go", session_id="s-instructions", user_id=USER)
    await run("context", ["fine"], context={"secret": marker("context")})
    await run("metadata", ["fine"], metadata={"secret": marker("metadata")})
    await run("tool_args", [{"tool": "echo", "args": {"text": marker("tool_args")}}, "fine"])
    await run("tool_result", [{"tool": "fetch", "args": {}}, "fine"])
    await run("tool_error", [{"tool": "explode", "args": {}}, "fine"])
    with pytest.raises(ModelError):
        await _agent(runtime, FailingModel()).run("go", session_id="s-model_error", user_id=USER)
    bad = json.dumps({"number": marker("validation_error")})
    with pytest.raises(Exception, match="output_schema"):
        await run("validation_error", [bad, bad], output_schema=Card)
    # Approval reason: the denial reaches the model, and the run goes on.
    agent = _agent(runtime, ScriptedModel([{"tool": "pay", "args": {"amount": 5}}, "fine"]))
    waiting = await agent.run("go", session_id="s-approval_reason", user_id=USER)
    await agent.resume(None, session_id="s-approval_reason", user_id=USER,
                       approvals={waiting.pending_approvals[0].id: f"no: {marker('approval_reason')}"})
    # Signal: delivered at the next pass boundary of the next run.
    agent = _agent(runtime, ScriptedModel(["first", "second"]))
    await agent.run("go", session_id="s-signal", user_id=USER)
    await agent.signal("s-signal", f"also {marker('signal')}", user_id=USER)
    await agent.resume("more", session_id="s-signal", user_id=USER)
    # A session of another user, whose CLI views must show none of the markers.
    await _agent(runtime, ScriptedModel(["hello"])).run("hi", session_id="victim", user_id="other")


def _texts(path: Path) -> str:
    """What an object says, as text: Parquet decoded (its strings may be compressed), gzip inflated."""
    data = path.read_bytes()
    if path.suffix == ".parquet":
        return json.dumps(pq.read_table(io.BytesIO(data)).to_pylist(), default=str)
    if path.suffix == ".gz":
        data = gzip.decompress(data)
    return data.decode("utf-8", "replace")


def _where(root: Path, needle: str) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file() and needle in _texts(p))


def _cli(root: Path, *args: str) -> str:
    out = CliRunner().invoke(main, [*args, "--store", str(root)], catch_exceptions=False)
    return out.output


@pytest.fixture(scope="module")
def swept(tmp_path_factory):
    pytest.importorskip("opentelemetry.sdk")
    import asyncio

    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from loomray import telemetry

    root = tmp_path_factory.mktemp("sweep") / "store"
    runtime = LocalRuntime(root)
    exporter, provider = InMemorySpanExporter(), TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracing = telemetry.enable_tracing(provider)
    metrics = Metrics(_FakeModule)
    observer = add_observer(MetricsObserver("test", metrics=metrics))
    try:
        asyncio.run(_run_every_channel(runtime))
    finally:
        remove_observer(observer)
        telemetry.remove_observer(tracing)
    runtime.store.compact()
    return root, runtime, exporter.get_finished_spans(), metrics


@pytest.mark.parametrize("channel", CHANNELS)
def test_a_marker_is_stored_only_under_its_own_session(swept, channel):
    root, *_ = swept
    found = _where(root, marker(channel))
    own = f"sessions/{USER}/s-{channel}/"
    assert found, f"the {channel} marker reached no object: the sweep would prove nothing"
    assert [k for k in found if not k.startswith(own)] == []


def test_the_index_table_and_marks_hold_no_marker(swept):
    root, runtime, *_ = swept
    shared = [p for p in root.rglob("*") if p.is_file() and not str(p.relative_to(root)).startswith("sessions/")]
    assert any("table" in str(p) for p in shared) and any("index/sessions" in str(p) for p in shared)
    leaks = {str(p.relative_to(root)): c for p in shared for c in CHANNELS if marker(c) in _texts(p)}
    assert leaks == {}


def test_failed_runs_leave_only_their_type_in_the_index(swept):
    root, runtime, *_ = swept
    row = runtime.store.sessions.get("s-validation_error", user_id=USER)
    assert row.status == "failed"
    assert row.error.startswith("OutputValidationError: ") and len(row.error) <= 160
    assert runtime.store.sessions.get("s-model_error", user_id=USER).error.startswith("ModelError: ")
    # The full text stays under the session's prefix, and its owner's `loomray logs` prints it.
    logs = _cli(root, "logs", "s-validation_error", "--user", USER)
    assert marker("validation_error") in logs


def test_cli_views_of_other_sessions_show_no_marker(swept):
    root, *_ = swept
    outputs = [_cli(root, "status"), _cli(root, "status", "--json"), _cli(root, "query", "--json"),
               _cli(root, "logs", "victim", "--user", "other"), _cli(root, "checkpoints", "victim", "--user", "other"),
               _cli(root, "show", "victim", "--user", "other")]
    assert "victim" in outputs[0]
    assert [(i, c) for i, text in enumerate(outputs) for c in CHANNELS if marker(c) in text] == []


def test_metric_labels_and_trace_attributes_hold_no_marker(swept):
    _, _, spans, metrics = swept
    labels = json.dumps([m.tags for m in vars(metrics).values()])
    assert '"tool"' in labels  # the observer saw the runs
    traced = json.dumps([{"name": s.name, "attributes": dict(s.attributes or {}),
                          "status": s.status.description, "events": [dict(e.attributes or {}) for e in s.events]}
                         for s in spans], default=str)
    assert "error.type" in traced  # failures were traced
    assert [c for c in CHANNELS if marker(c) in labels or marker(c) in traced] == [], traced
