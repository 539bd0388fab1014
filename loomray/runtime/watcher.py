"""Watching sessions: start a session's actor, await its run, restart it where it died, record its end.

A dead actor gets a new incarnation from the store, preferring another live node (its new lease epoch
fences a partitioned old one). What would fail again is marked failed instead: an actor that failed to
construct, an agent passed by value whose actor is gone, a session past ``max_restarts_per_session``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from dataclasses import dataclass, field
from typing import Any

import ray

from loomray import telemetry
from loomray.errors import LoomrayRunError
from loomray.ids import new_id
from loomray.records import utcnow
from loomray.run_errors import index_error, record_error
from loomray.runtime import active
from loomray.runtime.actors import AgentSpec, Outcome, RuntimeConfig, session_actor_name, session_actor_options
from loomray.runtime.connection import NAMESPACE
from loomray.runtime.handoffs import same_handoff
from loomray.runtime.placement import HostPool
from loomray.runtime.placement_rules import demand_of
from loomray.runtime.session_actor import session_actor_class
from loomray.storage import SessionRow, Store

log = logging.getLogger("loomray.runtime.watcher")

#: Crashes of shared session hosts (their node up) a session may be present at before it gets a process of its own.
QUARANTINE_AFTER = 2


def _new_outcome_future() -> asyncio.Future[Outcome]:
    """A session's outcome, to come (made in the supervisor's event loop)."""
    return asyncio.get_running_loop().create_future()


@dataclass
class WatchedSession:
    """The supervisor's view of one session."""

    session_id: str
    user_id: str | None
    request_json: str
    agent: AgentSpec | None
    handle: Any = None
    incarnation: int = 0
    last_node: str | None = None
    #: Resolves with the session's :class:`Outcome` once its run ended (or it was given up).
    done: asyncio.Future[Outcome] = field(default_factory=_new_outcome_future)
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
    #: Starts not charged against ``max_restarts_per_session``: restarts after a shared host died while
    #: its node was up (the session was one of many there; see :meth:`SessionWatcher.after_death`).
    uncharged: int = 0
    #: Times a shared host died with this session on it while the host's node was up.
    host_crashes: int = 0
    #: Moved to a process of its own after ``QUARANTINE_AFTER`` such deaths.
    quarantined: bool = False
    #: Deaths charged to it under the supervisors before this one (from its active mark, on adoption).
    charged_before: int = 0

    @property
    def charged(self) -> int:
        """Starts that count against the session's restart limit, across supervisors."""
        return self.charged_before + self.incarnation - self.uncharged

    def describe(self, placement: str) -> dict[str, Any]:
        """This session as the supervisor's ``status`` reports it (``placement``: the one it runs with)."""
        return {"session_id": self.session_id, "user_id": self.user_id,
                "status": self.done.result().state if self.done.done() else "running",
                "node_id": self.last_node, "host": self.host, "placement": placement,
                "epoch": self.epoch, "incarnation": self.incarnation, "restarts": max(0, self.incarnation - 1),
                "charged_restarts": max(0, self.charged - 1), "quarantined": self.quarantined,
                "turn": self.turn, "error": self.error}


class SessionWatcher:
    """Starts, watches and restarts one supervisor's sessions (see the module docstring)."""

    def __init__(self, config: RuntimeConfig, store: Store) -> None:
        self._config = config
        self._store = store
        #: Starts made by watchers (a lost actor replaced, an adopted session whose actor was gone).
        self.restarts = 0
        #: Session hosts for dense placement, made on first use.
        self._hosts: HostPool | None = None

    def config_of(self, w: WatchedSession) -> RuntimeConfig:
        """The config a session runs with: its submitting runtime's, else the supervisor's."""
        return w.config or self._config

    def host_pool(self) -> HostPool:
        """The dense placement's host pool (created on first use, in the supervisor actor)."""
        if self._hosts is None:
            self._hosts = HostPool(self._config.store_url, ray.get_runtime_context().current_actor)
        return self._hosts

    # -- starting ----------------------------------------------------------------
    async def start(self, w: WatchedSession, *, avoid_node: str | None) -> Any:
        """Start the session's next incarnation (not on ``avoid_node`` if another can take it); its handle."""
        if w.agent is None:
            raise LoomrayRunError(
                f"session {w.session_id!r} cannot be restarted: its agent was passed by value and its actor is "
                "gone; submit it by reference (module:attr) to make it recoverable")
        config = self.config_of(w)
        if config.placement == "dense":  # an activation on a session host: no process start
            activation = await self.host_pool().activate(config, w.agent, w.request_json, w.session_id, w.user_id,
                                                          avoid_node=avoid_node, stream_events=w.stream_events)
            w.incarnation += 1
            w.host = activation.host_name
            # Where a first incarnation runs: its host's node, which placement knows (asking the host for it is
            # one more call per fork to a host busy starting the rest of a fan-out). A restart keeps the lost node.
            w.last_node = w.last_node or activation.host.node_id
            return activation
        return await self._start_own_actor(w, config, avoid_node=avoid_node)

    async def _start_own_actor(self, w: WatchedSession, config: RuntimeConfig, *, avoid_node: str | None) -> Any:
        """Create the session's own actor, named after it; attach to one that runs this very request already."""
        options = session_actor_options(config, w.session_id, w.user_id, avoid_node=avoid_node)
        if self._hosts is not None:  # idle session hosts must not hold what this actor asks for
            await self._hosts.make_room(demand_of(options))
        w.host = options["name"]
        actor_cls = session_actor_class()
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

    async def _existing(self, name: str, request_json: str) -> Any | None:
        """An actor already holding ``name``: attach if it runs this very request, else stop it (a leftover of an
        earlier request must not answer for this one)."""
        try:
            handle = ray.get_actor(name, namespace=NAMESPACE)
            info = await handle.info.remote()
        except (ValueError, ray.exceptions.RayActorError):
            return None  # gone meanwhile; the caller retries creation
        if info.get("request_json") == request_json and not info.get("finished"):
            return handle
        ray.kill(handle, no_restart=True)
        return None

    async def attach(self, w: WatchedSession) -> Any | None:
        """The running session actor or activation of an adopted session, or None (gone: restart it)."""
        name = session_actor_name(self._config.store_url, w.session_id, w.user_id)
        try:
            handle = ray.get_actor(name, namespace=NAMESPACE)
            w.host = name
            return handle
        except ValueError:
            pass
        activation = await self.host_pool().find(w.session_id, w.user_id)
        if activation is not None:
            w.host = activation.host_name
        return activation

    async def rejoin(self, w: WatchedSession) -> Any | None:
        """The actor or activation that runs, or ran, ``w``'s very hand-off (a driver's resend), or None.

        Finished or not: a run that ended while no supervisor watched it waits in its lingering actor for
        someone to collect its outcome, and a new incarnation would take a second lease to answer it.
        """
        handle = await self.attach(w)
        if handle is None:
            return None
        try:
            info = await handle.info.remote()
        except Exception:  # gone meanwhile (or its host no longer holds it): start it instead
            return None
        if not same_handoff(info.get("request_json"), w.request_json):
            return None  # an earlier request's leftover: starting this one stops it
        w.incarnation += 1
        return handle

    # -- watching ----------------------------------------------------------------
    async def watch(self, w: WatchedSession) -> None:
        """Await the actor's run; restart it on death; resolve ``w.done`` with the outcome."""
        while True:
            if w.handle is None:
                limit = self.config_of(w).max_restarts_per_session
                if w.charged >= limit:
                    return await self.finish(w, Outcome(status="failed", error=_limit_reason(w, limit),
                                                        error_type="RestartLimit"), mark_failed=True)
                try:
                    w.handle = await self.start(w, avoid_node=w.last_node)
                    self.restarts += 1
                    telemetry.record_restart(self.config_of(w).placement, self._store.url)
                except LoomrayRunError as e:
                    return await self.finish(w, Outcome(status="failed", error=str(e), error_type=type(e).__name__),
                                             mark_failed=True)
            try:
                outcome = await w.handle.run.remote()
            except ray.exceptions.ActorUnavailableError:
                # Not death: the node is unreachable but not yet declared dead. run() is idempotent; rejoin.
                await asyncio.sleep(0.2)
                continue
            except ray.exceptions.RayActorError as e:
                if e.actor_init_failed:  # the constructor raised (bad store options, broken agent): would recur
                    return await self.finish(w, Outcome(status="failed", error=str(e), error_type="ActorInitFailed"),
                                             mark_failed=True)
                log.warning("session %r lost its actor (%s); restarting", w.session_id, type(e).__name__)
                await self.after_death(w, e)
                w.handle = None
                continue
            except Exception as e:  # anything else would recur on a restart: report, do not loop
                return await self.finish(w, Outcome(status="failed", error=f"{type(e).__name__}: {e}",
                                                    error_type=type(e).__name__), mark_failed=True)
            w.last_node = outcome.node_id or w.last_node
            w.epoch = outcome.epoch or w.epoch
            return await self.finish(w, outcome, mark_failed=False)

    async def after_death(self, w: WatchedSession, error: BaseException) -> None:
        """Attribute the death of the process that ran ``w`` before it is restarted (docs/containment.md).

        A shared host that died with its node up is charged to none of its sessions; a session present at
        ``QUARANTINE_AFTER`` such crashes moves to a session actor of its own.
        """
        config = self.config_of(w)
        if config.placement == "dense":
            host = getattr(w.handle, "host", None)
            node = getattr(host, "node_id", None) or w.last_node
            if not died_with_its_node(error) and await _node_alive(node):
                w.uncharged += 1
                w.host_crashes += 1
                if w.host_crashes >= QUARANTINE_AFTER:
                    quarantine(w, config)
                    log.warning("session %r was on %d session hosts that crashed with their node up; it runs in a "
                                "process of its own from now on", w.session_id, w.host_crashes)
        # In its active mark, so that a supervisor adopting it after this one's death carries on from here: its
        # charged deaths count against the same limit, and a quarantined session is not put back beside others
        # (seed 5 of the chaos checker).
        config = self.config_of(w)
        await active.mark(self._store, w.session_id, w.user_id, config.placement, config.actor_options,
                          host_crashes=w.host_crashes, quarantined=w.quarantined, charged=w.charged)

    async def finish(self, w: WatchedSession, outcome: Outcome, *, mark_failed: bool) -> None:
        """Record the session's end: active mark cleared, row marked failed if asked, actor stopped, ``done``."""
        if outcome.status != "fenced":  # fenced: a newer owner holds the session, and the mark is its
            await active.clear(self._store, w.session_id, w.user_id)
        if mark_failed:
            # The index is read across users: the error's type only; its text stays under the session's prefix.
            await asyncio.to_thread(record_error, self._store, w.session_id, w.user_id, new_id("supervisor"),
                                    outcome.error or "", error_type=outcome.error_type)
            row = SessionRow(session_id=w.session_id, user_id=w.user_id, status="failed", updated_at=utcnow(),
                             agent_ref=w.agent.ref if w.agent else None, node_id=w.last_node,
                             error=index_error(error_type=outcome.error_type), epoch=w.epoch or 0)
            try:
                await asyncio.to_thread(self._store.sessions.put, row)
            except Exception as e:
                log.warning("could not mark session %r failed: %s", w.session_id, e)
        if w.handle is not None:
            try:
                await w.handle.stop.remote()
            except ray.exceptions.RayActorError:
                pass  # the actor kills itself during the call: that is the clean path
        # status() lists every user's sessions: the type only (the caller of result() gets the whole outcome).
        w.error = index_error(error_type=outcome.error_type) if outcome.error else None
        if outcome.turn is not None:
            w.turn = outcome.turn
        w.finished_at = time.monotonic()
        if not w.done.done():
            w.done.set_result(outcome)


def quarantine(w: WatchedSession, config: RuntimeConfig) -> None:
    """From now on ``w`` runs in a session actor of its own (``config`` is the one it ran with)."""
    w.quarantined = True
    w.config = dataclasses.replace(config, placement="actor")


def _limit_reason(w: WatchedSession, limit: int) -> str:
    """Why a session is given up, for its status row: how often, and where, its processes died."""
    if w.quarantined:
        return (f"restart limit reached: its own process died {w.charged - 1} time(s) after it was moved out of "
                f"shared session hosts, which crashed {w.host_crashes} time(s) with it (max_restarts_per_session="
                f"{limit})")
    return f"restart limit reached: its process died {max(0, w.charged - 1)} time(s) (max_restarts_per_session={limit})"


async def _node_alive(node_id: str | None) -> bool:
    """Whether Ray lists ``node_id`` alive (True when unknown: only a node known dead is a node loss)."""
    if node_id is None:
        return True
    try:
        nodes = await asyncio.to_thread(ray.nodes)
    except Exception:
        return True
    return any(n["NodeID"] == node_id and n.get("Alive") for n in nodes)


def died_with_its_node(error: BaseException) -> bool:
    """True when Ray says the actor died because its node did (a node loss, not a crash of its own)."""
    text = str(error)
    return isinstance(error, ray.exceptions.ActorDiedError) and ("its node has died" in text
                                                                  or "node was terminated" in text)
