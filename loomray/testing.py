"""Test helpers for Ray, shipped with the library: a multi-node cluster on one machine.

``local_cluster()`` starts several raylets on this machine with
:class:`ray.cluster_utils.Cluster`, all bound to 127.0.0.1, and connects this
process to it. Nodes can be added and removed while tests run; removing a node
kills its raylet and, with it, every actor process it hosted -- the closest
thing to pulling a machine's plug that fits on a laptop or a CI runner.

Failure detection is tuned (see :data:`FAST_FAILURE_DETECTION`): with Ray's
defaults a SIGKILLed raylet is declared dead only after ~15 s (five missed
3 s health checks), and in between callers see ``ActorUnavailableError``
rather than ``ActorDiedError``. Measured numbers are in docs/ray-notes.md.

Example::

    from loomray.testing import local_cluster, wait_until_dead

    with local_cluster(num_nodes=3) as lc:
        actor = MyActor.options(scheduling_strategy=lc.pin(lc.workers[0])).remote()
        lc.remove_node(lc.workers[0])
        wait_until_dead(actor, timeout=10)

Teardown kills loomray's supervisor and standby session actors (so no
worker process is still starting as the nodes go), disconnects the driver,
stops every node and then checks that no
process this helper started (raylets, GCS, workers) is left; stragglers are
killed by pid and reported as a warning.
"""

from __future__ import annotations

import os

# Ray reads this once, when ``ray._private.ray_constants`` is first imported, to
# decide whether to bind to the host's address or to loopback. Set it before
# importing Ray so a process that only uses this module still binds to 127.0.0.1.
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

import contextlib  # noqa: E402
import signal  # noqa: E402
import time  # noqa: E402
import warnings  # noqa: E402
from collections.abc import Callable, Iterator  # noqa: E402
from dataclasses import dataclass, field  # noqa: E402
from typing import Any, TypeVar

import ray  # noqa: E402
from ray.cluster_utils import Cluster  # noqa: E402
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy  # noqa: E402

__all__ = [
    "FAST_FAILURE_DETECTION",
    "LOOPBACK",
    "LocalCluster",
    "local_cluster",
    "node_resource",
    "wait_for",
    "wait_until_dead",
]

LOOPBACK = "127.0.0.1"

#: GCS health-check settings that declare a SIGKILLed node dead in about
#: 1.5-2.5 s instead of Ray's ~15 s default (period 3 s x threshold 5). The
#: timeout stays at 1 s and the threshold at 5 so a raylet that is merely slow
#: on a busy 2-core CI runner is not declared dead by mistake (a node declared
#: dead is killed for good when it reconnects).
FAST_FAILURE_DETECTION: dict[str, Any] = {
    "health_check_initial_delay_ms": 0,
    "health_check_period_ms": 300,
    "health_check_timeout_ms": 1000,
    "health_check_failure_threshold": 5,
}

T = TypeVar("T")


def node_resource(index: int) -> str:
    """The custom resource name ``local_cluster`` gives node ``index`` (0 = head).

    ``{node_resource(2): 0.001}`` in an actor's ``resources`` pins it to node 2
    by name, which survives across a cluster restart where node ids do not.
    """
    return f"loomray_node_{index}"


def pid_alive(pid: int) -> bool:
    """True while a process with ``pid`` exists (signal 0 probes without touching it)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def wait_for(predicate: Callable[[], T], *, timeout: float, interval: float = 0.05, what: str = "condition") -> T:
    """Poll ``predicate`` until it returns a truthy value; return that value.

    Raises ``TimeoutError`` naming ``what`` when ``timeout`` seconds pass first.
    Exceptions raised by ``predicate`` propagate (they are not retried).
    """
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise TimeoutError(f"timed out after {timeout:.1f}s waiting for {what}")
        time.sleep(interval)


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
    _added: int = 0
    _index: dict[str, int] = field(default_factory=dict)
    #: Pids that existed before the cluster started (not ours to reap).
    _preexisting: set[tuple[int, int]] = field(default_factory=set)
    #: Every process seen under this cluster, so teardown can check they all exited.
    _started: set[tuple[int, int]] = field(default_factory=set)

    #: After exit: pids that had not exited on their own and were killed (should be empty).
    leftover: list[int] = field(default_factory=list)

    def started_processes(self) -> list[int]:
        """Pids of the processes seen under this cluster (raylets, GCS, workers, ...)."""
        if ray.is_initialized():
            self._snapshot()
        return sorted(p for p, _ in self._started)

    def any_started_alive(self) -> bool:
        """True while any process seen under this cluster is still running."""
        return any(_alive(p) for p in self._started)

    def _snapshot(self) -> None:
        self._started |= _descendants(os.getpid()) - self._preexisting

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

    def add_node(self, *, num_cpus: float | None = None, resources: dict[str, float] | None = None, **node_args: Any) -> Any:
        """Start one more raylet on loopback and wait until it has joined; return it.

        The node gets the custom resource :func:`node_resource` ``(i)`` (i counts
        every node ever added, so names are never reused after a removal).
        """
        index = self._added
        res = {node_resource(index): 1.0, **(self.worker_resources if resources is None else resources)}
        node = self.cluster.add_node(
            num_cpus=self.num_cpus_per_node if num_cpus is None else num_cpus,
            node_ip_address=LOOPBACK,
            resources=res,
            **node_args,
        )
        self._added += 1
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
      modules); the previous values are restored on exit.
    - ``head_node_args`` are extra Ray node parameters for the head (e.g.
      ``{"gcs_server_port": 6390, "temp_dir": "/tmp/x"}``).
    - ``connect=True`` calls ``ray.init(address=..., namespace=namespace)``.
      Raises ``RuntimeError`` if this process is already connected to Ray.

    On exit: loomray's supervisor and standby actors killed, ``ray.shutdown()``, every node
    stopped, and every process started under this cluster checked gone (killed by pid after a
    short grace).
    """
    if num_nodes < 1:
        raise ValueError(f"num_nodes must be >= 1, got {num_nodes}")
    if connect and ray.is_initialized():
        raise RuntimeError("this process is already connected to Ray; call ray.shutdown() first")
    saved_env = {k: os.environ.get(k) for k in (env or {})}
    os.environ.update(env or {})
    config = {**(FAST_FAILURE_DETECTION if fast_failure_detection else {}), **(system_config or {})}
    cluster: Cluster | None = None
    lc: LocalCluster | None = None
    before = _descendants(os.getpid())
    try:
        cluster = Cluster(
            initialize_head=True,
            head_node_args={
                "num_cpus": num_cpus_per_node,
                "node_ip_address": LOOPBACK,
                "resources": {node_resource(0): 1.0, **(head_resources or {})},
                "include_dashboard": include_dashboard,
                "_system_config": config,
                **(head_node_args or {}),
            },
            shutdown_at_exit=True,
        )
        lc = LocalCluster(cluster=cluster, namespace=namespace, num_cpus_per_node=num_cpus_per_node,
                          worker_resources=dict(worker_resources or {}), _preexisting=before)
        lc.nodes.append(cluster.head_node)
        lc._index[cluster.head_node.node_id] = 0
        lc._added = 1
        for _ in range(num_nodes - 1):
            lc.add_node(resources=worker_resources)
        cluster.wait_for_nodes()
        if connect:
            ray.init(address=cluster.address, namespace=namespace, **(init_kwargs or {}))
        yield lc
    finally:
        # Collect what we started before stopping it: once a raylet dies its
        # workers are re-parented and can no longer be found from here.
        started = _descendants(os.getpid()) - before
        if lc is not None:
            started |= lc._started
        if ray.is_initialized():
            _stop_standbys()
            ray.shutdown()
        if cluster is not None:
            cluster.shutdown()
        leftover = _reap(started)
        if lc is not None:
            lc._started = started
            lc.leftover = leftover
        for k, v in saved_env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _stop_standbys() -> None:
    """Kill loomray's supervisor, then its standby session actors, before the nodes stop.

    Otherwise the supervisor may be refilling its standby pool as the
    cluster goes down, and a worker process still starting when its raylet
    dies takes long to notice on a busy machine (teardown would report it
    as a leftover). Best effort: the nodes stop next anyway.
    """
    try:
        from loomray.runtime.actors import NAMESPACE, STANDBY_PREFIX, SUPERVISOR_NAME

        named = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if a.get("namespace") == NAMESPACE]
    except Exception:
        return
    # The supervisor first, so it starts no more standbys.
    ordered = [n for n in named if n == SUPERVISOR_NAME] + [n for n in named if n.startswith(STANDBY_PREFIX)]
    for name in ordered:
        with contextlib.suppress(Exception):
            ray.kill(ray.get_actor(name, namespace=NAMESPACE), no_restart=True)


def _proc_stat(pid: int) -> list[bytes] | None:
    """Fields 3.. of /proc/PID/stat (state, ppid, ...), or None if the process is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            # The command name (field 2) may contain spaces and parentheses.
            return f.read().rsplit(b")", 1)[1].split()
    except (OSError, IndexError):
        return None


def _descendants(root: int) -> set[tuple[int, int]]:
    """``(pid, start_time)`` of every live descendant of ``root`` (Linux /proc; empty elsewhere).

    The start time makes the identity safe against pid reuse: we must never
    signal a process some other user started after ours exited.
    """
    children: dict[int, list[tuple[int, int]]] = {}
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
    found: set[tuple[int, int]] = set()
    stack = [root]
    while stack:
        for child in children.get(stack.pop(), ()):
            if child not in found:
                found.add(child)
                stack.append(child[0])
    return found


def _alive(proc: tuple[int, int]) -> bool:
    fields = _proc_stat(proc[0])
    # A zombie has exited and only waits for its parent; a different start time is another process.
    return fields is not None and fields[0] != b"Z" and int(fields[19]) == proc[1]


def _reap(procs: set[tuple[int, int]], grace: float = 10.0) -> list[int]:
    """Wait for ``procs`` to exit; SIGKILL, report and return the pids of any that outlive ``grace``."""
    try:
        wait_for(lambda: not any(_alive(p) for p in procs), timeout=grace, interval=0.1, what="cluster processes to exit")
        return []
    except TimeoutError:
        pass
    left = sorted(p for p in procs if _alive(p))
    for pid, _ in left:
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)
    if left:
        warnings.warn(
            f"local_cluster: killed {len(left)} leftover process(es) after shutdown: {[p for p, _ in left]}",
            RuntimeWarning,
            stacklevel=3,
        )
    return [p for p, _ in left]
