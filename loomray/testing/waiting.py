"""Polling with a deadline: what tests wait with instead of sleeping."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def wait_for(predicate: Callable[[], T], *, timeout: float, interval: float = 0.05, what: str = "condition") -> T:
    """Poll ``predicate`` until it returns a truthy value; return that value.

    Raises ``TimeoutError`` naming ``what`` when ``timeout`` seconds pass first.
    Exceptions raised by ``predicate`` propagate (they are not retried).
    """
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise TimeoutError(f"timed out after {timeout:.1f}s waiting for {what}")
        time.sleep(interval)
