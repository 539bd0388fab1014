"""Standby session actors: processes started ahead of need, so a session's start waits for none.

With ``RuntimeConfig.standby_actors`` (actor placement) the supervisor keeps
that many session actors up per distinct ``actor_options``: worker process
started, loomray imported, store open, hosting nothing. A session that starts
claims one and ``begin`` makes it that session's actor, so a burst of forks
does not wait for worker processes (~0.6 s of CPU each) to start; a claimed
standby serves its one session only, exactly like an actor started for it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import ray

from loomray.runtime.actors import RuntimeConfig, standby_actor_name, standby_options, standby_prefix
from loomray.runtime.connection import NAMESPACE
from loomray.runtime.session_actor import session_actor_class

log = logging.getLogger("loomray.runtime.standby")

#: Standby actors one pool starts at once while it refills.
STANDBY_REFILL_BATCH = 8
#: A pool refills once no session has started for this long: a burst's own starts come first.
STANDBY_REFILL_QUIET_S = 1.0
#: ... but it waits at most this long for such a moment (a burst of 24 process starts takes about 10 s on
#: 2 cores; refills started during it only slow its last starts down).
STANDBY_REFILL_MAX_WAIT_S = 30.0
#: Distinct pools (``actor_options``) kept at most, a bound on idle processes whatever callers pass.
STANDBY_MAX_POOLS = 8
#: ``begin`` on a warm standby takes milliseconds; one that has not answered after this long (its node
#: unreachable?) is discarded and the session starts the ordinary way.
STANDBY_BEGIN_TIMEOUT_S = 30.0
#: How long the node list and the directory of standby-born sessions (for adoption) are reused.
_STANDBY_TTL_S = 1.0


@dataclass(eq=False)
class Standby:
    """The pool's view of one standby session actor."""

    name: str
    key: str
    handle: Any
    #: Resolves once the actor is constructed and warm (its node and pid known); fails if it died.
    ready: asyncio.Future | None = None
    node_id: str | None = None
    pid: int | None = None

    def warm(self) -> bool:
        """Constructed and answering: a session claimed now starts at once."""
        r = self.ready
        return r is not None and r.done() and not r.cancelled() and r.exception() is None

    def failed(self) -> bool:
        """It died or never came up: never claim it."""
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

    def __init__(self, store_url: str) -> None:
        #: The store whose sessions this pool serves: its standbys' names carry the store's key.
        self._store_url = store_url
        self._free: dict[str, list[Standby]] = {}
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

    @contextlib.contextmanager
    def session_starting(self) -> Iterator[None]:
        """Context manager around a session start: refills wait until starts stop for a moment."""
        self._starting += 1
        self._last_start = time.monotonic()
        try:
            yield
        finally:
            self._starting -= 1
            self._last_start = time.monotonic()

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
                starting = [s.ready for s in free if s.ready is not None and not s.warm()]
                if time.monotonic() < self._backoff_until.get(key, 0.0):
                    more = True
                    continue
                for _ in range(min(target - len(free), STANDBY_REFILL_BATCH - len(starting))):
                    starting.append(self._create(key, config, options))
                waiting += starting
                more = more or len(free) < target
            if not waiting and not more:
                return
            if waiting:
                await asyncio.wait(waiting, timeout=5.0)
            else:
                await asyncio.sleep(1.0)

    def _create(self, key: str, config: RuntimeConfig, options: dict[str, Any]) -> asyncio.Future:
        """Start one standby of pool ``key``; returns the future of its readiness (it joins the free list now)."""
        name = standby_actor_name(self._store_url)
        handle = session_actor_class().options(**options, name=name).remote(config, standby_pool=key)
        s = Standby(name, key, handle)
        self._known.add(name)
        ready = s.ready = asyncio.ensure_future(self._await_ready(s))
        # Its failure is handled where it is noticed; do not also log it as "never retrieved".
        ready.add_done_callback(lambda f: f.cancelled() or f.exception())
        self._free.setdefault(key, []).append(s)
        self.stats["created"] += 1
        return ready

    async def _await_ready(self, s: Standby) -> None:
        try:
            info = await s.handle.standby.remote()
        except Exception as e:
            if s not in self._free.get(s.key, ()):
                raise  # claimed or killed meanwhile: whoever took it out deals with it
            self.stats["failed"] += 1
            if died_with_its_node(e):
                # Not the standby's fault: it was starting on a node that went away. Start it elsewhere at once
                # (backing off here held a fan-out after a node loss up to a minute).
                log.info("standby actor %s died with its node; the pool refills on the others", s.name)
            else:
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

    def _remove(self, s: Standby) -> None:
        free = self._free.get(s.key)
        if free is not None and s in free:
            free.remove(s)

    def _kill(self, s: Standby, why: str) -> None:
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

    def claim(self, config: RuntimeConfig, *, avoid_node: str | None = None) -> Standby | None:
        """Take a standby for a session of ``config`` out of the pool (warm first), or None."""
        key, _ = standby_options(config)
        free = self._free.get(key)
        if not free:
            return None
        alive = self._alive_nodes() if avoid_node is not None or any(s.node_id for s in free) else None

        def usable(s: Standby) -> bool:
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

    def discard(self, s: Standby, why: BaseException | str) -> None:
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
                 and str(a.get("name", "")).startswith(standby_prefix(self._store_url))}
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
                s = Standby(name, info["pool"], handle, node_id=info["node_id"], pid=info["pid"])
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


def died_with_its_node(error: BaseException) -> bool:
    """True when Ray says the actor died because its node did (a node loss, not a failure to start)."""
    text = str(error)
    return isinstance(error, ray.exceptions.ActorDiedError) and ("its node has died" in text
                                                                  or "node was terminated" in text)
