"""Step 5 of ``loomray demo``: steer a running session on the cluster: a signal, then an approval.

A small publishing session runs on a worker: it checks the report's facts (a
slow tool), then calls ``publish``, a tool that needs a person's approval. The
demo sends a signal while the fact check is in flight (it reaches the model at
the next pass boundary, once), the run stops waiting for approval (its actor
exits: a waiting session holds no process), and the demo approves: a new actor
continues the same run, publishes once, and no model call is repeated.
"""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path

from rich.table import Table

from loomray.agent import Agent
from loomray.cli.demo_agent import append_line
from loomray.config import Tuning
from loomray.errors import LoomrayRunError
from loomray.ids import new_id
from loomray.models.scripted import ScriptedModel
from loomray.records import Message, RunResult
from loomray.runtime.base import Runtime
from loomray.tools import tool

SIGNAL = "Use the title 'Durable agents on Ray'."
_SCRIPT = [
    {"tool": "check_facts", "args": {"section": "recovery"}},
    {"tool": "publish", "args": {"title": "Durable agents on Ray"}},
    "Published 'Durable agents on Ray'.",
]


def steering_agent(log_path: str, check_s: float) -> Agent:
    """The publishing agent: ``check_facts`` takes ``check_s``; ``publish`` waits for a person's approval."""
    log = Path(log_path).with_name("steer.log")

    async def check_facts(section: str) -> str:
        """Check the facts of one section of the report.

        Args:
            section: which section.
        """
        append_line(str(log), f"check {os.getpid()}")
        await asyncio.sleep(check_s)
        return f"the {section} section checks out"

    @tool(requires_approval=True)
    def publish(title: str) -> str:
        """Publish the report (a person approves each call).

        Args:
            title: the report's title.
        """
        append_line(str(log), f"publish {os.getpid()}")
        return f"published as {title!r}"

    model = ScriptedModel(_SCRIPT, counter_path=log.with_name("steer-model.log"))
    return Agent("You publish research reports.", model=model, tools=[check_facts, publish],
                 tuning=Tuning(checkpoint=True), name="demo-publisher")


def _lines(path: Path, kind: str) -> int:
    return sum(1 for line in path.read_text().splitlines() if line.split()[0] == kind) if path.exists() else 0


async def steer(runtime: Runtime, log_path: str, check_s: float) -> tuple[str, RunResult, RunResult]:
    """Run the publishing session, signal it mid-tool, approve its publish call; returns what happened."""
    agent = steering_agent(log_path, check_s)
    agent.runtime = runtime
    log, sid = Path(log_path).with_name("steer.log"), new_id("sess")
    run = asyncio.ensure_future(agent.run("Publish the report.", session_id=sid))
    deadline = time.monotonic() + 60
    while _lines(log, "check") == 0:  # the fact check is in flight on a worker
        if run.done() or time.monotonic() > deadline:
            await run
            raise LoomrayRunError("the publishing session never started its fact check")
        await asyncio.sleep(0.05)
    await agent.signal(sid, SIGNAL)
    waiting = await run
    if waiting.stop_reason != "awaiting_approval" or len(waiting.pending_approvals) != 1:
        raise LoomrayRunError(f"the publishing session stopped with {waiting.stop_reason!r}, not for approval")
    done = await agent.resume(None, session_id=sid, approvals={waiting.pending_approvals[0].id: True})
    if done.stop_reason != "completed" or _lines(log, "publish") != 1:
        raise LoomrayRunError(f"the approved session ended {done.stop_reason!r} "
                              f"after {_lines(log, 'publish')} publish calls")
    calls = sorted(int(x) for x in log.with_name("steer-model.log").read_text().split())
    if calls != list(range(len(_SCRIPT))):
        raise LoomrayRunError(f"the publishing session's model replies were served {calls}: one was repeated")
    return sid, waiting, done


def story(sid: str, done: RunResult, log_path: str) -> tuple[str, Table]:
    """Step 5's story and its table: the transcript as the model saw it."""
    calls = sorted(int(x) for x in Path(log_path).with_name("steer-model.log").read_text().split())
    served = (f"model replies {', '.join(map(str, calls))}, each served once" if calls == list(range(len(calls)))
              else f"[bold red]model replies served {calls}: one was repeated[/]")
    body = (f"session [bold]{sid}[/]: a signal sent while check_facts ran reached the model at the next pass "
            f"boundary; the publish call stopped the run ([bold]awaiting_approval[/], its actor exited); "
            f"approved, a new actor continued the same run and published once; {served}.")
    table = Table("#", "role", "content", title="the publishing session, as the model saw it")
    for i, m in enumerate(m for m in done.messages if m.role != "system"):
        table.add_row(str(i + 1), m.role, _describe(m)[:70])
    return body, table


def _describe(m: Message) -> str:
    if m.tool_calls:
        return "calls " + ", ".join(f"{c.name}({', '.join(f'{k}={v!r}' for k, v in c.arguments.items())})"
                                    for c in m.tool_calls)
    return m.content or ""

