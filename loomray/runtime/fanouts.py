"""Fan-outs: many sessions started together, a bounded number at once (the rest queue), with progress
counters the driver polls for ``on_fork_progress``, forgotten like a finished session."""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from loomray.runtime.actors import AgentSpec, Outcome
from loomray.session import RunRequest

#: How a fork can end, each counted in the progress (:attr:`Outcome.state`; "fenced" counts as failed).
ENDINGS = ("completed", "failed", "cancelled", "paused", "awaiting_approval", "budget_exceeded")

#: Fan-out ids for callers that pass none.
_fanout_ids = itertools.count(1)


def agent_specs(agents: Sequence[Any], extra_tools: Sequence[Any] = ()) -> AgentSpec | list[AgentSpec]:
    """What a fan-out's agents travel as: one spec when one agent runs every fork (and for none), else one
    per fork, each distinct agent pickled once (a fork of variants runs an agent of its own)."""
    by_id: dict[int, AgentSpec] = {}
    for a in agents:
        if id(a) not in by_id:
            by_id[id(a)] = AgentSpec.of(a, extra_tools)
    specs = [by_id[id(a)] for a in agents]
    return specs if len(by_id) > 1 else (specs[0] if specs else AgentSpec())


class Fanouts:
    """The supervisor's fan-outs in flight (and finished, until forgotten), by id."""

    def __init__(self) -> None:
        self._progress: dict[str, dict[str, Any]] = {}

    async def run(self, request_jsons: list[str], limit: int, fanout_id: str | None,
                  run_one: Callable[[str, RunRequest], Awaitable[Outcome]]) -> list[Outcome]:
        """``run_one`` for every request, at most ``limit`` at once; outcomes in request order.

        A request whose ``run_one`` raises ends ``failed`` with the error; the others go on.
        """
        gate = asyncio.Semaphore(limit)
        requests = [RunRequest.model_validate_json(r) for r in request_jsons]
        fanout_id = fanout_id or f"fanout-{next(_fanout_ids)}"
        progress: dict[str, Any] = {"fanout_id": fanout_id, "total": len(requests), "queued": len(requests),
                                    "running": 0, **dict.fromkeys(ENDINGS, 0), "max_running": 0, "limit": limit,
                                    "sessions": [r.session_id for r in requests], "finished_at": None}
        self._progress[fanout_id] = progress

        async def one(request_json: str, request: RunRequest) -> Outcome:
            async with gate:
                progress["queued"] -= 1
                progress["running"] += 1
                progress["max_running"] = max(progress["max_running"], progress["running"])
                try:
                    outcome = await run_one(request_json, request)
                except Exception as e:
                    outcome = Outcome(status="failed", error=f"{type(e).__name__}: {e}", error_type=type(e).__name__)
                finally:
                    progress["running"] -= 1
                progress[outcome.state if outcome.state in ENDINGS else "failed"] += 1
                return outcome

        try:
            return list(await asyncio.gather(*(one(j, r) for j, r in zip(request_jsons, requests, strict=False))))
        finally:
            progress["finished_at"] = time.monotonic()

    def progress(self, fanout_id: str) -> dict[str, Any] | None:
        """Progress of a fan-out: total, queued, running, one count per ending (completed, failed, cancelled,
        paused, awaiting_approval, budget_exceeded), max_running, limit; None if unknown."""
        p = self._progress.get(fanout_id)
        return None if p is None else {k: v for k, v in p.items() if k != "finished_at"} | {
            "done": p["finished_at"] is not None}

    def forget(self, older_than_s: float) -> None:
        """Drop fan-outs finished more than ``older_than_s`` ago."""
        now = time.monotonic()
        for fid in [f for f, p in self._progress.items()
                    if p["finished_at"] is not None and now - p["finished_at"] >= older_than_s]:
            del self._progress[fid]
