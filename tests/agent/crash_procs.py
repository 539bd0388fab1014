"""Start ``crash_child.py`` runs as real processes without paying for Python and loomray's imports each time.

A crash test starts dozens of children (two per kill point); each used to be ``python crash_child.py ...``,
half a second of interpreter start and imports before the run itself. Here they are forked from a
multiprocessing *forkserver* that imported loomray once: each child is still a
separate process with its own memory, store clients and event loop, it still dies by a real SIGKILL
(``returncode == -9``), and it sees exactly the environment it is given (``os.environ`` is replaced, as
``subprocess.run(env=...)`` would), which loomray reads only at call time. The forkserver starts on first
use and exits with the test process. It preloads what ``crash_child`` imports, not ``crash_child`` itself
(Python 3.11's forkserver does not take this process's ``sys.path``, where this directory is): each child
imports that small module itself, in milliseconds.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import subprocess
from pathlib import Path

_FORKS = multiprocessing.get_context("forkserver")
_FORKS.set_forkserver_preload(["loomray", "loomray.models", "loomray.runtime", "storage"])


def run_child(argv: list[str], env: dict[str, str], log: Path, *, timeout: float = 120) -> subprocess.CompletedProcess:
    """``crash_child.py ARGV...`` with environment ``env`` in a forked process; its output (stdout and stderr
    together) goes to ``log`` and is returned as ``stderr``; ``returncode`` is negative for a signal."""
    import crash_child

    proc = _FORKS.Process(target=crash_child.forked_main, args=(argv, env, str(log)))
    proc.start()
    proc.join(timeout)
    if proc.exitcode is None:  # hung: end it the way subprocess.run's timeout would, then say so
        os.kill(proc.pid, signal.SIGKILL)
        proc.join()
        raise subprocess.TimeoutExpired(["crash_child.py", *argv], timeout)
    text = log.read_text() if log.exists() else ""
    return subprocess.CompletedProcess(["crash_child.py", *argv], proc.exitcode, stdout=text, stderr=text)
