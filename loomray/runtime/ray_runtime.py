"""``RayRuntime``: one Ray actor per session, watched by a detached supervisor.

The driver side is thin. ``execute`` ships the agent (by value, or as the
importable reference in ``agent.loomray_ref``) and the request JSON to the
``loomray:supervisor`` actor, which starts a ``SessionActor`` and restarts it
from the store if its node dies; the driver then waits for the outcome.
Checkpoint reads (``list_checkpoints``, ``get_checkpoint``) go straight to the
store from this process, exactly as with ``LocalRuntime``.

The store must be reachable from every node under the same URL: an
``s3://`` URL on a real cluster; a local path only works when every node is on
this machine (tests, ``cluster/local.sh``).
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
from typing import TYPE_CHECKING, Any, Callable, Sequence

import ray

from loomray.errors import LoomrayRunError, LoomrayUserError
from loomray.records import RunResult
from loomray.runtime.actors import NAMESPACE, SUPERVISOR_NAME, AgentSpec, Outcome, RuntimeConfig, Supervisor
from loomray.runtime.base import Runtime

if TYPE_CHECKING:  # pragma: no cover
    from loomray.agent import Agent
    from loomray.events import EmitFn
    from loomray.session import RunRequest

log = logging.getLogger("loomray.runtime.ray")

#: How long a driver waits for a replacement supervisor to adopt its session.
_READOPT_TIMEOUT_S = 60.0


def connect(address: str | None = None) -> None:
    """Connect this process to Ray (``address``, else ``RAY_ADDRESS``, else a local instance) if not yet."""
    if not ray.is_initialized():
        ray.init(address=address or os.environ.get("RAY_ADDRESS"), namespace=NAMESPACE, log_to_driver=False)


def _head_node_id() -> str | None:
    for node in ray.nodes():
        if node.get("Alive") and "node:__internal_head__" in node.get("Resources", {}):
            return node["NodeID"]
    return None


def get_supervisor(config: RuntimeConfig, *, timeout: float = 120.0) -> Any:
    """The cluster's supervisor actor, created (detached, preferably on the head) if missing.

    Raises :class:`LoomrayUserError` when the running supervisor serves another store.
    """
    options: dict[str, Any] = {
        "name": SUPERVISOR_NAME, "namespace": NAMESPACE, "lifetime": "detached", "get_if_exists": True,
        "num_cpus": 0, "max_restarts": -1, "max_concurrency": 1000,
    }
    if _head_node_id() is not None:
        # Worker nodes come and go; the head lives as long as the cluster. A resource,
        # not soft node affinity: soft affinity to the head was measured landing on a
        # worker about half the time, and a head re-created with a new node id (GCS
        # fault tolerance) still carries this resource.
        options["resources"] = {"node:__internal_head__": 0.001}
    handle = ray.remote(Supervisor).options(**options).remote(config)
    info = ray.get(handle.ready.remote(), timeout=timeout)
    if info["store"] != config.store_url:
        raise LoomrayUserError(
            f"the loomray supervisor on this cluster serves store {info['store']!r}, not {config.store_url!r}")
    return handle


def supervise(store_url: str, *, address: str | None = None, storage_options: dict[str, Any] | None = None,
              interval_s: float = 5.0, stop: threading.Event | None = None,
              report: Callable[[str], None] = print, **config: Any) -> None:
    """Keep the supervisor alive until ``stop`` is set (what ``loomray supervise`` runs on the head).

    Every ``interval_s`` it checks the supervisor answers; a dead one is
    re-created and rebuilds its state from the store's session index.
    """
    connect(address)
    cfg = RuntimeConfig(store_url=store_url, storage_options=dict(storage_options or {}), **config)
    stop = stop or threading.Event()
    handle = None
    while not stop.is_set():
        try:
            if handle is None:
                handle = get_supervisor(cfg)
                report(f"supervisor ready for {store_url}")
            ray.get(handle.ready.remote(), timeout=max(30.0, interval_s))
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError) as e:
            report(f"supervisor lost ({type(e).__name__}); re-creating")
            handle = None
            continue
        stop.wait(interval_s)


class RayRuntime(Runtime):
    """Runs each session in its own Ray actor; checkpoints and journal live in ``store``.

    ``store`` is a URL or path every node can reach (``s3://bucket/prefix`` with
    ``storage_options`` such as ``endpoint_url``, ``key``, ``secret``).
    ``address`` is the cluster (default: ``RAY_ADDRESS``, else a local Ray).
    ``actor_options`` go to each session actor's ``.options()`` (``num_cpus``,
    ``resources``, ``scheduling_strategy``, ...). Nothing connects to Ray until
    the first run, so building an Agent with this runtime is cheap anywhere.
    """

    def __init__(self, store: Any, address: str | None = None, max_checkpoints_per_session: int = 20,
                 actor_options: dict[str, Any] | None = None, **storage_options: Any) -> None:
        if not isinstance(store, (str, os.PathLike)):
            raise TypeError("RayRuntime needs a store URL or path (actors on other nodes open it themselves)")
        if actor_options is not None and not isinstance(actor_options, dict):
            raise TypeError(f"actor_options must be a dict, got {type(actor_options).__name__}")
        from storage import open_store

        url = os.fspath(store)
        if "://" not in url:
            url = os.path.abspath(url)  # actors do not share the driver's working directory
        super().__init__(open_store(url, **storage_options), max_checkpoints_per_session=max_checkpoints_per_session)
        self.address = address
        self.config = RuntimeConfig(store_url=url, storage_options=dict(storage_options),
                                    max_checkpoints_per_session=self.keep, actor_options=dict(actor_options or {}))
        self._supervisor: Any = None

    def __repr__(self) -> str:
        return f"RayRuntime({self.config.store_url!r}, address={self.address!r})"

    # -- the supervisor ---------------------------------------------------------
    def supervisor(self) -> Any:
        """The supervisor handle (connecting and creating it on first use)."""
        if self._supervisor is None:
            connect(self.address)
            self._supervisor = get_supervisor(self.config)
        return self._supervisor

    async def _call(self, method: str, *args: Any) -> Any:
        """Call a supervisor method; if the supervisor died, use its replacement (which adopts our sessions)."""
        deadline = time.monotonic() + _READOPT_TIMEOUT_S
        while True:
            try:
                handle = await asyncio.to_thread(self.supervisor)
                return await getattr(handle, method).remote(*args)
            except ray.exceptions.RayActorError:
                # Killed or its node died: the next handle is a replacement that re-adopts from the index.
                self._supervisor = None
            except LoomrayUserError as e:
                # A fresh supervisor adopts a session only once its row is in the index.
                if "not supervised" not in str(e) or time.monotonic() > deadline:
                    raise
            if time.monotonic() > deadline:
                raise LoomrayRunError(f"the loomray supervisor kept failing while calling {method}")
            await asyncio.sleep(0.2)

    # -- Runtime ----------------------------------------------------------------
    async def execute(self, agent: "Agent", request: "RunRequest", *, emit: "EmitFn | None" = None,
                      extra_tools: Sequence[Any] = (), output_type: Any = None) -> RunResult:
        """Run ``request`` in a session actor and return its result (restarts are invisible here)."""
        if emit is not None:
            log.warning("RayRuntime does not stream events to the driver yet; emit is ignored")
        spec = AgentSpec.of(agent, extra_tools)
        await self._call("submit", spec, request.model_dump_json())
        outcome = await self._call("result", request.session_id, request.user_id)
        return _result(outcome, request.session_id)

    async def execute_many(self, agent: "Agent", requests: Sequence["RunRequest"], *, emit: "EmitFn | None" = None,
                           extra_tools: Sequence[Any] = (), output_type: Any = None) -> list[RunResult]:
        """Fan-out: one actor per request, run in parallel by the supervisor; results in request order."""
        if emit is not None:
            log.warning("RayRuntime does not stream events to the driver yet; emit is ignored")
        spec = AgentSpec.of(agent, extra_tools)
        outcomes = await self._call("run_many", spec, [r.model_dump_json() for r in requests])
        return [_result(o, r.session_id) for o, r in zip(outcomes, requests)]

    async def status(self) -> list[dict[str, Any]]:
        """What the supervisor watches: one dict per session."""
        return await self._call("status")


def _result(outcome: Outcome, session_id: str) -> RunResult:
    if outcome.status == "completed" and outcome.result_json is not None:
        return RunResult.model_validate_json(outcome.result_json)
    if outcome.exception is not None:
        raise outcome.exception
    raise LoomrayRunError(f"session {session_id!r} ended {outcome.status}: {outcome.error}")
