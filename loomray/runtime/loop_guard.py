"""A process whose event loop died ends itself, so Ray reports it dead and its sessions move.

A Ray async actor runs its event loop in a thread of its own. When a
``SystemExit`` or ``KeyboardInterrupt`` escapes a task or a callback on that
loop, ``run_forever`` returns, the thread ends (silently: ``threading`` ignores
``SystemExit``), and the process stays up answering nothing: every session on
it is ``running`` forever, a driver's ``run`` never returns and the supervisor,
which only learns of dead processes, never restarts them.

Tools and runs are contained (:func:`loomray.tools.run_tool_call`,
``SessionActor._execute``); for whatever else may end the loop, session
actors and session hosts start :func:`guard_loop`: a daemon thread that sees
the loop stop, lets the store writes already submitted land, and exits the
process. To the supervisor that is a lost process, like a lost node: its
sessions are restarted from the store, their journaled model calls answered
from the journal.
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
    """Exit this process once ``loop`` stops running (see the module docstring); False if already guarded.

    ``executor`` is the loop's default executor when it is a
    :class:`DrainableExecutor`: its work under way is waited for before the exit.
    """
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
