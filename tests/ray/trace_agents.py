"""Agents of the Ray trace tests, and the tracing set-up their session actors run when they import this module.

The shared cluster's job has no ``worker_process_setup_hook`` (only ``ray.init``
sets one, and the cluster is shared), so the test gives its session actors
``LOOMRAY_TEST_OTLP_ENDPOINT`` through ``actor_options``' ``runtime_env`` and
the actor, importing this module to unpickle the agent's tools, enables
tracing to that endpoint with OpenTelemetry's OTLP exporter. Every span's
resource names its process and Ray node, so a test can tell the incarnations apart.
"""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path

from loomray import Agent, CheckpointConfig, Tuning, telemetry
from loomray.models import ScriptedModel

ENDPOINT = "LOOMRAY_TEST_OTLP_ENDPOINT"
#: Where the first process to reach tool step HOLD_AT leaves ``holding-{pid}`` and stays.
HOLD_DIR = "LOOMRAY_TEST_TRACE_DIR"
#: Tool passes of the slow agent, before its final answer.
TURNS = 6
HOLD_AT = 2


def _setup() -> None:
    endpoint = os.environ.get(ENDPOINT)
    if not endpoint:
        return  # the driver, or a worker of another test
    import ray
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor

    resource = Resource.create({"process.pid": os.getpid(), "loomray.test.node_id": ray.get_runtime_context().get_node_id()})
    provider = TracerProvider(resource=resource)
    provider.add_span_processor(SimpleSpanProcessor(OTLPSpanExporter(endpoint=endpoint, timeout=10)))
    telemetry.enable_tracing(provider)


_setup()


async def slow_step(n: int) -> str:
    """One unit of slow work (stands in for a long tool call).

    The first process to reach step HOLD_AT stays in it (until its node is removed): the test kills a
    session that is certainly mid-run, and a successor process goes through.
    """
    folder = os.environ.get(HOLD_DIR)
    if n == HOLD_AT and folder and not any(Path(folder).glob("holding-*")):
        (Path(folder) / f"holding-{os.getpid()}").write_text(str(n))
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            await asyncio.sleep(0.05)
    await asyncio.sleep(0.1)
    return f"step {n} done"


def slow(name: str) -> Agent:
    """TURNS slow tool passes, a checkpoint after each, then a final answer."""
    script = [{"tool": "slow_step", "args": {"n": i}} for i in range(TURNS)] + [f"{name} finished"]
    return Agent("slow", model=ScriptedModel(script), tools=[slow_step], name=name,
                 tuning=Tuning(checkpoint=CheckpointConfig()))


def forking(name: str) -> Agent:
    """Answers the base run at once; each fork makes one tool call, then answers."""
    script = ["base ready", {"tool": "slow_step", "args": {"n": 0}}, "fork done"]
    return Agent("forking", model=ScriptedModel(script), tools=[slow_step], name=name,
                 tuning=Tuning(checkpoint=CheckpointConfig()))
