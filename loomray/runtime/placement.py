"""Where dense sessions run: the supervisor's pool of host actors and its placement rule.

For each distinct set of host options (the runtime's ``actor_options``) the
pool keeps ``hosts_per_node`` hosts, pinned, on every node whose totals cover
one host; a session goes to the least-loaded live host (a host still starting
counts :data:`STARTING_PENALTY` sessions busier; a restart avoids the node it
was lost on). All hosts full or no node eligible: one more, unpinned host (a
pending demand the autoscaler acts on); an idle host exits after
``host_idle_s``, or at once when it holds a GPU or custom unit another session
waits for (:meth:`HostPool.make_room`); a lost host is dropped and its
sessions reactivated elsewhere; a restarted supervisor finds the hosts again.
The rule in full, with its reasons: docs/ray-notes.md, "Dense placement".
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from loomray.errors import SessionStartError
from loomray.runtime.activation_batch import ActivationBatcher
from loomray.runtime.actors import RuntimeConfig
from loomray.runtime.connection import NAMESPACE
from loomray.runtime.hosts import (
    ActivationHandle,
    SessionHost,
    host_actor_name,
    host_prefix,
)
from loomray.runtime.placement_rules import (
    HostRecord,
    demand_of,
    demand_of_key,
    eligible,
    host_options,
    hosts_wanted,
    pick,
    scarce_part,
)

log = logging.getLogger("loomray.runtime.placement")

#: How long the node list is trusted before ``ray.nodes()`` is asked again.
_NODES_TTL_S = 1.0
#: How long the directory of activations (for adoption) is reused.
_DIRECTORY_TTL_S = 1.0
#: A host that is not up after this long is given up (its activations go elsewhere).
_HOST_START_TIMEOUT_S = 120.0
class HostPool:
    """The supervisor's hosts, grouped by host options; see the module docstring."""

    def __init__(self, store_url: str, supervisor: Any = None) -> None:
        #: The store whose sessions these hosts run: host names carry the store's key.
        self._store_url = store_url
        #: The supervisor's own handle, passed to activations that stream events.
        self._supervisor = supervisor
        self._hosts: dict[str, HostRecord] = {}
        self._nodes: list[dict[str, Any]] = []
        self._nodes_at = 0.0
        self._nodes_read: asyncio.Future[None] | None = None  # a background re-read of the nodes in flight
        self._discovered = False
        self._lock = asyncio.Lock()
        self._directory: dict[tuple[str | None, str], tuple[HostRecord, dict[str, Any]]] = {}
        self._directory_at = 0.0
        self._batcher = ActivationBatcher()

    # -- views -------------------------------------------------------------------
    def hosts(self, pool_key: str | None = None) -> list[HostRecord]:
        """Live hosts (of one pool, or all)."""
        return [h for h in self._hosts.values() if h.alive and (pool_key is None or h.pool_key == pool_key)]

    # -- events from watchers ------------------------------------------------------
    def host_lost(self, host: HostRecord) -> None:
        """``host`` died: no more placement there (its sessions are reactivated by their watchers)."""
        if host.alive:
            log.warning("session host %s on node %s is gone", host.name, (host.node_id or "?")[:12])
        host.alive = False
        host.load = 0

    def release(self, host: HostRecord) -> None:
        """One activation on ``host`` was collected."""
        host.load = max(0, host.load - 1)

    # -- placement -----------------------------------------------------------------
    async def activate(self, config: RuntimeConfig, agent: Any, request_json: str, session_id: str,
                       user_id: str | None, *, avoid_node: str | None = None, stream_events: bool = False,
                       timeout: float = _HOST_START_TIMEOUT_S) -> ActivationHandle:
        """Place the session on a host and activate it there; return its handle.

        A host that turns out dead is skipped for another; an unusable agent, request or store raises
        :class:`SessionStartError`.
        """
        pool_key, options = host_options(config)
        deadline = time.monotonic() + timeout
        tried: set[str] = set()
        events_to = self._supervisor if stream_events else None
        while True:
            host = await self._reserve(pool_key, options, config, avoid_node, tried)
            try:
                if host.ready is not None:  # set when the pool made or found the host
                    await asyncio.wait_for(asyncio.shield(host.ready), max(0.1, deadline - time.monotonic()))
                await self._batcher.activate(host.name, host.handle, config, agent, request_json, events_to)
            except (ray.exceptions.RayActorError, asyncio.TimeoutError) as e:
                # The host died, never came up, or is unreachable right now: place elsewhere.
                if isinstance(e, ray.exceptions.ActorUnavailableError):
                    self.release(host)  # maybe only slow; keep it for others
                else:
                    self.host_lost(host)
                tried.add(host.name)
                if time.monotonic() > deadline:
                    raise SessionStartError(f"session {session_id!r}: no session host came up in {timeout:.0f} s "
                                            f"(last: {type(e).__name__}: {e})") from None
                continue
            except SessionStartError:
                self.release(host)
                raise
            except Exception as e:  # anything else the host raised: the session cannot start
                self.release(host)
                raise SessionStartError(f"session {session_id!r} could not start: {type(e).__name__}: {e}") \
                    from None
            return ActivationHandle(self, host, session_id, user_id)

    async def _reserve(self, pool_key: str, options: dict[str, Any], config: RuntimeConfig,
                       avoid_node: str | None, tried: set[str]) -> HostRecord:
        async with self._lock:  # creation decisions must see each other's reservations
            await self._make_room(demand_of(options), keep_key=pool_key)
            await self._refresh(pool_key, options, config)
            host = pick(self.hosts(pool_key), capacity=max(1, config.sessions_per_host), avoid_node=avoid_node,
                        exclude=tried)
            if host is None:
                # Every host is full (or failed): one more, unpinned unless a node has room for it.
                host = self._create(pool_key, options, config, node_id=self._roomiest(options, avoid_node))
            host.load += 1
            return host

    async def _refresh(self, pool_key: str, options: dict[str, Any], config: RuntimeConfig) -> None:
        """Re-read the nodes (at most every ``_NODES_TTL_S``); drop hosts of dead nodes; fill eligible nodes.

        With hosts to place on, a stale view is re-read in the background: ``ray.nodes()`` is slow, and under
        the pool's lock every reservation of a fan-out would wait for it. A host found dead meanwhile is
        skipped when its activation fails.
        """
        if not self._discovered:
            await self.discover()
        if time.monotonic() - self._nodes_at < _NODES_TTL_S and self.hosts(pool_key):
            return
        if not self.hosts(pool_key):
            self._apply_nodes(await asyncio.to_thread(ray.nodes), pool_key, options, config)
        elif self._nodes_read is None or self._nodes_read.done():
            self._nodes_read = asyncio.ensure_future(self._refresh_later(pool_key, options, config))
            self._nodes_read.add_done_callback(lambda f: f.cancelled() or f.exception())

    async def _refresh_later(self, pool_key: str, options: dict[str, Any], config: RuntimeConfig) -> None:
        nodes = await asyncio.to_thread(ray.nodes)
        async with self._lock:
            self._apply_nodes(nodes, pool_key, options, config)

    def _apply_nodes(self, nodes: list[dict[str, Any]], pool_key: str, options: dict[str, Any],
                     config: RuntimeConfig) -> None:
        self._nodes, self._nodes_at = nodes, time.monotonic()
        alive = {n["NodeID"] for n in self._nodes if n.get("Alive")}
        for h in self._hosts.values():
            if h.alive and h.node_id is not None and h.node_id not in alive:
                self.host_lost(h)
        if "scheduling_strategy" in options:
            # Ray places these hosts: keep as many as pinned placement would, wherever Ray puts them.
            demand = demand_of(options)
            want = sum(hosts_wanted(n, config, demand) for n in self._nodes if eligible(n, demand)) or 1
            for _ in range(want - len(self.hosts(pool_key))):
                self._create(pool_key, options, config, node_id=None)
            return
        demand = demand_of(options)
        for node in self._nodes:
            if not eligible(node, demand):
                continue
            have = sum(1 for h in self.hosts(pool_key) if h.node_id == node["NodeID"])
            for _ in range(hosts_wanted(node, config, demand) - have):
                self._create(pool_key, options, config, node_id=node["NodeID"])
        if not self.hosts(pool_key):
            # No node can run a host now: ask anyway; the pending demand is the autoscaler's signal.
            self._create(pool_key, options, config, node_id=None)

    async def make_room(self, demand: dict[str, float]) -> int:
        """Retire idle hosts that hold a GPU or custom resource ``demand`` asks for and the cluster has too
        little of free, so nothing loomray keeps warm holds a unit a user's session wants; how many exited."""
        async with self._lock:
            return await self._make_room(demand, keep_key=None)

    async def _make_room(self, demand: dict[str, float], *, keep_key: str | None) -> int:
        scarce = scarce_part(demand)
        if not scarce:
            return 0
        idle = [h for h in self.hosts() if h.pool_key != keep_key and h.load == 0 and h.ready is not None
                and h.ready.done() and set(scarce) & set(scarce_part(demand_of_key(h.pool_key)))]
        if not idle:  # the usual case: no other options' host is idle; no GCS call
            return 0
        free = await asyncio.to_thread(ray.available_resources)
        short = {k for k, v in scarce.items() if free.get(k, 0.0) < v}
        retired = 0
        for h in (h for h in idle if short & set(scarce_part(demand_of_key(h.pool_key)))):
            try:
                gone = await h.handle.retire_if_idle.remote()
            except ray.exceptions.RayActorError:
                gone = True
            if gone:
                h.alive, h.load, retired = False, 0, retired + 1
        return retired

    def _roomiest(self, options: dict[str, Any], avoid_node: str | None) -> str | None:
        demand = demand_of(options)
        nodes = [n["NodeID"] for n in self._nodes if eligible(n, demand)]
        if not nodes or "scheduling_strategy" in options:
            return None
        load = {n: 0 for n in nodes}
        for h in self.hosts():
            if h.node_id in load:
                load[h.node_id] += h.load
        return min(nodes, key=lambda n: (n == avoid_node, load[n]))

    def _create(self, pool_key: str, options: dict[str, Any], config: RuntimeConfig, *,
                node_id: str | None) -> HostRecord:
        name = host_actor_name(self._store_url)
        opts = {**options, "name": name, "namespace": NAMESPACE, "lifetime": "detached", "max_restarts": 0,
                "max_task_retries": 0,
                # Every hosted session keeps a run() call open here, plus progress and activation calls.
                "max_concurrency": max(10_000, 4 * config.sessions_per_host)}
        if node_id is not None:
            # Hard affinity: the node was chosen because its totals fit; spreading is the point.
            opts["scheduling_strategy"] = NodeAffinitySchedulingStrategy(node_id, soft=False)
        handle = ray.remote(SessionHost).options(**opts).remote(name, pool_key, config.host_idle_s)
        host = HostRecord(name=name, pool_key=pool_key, handle=handle, node_id=node_id)
        host.ready = asyncio.ensure_future(self._await_ready(host))
        # Its failure is handled where it is awaited; do not also log it as "never retrieved".
        host.ready.add_done_callback(lambda f: f.cancelled() or f.exception())
        self._hosts[name] = host
        log.info("session host %s created (node %s)", name, (node_id or "any")[:12])
        return host

    async def _await_ready(self, host: HostRecord) -> None:
        try:
            info = await host.handle.ready.remote()
        except Exception:
            self.host_lost(host)
            raise
        host.node_id, host.pid = info["node_id"], info["pid"]

    # -- after a supervisor restart --------------------------------------------------
    async def discover(self) -> int:
        """Find hosts an earlier supervisor created (named, detached); return how many were added."""
        self._discovered = True
        try:
            named = await asyncio.to_thread(ray.util.list_named_actors, True)
        except Exception as e:  # discovery is an optimisation: without it sessions are restarted instead
            log.warning("could not list named actors: %s", e)
            return 0
        found = [a["name"] for a in named if a.get("namespace") == NAMESPACE
                 and str(a.get("name", "")).startswith(host_prefix(self._store_url)) and a["name"] not in self._hosts]

        async def one(name: str) -> None:
            try:
                handle = ray.get_actor(name, namespace=NAMESPACE)
                info = await asyncio.wait_for(handle.ready.remote(), 10)
            except Exception:
                return  # gone meanwhile
            host = HostRecord(name=name, pool_key=info["pool"], handle=handle, node_id=info["node_id"],
                              pid=info["pid"], load=info["sessions"])
            host.ready = asyncio.get_running_loop().create_future()
            host.ready.set_result(None)
            self._hosts[name] = host

        await asyncio.gather(*(one(n) for n in found))
        return len(found)

    async def find(self, session_id: str, user_id: str | None) -> ActivationHandle | None:
        """A live activation of the session on one of the hosts, or None (for adoption)."""
        if time.monotonic() - self._directory_at > _DIRECTORY_TTL_S:
            await self._load_directory()
        hit = self._directory.get((user_id, session_id))
        if hit is None or not hit[0].alive:
            return None
        return ActivationHandle(self, hit[0], session_id, user_id)

    async def _load_directory(self) -> None:
        await self.discover()
        directory: dict[tuple[str | None, str], tuple[HostRecord, dict[str, Any]]] = {}

        async def one(host: HostRecord) -> None:
            try:
                sessions = await asyncio.wait_for(host.handle.sessions.remote(), 10)
            except ray.exceptions.ActorDiedError:
                self.host_lost(host)
                return
            except Exception:
                return
            for s in sessions:
                directory[(s["user_id"], s["session_id"])] = (host, s)

        await asyncio.gather(*(one(h) for h in self.hosts()))
        self._directory, self._directory_at = directory, time.monotonic()
