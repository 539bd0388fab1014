"""A multi-node Ray cluster on one machine, for tests, examples, benches and ``loomray demo``.

What it starts, how its failure detection is tuned and how teardown checks it: docs/testing.md. Example::

    with local_cluster(num_nodes=3) as lc:
        actor = MyActor.options(scheduling_strategy=lc.pin(lc.workers[0])).remote()
        lc.remove_node(lc.workers[0])
        wait_until_dead(actor, timeout=10)
"""

from __future__ import annotations

from loomray.runtime.connection import apply_ray_env_defaults

# Ray reads these once, when first imported: they must be set before the imports below.
apply_ray_env_defaults()

import contextlib  # noqa: E402
import os  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402
from collections.abc import Iterator  # noqa: E402
from dataclasses import dataclass, field  # noqa: E402
from typing import Any  # noqa: E402

import ray  # noqa: E402
from ray.cluster_utils import Cluster  # noqa: E402
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy  # noqa: E402

from loomray.runtime.actors import SUPERVISOR_PREFIX  # noqa: E402
from loomray.runtime.connection import NAMESPACE  # noqa: E402
from loomray.testing.processes import Process, descendants, process_alive, reap  # noqa: E402
from loomray.testing.waiting import wait_for  # noqa: E402

__all__ = [
    "FAST_FAILURE_DETECTION",
    "LOOPBACK",
    "LocalCluster",
    "local_cluster",
    "node_resource",
    "wait_until_dead",
]

LOOPBACK = "127.0.0.1"

#: GCS health-check settings that declare a SIGKILLed node dead after a few
#: periods (period x threshold) instead of Ray's default 3 s x 5. The
#: timeout stays at 1 s and the threshold at 5 so a raylet that is merely slow
#: on a busy CI host is not declared dead by mistake (a node declared
#: dead is killed for good when it reconnects).
FAST_FAILURE_DETECTION: dict[str, Any] = {
    "health_check_initial_delay_ms": 0,
    "health_check_period_ms": 300,
    "health_check_timeout_ms": 1000,
    "health_check_failure_threshold": 5,
}


#: The head's dashboard agent on a free port, as the other nodes' are: Ray's fixed default (52365) is taken by
#: the head of any other cluster on the machine, and this cluster's Ray Jobs, served through the agent, fail.
_HEAD_DEFAULTS: dict[str, Any] = {"dashboard_agent_listen_port": 0}


def node_resource(index: int) -> str:
    """The custom resource name ``local_cluster`` gives node ``index`` (0 = head).

    ``{node_resource(2): 0.001}`` in an actor's ``resources`` pins it to node 2
    by name, which survives across a cluster restart where node ids do not.
    """
    return f"loomray_node_{index}"


def wait_until_dead(actor: ray.actor.ActorHandle, *, timeout: float, probe: str = "__ray_ready__") -> ray.exceptions.ActorDiedError:
    """Call a cheap method on ``actor`` until Ray reports it dead; return the error.

    ``ActorUnavailableError`` (Ray cannot reach the actor right now, e.g. its
    node stopped answering but is not yet declared dead) is *not* death: keep
    probing. Raises ``TimeoutError`` if the actor is still alive, or still
    merely unavailable, after ``timeout`` seconds.
    """
    deadline = time.monotonic() + timeout
    while True:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError(f"actor {actor} still not dead after {timeout:.1f}s")
        try:
            ray.get(getattr(actor, probe).remote(), timeout=min(remaining, 2.0))
        except ray.exceptions.ActorDiedError as e:
            return e
        except (ray.exceptions.ActorUnavailableError, ray.exceptions.GetTimeoutError):
            pass
        else:
            # Alive and answering: back off a little before asking again.
            time.sleep(min(0.05, max(0.0, deadline - time.monotonic())))


@dataclass
class LocalCluster:
    """A running multi-node cluster on this machine, as returned by :func:`local_cluster`.

    ``nodes[0]`` is the head (the driver's node, which must not be removed);
    ``workers`` are the others, in the order they were added.
    """

    cluster: Cluster
    namespace: str
    num_cpus_per_node: float
    #: Extra resources every node added after the head gets by default.
    worker_resources: dict[str, float] = field(default_factory=dict)
    nodes: list[Any] = field(default_factory=list)
    removed: list[Any] = field(default_factory=list)
    #: Processes that existed before the cluster started (not ours to reap).
    preexisting: set[Process] = field(default_factory=set)
    #: After exit: pids that had not exited on their own and were killed (should be empty).
    leftover: list[int] = field(default_factory=list)
    #: Every process seen under this cluster, so teardown can check they all exited.
    _started: set[Process] = field(default_factory=set, init=False)
    _index: dict[str, int] = field(default_factory=dict, init=False)

    def __post_init__(self) -> None:
        head = self.cluster.head_node
        if head is None:
            raise ValueError("a LocalCluster needs a Ray cluster whose head node has started")
        self.nodes.append(head)
        self._index[head.node_id] = 0

    def any_started_alive(self) -> bool:
        """True while any process seen under this cluster is still running."""
        return any(process_alive(p) for p in self._started)

    def _snapshot(self) -> None:
        self._started |= descendants(os.getpid()) - self.preexisting

    @property
    def address(self) -> str:
        """The GCS address (``127.0.0.1:port``), what ``ray.init(address=...)`` takes."""
        return self.cluster.address

    @property
    def head(self) -> Any:
        """The head node (hosts GCS and the driver's raylet)."""
        return self.nodes[0]

    @property
    def workers(self) -> list[Any]:
        """The live non-head nodes."""
        return self.nodes[1:]

    def node_ids(self) -> list[str]:
        """Hex node ids of the live nodes, head first."""
        return [n.node_id for n in self.nodes]

    def node_index(self, node_id: str) -> int | None:
        """The number node ``node_id`` was added as (0 = the head), removed nodes included; None if unknown."""
        return self._index.get(node_id)

    def add_node(self, *, num_cpus: float | None = None, resources: dict[str, float] | None = None, **node_args: Any) -> Any:
        """Start one more raylet on loopback and wait until it has joined; return it.

        The node gets the custom resource :func:`node_resource` ``(i)`` (i counts
        every node ever added, so names are never reused after a removal).
        Main thread only: Ray's node start sets a SIGTERM handler, which Python
        allows there alone (from another thread Ray fails halfway, with an error
        about signals, and no node joins).
        """
        if threading.current_thread() is not threading.main_thread():
            raise RuntimeError("LocalCluster.add_node must be called from the main thread (Ray's node start sets "
                               "signal handlers); from asyncio, call it directly, not through asyncio.to_thread")
        index = len(self._index)
        res = {node_resource(index): 1.0, **(self.worker_resources if resources is None else resources)}
        node = self.cluster.add_node(
            num_cpus=self.num_cpus_per_node if num_cpus is None else num_cpus,
            node_ip_address=LOOPBACK,
            resources=res,
            **node_args,
        )
        self._index[node.node_id] = index
        self.nodes.append(node)
        return node

    def resource_of(self, node: Any) -> str:
        """The custom resource that pins work to ``node`` (see :func:`node_resource`)."""
        return node_resource(self._index[node.node_id])

    def remove_node(self, node: Any, *, graceful: bool = False) -> None:
        """Stop ``node``'s raylet and every process it started.

        ``graceful=False`` (the default) SIGKILLs the raylet, like a machine
        vanishing: the GCS notices only through missed health checks, and the
        node's actor processes exit within about 2 s once their raylet is gone.
        ``graceful=True`` lets the raylet drain, so the GCS learns at once and
        the actor processes are gone when this returns.
        """
        if node is self.head:
            raise ValueError("the head node hosts the GCS and the driver; remove a worker node instead")
        # Once the raylet dies its workers are re-parented and cannot be found
        # from this process any more; remember them now so teardown can check.
        self._snapshot()
        self.cluster.remove_node(node, allow_graceful=graceful)
        self.nodes.remove(node)
        self.removed.append(node)

    def pin(self, node: Any, *, soft: bool = False) -> NodeAffinitySchedulingStrategy:
        """A scheduling strategy that places an actor or task on ``node``."""
        return NodeAffinitySchedulingStrategy(node_id=node.node_id, soft=soft)

    def node_of(self, node_id: str) -> Any | None:
        """The live node object with hex id ``node_id``, or None."""
        return next((n for n in self.nodes if n.node_id == node_id), None)

    def alive_node_ids(self) -> set[str]:
        """Node ids the GCS currently considers alive (its view, not ours)."""
        return {n["NodeID"] for n in ray.nodes() if n["Alive"]}

    def reset(self, num_workers: int, *, timeout: float = 60.0) -> None:
        """Kill every loomray actor (supervisors first, again until none is left: a dying supervisor may
        have started one more) and wait until their names are free; then add or (gracefully) remove workers
        until ``num_workers`` are live, and wait until the GCS agrees."""
        wait_for(lambda: not _stop_loomray_actors(everything=True), timeout=timeout, interval=0.2,
                 what="loomray's actors to be gone")
        while len(self.workers) < num_workers:
            self.add_node()
        while len(self.workers) > num_workers:
            self.remove_node(self.workers[-1], graceful=True)
        wait_for(lambda: self.alive_node_ids() == set(self.node_ids()), timeout=timeout,
                 what="the GCS to see the nodes as they are")

    def shut_down(self) -> None:
        """Stop the cluster (see :func:`local_cluster`) and check that every process it started is gone."""
        # Collect what we started before stopping it: once a raylet dies its
        # workers are re-parented and can no longer be found from here.
        self._snapshot()
        if ray.is_initialized():
            _stop_loomray_actors()
            ray.shutdown()
        self.cluster.shutdown()
        self.leftover = reap(self._started)


@contextlib.contextmanager
def _environment(env: dict[str, str] | None) -> Iterator[None]:
    """``env`` set in ``os.environ`` for the duration, the previous values restored after."""
    saved = {k: os.environ.get(k) for k in (env or {})}
    os.environ.update(env or {})
    auth = any(k.startswith("RAY_AUTH_") for k in saved)
    if auth:
        _reload_ray_auth()
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        if auth:
            _reload_ray_auth()


def _reload_ray_auth() -> None:
    """Make this process see ``RAY_AUTH_MODE``/``RAY_AUTH_TOKEN`` as they are now.

    Ray reads them once, into its cached config and token loader; a test that
    turns token authentication on for one cluster (``env``) must refresh both,
    or this process could not talk to the cluster it starts.
    """
    from ray._raylet import (  # type: ignore[attr-defined]  # noqa: PLC2701 - no public reload of auth
        AuthenticationTokenLoader,
        Config,
    )

    Config.initialize("")
    AuthenticationTokenLoader.instance().reset_cache()


@contextlib.contextmanager
def local_cluster(
    num_nodes: int = 3,
    *,
    namespace: str = "loomray",
    num_cpus_per_node: float = 1,
    head_resources: dict[str, float] | None = None,
    worker_resources: dict[str, float] | None = None,
    fast_failure_detection: bool = True,
    system_config: dict[str, Any] | None = None,
    include_dashboard: bool = False,
    connect: bool = True,
    env: dict[str, str] | None = None,
    init_kwargs: dict[str, Any] | None = None,
    head_node_args: dict[str, Any] | None = None,
) -> Iterator[LocalCluster]:
    """Start a ``num_nodes``-node Ray cluster on 127.0.0.1, connect to it, and yield it.

    - ``num_nodes`` counts the head; each node gets ``num_cpus_per_node`` CPUs
      and a custom resource :func:`node_resource` ``(i)``; the head also gets
      ``head_resources``, the other nodes ``worker_resources`` (e.g.
      ``{"loomray_session": 100}`` to keep session actors off the head, so a
      node that can be removed hosts them).
    - ``fast_failure_detection`` applies :data:`FAST_FAILURE_DETECTION`;
      ``system_config`` entries override it (Ray ``_system_config`` keys).
    - ``env`` is set in ``os.environ`` before any node starts, so raylets and
      the workers they spawn inherit it (e.g. ``PYTHONPATH`` for test-only
      modules, or ``RAY_AUTH_MODE=token`` with ``RAY_AUTH_TOKEN`` for a
      cluster with token authentication); the previous values are restored
      on exit.
    - ``head_node_args`` are extra Ray node parameters for the head (e.g.
      ``{"gcs_server_port": 6390, "temp_dir": "/tmp/x"}``).
    - ``connect=True`` calls ``ray.init(address=..., namespace=namespace)``.
      Raises ``RuntimeError`` if this process is already connected to Ray.

    On exit: loomray's supervisors killed, ``ray.shutdown()``, every node
    stopped, and every process started under this cluster checked gone (killed by pid after a
    short grace).
    """
    if num_nodes < 1:
        raise ValueError(f"num_nodes must be >= 1, got {num_nodes}")
    if connect and ray.is_initialized():
        raise RuntimeError("this process is already connected to Ray; call ray.shutdown() first")
    config = {**(FAST_FAILURE_DETECTION if fast_failure_detection else {}), **(system_config or {})}
    before = descendants(os.getpid())
    with _environment(env):
        cluster = _start_head(before, {
            "num_cpus": num_cpus_per_node, "node_ip_address": LOOPBACK, **_HEAD_DEFAULTS,
            "resources": {node_resource(0): 1.0, **(head_resources or {})},
            "include_dashboard": include_dashboard, "_system_config": config, **(head_node_args or {})})
        lc = LocalCluster(cluster=cluster, namespace=namespace, num_cpus_per_node=num_cpus_per_node,
                          worker_resources=dict(worker_resources or {}), preexisting=before)
        try:
            for _ in range(num_nodes - 1):
                lc.add_node(resources=worker_resources)
            cluster.wait_for_nodes()
            if connect:
                ray.init(address=cluster.address, namespace=namespace, **(init_kwargs or {}))
            yield lc
        finally:
            lc.shut_down()


def _start_head(before: set[Process], head_node_args: dict[str, Any]) -> Cluster:
    """A Ray cluster with its head node started; if that fails, no process it started is left behind."""
    try:
        return Cluster(initialize_head=True, shutdown_at_exit=True, head_node_args=head_node_args)
    except BaseException:
        reap(descendants(os.getpid()) - before)
        raise


def _loomray_actor_names() -> list[str]:
    return [a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if a.get("namespace") == NAMESPACE]


def _stop_loomray_actors(*, everything: bool = False) -> list[str]:
    """Kill loomray's supervisors (``everything``: then all its other actors); the names it found
    (still listed until the actors are dead).

    Before the nodes stop: otherwise a supervisor may be restarting a session as the cluster goes
    down, and a worker process still starting when its raylet dies takes long to notice on a busy
    machine (teardown would report it as a leftover). Best effort.
    """
    try:
        named = _loomray_actor_names()
    except Exception:
        return []
    # The supervisors first, so they restart no session.
    ordered = [n for n in named if n.startswith(SUPERVISOR_PREFIX)]
    ordered += [n for n in named if n not in ordered] if everything else []
    for name in ordered:
        with contextlib.suppress(Exception):
            ray.kill(ray.get_actor(name, namespace=NAMESPACE), no_restart=True)
    return named
