"""Reaching a Ray cluster from the command line: its address, joining it, and actor results.

Ray itself is imported only inside the functions that need it, so the
store-side commands and ``loomray --help`` never import it.
"""

from __future__ import annotations

import logging
import os
import socket
import sys
import threading
from typing import Any

import click

from loomray.cli.common import CliError, actor_error
from loomray.runtime.connection import connect

#: ``--placement``: how the cluster hosts the sessions a command starts (see RayRuntime).
placement_option = click.option(
    "--placement", type=click.Choice(["actor", "dense"]), default="actor", show_default=True,
    envvar="LOOMRAY_PLACEMENT",
    help="actor: one Ray actor (process) per session; dense: many sessions per host actor. Env: LOOMRAY_PLACEMENT.")


def reachable(address: str, timeout: float = 3.0) -> bool:
    """Whether something listens at ``host:port`` (so ``ray.init`` will not hang on a dead address)."""
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        return True  # "auto", "ray://..." and friends: let Ray decide
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout):
            return True
    except OSError:
        return False


def require_address(address: str | None) -> str:
    """The cluster address, or one clear line saying how to get one."""
    if not address:
        raise CliError("no Ray cluster given: pass --address HOST:PORT or set RAY_ADDRESS "
                       "(cluster/local.sh start prints one)")
    if not reachable(address):
        raise CliError(f"no Ray cluster answers at {address!r}")
    return address


def join_cluster(address: str) -> None:
    """Join the cluster quietly (Ray's INFO lines would drown the command's output)."""
    connect(address, logging_level=logging.WARNING)


def leave_cluster(timeout_s: float = 15.0) -> None:
    """Disconnect this driver; when Ray does not let go within ``timeout_s``, exit the process anyway.

    Used where a foreground command ends on Ctrl-C: what it started on the cluster is detached and keeps
    running, so nothing is lost by not waiting for the driver's own teardown, which on a loaded machine
    has been seen to hang at interpreter exit.
    """
    import ray  # heavy: only the commands that talk to a cluster import it

    shutdown = threading.Thread(target=ray.shutdown, name="loomray-leave-cluster", daemon=True)
    shutdown.start()
    shutdown.join(timeout_s)
    if shutdown.is_alive():
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


def ray_get(ref: Any, timeout: float | None = None) -> Any:
    """``ray.get`` that re-raises an actor method's own exception (not Ray's multi-line wrapper)."""
    import ray  # heavy: only the commands that talk to a cluster import it

    try:
        return ray.get(ref, timeout=timeout)
    except ray.exceptions.RayTaskError as e:
        raise actor_error(e) from None
