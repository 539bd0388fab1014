"""Agents whose tools misbehave the way ordinary, imperfect tools do, for the containment tests and the chaos checker.

Importable by reference in every worker (tests/ray is on the workers' PYTHONPATH). Each agent has a
directory of its own under ``ray_agents.ROOT``; its ScriptedModel appends one line per model call to
``model-calls`` there (fsynced), so "no model call twice" is checked across processes and nodes.

- ``exits``: a sync tool raises ``SystemExit`` (a library calling ``sys.exit``);
- ``interrupts``: a sync tool raises ``KeyboardInterrupt`` in its worker thread;
- ``loop_breaker``: an async tool schedules a callback that raises ``SystemExit`` on the event loop (the
  loop itself ends; the tool cannot be contained), once: a rerun of the tool finds its marker and returns;
- ``crasher``: a sync tool calls ``os._exit`` (a segfault, an OOM kill), every time;
- ``neighbour(i)``: a healthy session of ``ray_agents.TURNS`` tool passes of 0.3 s each (``nb{i}``);
- ``forker``: answers a source run at once; each fork runs one 1 s tool call, then answers;
- ``holder``: its tool lasts while the file ``hold`` exists in its directory; ``approver``: its tool
  needs approval.
"""

from __future__ import annotations

import asyncio
import os
import sys
import time
import uuid
from pathlib import Path

from ray_agents import ROOT, TURNS, make

from loomray import Agent, Tuning, tool
from loomray.models import ScriptedModel


def workdir(name: str) -> Path:
    path = ROOT / name
    path.mkdir(parents=True, exist_ok=True)
    return path


def model_calls(name: str) -> list[int]:
    """The reply indices ScriptedModel served for agent ``name``, across all processes."""
    path = ROOT / name / "model-calls"
    return [int(x) for x in path.read_text().split()] if path.exists() else []


def _agent(name: str, script: list, tools: list, **tuning) -> Agent:
    model = ScriptedModel(script, counter_path=workdir(name) / "model-calls")
    return Agent(f"{name} agent", model=model, tools=tools, tuning=Tuning(checkpoint=True, **tuning), name=name)


def leave() -> str:
    """Leaves the way a library calling sys.exit does."""
    sys.exit(3)


def interrupt() -> str:
    """Raises KeyboardInterrupt in its worker thread."""
    raise KeyboardInterrupt("interrupted in a tool thread")


def crash() -> str:
    """Ends its process at once (what a segfault or an OOM kill does)."""
    (workdir("crasher") / f"crash-{uuid.uuid4().hex}").write_text(str(os.getpid()))
    os._exit(1)


async def break_loop() -> str:
    """The first time: ends the event loop it runs on (a callback raising SystemExit). After that: returns."""
    marker = workdir("loop_breaker") / "broke"
    if marker.exists():
        return "loop intact"
    marker.write_text(str(os.getpid()))

    def stop() -> None:
        raise SystemExit("a callback ended the loop")

    asyncio.get_running_loop().call_soon(stop)
    await asyncio.sleep(30)  # the loop ends before this returns
    return "unreachable"


def _exits_script() -> list:
    return [{"tool": "leave", "args": {}}, "unreachable"]


exits = _agent("exits", _exits_script(), [leave])
exits_dense = _agent("exits_dense", _exits_script(), [leave])
interrupts = _agent("interrupts", [{"tool": "interrupt", "args": {}}, "unreachable"], [interrupt])
loop_breaker = _agent("loop_breaker", [{"tool": "break_loop", "args": {}}, "loop_breaker finished"], [break_loop])
crasher = _agent("crasher", [{"tool": "crash", "args": {}}, "unreachable"], [crash])

#: Healthy neighbours: ``nb0`` .. ``nb5`` (each its own call log), ``ray_agents.TURNS`` passes of 0.3 s.
NEIGHBOURS = 6
for _i in range(NEIGHBOURS):
    globals()[f"nb{_i}"] = make(f"nb{_i}", 0.3)


def neighbour_calls_ok(i: int) -> bool:
    """Neighbour ``i`` was served each scripted reply exactly once."""
    return sorted(model_calls(f"nb{i}")) == list(range(TURNS + 1))


async def work() -> str:
    """One second of slow work."""
    await asyncio.sleep(1.0)
    return "worked"


forker = _agent("forker", ["source ready", {"tool": "work", "args": {}}, "fork done"], [work])


async def hold(key: str) -> str:
    """Slow work that lasts while the file ``hold`` exists (writes ``held-*`` when it starts)."""
    here = workdir("holder")
    (here / f"held-{uuid.uuid4().hex}").write_text(key)
    deadline = time.monotonic() + 60
    while (here / "hold").exists() and time.monotonic() < deadline:
        await asyncio.sleep(0.02)
    return f"held {key}"


holder = _agent("holder", [{"tool": "hold", "args": {"key": "a"}}, {"tool": "hold", "args": {"key": "b"}},
                           "holder finished"], [hold])

#: Its forks hold in ``hold`` (the holder's ``hold`` file) until released or cancelled.
fan_holder = _agent("fan_holder", ["source ready", {"tool": "hold", "args": {"key": "f"}}, "fork done"], [hold])


@tool(requires_approval=True)
def transfer(amount: int) -> str:
    """Move money (a person approves each call)."""
    return f"moved {amount}"


approver = _agent("approver", [{"tool": "transfer", "args": {"amount": 5}}, "transfer settled"], [transfer])
