"""``RayRuntime``: one Ray actor per session, watched by a detached supervisor (docs/api.md, docs/design.md).

The driver side is thin: ``execute`` ships the agent and the request JSON to the store's supervisor and
waits for the outcome; checkpoint reads go straight to the store from this process. The store must be
reachable from every node under the same URL.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import os
import threading
import time
import warnings
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import ray
from pydantic import BaseModel

from loomray.errors import LoomrayRunError, LoomrayUserError
from loomray.events import EmitFn, deliver, event_from_dict
from loomray.ids import new_id
from loomray.records import RunResult
from loomray.runtime.actors import AgentSpec, RuntimeConfig, agent_ref_allowed, ended_result, resolve_ref, run_result
from loomray.runtime.base import Runtime, per_request
from loomray.runtime.connection import connect, normalize_store_url
from loomray.runtime.fanouts import agent_specs
from loomray.runtime.handoffs import handed_off
from loomray.runtime.supervisor import get_supervisor
from loomray.session import RunRequest
from loomray.storage import open_store

if TYPE_CHECKING:  # annotations only: the Agent module imports the runtimes package for its default
    from loomray.agent import Agent

log = logging.getLogger("loomray.runtime.ray")

#: How long a driver waits for a replacement supervisor to adopt its session.
_READOPT_TIMEOUT_S = 60.0


def supervise(store_url: str, *, address: str | None = None, storage_options: dict[str, Any] | None = None,
              interval_s: float = 5.0, stop: threading.Event | None = None,
              report: Callable[[str], None] = print, **config: Any) -> None:
    """Keep the supervisor alive until ``stop`` is set (what ``loomray supervise`` runs on the head).

    Whenever it (re-)creates the supervisor, it makes it adopt every active session of the store at once, so
    a whole cluster lost and replaced resumes here. ``config`` are :class:`RuntimeConfig` fields.
    """
    connect(address)
    cfg = RuntimeConfig(store_url=store_url, storage_options=dict(storage_options or {}), **config)
    allow = list(cfg.allowed_agents)
    stop = stop or threading.Event()
    handle = None
    while not stop.is_set():
        try:
            if handle is None:
                handle = get_supervisor(cfg)
                # Adopt now, not at the next reconcile: a new cluster on an old store resumes at once.
                info = ray.get(handle.ready.remote(True, allow), timeout=120.0)
                report(f"supervisor ready for {store_url}: {info['sessions']} session(s) watched")
            ray.get(handle.ready.remote(), timeout=max(30.0, interval_s))
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError) as e:
            report(f"supervisor lost ({type(e).__name__}); re-creating")
            handle = None
            continue
        stop.wait(interval_s)


class RayRuntime(Runtime):
    """Runs each session in its own Ray actor, or many per host actor; checkpoints and journal live in ``store``.

    Nothing connects to Ray until the first run. Every argument, and the methods beyond the ``Agent`` API,
    is in docs/api.md, "``RayRuntime``".
    """

    def __init__(self, store: str | os.PathLike[str], address: str | None = None, max_checkpoints_per_session: int = 20,
                 actor_options: dict[str, Any] | None = None, *, max_concurrent_forks: int = 32,
                 on_fork_progress: Callable[[dict[str, Any]], Any] | None = None,
                 placement: str = "actor", hosts_per_node: int | None = None, sessions_per_host: int = 1000,
                 allowed_agents: Sequence[str] = (), max_restarts_per_session: int = 20,
                 **storage_options: Any) -> None:
        if not isinstance(store, (str, os.PathLike)):
            raise TypeError("RayRuntime needs a store URL or path (actors on other nodes open it themselves)")
        if actor_options is not None and not isinstance(actor_options, dict):
            raise TypeError(f"actor_options must be a dict, got {type(actor_options).__name__}")
        if storage_options.pop("standby_actors", None) is not None:
            warnings.warn("standby_actors is gone and ignored: actor placement starts a process per session; "
                          "placement='dense' starts none", DeprecationWarning, stacklevel=2)
        url = normalize_store_url(store)  # actors do not share the driver's working directory
        super().__init__(open_store(url, **storage_options), max_checkpoints_per_session=max_checkpoints_per_session)
        self.address = address
        check_placement(placement, hosts_per_node, sessions_per_host)
        self.config = RuntimeConfig(store_url=url, storage_options=dict(storage_options),
                                    max_checkpoints_per_session=self.keep, actor_options=dict(actor_options or {}),
                                    placement=placement, hosts_per_node=hosts_per_node,
                                    sessions_per_host=sessions_per_host,
                                    allowed_agents=tuple(allowed_agents),
                                    max_restarts_per_session=max_restarts_per_session)
        if isinstance(max_concurrent_forks, bool) or not isinstance(max_concurrent_forks, int) \
                or max_concurrent_forks < 1:
            raise ValueError(f"max_concurrent_forks must be a positive int, got {max_concurrent_forks!r}")
        #: Forks of one ``agent.fork`` running at once (the rest queue in the supervisor).
        self.max_concurrent_forks = max_concurrent_forks
        #: Called (sync or async) with fan-out progress dicts while ``agent.fork`` runs.
        self.on_fork_progress = on_fork_progress
        self.progress_interval_s = 0.2
        self._supervisor: Any = None
        self._supervisor_lock = threading.Lock()

    def __repr__(self) -> str:
        return f"RayRuntime({self.config.store_url!r}, address={self.address!r}, placement={self.config.placement!r})"

    # -- the supervisor ---------------------------------------------------------
    def _allow(self, spec: AgentSpec | list[AgentSpec]) -> None:
        """Add submitted agent references to this runtime's allowed list (a replacement supervisor gets them)."""
        for ref in {s.ref for s in (spec if isinstance(spec, list) else [spec])}:
            if ref and not agent_ref_allowed(ref, self.config.allowed_agents):
                self.config = dataclasses.replace(self.config, allowed_agents=(*self.config.allowed_agents, ref))

    def supervisor(self) -> Any:
        """The supervisor handle (connecting and creating it on first use; thread-safe)."""
        handle = self._supervisor
        if handle is None:
            with self._supervisor_lock:  # gathered first runs: one connect, one get_supervisor
                if self._supervisor is None:
                    connect(self.address)
                    self._supervisor = get_supervisor(self.config)
                handle = self._supervisor
        return handle

    async def _call(self, method: str, *args: Any, resendable: bool = False, await_adoption: bool = True) -> Any:
        """Call a supervisor method, or its replacement's (told of a ``resendable`` call's resend: handoffs).

        A replacement may briefly not know a session we started: with ``await_adoption`` the call is repeated
        for ``_READOPT_TIMEOUT_S`` from the loss (not from the call's start: a ``result`` lasts as its run)."""
        deadline = None
        while True:
            try:
                handle = await asyncio.to_thread(self.supervisor)
                if deadline is not None and resendable:
                    return await getattr(handle, method).remote(*args, resend=True)
                return await getattr(handle, method).remote(*args)
            except ray.exceptions.RayActorError:
                # Killed or its node died: the next handle is a replacement that re-adopts from the index.
                self._supervisor = None
                deadline = deadline or time.monotonic() + _READOPT_TIMEOUT_S
            except LoomrayUserError as e:
                if deadline is None or not await_adoption or "not supervised" not in str(e) \
                        or time.monotonic() > deadline:
                    raise
            if time.monotonic() > deadline:
                raise LoomrayRunError(f"the loomray supervisor kept failing while calling {method}")
            await asyncio.sleep(0.2)

    # -- Runtime ----------------------------------------------------------------
    async def execute(self, agent: Agent, request: RunRequest, *, emit: EmitFn | None = None,
                      extra_tools: Sequence[Any] = (), output_type: type[BaseModel] | None = None) -> RunResult:
        """Run ``request`` in a session actor and return its result (restarts are invisible here); ``emit``
        sees the events in order, relayed by the supervisor."""
        spec = AgentSpec.of(agent, extra_tools)
        self._allow(spec)
        request = handed_off(request)
        await self._call("submit", spec, request.model_dump_json(), emit is not None, self.config, resendable=True)
        try:
            # Not waiting for an adoption that may never come: a resend is answered in any case.
            return await self._wait(request.session_id, request.user_id, emit, await_adoption=False)
        except LoomrayUserError as e:
            if "not supervised" not in str(e):
                raise
            # It ended while its supervisor was lost (never adopted): resent, it returns that run's result.
            await self._call("submit", spec, request.model_dump_json(), emit is not None, self.config, True)
            return await self._wait(request.session_id, request.user_id, emit)

    async def _wait(self, session_id: str, user_id: str | None, emit: EmitFn | None,
                    await_adoption: bool = True) -> RunResult:
        if emit is None:
            return run_result(await self._call("result", session_id, user_id, await_adoption=await_adoption),
                              session_id)
        pump = asyncio.create_task(self._pump_events(session_id, user_id, emit))
        try:
            outcome = await self._call("result", session_id, user_id, await_adoption=await_adoption)
        except BaseException:
            pump.cancel()
            raise
        await pump  # the actor flushed every event before its outcome existed: the pump ends with them all
        return run_result(outcome, session_id)

    async def _pump_events(self, session_id: str, user_id: str | None, emit: EmitFn) -> None:
        """Deliver the session's events to ``emit`` until the run is over and they are all delivered."""
        cursor = 0
        while True:
            handle = self._supervisor
            try:
                batch = await self._call("events", session_id, user_id, cursor, 1.0)
            except Exception as e:  # the stream is best-effort; the result does not depend on it
                log.warning("event stream of %r broken: %s", session_id, e)
                return
            if handle is not None and self._supervisor is not handle:
                cursor = 0  # a replacement supervisor: its buffer starts afresh
            if batch["dropped"]:
                log.warning("%d event(s) of %r were dropped before the driver read them", batch["dropped"], session_id)
            for raw in batch["events"]:
                await deliver(emit, event_from_dict(json.loads(raw)))
            cursor = batch["cursor"]
            if batch["done"] and not batch["events"]:
                return

    async def cancel(self, session_id: str, *, user_id: str | None = None) -> None:
        """Cancel durably (as every runtime does), then tell the session's actor, so an in-flight tool stops now
        rather than at the run's next look at the store."""
        await super().cancel(session_id, user_id=user_id)
        try:
            await self._call("cancel", session_id, user_id)
        except Exception as e:  # the run still stops at its next look at the store
            log.info("session %r: telling its actor to stop failed (%s); it stops at its next look", session_id, e)

    async def execute_many(self, agent: Agent | Sequence[Agent], requests: Sequence[RunRequest], *,
                           emit: EmitFn | None = None, extra_tools: Sequence[Any] = (),
                           output_type: type[BaseModel] | None = None) -> list[RunResult]:
        """Fan-out: one actor per request, at most ``max_concurrent_forks`` at once; results in request order.

        ``on_fork_progress`` gets :meth:`~loomray.runtime.fanouts.Fanouts.progress` whenever it changes.
        """
        spec = agent_specs(per_request(agent, requests), extra_tools)
        self._allow(spec)
        fanout_id = new_id("fanout")
        # Each fork's run id is chosen here: a resend continues or answers what a lost supervisor started.
        requests = [handed_off(r, fork=True) for r in requests]
        run = asyncio.create_task(self._call("run_many", spec, [r.model_dump_json() for r in requests],
                                             self.max_concurrent_forks, fanout_id, emit is not None, self.config,
                                             resendable=True))
        watchers = []
        if emit is not None:
            watchers += [asyncio.create_task(self._pump_events(r.session_id, r.user_id, emit)) for r in requests]
        if self.on_fork_progress is not None:
            watchers.append(asyncio.create_task(self._watch_fanout(fanout_id, run)))
        try:
            outcomes = await run
        except BaseException:
            for w in watchers:
                w.cancel()
            await asyncio.gather(*watchers, return_exceptions=True)
            raise
        # Both kinds of watcher end by themselves once the fan-out is over: the last progress, every event.
        await asyncio.gather(*watchers, return_exceptions=True)
        return [run_result(o, r.session_id) for o, r in zip(outcomes, requests, strict=False)]

    async def _watch_fanout(self, fanout_id: str, run: asyncio.Task) -> None:
        """Pass the fan-out's progress to ``on_fork_progress`` whenever it changes, until ``run`` ends."""
        report = self.on_fork_progress
        last = None
        while True:
            done = run.done()
            try:
                progress = await self._call("fanout", fanout_id)
            except Exception as e:
                log.warning("fan-out progress unavailable: %s", e)
                return
            if progress is not None and progress != last and report is not None:
                last = progress
                result = report(progress)
                if asyncio.iscoroutine(result):
                    await result
            if done:
                return
            await asyncio.wait([run], timeout=self.progress_interval_s)

    # -- fire and forget ---------------------------------------------------------
    async def submit(self, agent: Agent | str, prompt: str | None = None, *, session_id: str | None = None,
                     user_id: str | None = None, resume: bool = False, metadata: dict[str, Any] | None = None,
                     effort: str | None = None) -> str:
        """Start a run by agent reference or Agent and return its session id once its actor is created.

        The run outlives this process; follow it with :meth:`wait`, :meth:`status` or the store. A reference
        that does not import here, or names no Agent, raises :class:`LoomrayUserError` here.
        """
        if not resume and not isinstance(prompt, str):
            raise TypeError(f"prompt must be a str, got {type(prompt).__name__}")
        request = RunRequest(kind="resume" if resume else "run", prompt=prompt,
                             session_id=session_id or new_id("sess"), user_id=user_id, metadata=metadata,
                             effort=effort)
        if isinstance(agent, str):
            await asyncio.to_thread(resolve_ref, agent)  # checked here: its actor may start much later
        spec = AgentSpec.of(agent)
        self._allow(spec)
        request = handed_off(request)
        await self._call("submit", spec, request.model_dump_json(), False, self.config, resendable=True)
        return request.session_id

    def submit_sync(self, agent: Agent | str, prompt: str | None = None, **kwargs: Any) -> str:
        """Blocking :meth:`submit` for scripts and the CLI."""
        return asyncio.run(self.submit(agent, prompt, **kwargs))

    async def wait(self, session_id: str, *, user_id: str | None = None, emit: EmitFn | None = None) -> RunResult:
        """Wait for a supervised session's run to end and return its result; ``emit`` sees events only of a
        run started with streaming."""
        try:
            return await self._wait(session_id, user_id, emit)
        except LoomrayUserError as e:  # no supervisor knows it: a run that ended meanwhile answers from the store
            ended = await asyncio.to_thread(ended_result, self.store, session_id, user_id) \
                if "not supervised" in str(e) else None
            if ended is None:
                raise
            return ended

    async def status(self) -> list[dict[str, Any]]:
        """What the supervisor watches: one dict per session (see :meth:`Supervisor.status`)."""
        return await self._call("status")

    def status_sync(self) -> list[dict[str, Any]]:
        """Blocking :meth:`status`."""
        return asyncio.run(self.status())

    async def session(self, session_id: str, *, user_id: str | None = None) -> dict[str, Any] | None:
        """One supervised session's :meth:`status` entry, plus ``pid`` and lease ``owner`` while it runs; or None."""
        return await self._call("session", session_id, user_id)


def check_placement(placement: object, hosts_per_node: object = None, sessions_per_host: object = 1000) -> None:
    """Validate the placement options of :class:`RayRuntime` (``ValueError`` naming the bad one)."""
    if placement not in ("actor", "dense"):
        raise ValueError(f"placement must be 'actor' or 'dense', got {placement!r}")
    if hosts_per_node is not None and (isinstance(hosts_per_node, bool) or not isinstance(hosts_per_node, int)
                                       or hosts_per_node < 1):
        raise ValueError(f"hosts_per_node must be a positive int or None, got {hosts_per_node!r}")
    if isinstance(sessions_per_host, bool) or not isinstance(sessions_per_host, int) or sessions_per_host < 1:
        raise ValueError(f"sessions_per_host must be a positive int, got {sessions_per_host!r}")

