"""The session actor and what travels to it: config, agent spec, outcome.

One ``SessionActor`` per session; the detached ``Supervisor`` that owns them
lives in :mod:`loomray.runtime.supervisor`.

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
- **Standbys**: with ``standby_actors`` (default 8) the supervisor keeps that
  many SessionActors started ahead of need (process up, imports done, store
  open; ``loomray/standby/...``). A starting session claims one and
  ``begin()`` makes it that session's actor, so a burst of forks does not
  wait for worker processes (~0.6 s of CPU each) to start; a claimed standby
  serves its one session only, exactly like an actor started for it.
- **Fencing**: an incarnation that loses the lease gets ``LeaseLostError`` on its
  next write; ``run()`` returns outcome ``fenced`` and the supervisor stops the
  actor without restarting it (a newer owner exists).

Only JSON and ids cross into storage; agents travel by value in memory only.
"""

from __future__ import annotations

import asyncio
import fnmatch
import importlib
import logging
import os
import random
import re
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Literal

import ray
from pydantic import BaseModel, ConfigDict, Field

log = logging.getLogger("loomray.runtime.actors")

NAMESPACE = "loomray"
SUPERVISOR_NAME = "loomray:supervisor"

#: Session rows in these states are live work a supervisor must own.
ACTIVE_STATES = ("pending", "running")

#: Name prefix of standby session actors (namespace ``loomray``): pre-started, claimed by one session each.
#: A ``/`` never occurs in a session actor's name (ids refuse it), so the names cannot collide.
STANDBY_PREFIX = "loomray/standby/"
#: Default of ``RuntimeConfig.standby_actors`` (and ``RayRuntime(standby_actors=...)``).
DEFAULT_STANDBY_ACTORS = 8
#: A standby that finds no supervisor on this many checks in a row (one every ``STANDBY_CHECK_S``) exits.
STANDBY_ORPHAN_CHECKS = 2
STANDBY_CHECK_S = 30.0


def standby_actor_name() -> str:
    """A fresh, unique standby actor name (``loomray/standby/{12 hex}``)."""
    return f"{STANDBY_PREFIX}{uuid.uuid4().hex[:12]}"


def session_actor_name(session_id: str, user_id: str | None = None) -> str:
    """``loomray:{user or _}:{session_id}``, the actor's name in the ``loomray`` namespace."""
    return f"loomray:{user_id or '_'}:{session_id}"


_REF = re.compile(r"^[A-Za-z_][\w]*(\.[A-Za-z_][\w]*)*:[A-Za-z_][\w]*(\.[A-Za-z_][\w]*)*$")


def check_ref(ref: Any) -> str:
    """Validate the form of an agent reference ``package.module:attribute``; return it.

    Raises :class:`LoomrayUserError` for anything else (nothing is imported here).
    """
    from loomray.errors import LoomrayUserError

    if not isinstance(ref, str) or not _REF.match(ref):
        raise LoomrayUserError(f"agent reference {ref!r} must look like 'package.module:attribute'")
    return ref


def resolve_ref(ref: str) -> Any:
    """Import ``module:attribute`` (dots allowed in the attribute path) and return the Agent it names.

    Raises :class:`LoomrayUserError` when the form is wrong, the import fails,
    or the object is not an agent.
    """
    from loomray.errors import LoomrayUserError

    module_name, _, attr = check_ref(ref).partition(":")
    try:
        obj: Any = importlib.import_module(module_name)
        for part in attr.split("."):
            obj = getattr(obj, part)
    except (ImportError, AttributeError) as e:
        raise LoomrayUserError(f"cannot import agent reference {ref!r}: {type(e).__name__}: {e}") from e
    if not all(hasattr(obj, a) for a in ("model", "tools", "tuning", "instructions")):
        raise LoomrayUserError(f"agent reference {ref!r} names a {type(obj).__name__}, not a loomray Agent")
    return obj


def check_pattern(pattern: Any) -> str:
    """Validate an allowed-agent pattern: an agent reference, optionally with glob wildcards (``examples.*:agent``)."""
    from loomray.errors import LoomrayUserError

    if not isinstance(pattern, str) or pattern.count(":") != 1 or not all(pattern.partition(":")[::2]) \
            or any(ch.isspace() for ch in pattern):
        raise LoomrayUserError(f"allowed agent pattern {pattern!r} must look like 'package.module:attribute' "
                               "(glob wildcards * ? [] allowed)")
    return pattern


def agent_ref_allowed(ref: Any, patterns: Any) -> bool:
    """Whether agent reference ``ref`` is well formed and matches one of ``patterns`` (globs, case-sensitive).

    What the supervisor asks before importing a reference it read from the
    store: whoever can write to the bucket must not choose what it runs.
    """
    try:
        check_ref(ref)
    except Exception:
        return False
    return any(fnmatch.fnmatchcase(ref, p) for p in patterns)


def set_agent_ref(agent: Any, ref: str) -> Any:
    """Register ``ref`` (``"package.module:attribute"``) as the importable name of ``agent``; return ``agent``.

    ``RayRuntime`` ships an agent by value (cloudpickle, in memory) *and* by
    this reference; the reference is stored in the session row, so a session
    whose actor and supervisor both die, or whose whole cluster is replaced,
    can be restarted by importing it. Without one such a session cannot be
    recovered. The module must be importable on every node.
    """
    agent.loomray_ref = check_ref(ref)
    return agent


def check_standby_actors(value: Any) -> int:
    """Validate ``standby_actors`` (a non-negative int); return it."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"standby_actors must be a non-negative int, got {value!r}")
    return value


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
    #: The supervisor reports a finished session for this long, then forgets it (bounded memory).
    forget_after_s: float = 600.0
    #: Agent references (``module:attr``, glob wildcards allowed) the supervisor may import for a session
    #: it adopts from the store. References submitted to it are allowed as well; nothing else is.
    allowed_agents: tuple[str, ...] = ()
    #: ``"actor"``: one Ray actor (one worker process) per session. ``"dense"``: sessions are
    #: activations hosted many per host actor (:mod:`loomray.runtime.hosts`).
    placement: str = "actor"
    #: Dense: host actors per node that can run them; None = one per CPU of the node (at least one).
    hosts_per_node: int | None = None
    #: Dense: sessions one host holds before placement opens another host.
    sessions_per_host: int = 1000
    #: Dense: a host without sessions for this long exits, so an autoscaler may release its node.
    host_idle_s: float = 600.0
    #: Actor placement: session actors the supervisor keeps started and warm (process up, loomray
    #: imported, store open) per distinct ``actor_options``. A session that starts claims one (no
    #: process start on its path) and the pool refills in the background once the burst is over.
    #: 0 disables: every session then starts its own actor process.
    standby_actors: int = DEFAULT_STANDBY_ACTORS

    def __post_init__(self) -> None:
        if isinstance(self.allowed_agents, str):
            raise TypeError("allowed_agents must be a list of patterns, not one string")
        check_standby_actors(self.standby_actors)
        object.__setattr__(self, "allowed_agents", tuple(check_pattern(p) for p in self.allowed_agents))

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
    def of(cls, agent: Any, extra_tools: Any = ()) -> AgentSpec:
        """``agent`` as a spec: a ``"module:attr"`` string travels by reference only; an Agent
        travels by value (without its runtime: clients and connections stay behind), plus
        its reference if one was registered with :func:`set_agent_ref`."""
        import copy

        from ray import cloudpickle

        if isinstance(agent, str):
            check_ref(agent)
            if extra_tools:
                raise TypeError("extra_tools need the agent by value; an agent reference cannot carry them")
            return cls(ref=agent)
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
    #: Passes completed when the run ended (its last event's turn).
    turn: int | None = None
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
    a bad configuration fails actor creation with a clear error. With
    ``events_to`` (the supervisor's handle) every event of the run is sent
    there in ordered batches, for a driver that passed ``emit``; the batches
    still in flight are flushed before ``run()`` returns.

    **Standby.** Built with ``standby_pool`` (the supervisor's pool key) and no
    request, the actor is a *standby*: its process is up, loomray and the
    store's modules are imported and the store is open, but it hosts nothing.
    :meth:`begin` (called once, by the supervisor) makes it the actor of one
    session, doing what the constructor would have done; from then on it is
    an ordinary session actor, for that session only: a standby that took a
    session's agent or request never serves another one (it exits when that
    session ends, or when ``begin`` fails). A standby that finds no supervisor
    on the cluster for ``STANDBY_ORPHAN_CHECKS`` checks in a row exits.
    """

    def __init__(self, config: RuntimeConfig, agent: AgentSpec | None = None, request_json: str | None = None,
                 events_to: Any = None, store: Any = None, *, standby_pool: str | None = None) -> None:
        ctx = ray.get_runtime_context()
        self._node_id = ctx.get_node_id()
        self._owner = f"ray:{ctx.get_actor_id()}@{self._node_id[:12]}:{os.getpid()}"
        self._config = config
        self._store = store
        self._request: Any = None
        self._request_json: str | None = None
        self._standby_pool = standby_pool
        #: Set by :meth:`begin` before anything of the session is loaded: never reused after that.
        self._claimed = False
        self._standby_watch: asyncio.Task | None = None
        self._task: asyncio.Task | None = None
        self._started = time.time()
        self._events_to = events_to
        self._pending: list[str] = []
        self._flushing: asyncio.Task | None = None
        self._turn = 0
        self._checkpoint_turn: int | None = None
        self._epoch: int | None = None
        self._epoch_task: asyncio.Task | None = None
        self._events = 0
        #: The session's latest checkpoint, read and validated here so an unreadable one fails the
        #: constructor (typed error, no restart loop) and status knows the turn before the run starts.
        #: ``run()`` restores it into the loop (after taking the lease) through ``execute_request``.
        self._restored_turn: int | None = None
        self._restored_checkpoint_id: str | None = None
        if request_json is None:
            if standby_pool is None or agent is not None:
                raise ValueError("a SessionActor needs a request, or standby_pool and nothing else")
            self._warm_up()
            return
        self._load(config, agent, request_json, events_to, store)

    def _load(self, config: RuntimeConfig, agent: AgentSpec | None, request_json: str, events_to: Any,
              store: Any) -> None:
        """Take on the session: agent, request, store, its latest checkpoint (the constructor's failure-prone part)."""
        from loomray.records import load_checkpoint
        from loomray.session import RunRequest

        if agent is None:
            raise ValueError("a session actor needs its agent")
        self._config = config
        self._agent_spec = agent
        self._agent, self._extra_tools = agent.load()
        self._request = RunRequest.model_validate_json(request_json)
        self._request_json = request_json
        # A dense host passes the store it shares among its sessions (loomray.runtime.hosts); a
        # standby passes the one it opened while it waited.
        self._store = config.open_store() if store is None else store
        self._events_to = events_to
        self._started = time.time()
        ckpt = load_checkpoint(self._store, self._request.session_id, "latest", user_id=self._request.user_id)
        if ckpt is not None:
            self._restored_turn, self._restored_checkpoint_id = ckpt.turn, ckpt.checkpoint_id
            self._turn = ckpt.turn

    # -- standby -------------------------------------------------------------------
    def _warm_up(self) -> None:
        """Pay now what a session's start would: imports of the run's path and the open store."""
        import loomray.records  # noqa: F401
        import loomray.runtime.hosts  # noqa: F401
        import loomray.session  # noqa: F401

        self._store = self._config.open_store()
        self._warm_store = _store_key(self._config)

    async def standby(self) -> dict[str, Any]:
        """This actor as a standby: its pool key, node, pid, and (once claimed) its session.

        The supervisor awaits it after creating a standby (it returns once the
        process is warm) and when it finds standbys after a restart. The first
        call starts the check that ends an orphaned standby.
        """
        if self._standby_watch is None and not self._claimed and self._standby_pool is not None:
            self._standby_watch = asyncio.get_running_loop().create_task(self._orphan_watch())
        return {"pool": self._standby_pool, "node_id": self._node_id, "pid": os.getpid(), "claimed": self._claimed,
                "session_id": None if self._request is None else self._request.session_id,
                "user_id": None if self._request is None else self._request.user_id,
                "finished": self._task is not None and self._task.done()}

    async def _orphan_watch(self) -> None:
        missed = 0
        while not self._claimed:
            await asyncio.sleep(STANDBY_CHECK_S)
            if self._claimed:
                return
            try:
                await asyncio.to_thread(ray.get_actor, SUPERVISOR_NAME, NAMESPACE)
                missed = 0
            except ValueError:
                missed += 1
            except Exception:  # GCS briefly unreachable: not evidence of anything
                continue
            if missed >= STANDBY_ORPHAN_CHECKS and not self._claimed:
                log.info("standby %s: no supervisor on the cluster; exiting", self._owner)
                _kill_self()
                return

    async def begin(self, config: RuntimeConfig, agent: AgentSpec, request_json: str,
                    events_to: Any = None) -> dict[str, Any]:
        """Make this standby the actor of the session ``request_json`` (once; then it is a session actor).

        Raises what the constructor would (bad agent, unreadable checkpoint);
        the supervisor then discards this process and starts the session the
        ordinary way, which reports the error.
        """
        if self._claimed or self._standby_pool is None:
            raise RuntimeError("this actor is not an unclaimed standby")
        self._claimed = True
        if self._standby_watch is not None:
            self._standby_watch.cancel()
        warm = self._store if getattr(self, "_warm_store", None) == _store_key(config) else None
        if warm is None and self._store is not None:
            close = getattr(self._store, "close", None)
            if close is not None:
                close()
        self._load(config, agent, request_json, events_to, warm)
        return {"node_id": self._node_id, "pid": os.getpid(), "owner": self._owner}

    async def run(self) -> Outcome:
        """Run (or join the run in flight) and return its outcome. Never raises for a run's failure."""
        if self._request is None:
            raise RuntimeError("a standby has no session to run (begin() first)")
        if self._task is None:
            from loomray.runtime.hosts import watch_raylet

            # Stop and exit as soon as this node's raylet dies rather than run on for ~2 s as a zombie
            # (created first: it installs the executor the run's writes go through).
            self._watchdog = asyncio.get_running_loop().create_task(watch_raylet(lambda: [self._task]))
            self._task = asyncio.get_running_loop().create_task(self._execute())
        outcome = await asyncio.shield(self._task)
        from loomray.runtime.hosts import node_lost

        if node_lost():  # stopped because this node is lost: never answer; the caller sees this actor die
            await asyncio.Event().wait()
        watchdog = getattr(self, "_watchdog", None)
        if watchdog is not None:
            watchdog.cancel()  # the run is over: nothing left to stop
        return outcome

    async def _execute(self) -> Outcome:
        from loomray.session import execute_request
        from storage.errors import LeaseLostError

        base = {"node_id": self._node_id}
        try:
            result = await execute_request(
                self._agent, self._request, self._store,
                max_checkpoints_per_session=self._config.max_checkpoints_per_session,
                extra_tools=self._extra_tools, owner=self._owner, emit=self._on_event,
                agent_ref=self._agent_spec.ref, node_id=self._node_id,
            )
            outcome = Outcome(status="completed", result_json=result.model_dump_json(), turn=result.turns, **base)
        except LeaseLostError as e:
            # A newer incarnation (or another runtime) owns the session: stop, write nothing more.
            log.warning("session %r fenced on node %s: %s", self._request.session_id, self._node_id, e)
            outcome = Outcome(status="fenced", error=str(e), error_type=type(e).__name__, exception=_portable(e),
                              **base)
        except asyncio.CancelledError:
            outcome = Outcome(status="cancelled", **base)
        except Exception as e:  # the run's own failure: reported, never retried (it would fail again)
            outcome = Outcome(status="failed", error=f"{type(e).__name__}: {e}", error_type=type(e).__name__,
                              exception=_portable(e), **base)
        if self._epoch_task is not None:
            await asyncio.wait([self._epoch_task], timeout=10)
        outcome.epoch = self._epoch
        if outcome.turn is None:
            outcome.turn = self._turn
        await self._flush_all()
        # Nobody may come to collect (a supervisor mid-restart): do not linger forever as a detached actor.
        self._schedule_linger()
        return outcome

    def _schedule_linger(self) -> None:
        """After the outcome: exit in ``linger_s`` unless collected first (a host overrides this)."""
        asyncio.get_running_loop().call_later(self._config.linger_s, _kill_self)

    # -- events ------------------------------------------------------------------
    async def _on_event(self, event: Any) -> None:
        self._events += 1
        self._turn = event.turn
        if event.type == "checkpoint" and event.ok:
            self._checkpoint_turn = event.turn
        if event.type == "run_start" and self._epoch_task is None:
            # The lease was taken just before the run started; read its epoch off the loop's path.
            self._epoch_task = asyncio.get_running_loop().create_task(self._read_epoch())
        if self._events_to is not None:
            self._pending.append(event.model_dump_json())
            if self._flushing is None or self._flushing.done():
                self._flushing = asyncio.get_running_loop().create_task(self._flush())

    async def _read_epoch(self) -> None:
        try:
            self._epoch = await asyncio.to_thread(self._store.current_epoch, self._request.session_id,
                                                  user_id=self._request.user_id)
        except Exception as e:  # only for status reports
            log.debug("could not read the epoch of %r: %s", self._request.session_id, e)

    async def _flush(self) -> None:
        """Send pending events in order, one batch at a time (the loop never waits for this)."""
        while self._pending:
            batch, self._pending = self._pending, []
            try:
                await self._events_to.push_events.remote(self._request.session_id, self._request.user_id, batch)
            except Exception as e:  # the driver's stream is best-effort; the run does not depend on it
                log.warning("dropped %d event(s) of %r: %s", len(batch), self._request.session_id, e)
                try:  # a supervisor re-created under its name gets the next batches
                    self._events_to = ray.get_actor(SUPERVISOR_NAME, namespace=NAMESPACE)
                except ValueError:
                    pass

    async def _flush_all(self) -> None:
        if self._events_to is None:
            return
        try:
            if self._flushing is not None:
                await asyncio.wait_for(asyncio.shield(self._flushing), timeout=10)
            await asyncio.wait_for(self._flush(), timeout=10)
        except asyncio.TimeoutError:
            log.warning("event stream of %r did not drain in 10 s", self._request.session_id)

    # -- queries -------------------------------------------------------------------
    async def progress(self) -> dict[str, Any]:
        """Cheap live status: passes completed, the turn of the latest checkpoint written, epoch, node."""
        return {"turn": self._turn, "checkpoint_turn": self._checkpoint_turn, "epoch": self._epoch,
                "restored_turn": self._restored_turn, "restored_checkpoint_id": self._restored_checkpoint_id,
                "node_id": self._node_id, "events": self._events,
                "finished": self._task is not None and self._task.done()}

    async def info(self) -> dict[str, Any]:
        """Where and what this incarnation is (for status and tests)."""
        return {"session_id": None if self._request is None else self._request.session_id,
                "user_id": None if self._request is None else self._request.user_id,
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


def _store_key(config: RuntimeConfig) -> str:
    """What identifies an open store: its URL and options."""
    return json_key([config.store_url, config.storage_options])


def _kill_self() -> None:
    ray.kill(ray.get_runtime_context().current_actor, no_restart=True)


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


#: Options of a session actor that are per actor, not part of what a standby pool is for.
_PER_ACTOR = ("name", "namespace", "lifetime", "get_if_exists")


def standby_options(config: RuntimeConfig) -> tuple[str, dict[str, Any]]:
    """``(pool key, options)`` of standby actors for sessions of ``config``: a session's options, unnamed.

    Standbys are made exactly like the session actors they stand in for
    (``actor_options``: resources, CPUs, runtime env, scheduling strategy);
    the key groups the sessions one pool can serve: the options' JSON
    (non-JSON values by repr).
    """
    options = session_actor_options(config, "_", None)
    for k in _PER_ACTOR:
        options.pop(k, None)
    key = json_key(options)
    return key, {**options, "namespace": NAMESPACE, "lifetime": "detached"}


def json_key(value: Any) -> str:
    """``value`` as canonical JSON: a dict key for options that is the same in every process.

    Keys sorted; an object that is not JSON (a scheduling strategy) by its
    type and attributes, else by its repr: a default repr holds the object's
    address, so a config unpickled per call would make a new key each time.
    """
    import json

    def plain(o: Any) -> Any:
        attrs = getattr(o, "__dict__", None)
        if attrs is not None:
            return {"__type__": f"{type(o).__module__}.{type(o).__qualname__}", **attrs}
        return repr(o)

    return json.dumps(value, sort_keys=True, default=plain)


def __getattr__(name: str) -> Any:
    # The Supervisor moved to loomray.runtime.supervisor; old imports keep working.
    if name == "Supervisor":
        from loomray.runtime.supervisor import Supervisor

        return Supervisor
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
