"""Submitted explorations: the store's supervisor runs them, so they outlive the driver that asked.

The request is recorded (``submit.json``, create-only) and marked (``submitted-explorations/{user}/{id}.json``,
the supervisors' worklist) before anything runs; a replacement supervisor continues every marked one whose
references it allows. docs/exploration.md, "Submitted explorations", has the whole story.
"""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import functools
import inspect
import json
import logging
from collections.abc import Callable, Sequence
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Any

import ray
from pydantic import BaseModel

from loomray.errors import LoomrayUserError
from loomray.events import EmitFn
from loomray.explore import Budget, ModelJudge
from loomray.explore.record import ExplorationRecord, callable_ref
from loomray.ids import new_id
from loomray.run_request import RunRequest
from loomray.runtime.actors import (
    AgentSpec,
    RuntimeConfig,
    check_ref,
    import_ref,
    resolve_ref,
    run_result,
    set_agent_ref,
)
from loomray.runtime.adoption import AdoptionPolicy
from loomray.runtime.base import Runtime, per_request
from loomray.runtime.fanouts import agent_specs
from loomray.runtime.handoffs import handed_off
from loomray.runtime.stored_options import restore_secrets, secret_env_names, storable_options, trusted_options
from loomray.session_store import SessionStore
from loomray.storage import Store, layout
from loomray.storage.ids import user_from_segment
from loomray.variants import Variant, VariantError, variant_agent

if TYPE_CHECKING:
    from loomray.agent import Agent
    from loomray.records import RunResult
    from loomray.runtime.ray_runtime import RayRuntime

log = logging.getLogger("loomray.runtime.explorations")

#: The fields of a submitted exploration's request (``submit.json``); all JSON.
REQUEST_FIELDS = ("exploration_id", "session_id", "user_id", "agent_ref", "judge_ref", "placement", "actor_options",
                  "secret_env_vars", "max_concurrent_forks", "variants", "rounds", "keep", "score_every", "adopt",
                  "from_checkpoint", "budget")

Key = tuple[str | None, str]


def import_judge(ref: str) -> Any:
    """The judge at ``module:attr``: a callable or a ``ModelJudge``; ``LoomrayUserError`` otherwise."""
    obj = import_ref(ref, "judge")
    if not isinstance(obj, ModelJudge) and not callable(obj):
        raise LoomrayUserError(f"judge {ref!r} names a {type(obj).__name__}, not a callable or a ModelJudge")
    return obj


class _OffLoopJudge:
    """A plain function judge run in a thread: the supervisor's event loop serves every session meanwhile.

    It describes itself as the function it wraps (what the stored plan compares on resume)."""

    def __init__(self, fn: Callable[..., Any]) -> None:
        self.fn = fn
        functools.update_wrapper(self, fn)

    def describe(self) -> str:
        return str(callable_ref(self.fn))

    async def __call__(self, judged: Any) -> Any:
        verdict = await asyncio.to_thread(self.fn, judged)
        return await verdict if inspect.isawaitable(verdict) else verdict


def off_loop(judge: Any) -> Any:
    """``judge``, made to run off the event loop when it is a plain (sync) function."""
    if isinstance(judge, ModelJudge) or inspect.iscoroutinefunction(judge) \
            or inspect.iscoroutinefunction(type(judge).__call__):
        return judge
    return _OffLoopJudge(judge)


class SupervisedRuntime(Runtime):
    """The runtime a submitted exploration runs on, inside the supervisor: its sessions are the supervisor's own.

    Every hand-off is a resend (:mod:`loomray.runtime.handoffs`): a continued exploration re-issues requests
    a dead supervisor may have started, and joins them.
    """

    def __init__(self, supervisor: Any, store: SessionStore, config: RuntimeConfig,
                 max_concurrent_forks: int | None = None) -> None:
        super().__init__(store, max_checkpoints_per_session=config.max_checkpoints_per_session)
        self.config, self.max_concurrent_forks = config, max_concurrent_forks
        self._supervisor = supervisor

    async def execute(self, agent: Agent, request: RunRequest, *, emit: EmitFn | None = None,
                      extra_tools: Sequence[Any] = (), output_type: type[BaseModel] | None = None) -> RunResult:
        """Run ``request`` as a supervised session and return its result (a judge session, in practice)."""
        request = handed_off(request)
        try:
            await self._supervisor.submit(AgentSpec.of(agent, extra_tools), request.model_dump_json(), False,
                                          self.config, True)
        except LoomrayUserError as e:
            # A judge session a dead supervisor's exploration started (another request id): its run is the
            # very judge call asked for again, so its result is the answer; anything else is an error.
            if "already running" not in str(e):
                raise
        return run_result(await self._supervisor.result(request.session_id, request.user_id), request.session_id)

    async def execute_many(self, agent: Agent | Sequence[Agent], requests: Sequence[RunRequest], *,
                           emit: EmitFn | None = None, extra_tools: Sequence[Any] = (),
                           output_type: type[BaseModel] | None = None) -> list[RunResult]:
        """The branches of a round: one fan-out of the supervisor; results in request order."""
        spec = agent_specs(per_request(agent, requests), extra_tools)
        requests = [handed_off(r, fork=True) for r in requests]
        outcomes = await self._supervisor.run_many(spec, [r.model_dump_json() for r in requests],
                                                   self.max_concurrent_forks, None, False, self.config, True)
        return [run_result(o, r.session_id) for o, r in zip(outcomes, requests, strict=True)]

    async def cancel(self, session_id: str, *, user_id: str | None = None) -> None:
        """Cancel durably, then tell the session's actor at once (an early-stopped branch stops now)."""
        await super().cancel(session_id, user_id=user_id)
        await self._supervisor.cancel(session_id, user_id)

    def close(self) -> None:
        """Nothing to release: the store is the supervisor's."""


def check_request(request: object) -> dict[str, Any]:
    """A submitted exploration's request with exactly :data:`REQUEST_FIELDS`, its references well formed."""
    if not isinstance(request, dict) or set(request) != set(REQUEST_FIELDS):
        got = sorted(request) if isinstance(request, dict) else type(request).__name__
        raise LoomrayUserError(f"an exploration request has the fields {list(REQUEST_FIELDS)}, got {got}")
    check_ref(request["agent_ref"])
    check_ref(request["judge_ref"])
    try:
        json.dumps(request)
    except (TypeError, ValueError) as e:
        raise LoomrayUserError(f"an exploration request must be JSON: {e}") from e
    return request


def request_doc(config: RuntimeConfig, **fields: Any) -> dict[str, Any]:
    """The request to store for an exploration whose branches run with ``config`` (without its secrets)."""
    return check_request({**fields, "placement": config.placement,
                          "actor_options": storable_options(config.actor_options),
                          "secret_env_vars": secret_env_names(config.actor_options)})


class Explorations:
    """The explorations one supervisor runs; ``adoption`` says which stored references it may import."""

    def __init__(self, supervisor: Any, config: RuntimeConfig, store: Store, adoption: AdoptionPolicy) -> None:
        self._supervisor, self._config, self._store, self._adoption = supervisor, config, store, adoption
        self._running: dict[Key, asyncio.Task] = {}
        #: The allowed references when the marks were last looked at (None: not yet). A live supervisor runs
        #: what was submitted to it; a dead one's marks are found by its replacement's first pass, or when
        #: sessions were adopted or more references allowed since: the periodic pass then costs no LIST.
        self._looked_with: frozenset[str] | None = None

    async def resume_if_due(self, known_nodes: set[str] | None, adopted: bool) -> list[str]:
        """:meth:`resume` on a first, foreign (``known_nodes`` None) or adopting pass, or once more references
        are allowed; else nothing."""
        allowed = self._adoption.allowed
        if known_nodes is not None and not adopted and self._looked_with == allowed:
            return []
        self._looked_with = allowed
        return await self.resume(known_nodes)

    def running(self, user_id: str | None, exploration_id: str) -> bool:
        """Whether this supervisor runs that exploration now."""
        task = self._running.get((user_id, exploration_id))
        return task is not None and not task.done()

    async def submit(self, request: dict[str, Any], config: RuntimeConfig) -> str:
        """Import its agent and judge (failing the caller now), record ``request`` (create-only: the same one
        again is harmless, another under its id refused), mark and run it; returns its exploration id."""
        request = check_request(request)
        if config.store_url != self._config.store_url:
            raise LoomrayUserError(f"this supervisor serves store {self._config.store_url!r}, not {config.store_url!r}")
        # Whoever submits runs code here already: its references (and its runtime's list) may be continued later.
        self._adoption.allow([request["agent_ref"], request["judge_ref"], *config.allowed_agents])
        await asyncio.to_thread(import_judge, request["judge_ref"])
        agent = await asyncio.to_thread(resolve_ref, request["agent_ref"])
        for doc in request["variants"]:  # a tool name the agent lacks, a model that does not resolve: fail now
            variant_agent(agent, Variant.from_json(doc))
        record = self._record(request)
        stored = await asyncio.to_thread(record.put, "submit", request)
        if {k: stored.get(k) for k in REQUEST_FIELDS} != request:
            raise LoomrayUserError(f"exploration {request['exploration_id']!r} was submitted with other arguments")
        await asyncio.to_thread(record.point)
        if not self.running(request["user_id"], request["exploration_id"]):
            await self._mark(request)
            self._start(request, config)
        return str(request["exploration_id"])

    async def resume(self, known_nodes: set[str] | None) -> list[str]:
        """Continue every marked exploration nobody here runs (only those last run on ``known_nodes``, unless
        None); returns their ids. A mark whose request is unreadable or names references not allowed stays."""
        resumed: list[str] = []
        try:
            marks = await asyncio.to_thread(self._marks)
        except Exception as e:  # the next pass tries again
            log.warning("could not list the submitted explorations: %s: %s", type(e).__name__, e)
            return resumed
        for user_id, xid in marks:
            if self.running(user_id, xid):
                continue
            try:
                request = await asyncio.to_thread(self._request_of, user_id, xid, known_nodes)
                config = None if request is None else self._branch_config(request)
            except Exception as e:  # noqa: BLE001 - whoever can write the bucket wrote it: a warning, not a crash
                log.warning("not continuing exploration %r (user %r): %s: %s", xid, user_id, type(e).__name__, e)
                continue
            if request is None or config is None:
                continue
            await self._mark(request)
            self._start(request, config)
            resumed.append(xid)
        if resumed:
            log.info("supervisor continues %d exploration(s): %s", len(resumed), ", ".join(resumed))
        return resumed

    def _marks(self) -> list[Key]:
        out = []
        for info in self._store.objects.list(prefix=layout.SUBMITTED_EXPLORATIONS):
            user, _, name = info.key[len(layout.SUBMITTED_EXPLORATIONS):].partition("/")
            if name.endswith(".json") and "/" not in name:
                out.append((user_from_segment(user), name[:-len(".json")]))
        return out

    def _request_of(self, user_id: str | None, xid: str, known_nodes: set[str] | None) -> dict[str, Any] | None:
        """The stored request of a marked exploration to continue here, or None (another cluster's)."""
        got = self._store.objects.get(key=layout.submitted_exploration_key(user_id, xid))
        mark = json.loads(got.data) if got is not None else None
        if not isinstance(mark, dict) or not isinstance(mark.get("session_id"), str):
            raise ValueError("its mark is gone or names no session")
        if known_nodes is not None and mark.get("node_id") not in known_nodes:
            return None  # run by another live cluster sharing the store, maybe
        stored = ExplorationRecord(self._store.objects, mark["session_id"], user_id, xid).get("submit")
        if stored is None:
            raise ValueError("its record holds no request")
        request = check_request({k: stored.get(k) for k in REQUEST_FIELDS})
        if (request["user_id"], request["exploration_id"]) != (user_id, xid):
            raise ValueError("its request names another exploration")
        refused = [r for r in (request["agent_ref"], request["judge_ref"]) if not self._adoption.allows(r)]
        if refused:
            raise LoomrayUserError(f"references not allowed here: {refused} (allow them: supervise --allow-agent)")
        return request

    def _branch_config(self, request: dict[str, Any]) -> RuntimeConfig:
        """How a continued exploration's branches run: its placement, its stored options as far as trusted."""
        options, dropped = trusted_options(request["actor_options"], self._config.actor_options)
        options, missing = restore_secrets(options, request["secret_env_vars"], self._config.actor_options)
        if dropped or missing:
            log.warning("exploration %r continues without %s", request["exploration_id"], dropped + missing)
        return dataclasses.replace(self._config, placement=request["placement"], actor_options=options)

    def _record(self, request: dict[str, Any]) -> ExplorationRecord:
        return ExplorationRecord(self._store.objects, request["session_id"], request["user_id"],
                                 request["exploration_id"])

    async def _mark(self, request: dict[str, Any]) -> None:
        body = {"v": 1, "session_id": request["session_id"], "node_id": ray.get_runtime_context().get_node_id(),
                "since": datetime.now(timezone.utc).isoformat()}
        await asyncio.to_thread(self._store.objects.put,
                                key=layout.submitted_exploration_key(request["user_id"], request["exploration_id"]),
                                data=json.dumps(body).encode())

    def _start(self, request: dict[str, Any], config: RuntimeConfig) -> None:
        key = (request["user_id"], request["exploration_id"])
        self._running[key] = asyncio.get_running_loop().create_task(self._run(request, config))
        self._running[key].add_done_callback(lambda _: self._running.pop(key, None))

    async def _run(self, request: dict[str, Any], config: RuntimeConfig) -> None:
        """Run (or continue) the exploration to its end; a failure is stored in its record, then the mark goes."""
        xid = request["exploration_id"]
        try:
            ref = request["agent_ref"]
            agent = set_agent_ref(copy.copy(await asyncio.to_thread(resolve_ref, ref)), ref)
            agent.runtime = SupervisedRuntime(self._supervisor, self._store, config, request["max_concurrent_forks"])
            judge = off_loop(await asyncio.to_thread(import_judge, request["judge_ref"]))
            await agent.explore(request["session_id"], variants=[Variant.from_json(v) for v in request["variants"]],
                                judge=judge, from_checkpoint=request["from_checkpoint"], rounds=request["rounds"],
                                keep=request["keep"], score_every=request["score_every"], adopt=request["adopt"],
                                budget=Budget(**request["budget"]), exploration_id=xid, user_id=request["user_id"])
        except Exception as e:  # noqa: BLE001 - stored for whoever looks; the exploration is over
            log.exception("exploration %s failed", xid)
            try:
                await asyncio.to_thread(self._record(request).put, "driver-error", {"error": f"{type(e).__name__}: {e}"})
            except Exception:  # noqa: BLE001
                log.exception("could not store the failure of exploration %s", xid)
        # Cancelled (the supervisor is going): the mark stays, for whoever continues it.
        try:
            await asyncio.to_thread(self._store.objects.delete,
                                    keys=[layout.submitted_exploration_key(request["user_id"], xid)])
        except Exception as e:  # a later pass finds the exploration over and removes the mark then
            log.warning("could not remove the mark of exploration %s: %s: %s", xid, type(e).__name__, e)


async def submit_exploration(runtime: RayRuntime, agent_ref: str, judge_ref: str, session_id: str, *,
                             variants: Sequence[Variant], from_checkpoint: str = "latest", rounds: int = 1,
                             keep: int = 1, score_every: int | None = None, adopt: bool = False,
                             budget: Budget | float | None = None, exploration_id: str | None = None,
                             user_id: str | None = None) -> str:
    """Hand an exploration to the supervisor of ``runtime``'s store; returns its id once the request is stored.

    The arguments are :meth:`loomray.Agent.explore`'s, with the agent and judge as ``module:attr`` references
    and variants that store whole; the branches run with ``runtime``'s placement and options.
    """
    stored = [_storable_variant(v) for v in variants]
    budget = Budget.of(budget)
    request = request_doc(runtime.config, exploration_id=exploration_id or new_id("xpl"), session_id=session_id,
                          user_id=user_id, agent_ref=agent_ref, judge_ref=judge_ref,
                          variants=stored, rounds=rounds, keep=keep,
                          score_every=score_every, adopt=bool(adopt), from_checkpoint=from_checkpoint,
                          max_concurrent_forks=runtime.max_concurrent_forks,
                          budget={"max_cost_usd": budget.max_cost_usd, "max_wall_s": budget.max_wall_s})
    handle = await asyncio.to_thread(runtime.supervisor)
    return str(await handle.explore.remote(request, runtime.config))


def _storable_variant(v: Any) -> dict[str, Any]:
    """``v`` as the request stores it (:meth:`Variant.to_json`): its model by name, its tools by the names of
    the agent's tools, its tuning field by field; :class:`LoomrayUserError` when it does not store whole."""
    if not isinstance(v, Variant) or not (v.model is None or isinstance(v.model, str)):
        raise LoomrayUserError("a submitted exploration stores its variants: each names its model (a string) and "
                               f"its tools (the agent's, by name); got {v!r:.200}")
    doc = v.to_json()
    try:
        Variant.from_json(json.loads(json.dumps(doc)))
    except (TypeError, ValueError, VariantError) as e:
        raise LoomrayUserError(f"a submitted exploration stores its variants; this one does not store whole "
                               f"({e}): {v!r:.200}") from None
    return doc
