"""The Ray actors: one ``SessionActor`` per session, one detached ``Supervisor``.

How the pieces fit (docs/ray-notes.md has the measurements behind the choices):

- A **SessionActor** hosts one run. Its constructor opens the store from a URL
  plus options and loads the agent (by an importable ``module:attr`` reference
  or by value); ``run()`` calls :func:`loomray.session.execute_request`, which
  takes the session lease (epoch + 1), restores the latest checkpoint of an
  unfinished run and answers journaled steps without calling the model again.
  ``run()`` is idempotent: a second call joins the run in flight, which is how
  a watcher re-attaches after ``ActorUnavailableError`` or a supervisor restart.
  Session actors are *detached* and ``max_restarts=0``: they outlive the driver
  and the supervisor, and only the supervisor restarts them, so every restart
  is a fresh lease epoch decided in one place.
- The **Supervisor** (detached, ``loomray:supervisor``) starts session actors,
  watches each by awaiting its ``run()`` ObjectRef, and on ``ActorDiedError``
  starts a new incarnation, preferring a live node other than the dead one.
  Its state is derived from the store's session index: on start it adopts
  every ``pending``/``running`` row that a Ray actor owned (``node_id`` set),
  attaching to the live actor by name or restarting it.
- **Fencing**: an incarnation that loses the lease gets ``LeaseLostError`` on its
  next write; ``run()`` returns outcome ``fenced`` and the supervisor stops the
  actor without restarting it (a newer owner exists).

Only JSON and ids cross into storage; agents travel by value in memory only.
"""

from __future__ import annotations

import asyncio
import importlib
import logging
import os
import random
import time
from dataclasses import dataclass, field
from typing import Any, Literal

import ray
from pydantic import BaseModel, ConfigDict, Field

log = logging.getLogger("loomray.runtime.actors")

NAMESPACE = "loomray"
SUPERVISOR_NAME = "loomray:supervisor"

#: Session rows in these states are live work a supervisor must own.
ACTIVE_STATES = ("pending", "running")


def session_actor_name(session_id: str, user_id: str | None = None) -> str:
    """``loomray:{user or _}:{session_id}``, the actor's name in the ``loomray`` namespace."""
    return f"loomray:{user_id or '_'}:{session_id}"


def resolve_ref(ref: str) -> Any:
    """Import ``module:attribute`` (dots allowed in the attribute path) and return it."""
    from loomray.errors import LoomrayUserError

    module_name, sep, attr = ref.partition(":")
    if not sep or not module_name or not attr:
        raise LoomrayUserError(f"agent reference {ref!r} must look like 'package.module:attribute'")
    try:
        obj: Any = importlib.import_module(module_name)
        for part in attr.split("."):
            obj = getattr(obj, part)
    except (ImportError, AttributeError) as e:
        raise LoomrayUserError(f"cannot import agent reference {ref!r}: {e}") from e
    return obj


@dataclass(frozen=True)
class RuntimeConfig:
    """What every actor needs to reach the store and to behave; plain data.

    ``storage_options`` may hold credentials: they travel to actors in memory
    (actor constructor arguments), never into the store.
    """

    store_url: str
    storage_options: dict[str, Any] = field(default_factory=dict)
    max_checkpoints_per_session: int = 20
    #: Passed to ``SessionActor.options()``; overrides the defaults below.
    actor_options: dict[str, Any] = field(default_factory=dict)
    #: How many forks of one fan-out run at once (the rest queue).
    max_concurrent_forks: int = 32
    #: Incarnations per session before it is marked failed (a crash loop).
    max_restarts_per_session: int = 20
    #: Seconds between background ``store.compact()`` runs; None disables.
    compact_interval_s: float | None = 600.0
    #: A finished session actor nobody collected exits after this long.
    linger_s: float = 300.0

    def open_store(self) -> Any:
        """Open the store this config names, in the calling process."""
        from storage import open_store

        return open_store(self.store_url, **self.storage_options)


@dataclass(frozen=True)
class AgentSpec:
    """How an agent reaches an actor: an importable reference, or the object by value.

    By value (``payload``, cloudpickled in memory, never stored) works for
    anything, but a session whose actor *and* supervisor both die can only be
    restarted when ``ref`` is set: the session row keeps the reference string.
    """

    ref: str | None = None
    payload: bytes | None = None

    @classmethod
    def of(cls, agent: Any, extra_tools: Any = ()) -> "AgentSpec":
        """Ship ``agent`` by value, without its runtime (clients and connections stay behind)."""
        import copy

        from ray import cloudpickle

        clone = copy.copy(agent)
        clone.runtime = None
        return cls(ref=getattr(agent, "loomray_ref", None), payload=cloudpickle.dumps((clone, tuple(extra_tools))))

    def load(self) -> tuple[Any, tuple]:
        """The agent and its extra tools, in this process."""
        if self.payload is not None:
            from ray import cloudpickle

            return cloudpickle.loads(self.payload)
        if self.ref is not None:
            return resolve_ref(self.ref), ()
        raise ValueError("AgentSpec needs a ref or a payload")


class Outcome(BaseModel):
    """How a session actor's run ended, as plain data (plus the exception, in memory only)."""

    model_config = ConfigDict(arbitrary_types_allowed=True)

    status: Literal["completed", "failed", "fenced", "cancelled"]
    result_json: str | None = None
    error: str | None = None
    error_type: str | None = None
    epoch: int | None = None
    node_id: str | None = None
    #: The run's exception, to re-raise in the driver; only when it survives pickling. Never stored.
    exception: Any = Field(default=None, exclude=True)


def _portable(e: BaseException) -> BaseException | None:
    """``e`` if it can cross to another process (Ray pickles it), else None."""
    from ray import cloudpickle

    try:
        cloudpickle.loads(cloudpickle.dumps(e))
    except Exception:
        return None
    return e


class SessionActor:
    """Hosts one session's run. Created by the Supervisor, never restarted by Ray.

    ``request_json`` is a :class:`loomray.session.RunRequest` as JSON. The
    constructor does the cheap, failure-prone parts (store, agent, request) so
    a bad configuration fails actor creation with a clear error.
    """

    def __init__(self, config: RuntimeConfig, agent: AgentSpec, request_json: str) -> None:
        from loomray.session import RunRequest

        self._config = config
        self._agent_spec = agent
        self._agent, self._extra_tools = agent.load()
        self._request = RunRequest.model_validate_json(request_json)
        self._request_json = request_json
        self._store = config.open_store()
        ctx = ray.get_runtime_context()
        self._node_id = ctx.get_node_id()
        self._owner = f"ray:{ctx.get_actor_id()}@{self._node_id[:12]}:{os.getpid()}"
        self._task: asyncio.Task | None = None
        self._started = time.time()

    async def run(self) -> Outcome:
        """Run (or join the run in flight) and return its outcome. Never raises for a run's failure."""
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._execute())
        return await asyncio.shield(self._task)

    async def _execute(self) -> Outcome:
        from loomray.session import execute_request
        from storage.errors import LeaseLostError

        try:
            result = await execute_request(
                self._agent, self._request, self._store,
                max_checkpoints_per_session=self._config.max_checkpoints_per_session,
                extra_tools=self._extra_tools, owner=self._owner,
                agent_ref=self._agent_spec.ref, node_id=self._node_id,
            )
            outcome = Outcome(status="completed", result_json=result.model_dump_json(), node_id=self._node_id)
        except LeaseLostError as e:
            # A newer incarnation (or another runtime) owns the session: stop, write nothing more.
            log.warning("session %r fenced on node %s: %s", self._request.session_id, self._node_id, e)
            outcome = Outcome(status="fenced", error=str(e), error_type=type(e).__name__, node_id=self._node_id,
                              exception=_portable(e))
        except asyncio.CancelledError:
            outcome = Outcome(status="cancelled", node_id=self._node_id)
        except Exception as e:  # the run's own failure: reported, never retried (it would fail again)
            outcome = Outcome(status="failed", error=f"{type(e).__name__}: {e}", error_type=type(e).__name__,
                              node_id=self._node_id, exception=_portable(e))
        # Nobody may come to collect (a supervisor mid-restart): do not linger forever as a detached actor.
        asyncio.get_running_loop().call_later(self._config.linger_s, _kill_self)
        return outcome

    async def info(self) -> dict[str, Any]:
        """Where and what this incarnation is (for status and tests)."""
        return {"session_id": self._request.session_id, "user_id": self._request.user_id,
                "request_json": self._request_json,
                "node_id": self._node_id, "pid": os.getpid(), "owner": self._owner,
                "finished": self._task is not None and self._task.done(), "started": self._started}

    async def cancel(self) -> None:
        """Stop the run in flight (its last checkpoint stays; it can be resumed)."""
        if self._task is not None:
            self._task.cancel()

    def stop(self) -> None:
        """Exit this actor process cleanly (called once its outcome is collected)."""
        close = getattr(self._store, "close", None)
        if close is not None:
            close()
        ray.actor.exit_actor()


def _kill_self() -> None:
    ray.kill(ray.get_runtime_context().current_actor, no_restart=True)


@dataclass
class _Watched:
    """The supervisor's view of one session."""

    session_id: str
    user_id: str | None
    request_json: str
    agent: AgentSpec | None
    handle: Any = None
    incarnation: int = 0
    last_node: str | None = None
    done: asyncio.Future | None = None
    task: asyncio.Task | None = None


def _alive_nodes(exclude: str | None) -> list[str]:
    nodes = [n["NodeID"] for n in ray.nodes() if n.get("Alive")]
    others = [n for n in nodes if n != exclude]
    return others or nodes


def session_actor_options(config: RuntimeConfig, session_id: str, user_id: str | None, *,
                          avoid_node: str | None = None) -> dict[str, Any]:
    """The ``.options()`` for a session actor: defaults, then ``config.actor_options``.

    On a restart (``avoid_node`` set) and with no scheduling strategy of the
    user's, prefer (softly) a live node other than the one that failed.
    """
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    options: dict[str, Any] = {
        "name": session_actor_name(session_id, user_id),
        "namespace": NAMESPACE,
        "lifetime": "detached",
        "num_cpus": 0,
        "max_restarts": 0,
        "max_task_retries": 0,
    }
    options.update(config.actor_options or {})
    if avoid_node is not None and "scheduling_strategy" not in (config.actor_options or {}):
        options["scheduling_strategy"] = NodeAffinitySchedulingStrategy(random.choice(_alive_nodes(avoid_node)),
                                                                        soft=True)
    return options


class Supervisor:
    """Starts, watches, restarts and forks session actors; detached, one per cluster.

    Its state is derived: on first use (and every ``reconcile_interval_s``) it
    adopts every active session row a Ray actor owned, attaching to the live
    actor by name or restarting it from the store. So a supervisor killed and
    re-created, or one on a new cluster pointed at the same store, picks up
    every active session.
    """

    def __init__(self, config: RuntimeConfig, reconcile_interval_s: float = 30.0) -> None:
        self._config = config
        self._store = config.open_store()
        self._reconcile_interval_s = reconcile_interval_s
        self._sessions: dict[tuple[str | None, str], _Watched] = {}
        self._started: asyncio.Task | None = None
        self._background: list[asyncio.Task] = []
        self._restarts = 0

    # -- lifecycle -------------------------------------------------------------
    async def ready(self) -> dict[str, Any]:
        """Adopt the store's active sessions (once) and start background work; return a summary."""
        await self._ensure_started()
        return {"store": self._config.store_url, "sessions": len(self._sessions), "restarts": self._restarts,
                "node_id": ray.get_runtime_context().get_node_id()}

    async def _ensure_started(self) -> None:
        # Async actors cannot start tasks from __init__; the first call does it.
        if self._started is None:
            self._started = asyncio.get_running_loop().create_task(self._adopt())
            self._background.append(asyncio.get_running_loop().create_task(self._reconcile_loop()))
            if self._config.compact_interval_s:
                self._background.append(asyncio.get_running_loop().create_task(self._compact_loop()))
        await asyncio.shield(self._started)

    async def _adopt(self) -> list[str]:
        """Take ownership of every active Ray session in the index that nobody here watches."""
        rows = []
        for state in ACTIVE_STATES:
            rows += await asyncio.to_thread(self._store.list_sessions, status=state, user_id=...)
        adopted = []
        for row in rows:
            key = (row.user_id, row.session_id)
            # node_id is set only by a Ray session actor: rows of in-process runtimes are not ours.
            if key in self._sessions or not row.node_id or not row.spec_json:
                continue
            # A newer lease than the row's means a live owner elsewhere took over: not ours to restart.
            if row.epoch < await asyncio.to_thread(self._store.current_epoch, row.session_id, user_id=row.user_id):
                continue
            agent = AgentSpec(ref=row.agent_ref) if row.agent_ref else None
            w = _Watched(row.session_id, row.user_id, row.spec_json, agent, last_node=row.node_id,
                         done=asyncio.get_running_loop().create_future())
            self._sessions[key] = w
            try:
                w.handle = ray.get_actor(session_actor_name(row.session_id, row.user_id), namespace=NAMESPACE)
            except ValueError:
                w.handle = None  # gone: the watcher restarts it
            w.task = asyncio.get_running_loop().create_task(self._watch(w))
            adopted.append(row.session_id)
        if adopted:
            log.info("supervisor adopted %d session(s) from %s", len(adopted), self._config.store_url)
        return adopted

    async def _reconcile_loop(self) -> None:
        while True:
            await asyncio.sleep(self._reconcile_interval_s)
            try:
                await self._adopt()
            except Exception as e:  # the index may be briefly unreadable; try again next round
                log.warning("supervisor reconcile failed: %s: %s", type(e).__name__, e)

    async def _compact_loop(self) -> None:
        while True:
            await asyncio.sleep(self._config.compact_interval_s)
            try:
                report = await asyncio.to_thread(self._store.compact)
                log.info("index compacted: %s", report)
            except Exception as e:  # compaction is an optimisation; never fatal
                log.warning("background compaction failed: %s: %s", type(e).__name__, e)

    # -- sessions --------------------------------------------------------------
    async def submit(self, agent: AgentSpec, request_json: str) -> dict[str, Any]:
        """Start a session actor for ``request_json`` and watch it; returns at once."""
        from loomray.errors import LoomrayUserError
        from loomray.session import RunRequest

        await self._ensure_started()
        request = RunRequest.model_validate_json(request_json)
        key = (request.user_id, request.session_id)
        current = self._sessions.get(key)
        if current is not None and not current.done.done():
            raise LoomrayUserError(f"session {request.session_id!r} (user {request.user_id!r}) is already running")
        w = _Watched(request.session_id, request.user_id, request_json, agent,
                     done=asyncio.get_running_loop().create_future())
        self._sessions[key] = w
        try:
            w.handle = await self._start(w, avoid_node=None)
        except BaseException:
            del self._sessions[key]
            raise
        w.task = asyncio.get_running_loop().create_task(self._watch(w))
        return {"session_id": w.session_id, "user_id": w.user_id, "actor": session_actor_name(w.session_id, w.user_id)}

    async def result(self, session_id: str, user_id: str | None = None) -> Outcome:
        """Wait for the session's run to end and return its outcome."""
        from loomray.errors import LoomrayUserError

        await self._ensure_started()
        w = self._sessions.get((user_id, session_id))
        if w is None:
            raise LoomrayUserError(f"session {session_id!r} (user {user_id!r}) is not supervised on this cluster")
        return await asyncio.shield(w.done)

    async def run_many(self, agent: AgentSpec, request_jsons: list[str]) -> list[Outcome]:
        """Fan-out: one actor per request, at most ``max_concurrent_forks`` at once; outcomes in order."""
        gate = asyncio.Semaphore(max(1, self._config.max_concurrent_forks))

        async def one(request_json: str) -> Outcome:
            from loomray.session import RunRequest

            request = RunRequest.model_validate_json(request_json)
            async with gate:
                await self.submit(agent, request_json)
                return await self.result(request.session_id, request.user_id)

        return list(await asyncio.gather(*(one(r) for r in request_jsons)))

    async def status(self) -> list[dict[str, Any]]:
        """One dict per supervised session: ids, incarnation, last node, state."""
        await self._ensure_started()
        out = []
        for w in self._sessions.values():
            state = w.done.result().status if w.done.done() else "running"
            out.append({"session_id": w.session_id, "user_id": w.user_id, "incarnation": w.incarnation,
                        "node_id": w.last_node, "state": state})
        return out

    async def cancel(self, session_id: str, user_id: str | None = None) -> bool:
        """Cancel a running session (it keeps its checkpoints and can be resumed)."""
        w = self._sessions.get((user_id, session_id))
        if w is None or w.done.done() or w.handle is None:
            return False
        await w.handle.cancel.remote()
        return True

    # -- internals -------------------------------------------------------------
    async def _start(self, w: _Watched, *, avoid_node: str | None) -> Any:
        if w.agent is None:
            from loomray.errors import LoomrayRunError

            raise LoomrayRunError(
                f"session {w.session_id!r} cannot be restarted: its agent was passed by value and its actor is "
                "gone; give the agent an importable reference (module:attr) to make it recoverable")
        options = session_actor_options(self._config, w.session_id, w.user_id, avoid_node=avoid_node)
        actor_cls = ray.remote(SessionActor)
        deadline = time.monotonic() + 30
        while True:
            try:
                handle = actor_cls.options(**options).remote(self._config, w.agent, w.request_json)
                break
            except ValueError as e:  # the name is held by another incarnation
                existing = await self._existing(options["name"], w.request_json)
                if existing is not None:
                    return existing
                if time.monotonic() > deadline:
                    raise
                log.info("actor name %s busy (%s); retrying", options["name"], e)
                await asyncio.sleep(0.2)
        w.incarnation += 1
        return handle

    async def _existing(self, name: str, request_json: str) -> Any | None:
        """An actor already holding ``name``: attach if it runs this very request, else stop it.

        A leftover from an earlier request of the same session (finished, not
        yet collected) must not answer for this one.
        """
        try:
            handle = ray.get_actor(name, namespace=NAMESPACE)
            info = await handle.info.remote()
        except (ValueError, ray.exceptions.RayActorError):
            return None  # gone meanwhile; the caller retries creation
        if info.get("request_json") == request_json and not info.get("finished"):
            return handle
        ray.kill(handle, no_restart=True)
        return None

    async def _watch(self, w: _Watched) -> None:
        """Await the actor's run; restart it on death; resolve ``w.done`` with the outcome."""
        from loomray.errors import LoomrayRunError

        while True:
            if w.handle is None:
                if w.incarnation >= self._config.max_restarts_per_session:
                    return await self._finish(w, Outcome(status="failed", error="restart limit reached",
                                                         error_type="RestartLimit"), mark_failed=True)
                try:
                    w.handle = await self._start(w, avoid_node=w.last_node)
                    self._restarts += 1
                except LoomrayRunError as e:
                    return await self._finish(w, Outcome(status="failed", error=str(e), error_type=type(e).__name__),
                                              mark_failed=True)
            try:
                outcome = await w.handle.run.remote()
            except ray.exceptions.ActorUnavailableError:
                # Not death: the node is unreachable but not yet declared dead. run() is idempotent; rejoin.
                await asyncio.sleep(0.2)
                continue
            except ray.exceptions.RayActorError as e:
                if e.actor_init_failed:  # the constructor raised (bad store options, broken agent): would recur
                    return await self._finish(w, Outcome(status="failed", error=str(e), error_type="ActorInitFailed"),
                                              mark_failed=True)
                log.warning("session %r lost its actor (%s); restarting", w.session_id, type(e).__name__)
                w.handle = None
                continue
            except Exception as e:  # constructor failure (bad store URL, unimportable agent): do not loop
                return await self._finish(w, Outcome(status="failed", error=f"{type(e).__name__}: {e}",
                                                     error_type=type(e).__name__), mark_failed=True)
            w.last_node = outcome.node_id
            return await self._finish(w, outcome, mark_failed=False)

    async def _finish(self, w: _Watched, outcome: Outcome, *, mark_failed: bool) -> None:
        if mark_failed:
            from storage import SessionRow

            from loomray.records import utcnow

            row = SessionRow(session_id=w.session_id, user_id=w.user_id, status="failed", updated_at=utcnow(),
                             agent_ref=w.agent.ref if w.agent else None, spec_json=w.request_json,
                             node_id=w.last_node, error=outcome.error)
            try:
                await asyncio.to_thread(self._store.put_session, row)
            except Exception as e:
                log.warning("could not mark session %r failed: %s", w.session_id, e)
        if w.handle is not None:
            try:
                await w.handle.stop.remote()
            except ray.exceptions.RayActorError:
                pass  # exit_actor ends the call with an actor error; that is the clean path
        if not w.done.done():
            w.done.set_result(outcome)
