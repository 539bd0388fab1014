"""Activations placed on one host together travel in one host call (``SessionHost.activate_many``).

One Ray call per activation would make a host deserialize the same config and agent once per session of a
fan-out. Each caller still gets its own answer (its activation's info, or its own error), so placement's
rules are unchanged.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

from loomray.errors import SessionStartError

#: How long an activation waits for others bound to the same host before its call leaves.
BATCH_WINDOW_S = 0.005


@dataclass
class _Batch:
    handle: Any
    config: Any
    agent: Any
    events_to: Any
    requests: list[str] = field(default_factory=list)
    waiters: list[asyncio.Future[dict[str, Any]]] = field(default_factory=list)


class ActivationBatcher:
    """Queues activations per host (and config, agent, event target) and sends each queue as one call."""

    def __init__(self, window_s: float = BATCH_WINDOW_S) -> None:
        self._window_s = window_s
        self._open: dict[tuple[str, int, int, int], _Batch] = {}
        self._sending: set[asyncio.Task[None]] = set()

    async def activate(self, host_name: str, handle: Any, config: Any, agent: Any, request_json: str,
                       events_to: Any) -> dict[str, Any]:
        """Activate ``request_json`` on the host, in one call with the others queued for it meanwhile; raises
        what a single ``activate`` call would."""
        loop = asyncio.get_running_loop()
        # By identity: a fan-out's sessions share one config and agent object (a batch keeps them alive).
        key = (host_name, id(config), id(agent), id(events_to))
        batch = self._open.get(key)
        if batch is None:
            batch = self._open[key] = _Batch(handle, config, agent, events_to)
            loop.call_later(self._window_s, self._send, key)
        waiter: asyncio.Future[dict[str, Any]] = loop.create_future()
        batch.requests.append(request_json)
        batch.waiters.append(waiter)
        return await waiter

    def _send(self, key: tuple[str, int, int, int]) -> None:
        batch = self._open.pop(key)
        task = asyncio.get_running_loop().create_task(self._call(batch))
        self._sending.add(task)  # held until done: the loop keeps only weak references to tasks
        task.add_done_callback(self._sending.discard)

    async def _call(self, batch: _Batch) -> None:
        try:
            answers = await batch.handle.activate_many.remote(batch.config, batch.agent, batch.requests,
                                                              batch.events_to)
        except BaseException as e:  # the call failed as a whole: every session in it sees the error
            for w in batch.waiters:
                if not w.done():
                    w.set_exception(e)
            if not isinstance(e, Exception):
                raise
            return
        for w, answer in zip(batch.waiters, answers, strict=True):
            if w.done():
                continue
            if "error" in answer:
                w.set_exception(SessionStartError(answer["error"]))
            else:
                w.set_result(answer["info"])
