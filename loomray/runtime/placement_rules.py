"""The pure rules of dense placement: a host's options and demand, how many hosts a node gets, which host a
session goes to. No Ray calls here (see :mod:`loomray.runtime.placement` for the pool that applies them).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field
from typing import Any

from loomray.runtime.actors import RuntimeConfig

#: Options of a session actor that mean nothing for a host (a host has its own name and lifetime).
_NOT_FOR_HOSTS = {"name", "namespace", "lifetime", "get_if_exists", "max_restarts", "max_task_retries",
                  "max_concurrency"}
#: A host still starting counts as this many sessions busier: a session placed there waits for a
#: process start, so a warm host takes it unless it is already that much busier. Starting
#: hosts are all equal, so a burst at cluster start still spreads evenly.
STARTING_PENALTY = 16


@dataclass(eq=False)
class HostRecord:
    """The pool's view of one host actor."""

    name: str
    pool_key: str
    handle: Any
    #: Known at creation when pinned to a node, else once the host answers.
    node_id: str | None = None
    pid: int | None = None
    #: Sessions placed here and not yet collected (reservations included).
    load: int = 0
    alive: bool = True
    ready: asyncio.Future | None = field(default=None, repr=False)


def host_options(config: RuntimeConfig) -> tuple[str, dict[str, Any]]:
    """``(pool key, options)``: the Ray options of a host for ``config``'s ``actor_options``.

    The key groups hosts that may run the same sessions (same resources,
    strategy, runtime env); it is the options' JSON (non-JSON values by repr).
    """
    user = {k: v for k, v in (config.actor_options or {}).items() if k not in _NOT_FOR_HOSTS}
    options: dict[str, Any] = {"num_cpus": 0, **user}
    key = json.dumps(options, sort_keys=True, default=repr)
    return key, options


def demand_of(options: dict[str, Any]) -> dict[str, float]:
    """The resources one host asks for, in ``ray.nodes()`` names (CPU, GPU, memory, custom)."""
    demand = {"CPU": options.get("num_cpus") or 0, "GPU": options.get("num_gpus") or 0,
              "memory": options.get("memory") or 0, **(options.get("resources") or {})}
    return {k: float(v) for k, v in demand.items() if v}


def eligible(node: dict[str, Any], demand: dict[str, float]) -> bool:
    """True when ``node`` (a ``ray.nodes()`` entry) is alive and its totals cover ``demand``."""
    have = node.get("Resources") or {}
    return bool(node.get("Alive")) and all(have.get(k, 0.0) >= v for k, v in demand.items())


def hosts_wanted(node: dict[str, Any], config: RuntimeConfig, demand: dict[str, float] | None = None) -> int:
    """Hosts per eligible node: ``hosts_per_node``, else one per CPU of the node (at least one), and no
    more than the node's totals fit of ``demand``: a host that could never start would wait for, and
    then hold, a unit a session of other options asks for."""
    have = node.get("Resources") or {}
    want = config.hosts_per_node if config.hosts_per_node is not None else int(have.get("CPU", 1))
    for name, amount in (demand or {}).items():
        want = min(want, int(have.get(name, 0.0) // amount))
    return max(1, int(want))


def scarce_part(demand: dict[str, float]) -> dict[str, float]:
    """The part of ``demand`` a user session may also ask for and wait on: GPUs and custom resources."""
    return {k: v for k, v in demand.items() if k not in ("CPU", "memory")}


def pick(hosts: list[HostRecord], *, capacity: int, avoid_node: str | None = None,
         exclude: AbstractSet[str] = frozenset()) -> HostRecord | None:
    """The host a new activation goes to, or None when every live host is full (pure; see the module doc)."""
    live = [h for h in hosts if h.alive and h.name not in exclude and h.load < capacity]
    if not live:
        return None
    elsewhere = [h for h in live if h.node_id is None or h.node_id != avoid_node]
    candidates = elsewhere or live
    node_load: dict[str | None, int] = {}
    for h in hosts:
        if h.alive:
            node_load[h.node_id] = node_load.get(h.node_id, 0) + h.load

    def starting(h: HostRecord) -> bool:
        return h.ready is not None and not h.ready.done()

    return min(candidates, key=lambda h: (h.load + (STARTING_PENALTY if starting(h) else 0),
                                          node_load.get(h.node_id, 0)))


def demand_of_key(pool_key: str) -> dict[str, float]:
    """The demand of a pool's hosts, from its key (the options' JSON, see :func:`host_options`)."""
    return demand_of(json.loads(pool_key))  # made by host_options: always a JSON object
