"""Helpers several agent tests share: a crash injected through ``emit``, and a ``lookup`` tool that counts calls.

``tool_calls`` is cleared before every test of this directory (``conftest.py``).
"""

from __future__ import annotations

import asyncio


class Crash(Exception):
    """Stands in for the process dying at a chosen point (raised from the emit callback)."""


def crash_at(event_type: str, nth: int = 1):
    """An ``emit`` callback that raises :class:`Crash` at the ``nth`` event of ``event_type``."""
    seen = {"n": 0}

    def emit(event):
        if event.type == event_type:
            seen["n"] += 1
            if seen["n"] == nth:
                raise Crash(f"{event_type} #{nth}")

    return emit


#: How often :func:`lookup` ran, by key.
tool_calls: dict[str, int] = {}


def lookup(key: str) -> str:
    """Look something up."""
    tool_calls[key] = tool_calls.get(key, 0) + 1
    return f"value of {key}"


class HookedCheckpoints:
    """A store whose checkpoint logs run each ``put(data, info)`` through ``hook(real_put, data, info)``: tests
    delay, gate or fail checkpoint writes with it; everything else is the wrapped store's."""

    def __init__(self, inner, hook):
        self._inner = inner
        self.checkpoints = _HookedLogs(inner.checkpoints, hook)

    def __getattr__(self, name):
        return getattr(self._inner, name)


class _HookedLogs:
    """``store.checkpoints`` whose logs run each ``put`` through the hook."""

    def __init__(self, inner, hook):
        self._inner = inner
        self._hook = hook

    def __getattr__(self, name):
        return getattr(self._inner, name)

    def log(self, lease, **kw):
        log = self._inner.log(lease, **kw)
        real = log.put
        log.put = lambda data, info: self._hook(real, data, info)
        return log


def paused_gate(pause_at: str = "k2"):
    """``(gate, paused, release)``: a tool ``gate(key)`` whose first call with ``pause_at`` sets ``paused`` and
    waits for ``release`` (a zombie frozen inside a tool while another incarnation takes over)."""
    paused, release = asyncio.Event(), asyncio.Event()
    calls: dict[str, int] = {}

    async def gate(key: str) -> str:
        """Look something up, slowly the first time for k2."""
        calls[key] = calls.get(key, 0) + 1
        if key == pause_at and calls[key] == 1:
            paused.set()
            await release.wait()
        return f"value of {key}"

    return gate, paused, release
