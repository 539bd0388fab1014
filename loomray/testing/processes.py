"""The processes a test started, found and reaped by ``(pid, start time)`` (Linux ``/proc``; nothing elsewhere).

The start time makes a process's identity safe against pid reuse: a helper
must never signal a process some other user started after ours exited.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import warnings

from loomray.testing.waiting import wait_for

#: A process as ``(pid, start time in clock ticks since boot)``.
Process = tuple[int, int]


def pid_alive(pid: int) -> bool:
    """True while a process with ``pid`` exists (signal 0 probes without touching it)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _proc_stat(pid: int) -> list[bytes] | None:
    """Fields 3.. of /proc/PID/stat (state, ppid, ...), or None if the process is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            # The command name (field 2) may contain spaces and parentheses.
            return f.read().rsplit(b")", 1)[1].split()
    except (OSError, IndexError):
        return None


def descendants(root: int) -> set[Process]:
    """``(pid, start_time)`` of every live descendant of process ``root`` (empty where there is no /proc)."""
    children: dict[int, list[Process]] = {}
    try:
        entries = os.listdir("/proc")
    except OSError:
        return set()
    for entry in entries:
        if not entry.isdigit():
            continue
        fields = _proc_stat(int(entry))
        if fields is None:
            continue
        # fields[1] is the parent pid, fields[19] the start time (stat fields 4 and 22).
        children.setdefault(int(fields[1]), []).append((int(entry), int(fields[19])))
    found: set[Process] = set()
    stack = [root]
    while stack:
        for child in children.get(stack.pop(), ()):
            if child not in found:
                found.add(child)
                stack.append(child[0])
    return found


def process_alive(proc: Process) -> bool:
    """True while ``proc`` runs: a zombie has exited (it only waits for its parent), another start time is
    another process."""
    fields = _proc_stat(proc[0])
    return fields is not None and fields[0] != b"Z" and int(fields[19]) == proc[1]


def reap(procs: set[Process], grace: float = 10.0) -> list[int]:
    """Wait for ``procs`` to exit; SIGKILL, report (a warning) and return the pids of any that outlive ``grace``."""
    try:
        wait_for(lambda: not any(process_alive(p) for p in procs), timeout=grace, interval=0.1,
                 what="cluster processes to exit")
        return []
    except TimeoutError:
        pass
    left = sorted(p for p in procs if process_alive(p))
    for pid, _ in left:
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)
    if left:
        warnings.warn(f"local_cluster: killed {len(left)} leftover process(es) after shutdown: {[p for p, _ in left]}",
                      RuntimeWarning, stacklevel=3)
    return [p for p, _ in left]


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (for a server a test starts)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
