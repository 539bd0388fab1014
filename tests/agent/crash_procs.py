"""``crash_child.py`` runs as real processes, forked (``tests/forked.py``) rather than started from scratch.

A crash test starts dozens of children (two per kill point); each used to be ``python crash_child.py ...``,
half a second of interpreter start and imports before a run of a tenth of that. Forked, each is still
a process of its own with the environment it is given, and it still dies by a real SIGKILL
(``returncode == -9``).
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import forked


def run_child(argv: list[str], env: dict[str, str], log: Path, *, timeout: float = 120) -> subprocess.CompletedProcess:
    """``python crash_child.py ARGV...`` with environment ``env``; its stdout and stderr together go to ``log``
    and come back as ``stdout`` and ``stderr``."""
    import crash_child

    return forked.run(crash_child.forked_main, (list(argv),), env=env, cwd=os.getcwd(), log=log, timeout=timeout,
                      script_dir=Path(crash_child.__file__).parent, name="crash_child.py")
