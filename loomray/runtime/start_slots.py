"""How many session actors (actor placement) are being constructed at once: a bound set by the cluster's CPUs.

Starting a session actor costs its node about half a second of CPU (Ray's
worker process, then loomray's imports and the store), and nothing of the
session happens until that is done. The raylet bounds how many worker
processes *start* at once (one per CPU), but not how many are importing and
constructing; a burst of forks (32 at once) then has every new process
competing for the same cores, and each one's start costs half as much again
as it would alone. The supervisor therefore lets at most
``STARTS_PER_CPU`` constructions per CPU of the nodes that can host
sessions run at once (at least ``MIN_STARTS``): enough to keep every core
busy, few enough that they do not thrash. On the bench's 2-core machine
32 forks with 8 standbys (24 new processes) went from 9.6 s and a 3.9 GB
peak unbounded to 8.9 s and 2.4 GB (one run each way).

A start holds its slot until its actor answered (or failed) or for
``SLOT_MAX_S`` at most: an actor waiting for resources (an autoscaler adding
a node) must not hold back the starts queued behind it.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import ray

from loomray.runtime.placement import eligible

#: Constructions in flight per CPU of the nodes that can host session actors ...
STARTS_PER_CPU = 2
#: ... and at least this many.
MIN_STARTS = 4
#: A start holds its slot at most this long.
SLOT_MAX_S = 10.0
#: How long the node list behind the bound is reused.
NODES_TTL_S = 10.0


def starts_allowed(nodes: list[dict[str, Any]], demand: dict[str, float]) -> int:
    """The bound for ``nodes`` (``ray.nodes()`` entries) and one session actor's ``demand``."""
    cpus = sum((node.get("Resources") or {}).get("CPU", 0.0) for node in nodes if eligible(node, demand))
    return max(MIN_STARTS, int(STARTS_PER_CPU * cpus))


class StartSlots:
    """At most :func:`starts_allowed` session actors under construction at once (one per supervisor)."""

    def __init__(self, nodes: Callable[[], list[dict[str, Any]]] = ray.nodes) -> None:
        self._nodes_of = nodes
        self._nodes: tuple[float, list[dict[str, Any]]] = (float("-inf"), [])
        self._busy = 0
        self._changed: asyncio.Condition | None = None
        #: Starts that had to wait for a slot (for status and tests).
        self.waited = 0

    def _limit(self, demand: dict[str, float]) -> int:
        at, nodes = self._nodes
        if time.monotonic() - at > NODES_TTL_S:
            try:
                nodes = self._nodes_of()
            except Exception:  # GCS briefly unreachable: keep the last list
                pass
            self._nodes = (time.monotonic(), nodes)
        return starts_allowed(nodes, demand)

    @property
    def busy(self) -> int:
        return self._busy

    @contextlib.asynccontextmanager
    async def slot(self, demand: dict[str, float]) -> AsyncIterator[None]:
        """Hold one slot for the body (a session actor's creation until it answered)."""
        if self._changed is None:
            self._changed = asyncio.Condition()
        changed = self._changed
        async with changed:
            if self._busy >= self._limit(demand):
                self.waited += 1
                await changed.wait_for(lambda: self._busy < self._limit(demand))
            self._busy += 1
        try:
            yield
        finally:
            async with changed:
                self._busy -= 1
                changed.notify_all()


async def constructed(handle: Any, timeout: float = SLOT_MAX_S) -> None:
    """Wait until the actor ``handle`` answered (its constructor ran), failed, or ``timeout`` passed.

    Never raises: whoever started the actor learns its fate from its own call.
    """
    ref = handle.info.remote()
    with contextlib.suppress(Exception):
        await asyncio.wait_for(ref, timeout)
