"""Backoff between retries (exponential, full jitter) and the clock time budgets are measured with.

Lease acquires retry a lost swap and readers LIST again while writers keep
changing what they list; both wait ``uniform(0, min(CAP, BASE * 2**attempt))``
seconds and give up once a wait would pass their deadline. ``sleep`` and
``clock`` are looked up here at every call, so tests record the waits or move
time instead of waiting.
"""

from __future__ import annotations

import random
import time

BASE = 0.005
CAP = 0.5
sleep = time.sleep
clock = time.monotonic


def jittered(attempt: int) -> float:
    """A random delay for retry number ``attempt``: full jitter under an exponential cap."""
    return random.uniform(0, min(CAP, BASE * 2 ** attempt))


def wait(attempt: int, deadline: float) -> bool:
    """Sleep before retry ``attempt``; False (without sleeping) when the delay would pass ``deadline``."""
    delay = jittered(attempt)
    if clock() + delay > deadline:
        return False
    sleep(delay)
    return True
