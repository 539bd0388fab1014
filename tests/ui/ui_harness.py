"""Helpers of the session-browser tests (a module of its own: ``conftest`` is a name every test folder uses)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import ui_agents

from loomray.cli.runs import bind
from loomray.runtime import LocalRuntime


def bound(store_url: str, name: str) -> Any:
    """``ui_agents.NAME`` on the in-process runtime, remembering its reference (so the UI can resume it)."""
    return bind(getattr(ui_agents, name), f"ui_agents:{name}", LocalRuntime(store_url))


def wait_for(check: Callable[[], Any], what: str, timeout: float = 30.0) -> Any:
    """Poll ``check`` until it returns something truthy; fail after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = check()
        if got:
            return got
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")
