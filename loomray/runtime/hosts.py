"""Dense placement: sessions as activations, many per Ray host actor (docs/ray-notes.md, "Dense placement").

An activation is a :class:`SessionActor` minus the process: same lease, fencing, journal and recovery
rule, its own task; only the process is shared, so a fork starts no process. Which host: placement.py.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import threading
import time
import uuid
from typing import TYPE_CHECKING, Any

import ray

from loomray.errors import SessionNotHosted, SessionStartError
from loomray.runtime.actors import AgentSpec, Outcome, RuntimeConfig, store_key
from loomray.runtime.loop_guard import guard_loop
from loomray.runtime.raylet_watch import DrainableExecutor, watch_raylet
from loomray.runtime.session_actor import SessionActor
from loomray.session import RunRequest
from loomray.storage import Store

if TYPE_CHECKING:  # pragma: no cover
    from loomray.runtime.placement import HostPool
    from loomray.runtime.placement_rules import HostRecord

log = logging.getLogger("loomray.runtime.hosts")

#: Name prefix of host actors (namespace ``loomray``), ``loomray/host/{store key}/{12 hex}``. A ``/``
#: can never occur in a session actor's name (ids refuse it), so host and session actor names cannot collide.
HOST_PREFIX = "loomray/host/"
#: Threads of a host's default executor: store calls and sync tools of all its sessions.
#: Threads start on demand, so an idle host holds few.
HOST_THREADS = 256


def host_prefix(store_url: str) -> str:
    """``loomray/host/{store key}/``: the name prefix of the hosts of ``store_url``'s supervisor."""
    return f"{HOST_PREFIX}{store_key(store_url)}/"


def host_actor_name(store_url: str) -> str:
    """A fresh, unique host actor name for ``store_url`` (``loomray/host/{store key}/{12 hex}``)."""
    return f"{host_prefix(store_url)}{uuid.uuid4().hex[:12]}"


class Activation(SessionActor):
    """One session inside a host: a :class:`SessionActor` that shares the host's process and store."""

    def __init__(self, host: SessionHost, config: RuntimeConfig, agent: AgentSpec, request_json: str,
                 events_to: Any, store: Store) -> None:
        super().__init__(config, agent, request_json, events_to, store=store)
        self._host = host
        # The lease owner names the host (several activations share its actor id and pid).
        self._owner = f"ray-host:{host.name}@{self._node_id[:12]}:{os.getpid()}"

    @property
    def key(self) -> tuple[str | None, str]:
        return (self._request.user_id, self._request.session_id)

    def _schedule_linger(self) -> None:
        # Collected by the supervisor (deactivate) as a rule; if nobody comes, drop it later.
        asyncio.get_running_loop().call_later(self._config.linger_s, self._host._expire, self)

    def finished(self) -> bool:
        return self._task is not None and self._task.done()


class SessionHost:
    """An async Ray actor hosting many session activations, each addressed by ``(session_id, user_id)``.

    A host with no session for ``idle_s`` exits by itself.
    """

    def __init__(self, name: str, pool_key: str, idle_s: float = 600.0) -> None:
        self.name = name
        self._pool_key = pool_key
        self._idle_s = idle_s
        self._activations: dict[tuple[str | None, str], Activation] = {}
        self._stores: dict[str, Any] = {}
        self._stores_lock = threading.Lock()
        ctx = ray.get_runtime_context()
        self._node_id = ctx.get_node_id()
        self._pid = os.getpid()
        self._started = False
        self._activating = 0
        self._last_busy = time.monotonic()
        self._activated_total = 0
        self._activation_calls = 0

    def _start(self) -> None:
        # Async actors cannot touch their event loop in __init__; the first call does it.
        if self._started:
            return
        self._started = True
        loop = asyncio.get_running_loop()
        executor = DrainableExecutor(max_workers=HOST_THREADS, thread_name_prefix="loomray-host")
        loop.set_default_executor(executor)
        guard_loop(loop, executor)  # a loop that dies ends the process: its sessions are reactivated elsewhere
        self._watchdog = loop.create_task(watch_raylet(
            lambda: [a._task for a in self._activations.values() if a._task is not None], executor))
        if self._idle_s and self._idle_s > 0:
            loop.create_task(self._idle_watch())

    async def ready(self) -> dict[str, Any]:
        """Where this host runs and how loaded it is: name, pool, node_id, pid, sessions, activated (sessions
        ever activated here), activation_calls (the ``activate_many`` calls they came in)."""
        self._start()
        return {"name": self.name, "pool": self._pool_key, "node_id": self._node_id, "pid": self._pid,
                "sessions": len(self._activations), "activated": self._activated_total,
                "activation_calls": self._activation_calls}

    # -- activations -------------------------------------------------------------
    def _store_for(self, config: RuntimeConfig) -> Any:
        """The store of ``config``, opened once per host and shared by its sessions (thread-safe)."""
        key = json.dumps([config.store_url, config.storage_options], sort_keys=True, default=repr)
        with self._stores_lock:
            store = self._stores.get(key)
            if store is None:
                store = self._stores[key] = config.open_store()
            return store

    def _build(self, config: RuntimeConfig, agent: AgentSpec, request_json: str, events_to: Any) -> Activation:
        return Activation(self, config, agent, request_json, events_to, self._store_for(config))

    async def activate(self, config: RuntimeConfig, agent: AgentSpec, request_json: str,
                       events_to: Any = None) -> dict[str, Any]:
        """Activate a session here and start its run; idempotent for the same request.

        :class:`SessionStartError` when the agent, the request or the store is unusable.
        """
        self._start()
        request = RunRequest.model_validate_json(request_json)
        key = (request.user_id, request.session_id)
        current = self._activations.get(key)
        if current is not None:
            if current._request_json == request_json and not current.finished():
                return await self._info(current)
            # A leftover of an earlier run of this session; if it still runs, the new lease fences it anyway.
            self._activations.pop(key, None)
            if not current.finished() and current._task is not None:
                current._task.cancel()
        self._activating += 1
        try:
            # Off the loop: unpickling the agent and reading the checkpoint block.
            act = await asyncio.to_thread(self._build, config, agent, request_json, events_to)
        except Exception as e:
            raise SessionStartError(f"session {request.session_id!r} could not start: {type(e).__name__}: {e}") \
                from None
        finally:
            self._activating -= 1
            self._last_busy = time.monotonic()
        if key in self._activations and self._activations[key]._request_json == request_json:
            return await self._info(self._activations[key])  # a concurrent identical activate won
        self._activations[key] = act
        self._activated_total += 1
        # Start at once (a fork's clock runs from here); run() joins the task.
        act._task = asyncio.get_running_loop().create_task(act._execute())
        return await self._info(act)

    async def activate_many(self, config: RuntimeConfig, agent: AgentSpec, request_jsons: list[str],
                            events_to: Any = None) -> list[dict[str, Any]]:
        """:meth:`activate` each request in order: ``{"info": ...}`` or ``{"error": message}`` per request."""
        self._activation_calls += 1

        async def one(request_json: str) -> dict[str, Any]:
            try:
                return {"info": await self.activate(config, agent, request_json, events_to)}
            except Exception as e:
                return {"error": str(e) if isinstance(e, SessionStartError) else f"{type(e).__name__}: {e}"}
        # One after another, each run's task started as soon as it is built (as separate calls arrive): built
        # all at once, the first session would wait for the last one's build.
        return [await one(r) for r in request_jsons]

    def _get(self, session_id: str, user_id: str | None) -> Activation:
        act = self._activations.get((user_id, session_id))
        if act is None:
            raise SessionNotHosted(f"host {self.name} holds no session {session_id!r} (user {user_id!r})")
        return act

    async def run(self, session_id: str, user_id: str | None = None) -> Outcome:
        """The session's :class:`~loomray.runtime.actors.Outcome` once its run ends (joins the run in flight)."""
        return await self._get(session_id, user_id).run()

    async def progress(self, session_id: str, user_id: str | None = None) -> dict[str, Any]:
        """The activation's cheap live status (as ``SessionActor.progress``) plus this host's name."""
        return {**await self._get(session_id, user_id).progress(), "host": self.name}

    async def info(self, session_id: str, user_id: str | None = None) -> dict[str, Any]:
        """Where and what the activation is (as ``SessionActor.info``) plus this host's name."""
        return await self._info(self._get(session_id, user_id))

    async def _info(self, act: Activation) -> dict[str, Any]:
        return {**await act.info(), "host": self.name}

    async def cancel(self, session_id: str, user_id: str | None = None) -> None:
        """Cancel the session's run in flight (its checkpoints stay; it can be resumed)."""
        await self._get(session_id, user_id).cancel()

    async def deactivate(self, session_id: str, user_id: str | None = None) -> bool:
        """Forget the session's activation (its outcome was collected); False if none was here."""
        act = self._activations.pop((user_id, session_id), None)
        if act is None:
            return False
        if not act.finished() and act._task is not None:
            act._task.cancel()
        self._last_busy = time.monotonic()
        return True

    def _expire(self, act: Activation) -> None:
        if self._activations.get(act.key) is act:
            log.info("dropping uncollected session %r after linger_s", act.key[1])
            del self._activations[act.key]
            self._last_busy = time.monotonic()

    async def sessions(self) -> list[dict[str, Any]]:
        """Every activation here: session_id, user_id, request_json, finished (the supervisor's directory)."""
        return [{"session_id": a._request.session_id, "user_id": a._request.user_id,
                 "request_json": a._request_json, "finished": a.finished()} for a in self._activations.values()]

    async def retire_if_idle(self) -> bool:
        """Exit now (True) if no session is here or being activated; checked on the host's own loop, so an
        activation cannot slip in between the check and the exit."""
        if self._activations or self._activating:
            return False
        log.info("host %s retired while idle: its resources are wanted elsewhere", self.name)
        ray.kill(ray.get_runtime_context().current_actor, no_restart=True)
        return True

    async def _idle_watch(self) -> None:
        period = max(0.5, min(30.0, self._idle_s / 4))
        while True:
            await asyncio.sleep(period)
            if self._activations or self._activating:
                self._last_busy = time.monotonic()
            elif time.monotonic() - self._last_busy >= self._idle_s:
                log.info("host %s idle for %.0f s; exiting", self.name, self._idle_s)
                ray.kill(ray.get_runtime_context().current_actor, no_restart=True)
                return


class _Method:
    """``handle.run.remote()`` for an activation: one host call, addressed by session."""

    def __init__(self, handle: ActivationHandle, method: str) -> None:
        self._handle, self._method = handle, method

    def remote(self, *args: Any) -> Any:
        return self._handle._call(self._method, *args)


class ActivationHandle:
    """The supervisor's handle on one activation; answers like a session actor's handle.

    A host found dead is reported to the pool before the error reaches the caller; a host that no longer
    holds the session raises ``ActorDiedError`` too, so the supervisor reactivates it either way.
    """

    def __init__(self, pool: HostPool, host: HostRecord, session_id: str, user_id: str | None) -> None:
        self._pool = pool
        self.host = host
        self.session_id = session_id
        self.user_id = user_id
        self._released = False
        self.run = _Method(self, "run")
        self.progress = _Method(self, "progress")
        self.info = _Method(self, "info")
        self.cancel = _Method(self, "cancel")
        self.stop = _Method(self, "deactivate")

    @property
    def host_name(self) -> str:
        return self.host.name

    def __repr__(self) -> str:
        return f"ActivationHandle({self.session_id!r} on {self.host.name})"

    async def _call(self, method: str, *args: Any) -> Any:
        try:
            return await getattr(self.host.handle, method).remote(self.session_id, self.user_id, *args)
        except ray.exceptions.ActorDiedError:
            self._pool.host_lost(self.host)
            raise
        except SessionNotHosted as e:
            if method == "deactivate":
                return False
            raise ray.exceptions.ActorDiedError() from e
        finally:
            if method == "deactivate" and not self._released:
                self._released = True
                self._pool.release(self.host)
