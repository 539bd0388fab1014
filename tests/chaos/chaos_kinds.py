"""The sessions of the chaos checker: one agent per kind of tool behaviour, importable on every node.

The checker's cluster puts this directory on the workers' ``PYTHONPATH`` and
``LOOMRAY_CHAOS_DIR`` in their environment. Every agent's model logs each call
as ``{prompt} {reply index}`` to ``$LOOMRAY_CHAOS_DIR/model-calls`` (appended
and fsynced, one line per call, across processes and nodes); the checker gives
each session its own id as its prompt, so a line seen twice is a model call
made twice.

Kinds, and how a session of each may end (what the oracle accepts):

- ``sleep``: four passes of an async tool that sleeps 0.3 s; ``completed``;
- ``gil``: three passes of a sync tool that holds the GIL for 0.2 s
  (pure-Python busy loop); ``completed``;
- ``raise``: two passes of a tool that raises ``ValueError`` (information for
  the model); ``completed``;
- ``sysexit``: a sync tool calls ``sys.exit``; ``failed`` (ToolAborted);
- ``osexit``: a sync tool calls ``os._exit``; ``failed`` (restart limit);
- ``approval``: a tool that needs approval; ``awaiting_approval``, then
  ``completed`` once approved.

Every kind may also end ``cancelled`` or ``paused`` when the schedule did that to it.
"""

from __future__ import annotations

import asyncio
import os
import sys
import time
from pathlib import Path

from loomray import Agent, Tuning, tool
from loomray.models import ModelRequest, ModelResponse, ScriptedModel
from loomray.models.scripted import reply_index

DIR = Path(os.environ.get("LOOMRAY_CHAOS_DIR", "/tmp/loomray-chaos"))
#: Kinds whose sessions are healthy: they must never fail, whatever happens to their neighbours.
HEALTHY = ("sleep", "gil", "raise", "approval")
#: Kinds whose sessions crash themselves.
CRASHING = ("sysexit", "osexit")
KINDS = HEALTHY + CRASHING


class LoggedModel(ScriptedModel):
    """A ScriptedModel that logs ``{prompt} {reply index}`` per call to ``$LOOMRAY_CHAOS_DIR/model-calls``."""

    async def complete(self, request: ModelRequest) -> ModelResponse:
        response = await super().complete(request)
        prompt = next((m.content for m in request.messages if m.role == "user"), "?")
        line = f"{prompt} {reply_index(request.messages)}\n".encode()
        fd = os.open(DIR / "model-calls", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        try:
            os.write(fd, line)
            os.fsync(fd)
        finally:
            os.close(fd)
        return response


def calls() -> list[str]:
    """Every logged model call, ``{prompt} {reply index}``, in order."""
    path = DIR / "model-calls"
    return path.read_text().splitlines() if path.exists() else []


async def nap() -> str:
    """Sleeps 0.3 s off the loop's critical path."""
    await asyncio.sleep(0.3)
    return "rested"


def spin() -> str:
    """Holds the GIL for 0.2 s (a pure-Python busy loop)."""
    end, n = time.monotonic() + 0.2, 0
    while time.monotonic() < end:
        n += 1
    return f"spun {n}"


def flaky() -> str:
    """Always fails (the model reads the error and goes on)."""
    raise ValueError("flaky tool failed")


def leave() -> str:
    """Leaves the way a library calling sys.exit does."""
    sys.exit(2)


def crash() -> str:
    """Ends its process at once (a segfault, an OOM kill)."""
    os._exit(1)


@tool(requires_approval=True)
def pay(amount: int) -> str:
    """Pays (a person approves each call)."""
    return f"paid {amount}"


def _agent(kind: str, script: list, tools: list) -> Agent:
    return Agent(f"chaos {kind}", model=LoggedModel(script), tools=tools, tuning=Tuning(checkpoint=True),
                 name=f"chaos-{kind}")


def _passes(name: str, n: int, **args: object) -> list:
    return [{"tool": name, "args": dict(args)} for _ in range(n)] + [f"{name} done"]


sleep = _agent("sleep", _passes("nap", 4), [nap])
gil = _agent("gil", _passes("spin", 3), [spin])
raise_ = _agent("raise", _passes("flaky", 2), [flaky])
sysexit = _agent("sysexit", _passes("leave", 1), [leave])
osexit = _agent("osexit", _passes("crash", 1), [crash])
approval = _agent("approval", [{"tool": "pay", "args": {"amount": 3}}, "paid"], [pay])


def ref(kind: str) -> str:
    """The agent reference of ``kind`` (``chaos_kinds:raise_`` for ``raise``)."""
    return f"chaos_kinds:{'raise_' if kind == 'raise' else kind}"
