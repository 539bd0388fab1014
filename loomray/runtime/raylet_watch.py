"""Node loss seen from inside a worker: stop the runs and exit before the node is declared dead.

A Ray worker outlives its killed raylet by about two seconds and would keep
calling models and tools meanwhile; once the node is declared dead, a new
incarnation repeats whatever such a zombie did and had not journaled. Session
actors and session hosts therefore watch their raylet (:func:`watch_raylet`)
and run every store write and sync tool through a :class:`DrainableExecutor`
that stops taking work the moment the raylet is gone.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

log = logging.getLogger("loomray.runtime.raylet_watch")

#: Set once this process's raylet is gone: its runs were stopped and it is exiting.
_node_lost = False


def node_lost() -> bool:
    """True once :func:`watch_raylet` found this process's raylet gone.

    A run stopped for that reason ends "cancelled", and that outcome must
    never reach the supervisor (it would finish the session instead of
    restarting it elsewhere): ``run()`` then never answers, and the caller
    sees the actor die.
    """
    return _node_lost


def raylet_pid() -> int | None:
    """The pid of the raylet that started this worker process (its parent), or None if the parent is not one."""
    ppid = os.getppid()
    try:
        with open(f"/proc/{ppid}/comm") as f:
            return ppid if f.read().strip() == "raylet" else None
    except OSError:
        return None  # no /proc (not Linux): rely on Ray's own detection


class DrainableExecutor(ThreadPoolExecutor):
    """The default executor of a host or session actor; on node loss it takes no more work and drains.

    Every store write and sync tool of the process runs here (``asyncio.to_thread``).
    After :meth:`freeze`, a new submission gets a future that never completes (its
    caller is being stopped anyway) while the work already submitted runs to the end.
    """

    def __init__(self, max_workers: int | None = None, thread_name_prefix: str = "loomray") -> None:
        super().__init__(max_workers=max_workers, thread_name_prefix=thread_name_prefix)
        self._frozen = False
        self._inflight: set[Future] = set()
        self._inflight_lock = threading.Lock()

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Future:
        if self._frozen:
            return Future()
        future = super().submit(fn, *args, **kwargs)
        with self._inflight_lock:
            self._inflight.add(future)
        future.add_done_callback(self._settled)
        return future

    def _settled(self, future: Future) -> None:
        with self._inflight_lock:
            self._inflight.discard(future)

    def freeze(self) -> list[Future]:
        """Take no more work; return the work already submitted (to wait for)."""
        self._frozen = True
        with self._inflight_lock:
            return list(self._inflight)


async def watch_raylet(tasks: Callable[[], list[asyncio.Task]], executor: DrainableExecutor | None = None,
                       interval: float = 0.05, drain_s: float = 1.0) -> None:
    """Stop the runs of this process and exit as soon as its raylet is gone (its node is lost).

    A worker outlives a killed raylet by ~2 s and would keep calling models
    and tools meanwhile; once the node is declared dead, a new incarnation
    repeats whatever such a zombie did and had not journaled. The parent pid
    changes the moment the raylet dies, about a second before the node is
    declared dead (tuned detection; far more by default), so: freeze the
    process's executor (``executor``, else a :class:`DrainableExecutor`
    installed here as the loop's default) so no new write or tool starts;
    cancel every run (``tasks()``) so none starts another model call; let the
    writes already submitted land, for up to ``drain_s`` (a step whose model
    call returned is journaled, and the new incarnation replays it); exit. A
    raylet that is only frozen or partitioned is not detected here; fencing
    covers that case.
    """
    global _node_lost
    pid = raylet_pid()
    if pid is None:
        return
    if executor is None:
        executor = DrainableExecutor()
        asyncio.get_running_loop().set_default_executor(executor)
    while os.getppid() == pid:
        await asyncio.sleep(interval)
    _node_lost = True
    log.warning("raylet %d is gone; stopping every session here and exiting (no zombie runs)", pid)
    pending = executor.freeze()
    for t in tasks():
        if not t.done():
            t.cancel()
    deadline = time.monotonic() + drain_s
    while any(not f.done() for f in pending) and time.monotonic() < deadline:
        await asyncio.sleep(0.01)
    os._exit(1)
