"""Child processes that skip the interpreter start and loomray's imports: forked from a server that did both once.

The suite starts ~180 short children (the crash points' ``crash_child.py`` runs, the store-side
``loomray`` commands); each used to spend half a second or more of a 2-core machine starting Python
and importing loomray and storage (pyarrow, pydantic) before work of a tenth of that. Here they are
forked from a multiprocessing *forkserver* that imported ``loomray`` and ``storage`` once -- exactly
what each of those children imports first anyway (``loomray.cli`` is a subpackage of ``loomray``).
Anything else (``loomray.cli``, click, rich, the child script) each child imports itself, after it
has taken its environment, so import-time reads of the environment see the child's own.

Each child is still a process of its own: its own memory, store clients and event loop; it is given
its whole environment (``os.environ`` is replaced, as ``subprocess.run(env=...)`` would), its working
directory, argv, and the ``sys.path`` a fresh interpreter would have (the script's directory, then
the environment's ``PYTHONPATH``, then the interpreter's own); stdin is /dev/null; stdout and stderr go to files the parent reads back; it ends
with ``sys.exit``'s code, or dies by a real signal (``returncode == -9`` after SIGKILL); exit handlers
run as at a normal interpreter exit. loomray and storage read the environment only at call time.
One child runs at a time (``_ONE_AT_A_TIME``): with two test threads starting and joining children
at once, the forkserver once reported a child that had exited as 255 ("it could not tell"), the
failure CPython's issue #140867 describes for a forkserver under concurrent load.

The forkserver starts when this module is imported (at collection), before any test starts a Ray
cluster whose teardown would take it for one of the cluster's processes; it exits with the test process.
"""

from __future__ import annotations

import atexit
import json
import multiprocessing
import os
import signal
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable
from multiprocessing import forkserver
from pathlib import Path
from typing import Any

_FORKS = multiprocessing.get_context("forkserver")
# Not this directory's modules: Python 3.11's forkserver does not take the parent's sys.path (only its
# environment's PYTHONPATH), so each child imports a test module itself, from the sys.path it is given.
_FORKS.set_forkserver_preload(["loomray", "storage"])
_ONE_AT_A_TIME = threading.Lock()
#: A fresh interpreter's own sys.path entries (stdlib, site-packages, .pth files), without PYTHONPATH's.
_OWN_PATH: list[str] = []
# Only in the test process: a child imports this module too, to unpickle what it runs (it is "inheriting").
if multiprocessing.parent_process() is None and not getattr(multiprocessing.current_process(), "_inheriting", False):
    forkserver.ensure_running()
    _OWN_PATH = json.loads(subprocess.run(
        [sys.executable, "-c", "import json, sys; print(json.dumps(sys.path[1:]))"], capture_output=True, text=True,
        check=True, cwd="/", env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"}).stdout)


def run(target: Callable[..., Any], args: tuple, *, env: dict[str, str], cwd: Path | str, log: Path,
        script_dir: Path | str, err_log: Path | None = None, timeout: float = 120,
        name: str = "child") -> subprocess.CompletedProcess:
    """``target(*args)`` in a forked child with ``env`` and ``cwd``, as a script in ``script_dir`` would run;
    its stdout goes to ``log`` and its stderr to ``err_log`` (default: ``log`` too); both come back as text
    in the CompletedProcess."""
    err_log = err_log or log
    added = [os.path.abspath(p) for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    path = [str(script_dir), *added, *_OWN_PATH]
    with _ONE_AT_A_TIME:
        proc = _FORKS.Process(target=_child, args=(target, args, dict(env), str(cwd), str(log), str(err_log), path))
        proc.start()
        proc.join(timeout)
        if proc.exitcode is None:  # hung: end it as subprocess.run's timeout would, then say so
            os.kill(proc.pid, signal.SIGKILL)
            proc.join()
            raise subprocess.TimeoutExpired([name, *map(str, args)], timeout)
    out = log.read_text() if log.exists() else ""
    err = out if err_log == log else (err_log.read_text() if err_log.exists() else "")
    return subprocess.CompletedProcess([name], proc.exitcode, stdout=out, stderr=err)


def _child(target: Callable[..., Any], args: tuple, env: dict[str, str], cwd: str, log: str, err_log: str,
           path: list[str]) -> None:
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    out = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    err = out if err_log == log else os.open(err_log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(out, 1)
    os.dup2(err, 2)
    for fd in {out, err}:
        os.close(fd)
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    sys.path[:] = path  # (multiprocessing gave the child this process's sys.path to unpickle ``target`` with)
    try:
        target(*args)
    finally:
        atexit._run_exitfuncs()  # as at interpreter exit (multiprocessing's children skip them)


def loomray_main(argv: list[str]) -> None:
    """What the ``loomray`` console script does with ``argv`` (``sys.exit(main())``)."""
    from loomray.cli.main import main

    sys.argv = ["loomray", *argv]
    sys.exit(main())


def run_loomray(argv: list[str], *, env: dict[str, str], cwd: Path | str,
                timeout: float = 90) -> subprocess.CompletedProcess:
    """``loomray ARGV...`` as a forked child (see the module docstring): stdout and stderr apart, as text,
    like ``subprocess.run([loomray, *argv], capture_output=True, text=True, ...)``."""
    with tempfile.TemporaryDirectory(prefix="loomray-cli-") as tmp:
        done = run(loomray_main, (list(argv),), env=env, cwd=cwd, log=Path(tmp) / "out", err_log=Path(tmp) / "err",
                   script_dir=Path(sys.executable).parent, timeout=timeout, name="loomray")
    done.args = ["loomray", *argv]
    return done
