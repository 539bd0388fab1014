"""The agent of ``loomray demo``: an offline research assistant whose every model call is logged.

:func:`build_agent` makes the demo's agent with its pace (seconds per model
call and per page fetch) and a call log shared by every process, so the demo
can prove that no model call was repeated across a node's death.
``research_agent`` is the same agent without delays, built on first use, and
importable by reference (:data:`RESEARCH_AGENT_REF`): sessions the demo
leaves in a store keep that reference, so ``loomray resume`` and ``loomray
fork`` on them find their agent.
"""

from __future__ import annotations

import asyncio
import os
from dataclasses import dataclass
from typing import Any

from loomray.agent import Agent
from loomray.config import Tuning
from loomray.models.base import ModelRequest, ModelResponse
from loomray.models.research import fetch_page as research_fetch_page
from loomray.models.research import search as research_search
from loomray.models.research import take_note as research_take_note
from loomray.models.resolve import resolve_model
from loomray.tools import Tool, tool

INSTRUCTIONS = (
    "You are a careful research assistant. Work in rounds: search, read the most relevant page with "
    "fetch_page, and keep a note with take_note; one tool call per turn. After at least six rounds, "
    "write a final report that cites your notes."
)
#: Passes of the offline research model (``make demo``); ``--fast`` uses fewer.
DEMO_PASSES = 14
#: The importable name of :data:`research_agent`, kept in the rows of the sessions the demo runs.
RESEARCH_AGENT_REF = "loomray.cli.demo_agent:research_agent"


@dataclass(frozen=True)
class Pace:
    """How slow the demo runs, so a person can follow it."""

    passes: int
    model_s: float
    fetch_s: float
    kill_after: int  # model calls before the node is killed (during the next fetch_page)

    @classmethod
    def choose(cls, fast: bool, passes: int | None) -> Pace:
        # The kill lands during a fetch_page; the work left after it must outlast the ~2 s that a
        # SIGKILLed node's orphaned worker process lives on (docs/ray-notes.md), or that orphan
        # finishes the run itself before the supervisor even notices the node is gone.
        if fast:
            p = passes or 9
            return cls(passes=p, model_s=0.25, fetch_s=0.8, kill_after=2)
        p = passes or DEMO_PASSES
        return cls(passes=p, model_s=1.5, fetch_s=2.0, kill_after=max(2, p // 2))


def append_line(path: str, line: str) -> None:
    """Append ``line`` to the call log at ``path``: one short O_APPEND write, atomic across processes on one machine."""
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, (line + "\n").encode())
    finally:
        os.close(fd)


class CountingModel:
    """Wraps a model; appends one line per *completed* call to a log shared by every process.

    The line names the reply index (assistant turns already in the
    transcript) and the process, so "no model call repeated" can be checked
    across actors and nodes: a replayed step never reaches this method.
    """

    def __init__(self, inner: Any, log_path: str) -> None:
        self.inner = inner
        self.name = inner.name
        self.log_path = log_path

    async def complete(self, request: ModelRequest) -> ModelResponse:
        response = await self.inner.complete(request)
        index = sum(1 for m in request.messages if m.role == "assistant")
        append_line(self.log_path, f"model {index} {os.getpid()}")
        return response


def demo_tools(fetch_s: float = 0.0, log_path: str | None = None) -> list[Tool]:
    """The research tools; ``fetch_page`` takes ``fetch_s`` (a slow network) and logs when it starts."""

    async def fetch_page(url: str, max_kb: float = 3.0) -> str:
        """Fetch a page of the offline corpus as text.

        Args:
            url: the page address, from a search result.
            max_kb: how much text to return, in KB.
        """
        if log_path:
            append_line(log_path, f"fetch {os.getpid()}")
        await asyncio.sleep(fetch_s)
        return research_fetch_page(url, max_kb)

    return [tool(research_search), tool(fetch_page), tool(research_take_note)]


def build_agent(model: str, *, pace: Pace | None = None, log_path: str | None = None) -> Agent:
    """The demo's research agent; ``demo:*`` models get ``pace``, real ones are used as they are."""
    pace = pace or Pace(passes=DEMO_PASSES, model_s=0.0, fetch_s=0.0, kill_after=0)
    if model.startswith("demo:"):
        inner = resolve_model(model, passes=pace.passes, delay=pace.model_s)
    else:
        inner = resolve_model(model)
    wrapped = CountingModel(inner, log_path) if log_path else inner
    return Agent(INSTRUCTIONS, model=wrapped, tools=demo_tools(pace.fetch_s, log_path),
                 tuning=Tuning(checkpoint=True, max_turns=60), name="demo-research")


def __getattr__(name: str) -> Agent:
    """``research_agent``: the offline demo agent without delays, built on first use and then kept."""
    if name == "research_agent":
        agent = globals()["research_agent"] = build_agent("demo:research")
        return agent
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
