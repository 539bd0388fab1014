"""The ``Supervisor``: one detached actor per store that owns every session actor (docs/design.md).

It is the one place where sessions are started and restarted, so every restart is a fresh lease epoch
decided once. Its state is derived from the store's active-session marks, never authoritative, so a
replacement supervisor picks up every active session.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import Counter
from collections.abc import Iterable
from typing import Any

import ray

from loomray import telemetry
from loomray.errors import LoomrayUserError
from loomray.runtime import active
from loomray.runtime.actors import AgentSpec, Outcome, RuntimeConfig, head_node_id, session_actor_name, supervisor_name
from loomray.runtime.adoption import AdoptionPolicy, same_request
from loomray.runtime.connection import NAMESPACE
from loomray.runtime.event_relay import EventRelay, SessionKey
from loomray.runtime.explorations import Explorations
from loomray.runtime.fanouts import Fanouts
from loomray.runtime.handoffs import pinned
from loomray.runtime.index_compaction import IndexCompaction
from loomray.runtime.watcher import SessionWatcher, WatchedSession
from loomray.session import RunRequest

log = logging.getLogger("loomray.runtime.supervisor")

#: Finished sessions remembered at most, whatever ``forget_after_s`` says.
MAX_FINISHED = 10_000

#: How long telling a session's actor to cancel may wait for it (an actor not started yet answers late).
_TELL_CANCEL_S = 5.0


class Supervisor:
    """Starts, watches, restarts and forks session actors; detached, one per cluster (see module docstring)."""

    def __init__(self, config: RuntimeConfig, reconcile_interval_s: float = 30.0) -> None:
        self._config = config
        self._store = config.open_store()
        self._reconcile_interval_s = reconcile_interval_s
        self._sessions: dict[SessionKey, WatchedSession] = {}
        #: Sessions whose run is not over, per placement (what telemetry's active-sessions gauge shows).
        self._active: Counter[str] = Counter()
        self._awaiting: set[SessionKey] = set()
        self._watcher = SessionWatcher(config, self._store)
        self._adoption = AdoptionPolicy(config, self._store)
        self._events = EventRelay()
        self._fanouts = Fanouts()
        self._compaction = IndexCompaction(self._store)
        self._explorations = Explorations(self, config, self._store, self._adoption)
        self._started: asyncio.Task | None = None
        self._background: list[asyncio.Task] = []
        self._adopting: asyncio.Lock | None = None
        #: Calls learning where new session actors run (kept referenced until they end).
        self._learning: set[asyncio.Task] = set()

    # -- lifecycle -------------------------------------------------------------
    async def ready(self, adopt: bool = False, allow: Iterable[str] = ()) -> dict[str, Any]:
        """Start background work (once), allow ``allow``'s agent patterns, with ``adopt`` adopt now; a summary."""
        self.allow(allow)
        await self._ensure_started()
        if adopt:
            await self._adopt(foreign=True)
        return {"store": self._config.store_url, "sessions": len(self._sessions), "restarts": self._watcher.restarts,
                "compactions": self._compaction.count, "node_id": ray.get_runtime_context().get_node_id()}

    def allow(self, patterns: Iterable[str]) -> None:
        """Allow more agent references (patterns as in ``RuntimeConfig.allowed_agents``) for adopted sessions."""
        self._adoption.allow(patterns)

    async def _ensure_started(self) -> None:
        # Async actors cannot start tasks from __init__; the first call does it.
        if self._started is None:
            loop = asyncio.get_running_loop()
            self._started = loop.create_task(self._adopt())
            self._background.append(loop.create_task(self._reconcile_loop()))
            self._background.append(loop.create_task(telemetry.hold_gauges()))  # Ray drops a gauge not set again
            if self._config.compact_interval_s:
                self._background.append(loop.create_task(self._compaction.every(self._config.compact_interval_s)))
        await asyncio.shield(self._started)

    async def _reconcile_loop(self) -> None:
        while True:
            await asyncio.sleep(self._reconcile_interval_s)
            self._forget()
            try:
                await self._adopt()
            except Exception as e:  # the index may be briefly unreadable; try again next round
                log.warning("supervisor reconcile failed: %s: %s", type(e).__name__, e)

    def _forget(self) -> None:
        """Drop finished sessions reported for longer than ``forget_after_s`` (and beyond ``MAX_FINISHED``)."""
        now = time.monotonic()
        finished = sorted((w.finished_at, k) for k, w in self._sessions.items() if w.finished_at is not None)
        excess = max(0, len(finished) - MAX_FINISHED)
        for i, (at, key) in enumerate(finished):
            if i < excess or now - at >= self._config.forget_after_s:
                del self._sessions[key]
                self._events.drop(key)
        self._fanouts.forget(self._config.forget_after_s)

    # -- the sessions watched ------------------------------------------------------
    def _track(self, w: WatchedSession) -> None:
        """Hold ``w`` as an active session and count it (and whether its outcome waits for a person) for the gauges."""
        key = (w.user_id, w.session_id)
        self._sessions[key] = w
        placement = self._watcher.config_of(w).placement
        self._awaiting.discard(key)
        self._count_active(placement, +1)
        w.done.add_done_callback(lambda done: self._ended(placement, key, done))

    def _ended(self, placement: str, key: SessionKey, done: asyncio.Future) -> None:
        waits = not done.cancelled() and done.exception() is None and done.result().state == "awaiting_approval"
        (self._awaiting.add if waits else self._awaiting.discard)(key)
        self._count_active(placement, -1)

    def _count_active(self, placement: str, change: int) -> None:
        self._active[placement] += change
        telemetry.set_active_sessions(placement, self._active[placement], self._store.url)
        telemetry.set_awaiting_approval(len(self._awaiting), self._store.url)

    def _watching(self, key: SessionKey) -> bool:
        w = self._sessions.get(key)
        return w is not None and not w.done.done()

    async def _adopt(self, foreign: bool = False) -> list[str]:
        """Take ownership of every active Ray session in the index that nobody here watches.

        Without ``foreign`` only sessions last run on a node this cluster knows: another live cluster may
        share the store, and restarting its sessions here would fence them.
        """
        if self._adopting is None:
            self._adopting = asyncio.Lock()
        async with self._adopting:  # two passes at once could both restart one session
            return await self._adopt_locked(foreign)

    async def _adopt_locked(self, foreign: bool) -> list[str]:
        known = None if foreign else {n["NodeID"] for n in ray.nodes()}
        # Only marked sessions nobody here watches, not the whole index: O(active sessions).
        marked = await active.candidates(self._store, self._watching, foreign)
        adopted = []
        for row, mark in marked:
            current = self._sessions.get((row.user_id, row.session_id))
            w = await self._adoption.review(row, mark, current, known)
            if w is None:
                continue
            self._track(w)
            # None: gone (its node, or its whole cluster): the watcher restarts it.
            w.handle = await self._watcher.attach(w)
            w.incarnation = 1 if w.handle is not None else 0
            w.task = asyncio.get_running_loop().create_task(self._watcher.watch(w))
            adopted.append(row.session_id)
        if adopted:
            log.info("supervisor adopted %d session(s) from %s", len(adopted), self._config.store_url)
        await self._explorations.resume_if_due(known, bool(adopted))  # after their branches: one continued joins them
        return adopted

    # -- sessions --------------------------------------------------------------
    async def submit(self, agent: AgentSpec, request_json: str, stream_events: bool = False,
                     config: RuntimeConfig | None = None, resend: bool = False) -> dict[str, Any]:
        """Start a session actor for ``request_json`` and watch it; returns once the actor is created, not started.

        ``config`` is the submitting runtime's and must name this store. A driver's ``resend`` starts no run
        twice (:mod:`~.handoffs`).
        """
        if config is not None and config.store_url != self._config.store_url:
            raise LoomrayUserError(f"this supervisor serves store {self._config.store_url!r}, not {config.store_url!r}")
        # Whoever submits runs code here already: its reference (and its runtime's list) may be adopted later.
        if agent.ref:
            self.allow([agent.ref])
        if config is not None:
            self.allow(config.allowed_agents)
        await self._ensure_started()
        self._forget()
        request = RunRequest.model_validate_json(request_json)
        key = (request.user_id, request.session_id)
        if self._watching(key):
            if same_request(self._sessions[key].request_json, request_json):  # a resend: its run is under way
                return self._submitted(self._sessions[key])
            raise LoomrayUserError(f"session {request.session_id!r} (user {request.user_id!r}) is already running")
        if resend:
            request_json = await pinned(self._store, request, request_json)
        w = WatchedSession(request.session_id, request.user_id, request_json, agent, stream_events=stream_events,
                           config=config)
        self._track(w)
        if stream_events:
            self._events.open(key)
        await self._start_watched(w, rejoin=resend)
        return self._submitted(w)

    async def explore(self, request: dict[str, Any], config: RuntimeConfig | None = None) -> str:
        """Run a submitted exploration (:mod:`loomray.runtime.explorations`); returns its id once it is recorded."""
        await self._ensure_started()
        return await self._explorations.submit(request, config or self._config)

    def _submitted(self, w: WatchedSession) -> dict[str, Any]:
        actor = session_actor_name(self._config.store_url, w.session_id, w.user_id)
        return {"session_id": w.session_id, "user_id": w.user_id, "actor": actor, "node_id": w.last_node}

    async def _start_watched(self, w: WatchedSession, rejoin: bool = False) -> None:
        """Mark the session active, start its first incarnation (``rejoin``: or join the one of its hand-off,
        :meth:`SessionWatcher.rejoin`) and its watcher; learn its node once it runs."""
        # Marked before it starts, so a supervisor that dies in between still leaves it findable.
        config = self._watcher.config_of(w)
        await active.mark(self._store, w.session_id, w.user_id, config.placement, config.actor_options)
        try:
            handle = await self._watcher.rejoin(w) if rejoin else None
            w.handle = handle if handle is not None else await self._watcher.start(w, avoid_node=None)
        except BaseException:
            del self._sessions[(w.user_id, w.session_id)]
            w.done.cancel()  # it never ran: no longer counted as active
            await active.clear(self._store, w.session_id, w.user_id)
            raise
        w.task = asyncio.get_running_loop().create_task(self._watcher.watch(w))
        if w.last_node is None:  # an activation's node is its host's (set by the start); a session actor is asked
            self._learning.add(learn := asyncio.get_running_loop().create_task(self._learn_node(w, w.handle)))
            learn.add_done_callback(self._learning.discard)

    @staticmethod
    async def _learn_node(w: WatchedSession, handle: Any) -> None:
        """Where the session's first incarnation runs once it started (a restart prefers another node)."""
        with contextlib.suppress(Exception):  # it died first: its watcher restarts it
            w.last_node = (await handle.info.remote())["node_id"]

    async def result(self, session_id: str, user_id: str | None = None) -> Outcome:
        """Wait for the session's run to end and return its outcome."""
        await self._ensure_started()
        w = self._sessions.get((user_id, session_id))
        if w is None:
            # Its row may have appeared since the last reconcile (e.g. a replacement supervisor): look now.
            await self._adopt()
            w = self._sessions.get((user_id, session_id))
        if w is None:
            row = await asyncio.to_thread(self._store.sessions.get, session_id, user_id=user_id)
            state = f"its last status in the store is {row.status!r}" if row else "the store does not know it"
            raise LoomrayUserError(
                f"session {session_id!r} (user {user_id!r}) is not supervised on this cluster; {state}")
        return await asyncio.shield(w.done)

    async def run_many(self, agent: AgentSpec | list[AgentSpec], request_jsons: list[str],
                       max_concurrent: int | None = None, fanout_id: str | None = None, stream_events: bool = False,
                       config: RuntimeConfig | None = None, resend: bool = False) -> list[Outcome]:
        """Fan-out: one session per request (``agent``: one for all or one each), ``max_concurrent`` at once.

        Outcomes come back in request order; ``fanout(fanout_id)`` reports progress meanwhile.
        """
        specs = agent if isinstance(agent, list) else [agent] * len(request_jsons)
        spec_of = dict(zip(request_jsons, specs, strict=True))  # each request's JSON is its own: a new session id

        async def run_one(request_json: str, request: RunRequest) -> Outcome:
            await self.submit(spec_of[request_json], request_json, stream_events, config, resend)
            return await self.result(request.session_id, request.user_id)

        limit = max(1, max_concurrent or self._config.max_concurrent_forks)
        return await self._fanouts.run(request_jsons, limit, fanout_id, run_one)

    async def fanout(self, fanout_id: str) -> dict[str, Any] | None:
        """Progress of a fan-out (:meth:`Fanouts.progress`); None if unknown."""
        return self._fanouts.progress(fanout_id)

    async def status(self) -> list[dict[str, Any]]:
        """One dict per session this supervisor knows (:meth:`WatchedSession.describe`); live ones asked briefly."""
        await self._ensure_started()
        self._forget()
        live = [w for w in self._sessions.values() if not w.done.done() and w.handle is not None]

        async def progress(w: WatchedSession) -> None:
            try:
                p = await asyncio.wait_for(w.handle.progress.remote(), timeout=2.0)
            except Exception:
                return  # restarting or unreachable: report what we knew
            w.turn, w.epoch, w.last_node = p.get("turn", w.turn), p.get("epoch") or w.epoch, p["node_id"]

        await asyncio.gather(*(progress(w) for w in live))
        return [w.describe(self._watcher.config_of(w).placement) for w in self._sessions.values()]

    async def session(self, session_id: str, user_id: str | None = None) -> dict[str, Any] | None:
        """One supervised session as in :meth:`status`, plus ``pid`` and ``owner`` while it runs; None if unknown."""
        await self._ensure_started()
        w = self._sessions.get((user_id, session_id))
        if w is None:
            return None
        out = w.describe(self._watcher.config_of(w).placement)
        if not w.done.done() and w.handle is not None:
            try:
                info = await asyncio.wait_for(w.handle.info.remote(), timeout=5.0)
                out.update(pid=info.get("pid"), owner=info.get("owner"), node_id=info.get("node_id"),
                           host=info.get("host", w.host))
            except Exception:
                pass  # restarting or unreachable: what we knew
        return out

    async def cancel(self, session_id: str, user_id: str | None = None) -> bool:
        """Tell a session's actor to stop its run now; the durable cancel (already written) does the rest.

        Waits a few seconds at most: an actor not started yet finds the durable cancel when it takes the lease.
        """
        w = self._sessions.get((user_id, session_id))
        if w is None or w.done.done() or w.handle is None:
            return False
        await asyncio.wait([asyncio.ensure_future(w.handle.cancel.remote())], timeout=_TELL_CANCEL_S)
        return True

    async def compact(self) -> dict[str, Any] | None:
        """Compact the store's Parquet index now (also runs every ``compact_interval_s``); None on failure."""
        return await self._compaction.compact()

    # -- events ------------------------------------------------------------------
    async def push_events(self, session_id: str, user_id: str | None, events: list[str]) -> None:
        """Called by a session actor with a batch of its run's events (JSON), in order."""
        key = (user_id, session_id)
        self._events.push(key, events, supervised=key in self._sessions)

    async def events(self, session_id: str, user_id: str | None = None, cursor: int = 0,
                     wait_s: float = 1.0) -> dict[str, Any]:
        """Events of a streamed session from ``cursor`` on, waiting up to ``wait_s`` (:meth:`EventRelay.read`)."""
        key = (user_id, session_id)
        w = self._sessions.get(key)
        return await self._events.read(key, cursor, wait_s, None if w is None else w.done)


def get_supervisor(config: RuntimeConfig, *, timeout: float = 120.0) -> Any:
    """The supervisor of ``config``'s store on this cluster, created (detached, on the head) if missing.

    :class:`LoomrayUserError` when the actor under that name serves another store (a hash collision).
    """
    options: dict[str, Any] = {
        "name": supervisor_name(config.store_url), "namespace": NAMESPACE, "lifetime": "detached", "get_if_exists": True,
        # Every session has a watcher here and every waiting driver a result() call in flight.
        "num_cpus": 0, "max_restarts": -1, "max_concurrency": 100_000,
    }
    if head_node_id() is not None:
        # The head lives as long as the cluster. A resource, not soft affinity: soft affinity landed on a
        # worker about half the time, and a head re-created with a new node id still carries the resource.
        options["resources"] = {"node:__internal_head__": 0.001}
    handle: Any = ray.remote(Supervisor).options(**options).remote(config)
    info: dict[str, Any] = ray.get(handle.ready.remote(), timeout=timeout)
    if info["store"] != config.store_url:
        raise LoomrayUserError(
            f"the loomray supervisor {supervisor_name(config.store_url)!r} serves store {info['store']!r}, "
            f"not {config.store_url!r}")
    return handle
