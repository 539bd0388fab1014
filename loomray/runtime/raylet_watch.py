"""Node loss seen from inside a worker: stop the runs and exit before the node is declared dead.

A worker outlives its killed raylet for a moment and would keep calling models and tools, which a new
incarnation then repeats; so it watches its raylet and freezes its executor but for the runs' own writes
(docs/ray-notes.md, "Zombies at 100 sessions per process").
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

from loomray.journal import answers_recording
from loomray.run_writes import STORE_WRITE

log = logging.getLogger("loomray.runtime.raylet_watch")

#: Set once this process's raylet is gone: its runs were stopped and it is exiting.
_node_lost = False


def node_lost() -> bool:
    """True once :func:`watch_raylet` found this process's raylet gone: ``run()`` must then never answer (its
    "cancelled" outcome would finish the session instead of restarting it elsewhere)."""
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
    """The default executor of a host or session actor; on node loss it takes no new work but a run's writes.

    Every store write and sync tool of the process runs here (``asyncio.to_thread``).
    After :meth:`freeze`, a new submission gets a future that never completes (its caller is being stopped),
    except a run's store write (:data:`~loomray.run_writes.STORE_WRITE`, fenced by its lease).
    """

    def __init__(self, max_workers: int | None = None, thread_name_prefix: str = "loomray") -> None:
        super().__init__(max_workers=max_workers, thread_name_prefix=thread_name_prefix)
        self._frozen = False
        self._inflight: set[Future] = set()
        self._inflight_lock = threading.Lock()

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Future:
        if self._frozen and not STORE_WRITE.get():
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
        """Take no more work but a run's store writes; return the work already submitted (to wait for)."""
        self._frozen = True
        return self.under_way()

    def under_way(self) -> list[Future]:
        """The work submitted and not finished."""
        with self._inflight_lock:
            return list(self._inflight)


async def watch_raylet(tasks: Callable[[], list[asyncio.Task]], executor: DrainableExecutor | None = None,
                       interval: float = 0.05, drain_s: float = 2.0) -> None:
    """Stop the runs of this process and exit as soon as its raylet is gone (its parent pid changes).

    ``executor`` is the process's default executor, else one is installed here. A raylet that is only
    frozen or partitioned is not detected; fencing covers that case.
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
    await stop_runs(tasks(), executor, drain_s)
    os._exit(1)


async def stop_runs(tasks: list[asyncio.Task], executor: DrainableExecutor, drain_s: float) -> None:
    """Stop ``tasks`` (the runs of a process whose node is lost) so none starts another model call or tool,
    and let what they already did become durable, for up to ``drain_s``.

    The executor is frozen first; a run's store writes still go through, so a model answer that already
    arrived is journaled (:func:`~loomray.journal.answers_recording`) and not billed again.
    """
    executor.freeze()
    for t in tasks:
        if not t.done():
            t.cancel()
    deadline = time.monotonic() + drain_s
    await asyncio.sleep(0)  # the cancelled runs see their cancel (and start their last records) first
    while (answers_recording() or any(not f.done() for f in executor.under_way())) and time.monotonic() < deadline:
        await asyncio.sleep(0.01)
