"""A process whose event loop died ends itself, so Ray reports it dead and its sessions move.

A Ray async actor's loop thread that a ``SystemExit`` ends leaves the process up answering nothing, which
the supervisor never restarts. :func:`guard_loop` sees the loop stop, lets the writes already submitted
land, and exits (docs/containment.md, "An actor whose event loop died anyway").
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
from concurrent.futures import Executor

from loomray.runtime.raylet_watch import DrainableExecutor

log = logging.getLogger("loomray.runtime.loop_guard")

#: How often the guard looks at the loop.
CHECK_S = 0.2
#: How long the writes under way may take to land once the loop is found dead.
DRAIN_S = 1.0
#: The exit status of a process whose loop died (what its worker log shows).
EXIT_STATUS = 70

#: Loops guarded in this process (a session actor starts its guard on its first run; a host on its first call).
_guarded: set[int] = set()
_guarded_lock = threading.Lock()


def guard_loop(loop: asyncio.AbstractEventLoop, executor: Executor | None = None) -> bool:
    """Exit this process once ``loop`` stops running, first waiting for ``executor``'s work under way (a
    :class:`DrainableExecutor`); False if already guarded."""
    with _guarded_lock:
        if id(loop) in _guarded:
            return False
        _guarded.add(id(loop))
    threading.Thread(target=_watch, args=(loop, executor), name="loomray-loop-guard", daemon=True).start()
    return True


def _watch(loop: asyncio.AbstractEventLoop, executor: Executor | None) -> None:
    while loop.is_running():
        time.sleep(CHECK_S)
    log.error("the event loop of this actor (pid %d) stopped; exiting so its sessions are restarted elsewhere",
              os.getpid())
    if isinstance(executor, DrainableExecutor):
        pending = executor.freeze()
        deadline = time.monotonic() + DRAIN_S
        while any(not f.done() for f in pending) and time.monotonic() < deadline:
            time.sleep(0.01)
    os._exit(EXIT_STATUS)
