"""What the steering tests share: tools that record their effects, and a tool that blocks until released.

Used by tests/agent/test_agent_control.py (the API) and tests/cli/test_cli_control.py
(the same steering through ``loomray``'s commands). A test module that imports
:func:`reset_effects` gets it as an autouse fixture: :data:`effects` starts empty
in every test.
"""

from __future__ import annotations

import asyncio
import threading

import pytest

from loomray import tool

DEADLINE_S = 60.0

#: What the tools did, in order (a tool that runs twice shows twice).
effects: list[str] = []


@pytest.fixture(autouse=True)
def reset_effects():
    effects.clear()


def lookup(key: str) -> str:
    """Look something up."""
    effects.append(key)
    return f"value of {key}"


@tool(requires_approval=True)
def transfer(amount: int) -> str:
    """Move money."""
    effects.append(f"transfer-{amount}")
    return f"moved {amount}"


def user_texts(messages) -> list[str]:
    return [m.content for m in messages if m.role == "user"]


class Gate:
    """A tool that blocks until released: ``started`` is set once it runs (async or sync flavour)."""

    def __init__(self) -> None:
        self.started = threading.Event()
        self.release = threading.Event()
        self.finished = threading.Event()
        self.cancelled = False

    def async_tool(self):
        gate = self

        async def slow(key: str) -> str:
            """Take a while."""
            gate.started.set()
            try:
                while not gate.release.is_set():
                    await asyncio.sleep(0.005)
            except asyncio.CancelledError:
                gate.cancelled = True
                raise
            effects.append(f"slow-{key}")
            gate.finished.set()
            return f"slow {key}"

        return slow

    def sync_tool(self):
        gate = self

        def slow(key: str) -> str:
            """Take a while (in a worker thread)."""
            gate.started.set()
            gate.release.wait(DEADLINE_S)
            effects.append(f"slow-{key}")
            gate.finished.set()
            return f"slow {key}"

        return slow

    async def wait_started(self) -> None:
        assert await asyncio.to_thread(self.started.wait, DEADLINE_S), "the tool never started"
