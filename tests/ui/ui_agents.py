"""Agents of the session-browser tests, importable by reference (``ui_agents:NAME``) so the UI can resume them."""

from __future__ import annotations

import asyncio
import threading

from loomray import Agent, Tuning, tool
from loomray.models import ModelRequest, ScriptedModel

#: The live test's tool waits on this until the test has the page open.
GATE = threading.Event()


def echo_last_tool(request: ModelRequest) -> str:
    """The model's last reply: what the last tool result said (a denial's reason among it)."""
    last = next(m for m in reversed(request.messages) if m.role == "tool")
    return f"model saw: {last.content}"


@tool(requires_approval=True)
def publish(title: str) -> str:
    """Publish the report (a person approves each call).

    Args:
        title: the report's title.
    """
    return f"published as {title!r}"


async def step() -> str:
    """One slow step: returns once the test opens the gate."""
    opened = await asyncio.to_thread(GATE.wait, 60)
    return "the step is done" if opened else "the gate never opened"


approval_agent = Agent("You publish reports.", model=ScriptedModel([{"tool": "publish", "args": {"title": "Q3"}},
                                                                   echo_last_tool]),
                       tools=[publish], tuning=Tuning(checkpoint=True), name="ui-publisher")

gated_agent = Agent("You take one slow step.", model=ScriptedModel([{"tool": "step", "args": {}},
                                                                   "finished after the step"]),
                    tools=[step], tuning=Tuning(checkpoint=True), name="ui-gated")

chatty_agent = Agent("You chat.", model=ScriptedModel(["first answer", "second answer", "third answer",
                                                      "fourth answer", "fifth answer"]),
                     tuning=Tuning(checkpoint=True), name="ui-chatty")

XSS = "<script>window.__pwned = 1</script><img src=x onerror=\"window.__pwned = 2\">"

xss_agent = Agent("You repeat.", model=ScriptedModel([f"here it is: {XSS}"]), tuning=Tuning(checkpoint=True),
                  name="ui-xss")
