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
        counter = _counter
    return f"{prefix}{ms:012x}{counter:04x}{os.urandom(5).hex()}"
