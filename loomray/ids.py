"""Identifiers: ``new_id(prefix)`` returns a time-sortable, unique id.

The suffix is 12 hex digits of milliseconds since the epoch, a 4-hex-digit
monotonic counter (so ids made in the same millisecond by one process still
sort in creation order), then 10 random hex digits. Lexicographic order is
creation order within a process and millisecond order across processes.
"""

from __future__ import annotations

import os
import threading
import time

_lock = threading.Lock()
_last_ms = 0
_counter = 0


def new_id(prefix: str) -> str:
    """Return ``prefix`` followed by a lexicographically time-sortable unique suffix."""
    ms, counter = _tick()
    return f"{prefix}{ms:012x}{counter:04x}{os.urandom(5).hex()}"


def new_segment() -> str:
    """A checkpoint id segment: ``ckpt``, then 12 hex digits of milliseconds, the 4-digit counter and 4 random
    hex digits. :func:`segment_id` appends a 6-hex-digit link number, so a segment's ids have the length and
    the order of :func:`new_id`'s, and consecutive links are one range in a checkpoint chain."""
    ms, counter = _tick()
    return f"ckpt{ms:012x}{counter:04x}{os.urandom(2).hex()}"


def segment_id(segment: str, link: int) -> str:
    """The id of link ``link`` (0 to 2**24 - 1) of ``segment``."""
    if not 0 <= link < 1 << 24:
        raise ValueError(f"link number must be in [0, 2**24), got {link!r}")
    return f"{segment}{link:06x}"


def _tick() -> tuple[int, int]:
    """(milliseconds, counter): strictly increasing within this process."""
    global _last_ms, _counter
    with _lock:
        ms = time.time_ns() // 1_000_000
        if ms <= _last_ms:
            ms = _last_ms
            _counter += 1
            if _counter > 0xFFFF:
                ms += 1
                _counter = 0
        else:
            _counter = 0
        _last_ms = ms
        return ms, _counter
