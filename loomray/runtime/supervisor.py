"""The ``Supervisor``: one detached actor per cluster that owns every session actor.

It starts session actors (or, with ``placement="dense"``, activations on
session hosts: :mod:`loomray.runtime.placement`), preferably by handing the
session to a pre-started *standby* actor of its :class:`StandbyPool` (no
worker process start on the session's path), watches each by awaiting its
``run()`` ObjectRef, restarts a dead one from the store on a live node (a new
lease epoch, so a partitioned old incarnation is fenced), runs fan-outs with
bounded concurrency, relays run events to waiting drivers, answers
``status()`` and compacts the index in the background.

Its state is derived, never authoritative: on first use, on
``ready(adopt=True)`` (what ``supervise()`` calls) and every
``reconcile_interval_s`` it adopts every session marked active in the store
(:mod:`loomray.runtime.active`; so a pass costs O(active sessions)) whose
``pending``/``running`` row a Ray actor owned (``node_id`` set) and whose epoch
is still the session's current one, attaching to the live actor or activation
or restarting it, in the placement it ran in, by the row's agent reference. So a killed supervisor, or one on a new cluster pointed at the same
store, picks up every active session. Finished sessions are reported for
``forget_after_s`` and then forgotten, so memory stays bounded however long
the cluster runs.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import json
import logging
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import ray

from loomray.runtime import active
from loomray.runtime.actors import (
    NAMESPACE,
    STANDBY_PREFIX,
    AgentSpec,
    Outcome,
    RuntimeConfig,
    SessionActor,
    agent_ref_allowed,
    check_pattern,
    session_actor_name,
    session_actor_options,
    standby_actor_name,
    standby_options,
)

log = logging.getLogger("loomray.runtime.supervisor")

#: Events kept per session for drivers that poll them (older ones are dropped and counted).
EVENT_BUFFER = 10_000
#: Finished sessions remembered at most, whatever ``forget_after_s`` says.
MAX_FINISHED = 10_000
_fanout_ids = itertools.count(1)
#: Standby actors one pool starts at once while it refills.
STANDBY_REFILL_BATCH = 8
#: A pool refills once no session has started for this long: a burst's own starts come first.
STANDBY_REFILL_QUIET_S = 1.0
#: ... but it waits at most this long for such a moment.
STANDBY_REFILL_MAX_WAIT_S = 10.0
#: Distinct pools (``actor_options``) kept at most, a bound on idle processes whatever callers pass.
STANDBY_MAX_POOLS = 8
#: ``begin`` on a warm standby takes milliseconds; one that has not answered after this long (its node
#: unreachable?) is discarded and the session starts the ordinary way.
STANDBY_BEGIN_TIMEOUT_S = 30.0
#: How long the node list and the directory of standby-born sessions (for adoption) are reused.
_STANDBY_TTL_S = 1.0
_ACTOR_CLASS: Any = None


def _session_actor_class() -> Any:
    """``ray.remote(SessionActor)``, made once per process (each new ActorClass exports the class again)."""
    global _ACTOR_CLASS
    if _ACTOR_CLASS is None:
        _ACTOR_CLASS = ray.remote(SessionActor)
    return _ACTOR_CLASS


def _same_request(a: str, b: str) -> bool:
    """Two run requests as JSON are the same request (whatever their key order or spacing)."""
    try:
        return json.loads(a) == json.loads(b)
    except ValueError:
        return a == b


@dataclass
class _EventLog:
    """A bounded, cursor-addressed buffer of one session's events (JSON strings)."""

    items: deque = field(default_factory=lambda: deque(maxlen=EVENT_BUFFER))
    #: Cursor of ``items[0]``: events before it were dropped.
    base: int = 0
    changed: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def end(self) -> int:
        return self.base + len(self.items)

    def extend(self, events: list[str]) -> None:
        for e in events:
            if len(self.items) == self.items.maxlen:
                self.base += 1
            self.items.append(e)
        self.changed.set()
        self.changed = asyncio.Event()

    def since(self, cursor: int) -> tuple[list[str], int, int]:
        """Events from ``cursor`` on, the next cursor, and how many were dropped before ``cursor`` could see them."""
        start = max(cursor, self.base)
        return list(itertools.islice(self.items, start - self.base, None)), self.end, start - cursor


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
    stream_events: bool = False
    epoch: int | None = None
    turn: int | None = None
    #: The submitting runtime's config (retention, actor options); None = the supervisor's.
    config: RuntimeConfig | None = None
    finished_at: float | None = None
    error: str | None = None
    #: The actor hosting it: its own session actor, or (dense placement) a session host.
    host: str | None = None


@dataclass(eq=False)
class _Standby:
    """The pool's view of one standby session actor."""

    name: str
    key: str
    handle: Any
    #: Resolves once the actor is constructed and warm (its node and pid known); fails if it died.
    ready: asyncio.Future | None = None
    node_id: str | None = None
    pid: int | None = None

    def warm(self) -> bool:
        r = self.ready
        return r is not None and r.done() and not r.cancelled() and r.exception() is None

    def failed(self) -> bool:
        r = self.ready
        return r is not None and r.done() and (r.cancelled() or r.exception() is not None)


class StandbyPool:
    """Pre-started session actors (actor placement), kept warm by the supervisor; see ``RuntimeConfig.standby_actors``.

    One pool per distinct session actor options (:func:`standby_options`),
    started by the first session of a runtime config with those options
    (sized by that config's ``standby_actors``; the latest config wins). A
    standby is created exactly like the session actors it stands in for,
    only named ``loomray/standby/...`` instead of after a session. A session
    start :meth:`claim` s one, warm ones first, then one still starting (its
    process has a head start on a new one), never one on the node the
    session is restarted away from; the supervisor hands it the session
    (``begin``) and it is that session's actor from then on. With none left
    the session starts its own actor as before. Refilling waits until no
    session has started for ``STANDBY_REFILL_QUIET_S`` (a burst's process
    starts are not slowed by the next burst's; at most
    ``STANDBY_REFILL_MAX_WAIT_S``) and starts at most
    ``STANDBY_REFILL_BATCH`` at once per pool; standbys that fail to start
    back the pool off (up to a minute). After a supervisor restart
    :meth:`find` / :meth:`discover_once` find the standbys an earlier
    supervisor made: free ones join their pool, claimed ones are sessions to
    attach to.
    """

    def __init__(self) -> None:
        self._free: dict[str, list[_Standby]] = {}
        #: Pool key -> (target size, config to create standbys with, their Ray options).
        self._want: dict[str, tuple[int, RuntimeConfig, dict[str, Any]]] = {}
        self._refilling: asyncio.Task | None = None
        #: Session starts in flight, and when the last one began: refills wait for a quiet moment.
        self._starting = 0
        self._last_start = 0.0
        self._failures: dict[str, int] = {}
        self._backoff_until: dict[str, float] = {}
        self._nodes: tuple[float, set[str] | None] = (0.0, None)
        self._directory: dict[tuple[str | None, str], tuple[str, Any]] = {}
        self._directory_at = 0.0
        self._discovering: asyncio.Task | None = None
        #: Every standby this pool made or took in (free or claimed): discovery only takes in others.
        self._known: set[str] = set()
        self._full_logged = False
        self.stats = {"created": 0, "claimed": 0, "missed": 0, "discarded": 0, "failed": 0, "trimmed": 0,
                      "discovered": 0}

    # -- sizing ----------------------------------------------------------------------
    def want(self, config: RuntimeConfig) -> str:
        """Keep ``config.standby_actors`` standbys for sessions of ``config`` (latest config wins); its key.

        At most ``STANDBY_MAX_POOLS`` pools: sessions of yet other options start their own actors.
        """
        key, options = standby_options(config)
        current = self._want.get(key)
        if current is None and len(self._want) >= STANDBY_MAX_POOLS:
            if not self._full_logged:
                self._full_logged = True
                log.warning("%d standby pools (one per distinct actor_options) already; sessions of other "
                            "options start their own actors", STANDBY_MAX_POOLS)
            return key
        if current is None or current[0] != config.standby_actors or current[1] != config:
            self._want[key] = (config.standby_actors, config, options)
        self._kick()
        return key

    def _kick(self) -> None:
        if self._refilling is None or self._refilling.done():
            self._refilling = asyncio.get_running_loop().create_task(self._refill())

    def session_starting(self) -> _Starting:
        """Context manager around a session start: refills wait until starts stop for a moment."""
        return _Starting(self)

    async def _refill(self) -> None:
        await self.discover_once()
        while True:
            # Sessions starting now come first; but a steady stream of starts must not starve the pool.
            waited = time.monotonic() + STANDBY_REFILL_MAX_WAIT_S
            while (self._starting or time.monotonic() - self._last_start < STANDBY_REFILL_QUIET_S) \
                    and time.monotonic() < waited:
                await asyncio.sleep(0.1)
            waiting: list[asyncio.Future] = []
            more = False
            self._prune()
            for key, (target, config, options) in list(self._want.items()):
                free = self._free.setdefault(key, [])
                while len(free) > target:
                    self._kill(free.pop(), "trimmed")
                starting = [s.ready for s in free if not s.warm()]
                if time.monotonic() < self._backoff_until.get(key, 0.0):
                    more = True
                    continue
                for _ in range(min(target - len(free), STANDBY_REFILL_BATCH - len(starting))):
                    starting.append(self._create(key, config, options).ready)
                waiting += starting
                more = more or len(free) < target
            if not waiting and not more:
                return
            if waiting:
                await asyncio.wait(waiting, timeout=5.0)
            else:
                await asyncio.sleep(1.0)

    def _create(self, key: str, config: RuntimeConfig, options: dict[str, Any]) -> _Standby:
        name = standby_actor_name()
        handle = _session_actor_class().options(**options, name=name).remote(config, standby_pool=key)
        s = _Standby(name, key, handle)
        self._known.add(name)
        s.ready = asyncio.ensure_future(self._await_ready(s))
        # Its failure is handled where it is noticed; do not also log it as "never retrieved".
        s.ready.add_done_callback(lambda f: f.cancelled() or f.exception())
        self._free.setdefault(key, []).append(s)
        self.stats["created"] += 1
        return s

    async def _await_ready(self, s: _Standby) -> None:
        try:
            info = await s.handle.standby.remote()
        except Exception as e:
            if s not in self._free.get(s.key, ()):
                raise  # claimed or killed meanwhile: whoever took it out deals with it
            self.stats["failed"] += 1
            n = self._failures[s.key] = self._failures.get(s.key, 0) + 1
            self._backoff_until[s.key] = time.monotonic() + min(60.0, 2.0 ** n)
            log.warning("standby actor %s failed to start (%s: %s); pool backs off", s.name, type(e).__name__, e)
            self._remove(s)
            raise
        s.node_id, s.pid = info["node_id"], info["pid"]
        self._failures[s.key] = 0

    def _prune(self) -> None:
        """Forget standbys that failed to start or whose node is gone (they died with it)."""
        alive = self._alive_nodes() if any(s.node_id for f in self._free.values() for s in f) else None
        for free in self._free.values():
            free[:] = [s for s in free if not s.failed()
                       and (alive is None or s.node_id is None or s.node_id in alive)]

    def _remove(self, s: _Standby) -> None:
        free = self._free.get(s.key)
        if free is not None and s in free:
            free.remove(s)

    def _kill(self, s: _Standby, why: str) -> None:
        self._remove(s)
        self.stats[why] += 1
        try:
            ray.kill(s.handle, no_restart=True)
        except Exception:
            pass  # already gone

    # -- claiming --------------------------------------------------------------------
    def _alive_nodes(self) -> set[str] | None:
        at, nodes = self._nodes
        if time.monotonic() - at > _STANDBY_TTL_S:
            try:
                nodes = {n["NodeID"] for n in ray.nodes() if n.get("Alive")}
            except Exception:
                nodes = None
            self._nodes = (time.monotonic(), nodes)
        return nodes

    def claim(self, config: RuntimeConfig, *, avoid_node: str | None = None) -> _Standby | None:
        """Take a standby for a session of ``config`` out of the pool (warm first), or None."""
        key, _ = standby_options(config)
        free = self._free.get(key)
        if not free:
            return None
        alive = self._alive_nodes() if avoid_node is not None or any(s.node_id for s in free) else None

        def usable(s: _Standby) -> bool:
            if s.failed():
                return False
            if s.node_id is None:
                return True
            return s.node_id != avoid_node and (alive is None or s.node_id in alive)

        pick = next((s for s in free if s.warm() and usable(s)), None) \
            or next((s for s in free if not s.warm() and usable(s)), None)
        if pick is not None:
            free.remove(pick)
            self._kick()
        return pick

    def discard(self, s: _Standby, why: BaseException | str) -> None:
        """A claimed standby that did not take its session: it ran some of it, so it never serves another."""
        log.info("standby %s discarded: %s", s.name, why)
        self._kill(s, "discarded")
        self._kick()

    # -- after a supervisor restart ----------------------------------------------------
    async def discover_once(self) -> None:
        """Find the standbys an earlier supervisor made (once; concurrent callers share the pass)."""
        if self._discovering is None:
            self._discovering = asyncio.ensure_future(self._load_directory())
        try:
            await asyncio.shield(self._discovering)
        except Exception as e:  # an optimisation: without it sessions are restarted, standbys made anew
            log.warning("standby discovery failed: %s: %s", type(e).__name__, e)

    async def find(self, session_id: str, user_id: str | None) -> tuple[str, Any] | None:
        """``(name, handle)`` of a live standby-born actor of the session, or None (for adoption)."""
        if time.monotonic() - self._directory_at > _STANDBY_TTL_S:
            await self._load_directory()
        return self._directory.get((user_id, session_id))

    async def _load_directory(self) -> None:
        known_before = set(self._known)
        named = await asyncio.to_thread(ray.util.list_named_actors, True)
        names = {a["name"] for a in named if a.get("namespace") == NAMESPACE
                 and str(a.get("name", "")).startswith(STANDBY_PREFIX)}
        self._known -= known_before - names  # those are gone: keeps the set as small as the live ones
        free = {s.name for f in self._free.values() for s in f}
        directory: dict[tuple[str | None, str], tuple[str, Any, bool]] = {}

        async def one(name: str) -> None:
            try:
                handle = ray.get_actor(name, namespace=NAMESPACE)
                info = await asyncio.wait_for(handle.standby.remote(), 10)
            except Exception:
                return  # gone meanwhile, or unreachable: its session (if any) is restarted instead
            if info.get("claimed"):
                if info.get("session_id") is not None:
                    key = (info.get("user_id"), info["session_id"])
                    # Two actors of one session (an old one lingering, finished): the running one wins.
                    if key not in directory or directory[key][2]:
                        directory[key] = (name, handle, bool(info.get("finished")))
            elif info.get("pool") and name not in self._known:
                # An earlier supervisor's free standby. One of ours is never taken in here: if it is not
                # in the pool it was claimed, and may still be in ``begin``.
                self._known.add(name)
                s = _Standby(name, info["pool"], handle, node_id=info["node_id"], pid=info["pid"])
                s.ready = asyncio.get_running_loop().create_future()
                s.ready.set_result(None)
                self._free.setdefault(s.key, []).append(s)
                self.stats["discovered"] += 1

        await asyncio.gather(*(one(n) for n in names - free))
        self._directory = {k: (v[0], v[1]) for k, v in directory.items()}
        self._directory_at = time.monotonic()

    def status(self) -> dict[str, Any]:
        """Per pool: target, warm and starting standbys; plus counters (created, claimed, missed, ...)."""
        self._prune()
        pools = []
        for key in sorted(set(self._want) | set(self._free)):
            free = self._free.get(key, [])
            pools.append({"key": key, "target": self._want[key][0] if key in self._want else None,
                          "warm": sum(s.warm() for s in free),
                          "starting": sum(not s.warm() and not s.failed() for s in free)})
        return {"pools": pools, **self.stats}


class _Starting:
    def __init__(self, pool: StandbyPool) -> None:
        self._pool = pool

    def __enter__(self) -> None:
        self._pool._starting += 1
        self._pool._last_start = time.monotonic()

    def __exit__(self, *exc: Any) -> None:
        self._pool._starting -= 1
        self._pool._last_start = time.monotonic()


class Supervisor:
    """Starts, watches, restarts and forks session actors; detached, one per cluster (see module docstring)."""

    def __init__(self, config: RuntimeConfig, reconcile_interval_s: float = 30.0) -> None:
        self._config = config
        self._store = config.open_store()
        self._reconcile_interval_s = reconcile_interval_s
        self._sessions: dict[tuple[str | None, str], _Watched] = {}
        self._events: dict[tuple[str | None, str], _EventLog] = {}
        self._fanouts: dict[str, dict[str, Any]] = {}
        self._started: asyncio.Task | None = None
        self._background: list[asyncio.Task] = []
        self._restarts = 0
        self._compactions = 0
        self._adopting: asyncio.Lock | None = None
        #: Agent reference patterns adopted sessions may use: the config's, the operator's, and every
        #: reference submitted here (see :meth:`_refusal`).
        self._allowed: set[str] = set(config.allowed_agents)
        #: Session hosts for dense placement (loomray.runtime.placement), made on first use.
        self._hosts: Any = None
        #: Standby session actors for actor placement (``RuntimeConfig.standby_actors``), made on first use.
        self._standby: StandbyPool | None = None

    # -- lifecycle -------------------------------------------------------------
    async def ready(self, adopt: bool = False, allow: Any = ()) -> dict[str, Any]:
        """Start background work (once); with ``adopt`` also adopt the store's active sessions now.

        ``allow`` adds allowed agent reference patterns first (what ``supervise``
        passes, so a supervisor that already existed learns the operator's list).

        Returns a summary: store URL, sessions watched, restarts made, this node.
        """
        self.allow(allow)
        await self._ensure_started()
        if adopt:
            await self._adopt(foreign=True)
        return {"store": self._config.store_url, "sessions": len(self._sessions), "restarts": self._restarts,
                "compactions": self._compactions, "node_id": ray.get_runtime_context().get_node_id()}

    async def _ensure_started(self) -> None:
        # Async actors cannot start tasks from __init__; the first call does it.
        if self._started is None:
            loop = asyncio.get_running_loop()
            self._started = loop.create_task(self._adopt())
            self._background.append(loop.create_task(self._reconcile_loop()))
            if self._config.compact_interval_s:
                self._background.append(loop.create_task(self._compact_loop()))
        await asyncio.shield(self._started)

    async def _adopt(self, foreign: bool = False) -> list[str]:
        """Take ownership of every active Ray session in the index that nobody here watches.

        Without ``foreign`` only sessions last run on a node this cluster knows
        (alive or dead) are taken: another live cluster may share the store,
        and restarting its sessions here would fence them. ``foreign=True``
        (``supervise()``, an operator's decision) takes every one: the cluster
        that ran them is gone.
        """
        if self._adopting is None:
            self._adopting = asyncio.Lock()
        async with self._adopting:  # two passes at once could both restart one session
            return await self._adopt_locked(foreign)

    async def _adopt_locked(self, foreign: bool) -> list[str]:
        known = None if foreign else {n["NodeID"] for n in ray.nodes()}
        # Only marked sessions nobody here watches, not the whole index: O(active sessions).
        marked = await active.candidates(self._store, self._watching, foreign)
        rows = [row for row, _ in marked]
        placements = {(row.user_id, row.session_id): mark.get("placement") for row, mark in marked}
        adopted = []
        for row in rows:
            key = (row.user_id, row.session_id)
            current = self._sessions.get(key)
            # node_id is set only by a Ray session actor: rows of in-process runtimes are not ours.
            if (current is not None and not current.done.done()) or not row.node_id:
                continue
            if known is not None and row.node_id not in known:
                continue  # another cluster's session (see above)
            # The request lives in the run's record, beside the session's objects (never in the index).
            request_json = await asyncio.to_thread(self._request_of, row)
            if request_json is None:
                continue
            if current is not None and _same_request(current.request_json, request_json):
                continue  # we finished this very run; the row is only behind
            # A newer lease than the row's means a live owner elsewhere took over: not ours to restart.
            if row.epoch < await asyncio.to_thread(self._store.current_epoch, row.session_id, user_id=row.user_id):
                continue
            refusal = self._refusal(row, request_json)
            if refusal is not None:
                await self._refuse(row, refusal)
                continue
            agent = AgentSpec(ref=row.agent_ref) if row.agent_ref else None
            w = _Watched(row.session_id, row.user_id, request_json, agent, last_node=row.node_id,
                         done=asyncio.get_running_loop().create_future(), epoch=row.epoch)
            placement = placements.get(key) or self._config.placement
            if placement != self._config.placement:
                w.config = dataclasses.replace(self._config, placement=placement)  # restart it the way it ran
            self._sessions[key] = w
            # None: gone (its node, or its whole cluster): the watcher restarts it.
            w.handle = await self._live_handle(w)
            w.incarnation = 1 if w.handle is not None else 0
            w.task = asyncio.get_running_loop().create_task(self._watch(w))
            adopted.append(row.session_id)
        if adopted:
            log.info("supervisor adopted %d session(s) from %s", len(adopted), self._config.store_url)
        return adopted

    def _request_of(self, row: Any) -> str | None:
        """The JSON run request of the run ``row`` reports, or None (not known yet: try next pass).

        It is the request in the session's last run record when that record is
        the row's run; a session written before run records keeps it in the row.
        """
        record = self._store.last_run(row.session_id, user_id=row.user_id)
        if record is not None:
            if record.run_id != row.run_id or not record.request:
                return None  # a newer run started and its row is not written yet, or nothing to re-run
            return json.dumps(record.request)
        return row.spec_json or None

    def _allows(self, ref: str) -> bool:
        return agent_ref_allowed(ref, self._allowed)

    def allow(self, patterns: Any) -> None:
        """Allow more agent references (patterns as in ``RuntimeConfig.allowed_agents``) for adopted sessions."""
        self._allowed.update(check_pattern(p) for p in patterns)

    def _refusal(self, row: Any, request_json: str) -> str | None:
        """Why a session read from the store must not be restarted here, or None.

        The store is not trusted to choose code or targets: the agent reference
        must be allowed by the operator (or have been submitted here), and the
        request must be for the very session and user whose partition it came from.
        """
        from loomray.session import RunRequest

        try:
            request = RunRequest.model_validate_json(request_json)
        except ValueError as e:
            return f"its stored run request is unreadable: {str(e).splitlines()[0] if str(e) else type(e).__name__}"
        if (request.session_id, request.user_id) != (row.session_id, row.user_id):
            return (f"its stored run request is for session {request.session_id!r} (user {request.user_id!r}), "
                    f"not for the session it is stored under")
        if row.agent_ref and not self._allows(row.agent_ref):
            return (f"agent reference {row.agent_ref!r} is not allowed on this supervisor "
                    "(allow it with `loomray supervise --allow-agent` or RayRuntime(allowed_agents=...))")
        return None

    async def _refuse(self, row: Any, reason: str) -> None:
        """Log the refusal and mark the session failed with it (it is not adopted, and not retried)."""
        from loomray.records import utcnow
        from storage import SessionRow

        log.warning("supervisor refuses to restart session %r (user %r): %s", row.session_id, row.user_id, reason)
        failed = SessionRow(session_id=row.session_id, user_id=row.user_id, status="failed", updated_at=utcnow(),
                            run_id=row.run_id, agent_ref=row.agent_ref, epoch=row.epoch, node_id=row.node_id,
                            error=f"refused by the supervisor: {reason}")
        try:
            await asyncio.to_thread(self._store.put_session, failed)
        except Exception as e:
            log.warning("could not mark session %r failed: %s", row.session_id, e)
        await active.clear(self._store, row.session_id, row.user_id)

    def _watching(self, key: tuple[str | None, str]) -> bool:
        w = self._sessions.get(key)
        return w is not None and not w.done.done()

    async def _live_handle(self, w: _Watched) -> Any | None:
        """The running session actor or activation of an adopted session, or None."""
        name = session_actor_name(w.session_id, w.user_id)
        try:
            handle = ray.get_actor(name, namespace=NAMESPACE)
            w.host = name
            return handle
        except ValueError:
            pass
        if (w.config or self._config).placement == "actor":  # it may run on a standby it claimed
            try:
                found = await self._standby_pool().find(w.session_id, w.user_id)
            except Exception as e:  # an optimisation: without it the session is restarted (a new epoch)
                log.warning("could not look for standby-born actors: %s: %s", type(e).__name__, e)
                found = None
            if found is not None:
                w.host, handle = found
                return handle
        handle = await self._pool().find(w.session_id, w.user_id)
        if handle is not None:
            w.host = handle.host_name
        return handle

    def _standby_pool(self) -> StandbyPool:
        """The actor placement's pool of standby session actors (created on first use)."""
        if self._standby is None:
            self._standby = StandbyPool()
        return self._standby

    async def standby_status(self, config: RuntimeConfig | None = None) -> dict[str, Any]:
        """The standby pools: per pool its target, warm and starting standbys; counters (see :class:`StandbyPool`).

        With ``config`` (a runtime's, same store), its pool is kept from now on if it was not yet.
        """
        await self._ensure_started()
        if config is not None and config.store_url == self._config.store_url and config.placement == "actor":
            self._standby_pool().want(config)
        return self._standby_pool().status()

    def _pool(self) -> Any:
        """The dense placement's host pool (created on first use)."""
        if self._hosts is None:
            from loomray.runtime.placement import HostPool

            self._hosts = HostPool(ray.get_runtime_context().current_actor)
        return self._hosts

    async def _reconcile_loop(self) -> None:
        while True:
            await asyncio.sleep(self._reconcile_interval_s)
            self._forget()
            try:
                await self._adopt()
            except Exception as e:  # the index may be briefly unreadable; try again next round
                log.warning("supervisor reconcile failed: %s: %s", type(e).__name__, e)

    async def _compact_loop(self) -> None:
        while True:
            await asyncio.sleep(self._config.compact_interval_s)
            await self.compact()

    async def compact(self) -> dict[str, Any] | None:
        """Compact the store's Parquet index now (also runs every ``compact_interval_s``); None on failure."""
        try:
            report = await asyncio.to_thread(self._store.compact)
        except Exception as e:  # compaction is an optimisation; never fatal
            log.warning("index compaction failed: %s: %s", type(e).__name__, e)
            return None
        self._compactions += 1
        log.info("index compacted: %s", report)
        return dict(report.__dict__) if hasattr(report, "__dict__") else {"report": str(report)}

    def _forget(self) -> None:
        """Drop finished sessions reported for longer than ``forget_after_s`` (and beyond ``MAX_FINISHED``)."""
        now = time.monotonic()
        finished = sorted((w.finished_at, k) for k, w in self._sessions.items() if w.finished_at is not None)
        excess = max(0, len(finished) - MAX_FINISHED)
        for i, (at, key) in enumerate(finished):
            if i < excess or now - at >= self._config.forget_after_s:
                del self._sessions[key]
                self._events.pop(key, None)
        for fid in [f for f, p in self._fanouts.items()
                    if p.get("finished_at") is not None and now - p["finished_at"] >= self._config.forget_after_s]:
            del self._fanouts[fid]

    # -- sessions --------------------------------------------------------------
    async def submit(self, agent: AgentSpec, request_json: str, stream_events: bool = False,
                     config: RuntimeConfig | None = None) -> dict[str, Any]:
        """Start a session actor for ``request_json`` and watch it; returns once the actor is constructed.

        The run itself goes on without the caller. A constructor failure (an
        unimportable agent reference, an unreachable store) raises
        :class:`LoomrayUserError` here rather than later. ``config`` is the
        submitting runtime's (its retention and actor options apply to this
        session); it must name this supervisor's store. A session adopted
        later from the index gets the supervisor's own config.
        """
        from loomray.errors import LoomrayUserError
        from loomray.session import RunRequest

        if config is not None and config.store_url != self._config.store_url:
            raise LoomrayUserError(f"this supervisor serves store {self._config.store_url!r}, not {config.store_url!r}")
        # Whoever submits runs code here already: its reference (and its runtime's list) may be adopted later.
        if agent.ref:
            self._allowed.add(agent.ref)
        if config is not None:
            self.allow(config.allowed_agents)
        await self._ensure_started()
        self._forget()
        request = RunRequest.model_validate_json(request_json)
        key = (request.user_id, request.session_id)
        current = self._sessions.get(key)
        if current is not None and not current.done.done():
            raise LoomrayUserError(f"session {request.session_id!r} (user {request.user_id!r}) is already running")
        w = _Watched(request.session_id, request.user_id, request_json, agent,
                     done=asyncio.get_running_loop().create_future(), stream_events=stream_events, config=config)
        self._sessions[key] = w
        if stream_events:
            self._events[key] = _EventLog()
        placement = (config or self._config).placement
        starting = self._standby_pool().session_starting() if placement == "actor" else contextlib.nullcontext()
        with starting:
            # Marked before it starts, so a supervisor that dies in between still leaves it findable.
            await active.mark(self._store, w.session_id, w.user_id, placement)
            try:
                w.handle = await self._start(w, avoid_node=None)
            except BaseException:
                del self._sessions[key]
                await active.clear(self._store, w.session_id, w.user_id)
                raise
            w.task = asyncio.get_running_loop().create_task(self._watch(w))
            try:
                info = await w.handle.info.remote()
                w.last_node = info["node_id"]
            except ray.exceptions.RayActorError as e:
                if getattr(e, "actor_init_failed", False):
                    outcome = await asyncio.shield(w.done)
                    raise LoomrayUserError(
                        f"session {request.session_id!r} could not start: {outcome.error}") from None
                # Died right away (its node?): the watcher restarts it.
        return {"session_id": w.session_id, "user_id": w.user_id, "actor": session_actor_name(w.session_id, w.user_id),
                "node_id": w.last_node}

    async def result(self, session_id: str, user_id: str | None = None) -> Outcome:
        """Wait for the session's run to end and return its outcome."""
        from loomray.errors import LoomrayUserError

        await self._ensure_started()
        w = self._sessions.get((user_id, session_id))
        if w is None:
            # Its row may have appeared since the last reconcile (e.g. a replacement supervisor): look now.
            await self._adopt()
            w = self._sessions.get((user_id, session_id))
        if w is None:
            row = await asyncio.to_thread(self._store.get_session, session_id, user_id=user_id)
            state = f"its last status in the store is {row.status!r}" if row else "the store does not know it"
            raise LoomrayUserError(
                f"session {session_id!r} (user {user_id!r}) is not supervised on this cluster; {state}")
        return await asyncio.shield(w.done)

    async def run_many(self, agent: AgentSpec, request_jsons: list[str], max_concurrent: int | None = None,
                       fanout_id: str | None = None, stream_events: bool = False,
                       config: RuntimeConfig | None = None) -> list[Outcome]:
        """Fan-out: one actor per request, at most ``max_concurrent`` (default ``max_concurrent_forks``) at once.

        Outcomes come back in request order; ``fanout(fanout_id)`` reports
        progress meanwhile.
        """
        from loomray.session import RunRequest

        limit = max(1, max_concurrent or self._config.max_concurrent_forks)
        gate = asyncio.Semaphore(limit)
        requests = [RunRequest.model_validate_json(r) for r in request_jsons]
        fanout_id = fanout_id or f"fanout-{next(_fanout_ids)}"
        progress: dict[str, Any] = {"fanout_id": fanout_id, "total": len(requests), "queued": len(requests),
                                    "running": 0, "completed": 0, "failed": 0, "max_running": 0, "limit": limit,
                                    "sessions": [r.session_id for r in requests], "finished_at": None}
        self._fanouts[fanout_id] = progress

        async def one(request_json: str, request: RunRequest) -> Outcome:
            async with gate:
                progress["queued"] -= 1
                progress["running"] += 1
                progress["max_running"] = max(progress["max_running"], progress["running"])
                try:
                    await self.submit(agent, request_json, stream_events, config)
                    outcome = await self.result(request.session_id, request.user_id)
                except Exception as e:
                    outcome = Outcome(status="failed", error=f"{type(e).__name__}: {e}", error_type=type(e).__name__)
                finally:
                    progress["running"] -= 1
                progress["completed" if outcome.status == "completed" else "failed"] += 1
                return outcome

        try:
            return list(await asyncio.gather(*(one(j, r) for j, r in zip(request_jsons, requests, strict=False))))
        finally:
            progress["finished_at"] = time.monotonic()

    async def fanout(self, fanout_id: str) -> dict[str, Any] | None:
        """Progress of a fan-out: total, queued, running, completed, failed, max_running, limit; None if unknown."""
        p = self._fanouts.get(fanout_id)
        return None if p is None else {k: v for k, v in p.items() if k != "finished_at"} | {
            "done": p["finished_at"] is not None}

    async def status(self) -> list[dict[str, Any]]:
        """One dict per session this supervisor knows (running, or finished within ``forget_after_s``).

        Keys: ``session_id``, ``user_id``, ``status`` (``running``,
        ``completed``, ``failed``, ``fenced``, ``cancelled``; ``state`` is the
        same), ``node_id``, ``epoch``, ``incarnation``, ``restarts``, ``turn``
        (passes completed as of the latest event or checkpoint; asked of live
        actors with a short timeout, else the last value seen), ``error``.
        """
        await self._ensure_started()
        self._forget()
        live = [w for w in self._sessions.values() if not w.done.done() and w.handle is not None]

        async def progress(w: _Watched) -> None:
            try:
                p = await asyncio.wait_for(w.handle.progress.remote(), timeout=2.0)
            except Exception:
                return  # restarting or unreachable: report what we knew
            w.turn, w.epoch, w.last_node = p.get("turn", w.turn), p.get("epoch") or w.epoch, p["node_id"]

        await asyncio.gather(*(progress(w) for w in live))
        return [self._describe(w) for w in self._sessions.values()]

    def _describe(self, w: _Watched) -> dict[str, Any]:
        state = w.done.result().status if w.done.done() else "running"
        return {"session_id": w.session_id, "user_id": w.user_id, "status": state, "state": state,
                "node_id": w.last_node, "host": w.host, "placement": (w.config or self._config).placement,
                "epoch": w.epoch, "incarnation": w.incarnation, "restarts": max(0, w.incarnation - 1),
                "turn": w.turn, "error": w.error}

    async def session(self, session_id: str, user_id: str | None = None) -> dict[str, Any] | None:
        """One supervised session as in :meth:`status`, plus ``pid`` and ``owner`` while it runs; None if unknown."""
        await self._ensure_started()
        w = self._sessions.get((user_id, session_id))
        if w is None:
            return None
        out = self._describe(w)
        if not w.done.done() and w.handle is not None:
            try:
                info = await asyncio.wait_for(w.handle.info.remote(), timeout=5.0)
                out.update(pid=info.get("pid"), owner=info.get("owner"), node_id=info.get("node_id"),
                           host=info.get("host", w.host))
            except Exception:
                pass  # restarting or unreachable: what we knew
        return out

    async def cancel(self, session_id: str, user_id: str | None = None) -> bool:
        """Cancel a running session (it keeps its checkpoints and can be resumed)."""
        w = self._sessions.get((user_id, session_id))
        if w is None or w.done.done() or w.handle is None:
            return False
        await w.handle.cancel.remote()
        return True

    # -- events ------------------------------------------------------------------
    async def push_events(self, session_id: str, user_id: str | None, events: list[str]) -> None:
        """Called by a session actor with a batch of its run's events (JSON), in order."""
        key = (user_id, session_id)
        log_ = self._events.get(key)
        if log_ is None:
            if key not in self._sessions:
                return  # nobody asked for them (or the session was forgotten)
            log_ = self._events[key] = _EventLog()
        log_.extend(events)

    async def events(self, session_id: str, user_id: str | None = None, cursor: int = 0,
                     wait_s: float = 1.0) -> dict[str, Any]:
        """Events of a streamed session from ``cursor`` on; waits up to ``wait_s`` for new ones.

        Returns ``{"events": [json, ...], "cursor": next, "dropped": n, "done": bool}``;
        ``done`` is true once the run ended and every event it sent is included.
        """
        key = (user_id, session_id)
        log_ = self._events.get(key)
        w = self._sessions.get(key)
        if log_ is None:
            return {"events": [], "cursor": cursor, "dropped": 0, "done": w is None or w.done.done()}
        if log_.end <= cursor and not (w is None or w.done.done()) and wait_s > 0:
            waiter = asyncio.ensure_future(log_.changed.wait())
            await asyncio.wait([waiter, w.done], timeout=wait_s, return_when=asyncio.FIRST_COMPLETED)
            waiter.cancel()
        events, nxt, dropped = log_.since(cursor)
        return {"events": events, "cursor": nxt, "dropped": dropped, "done": w is None or w.done.done()}

    # -- internals -------------------------------------------------------------
    async def _start(self, w: _Watched, *, avoid_node: str | None) -> Any:
        if w.agent is None:
            from loomray.errors import LoomrayRunError

            raise LoomrayRunError(
                f"session {w.session_id!r} cannot be restarted: its agent was passed by value and its actor is "
                "gone; submit it by reference (module:attr) to make it recoverable")
        config = w.config or self._config
        if config.placement == "dense":  # an activation on a session host: no process start
            handle = await self._pool().activate(config, w.agent, w.request_json, w.session_id, w.user_id,
                                                 avoid_node=avoid_node, stream_events=w.stream_events)
            w.incarnation += 1
            w.host = handle.host_name
            return handle
        handle = await self._start_on_standby(w, config, avoid_node=avoid_node)
        if handle is not None:
            return handle
        options = session_actor_options(config, w.session_id, w.user_id, avoid_node=avoid_node)
        w.host = options["name"]
        actor_cls = _session_actor_class()
        me = ray.get_runtime_context().current_actor
        deadline = time.monotonic() + 30
        while True:
            try:
                handle = actor_cls.options(**options).remote(config, w.agent, w.request_json,
                                                             me if w.stream_events else None)
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

    async def _start_on_standby(self, w: _Watched, config: RuntimeConfig, *, avoid_node: str | None) -> Any | None:
        """Give the session to a standby actor of the pool: its handle, or None (start one the ordinary way).

        A standby that died or does not answer is discarded and the next one
        tried. One whose ``begin`` raised (the session's agent or checkpoint
        is unusable) is discarded too, and None makes the caller start the
        session's own actor, whose constructor fails and reports it as always.
        """
        pool = self._standby_pool()
        pool.want(config)  # the first session of a config starts its pool (0: none, or empties it)
        if not config.standby_actors:
            return None
        me = ray.get_runtime_context().current_actor
        while True:
            s = pool.claim(config, avoid_node=avoid_node)
            if s is None:
                pool.stats["missed"] += 1
                return None
            # A standby still starting is waited for like a new actor would be; a warm one answers at once.
            timeout = STANDBY_BEGIN_TIMEOUT_S if s.warm() else None
            try:
                await asyncio.wait_for(s.handle.begin.remote(config, w.agent, w.request_json,
                                                             me if w.stream_events else None), timeout)
            except (ray.exceptions.RayActorError, asyncio.TimeoutError) as e:
                pool.discard(s, e)  # dead or unreachable: try the next one
                continue
            except Exception as e:
                pool.discard(s, e)
                return None
            pool.stats["claimed"] += 1
            w.incarnation += 1
            w.host = s.name
            return s.handle

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
            except Exception as e:  # anything else would recur on a restart: report, do not loop
                return await self._finish(w, Outcome(status="failed", error=f"{type(e).__name__}: {e}",
                                                     error_type=type(e).__name__), mark_failed=True)
            w.last_node = outcome.node_id or w.last_node
            w.epoch = outcome.epoch or w.epoch
            return await self._finish(w, outcome, mark_failed=False)

    async def _finish(self, w: _Watched, outcome: Outcome, *, mark_failed: bool) -> None:
        if outcome.status != "fenced":  # fenced: a newer owner holds the session, and the mark is its
            await active.clear(self._store, w.session_id, w.user_id)
        if mark_failed:
            from loomray.records import utcnow
            from storage import SessionRow

            row = SessionRow(session_id=w.session_id, user_id=w.user_id, status="failed", updated_at=utcnow(),
                             agent_ref=w.agent.ref if w.agent else None,
                             node_id=w.last_node, error=outcome.error, epoch=w.epoch or 0)
            try:
                await asyncio.to_thread(self._store.put_session, row)
            except Exception as e:
                log.warning("could not mark session %r failed: %s", w.session_id, e)
        if w.handle is not None:
            try:
                await w.handle.stop.remote()
            except ray.exceptions.RayActorError:
                pass  # exit_actor ends the call with an actor error; that is the clean path
        w.error = outcome.error
        if outcome.turn is not None:
            w.turn = outcome.turn
        w.finished_at = time.monotonic()
        if not w.done.done():
            w.done.set_result(outcome)
