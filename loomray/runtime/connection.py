"""Joining Ray: the environment defaults, one ``connect`` and the store URL every node can use.

This module does not import Ray when it is imported: :func:`apply_ray_env_defaults`
must run before Ray's first import (Ray reads those variables once, then), so the
CLI, the demo and the test helpers call it from their module top and only then
import anything that imports Ray.
"""

from __future__ import annotations

import os
import threading
from typing import Any

#: The Ray namespace of every loomray actor (supervisor, session actors, hosts).
NAMESPACE = "loomray"

#: Environment defaults applied before Ray is imported (a variable already set wins).
RAY_ENV_DEFAULTS = {
    # Ray reads this once, when it is first imported, to decide whether to bind to the
    # host's address or to loopback: "0" keeps a local cluster on 127.0.0.1.
    "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
    "RAY_USAGE_STATS_ENABLED": "0",
}

#: Serialises connecting: runs gathered on a fresh runtime reach ``connect`` from several threads at once.
_CONNECT_LOCK = threading.Lock()


def apply_ray_env_defaults() -> None:
    """Set :data:`RAY_ENV_DEFAULTS` in ``os.environ`` where unset; call it before importing Ray."""
    for name, value in RAY_ENV_DEFAULTS.items():
        os.environ.setdefault(name, value)


def connect(address: str | None = None, *, logging_level: int | None = None) -> None:
    """Connect this process to Ray in the ``loomray`` namespace, if it is not connected yet (thread-safe).

    ``address`` goes to ``ray.init`` as given (default ``RAY_ADDRESS``, else a local Ray); worker logs stay off
    this process's output, and ``logging_level`` quiets Ray's own messages.
    """
    import ray  # here, not at the top: importing this module must not import Ray (see the module docstring)

    if ray.is_initialized():
        return
    # Ray's own default level unless asked: a runtime in a user's program keeps Ray's usual messages.
    options: dict[str, Any] = {} if logging_level is None else {"logging_level": logging_level}
    with _CONNECT_LOCK:
        if not ray.is_initialized():
            ray.init(address=address or os.environ.get("RAY_ADDRESS"), namespace=NAMESPACE,
                     log_to_driver=False, **options)


def normalize_store_url(url: str | os.PathLike[str]) -> str:
    """The store URL as every actor sees it: a plain path made absolute (actors have another cwd), a URL as is."""
    url = os.fspath(url)
    return url if "://" in url else os.path.abspath(url)
