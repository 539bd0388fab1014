"""``Agent``: the user-facing API (run, resume, fork, checkpoints), runtime-agnostic.

Every call becomes a :class:`~loomray.session.RunRequest` executed by the
agent's runtime; the Agent itself holds only configuration (instructions,
model, tools, tuning), so it can be rebuilt in another process.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine, Sequence
from typing import Any, TypeVar

from pydantic import BaseModel

from loomray import control
from loomray.call_args import check_id, check_ids, check_user, output_type, schema, split_kwargs
from loomray.config import Tuning
from loomray.errors import CheckpointNotFound
from loomray.events import EmitFn
from loomray.explore import Budget, Exploration, StopRule
from loomray.explore import explore as _explore
from loomray.explore.engine import Judge, Variants
from loomray.ids import new_id
from loomray.models.base import Model
from loomray.models.resolve import resolve_model
from loomray.records import Checkpoint, CheckpointMeta, RunResult
from loomray.run_request import RunRequest
from loomray.runtime.base import Runtime
from loomray.runtime.inproc import InProcRuntime
from loomray.tools import as_tools
from loomray.variants import Variant, check_edits, fork_arms, variant_agent

T = TypeVar("T")


def _row(rows: Sequence[CheckpointMeta], session_id: str, checkpoint_id: str, user_id: str | None) -> CheckpointMeta:
    """The row of ``checkpoint_id`` (``"latest"``: the newest) among ``rows``; else CheckpointNotFound."""
    for row in rows:
        if checkpoint_id in ("latest", row.checkpoint_id):
            return row
    raise CheckpointNotFound(f"session {session_id!r} (user {user_id!r}) has no checkpoint {checkpoint_id!r}")


def _run_sync(coro: Coroutine[Any, Any, T]) -> T:
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coro)
    coro.close()
    raise RuntimeError("the *_sync methods cannot be called from a running event loop; await the async method")


class Agent:
    """An LLM agent: instructions, a model, tools, a runtime and tuning.

    ``model`` is a name (``"claude-opus-4-7"``, ``"demo:research"``) resolved
    when the Agent is built, or a :class:`~loomray.models.Model` instance.
    ``tools`` are plain functions (sync or async) or ``@tool`` objects.
    ``runtime`` defaults to a fresh :class:`~loomray.runtime.InProcRuntime`.
    ``tuning`` must be a :class:`Tuning`; a wrong ``Tuning.checkpoint`` type is a
    ``TypeError`` here, not later. ``name`` (default ``"agent"``) is stored with
    every checkpoint, so it must be a valid id; an invalid one raises
    :class:`~loomray.errors.InvalidIdError` here.

    Ids passed to the methods follow the storage id rules; an invalid one (the
    empty string included) raises :class:`~loomray.errors.InvalidIdError`, a
    ``ValueError``. ``session_id=None`` in :meth:`run` means a new id.
    """

    def __init__(
        self,
        instructions: str = "",
        *,
        model: str | Model,
        tools: Sequence[Any] = (),
        runtime: Runtime | None = None,
        tuning: Tuning | None = None,
        name: str | None = None,
    ) -> None:
        if not isinstance(instructions, str):
            raise TypeError(f"instructions must be a str, got {type(instructions).__name__}")
        if tuning is None:
            tuning = Tuning()
        if not isinstance(tuning, Tuning):
            raise TypeError(f"tuning must be a loomray.Tuning, got {type(tuning).__name__}")
        tuning.checkpoint_config()  # raises TypeError for a wrong checkpoint type
        name = "agent" if name is None else check_id(name, "Agent name")
        self.instructions = instructions
        self.model: Model = resolve_model(model)
        self.tools = as_tools(tools)
        self.runtime: Runtime = InProcRuntime() if runtime is None else runtime
        self.tuning = tuning
        self.name = name
        #: The stored form of the :class:`~loomray.Variant` this agent was made with (``with_variant``); None.
        self.variant: dict[str, Any] | None = None

    def __getstate__(self) -> dict[str, Any]:
        # The runtime holds live clients; a copy shipped to a worker (a Ray actor) gets its
        # store from the process that hosts it, so the runtime does not travel.
        return {**self.__dict__, "runtime": None}

    def __repr__(self) -> str:
        return f"Agent({self.name!r}, model={self.model.name!r}, tools={sorted(self.tools)}, runtime={self.runtime!r})"

    # -- running -----------------------------------------------------------
    async def run(
        self,
        prompt: str,
        *,
        session_id: str | None = None,
        user_id: str | None = None,
        metadata: dict[str, Any] | None = None,
        context: Any = None,
        extra_tools: Sequence[Any] = (),
        emit: EmitFn | None = None,
        output_schema: type[BaseModel] | dict[str, Any] | None = None,
        effort: str | None = None,
    ) -> RunResult:
        """Run ``prompt`` in ``session_id`` (a new ``sess...`` id when omitted) until the model answers.

        Sessions remember: when the session's latest checkpoint ended a run
        (its last run finished, with checkpointing on), ``prompt`` is appended
        to that checkpoint's transcript, so the model sees the earlier
        conversation (and the session's spend carries on). Otherwise the run
        starts from an empty transcript (plus ``instructions``). Without
        checkpoints there is no transcript to continue from.

        Re-issuing the same call while the session's last run is unfinished
        (a crash, a budget stop) continues that run instead: journaled steps
        replay instead of calling the model or tools again. A different prompt
        on such a session starts a new run (from an empty transcript unless
        the latest checkpoint ended a run); ``resume(prompt, ...)`` appends it
        to the latest checkpoint instead.

        ``RunResult.stop_reason`` says why the call returned: "completed", or
        e.g. "budget_exceeded" (``Tuning.max_cost_usd``/``max_tokens``: the
        run checkpointed and stopped before the model call that would exceed
        the limit; ``resume(None, session_id=...)`` with a raised limit
        continues it without repeating a model call).
        """
        if not isinstance(prompt, str):
            raise TypeError(f"prompt must be a str, got {type(prompt).__name__}")
        session_id = new_id("sess") if session_id is None else check_id(session_id, "session_id")
        check_user(user_id)
        request = RunRequest(kind="run", prompt=prompt, session_id=session_id, user_id=user_id,
                             metadata=metadata, context=context, output_schema=schema(output_schema), effort=effort)
        return await self._execute(request, emit=emit, extra_tools=extra_tools, output_schema=output_schema)

    async def resume(
        self,
        prompt: str | None = None,
        *,
        session_id: str,
        from_checkpoint: str = "latest",
        user_id: str | None = None,
        approvals: dict[str, Any] | None = None,
        **run_kwargs: Any,
    ) -> RunResult:
        """Continue ``session_id`` from a checkpoint.

        ``"latest"`` or the latest checkpoint's id continues in place; an older
        id forks into a new ``sess...`` session (the original stays untouched).
        ``prompt=None`` appends "Continue the interrupted task.", except when
        the session's last run is unfinished (a crash, a budget stop, a pause,
        a wait for approval): then ``resume(None)`` continues that very run
        (nothing appended, journaled steps replayed). With no checkpoint this
        falls back to ``run`` against the session's last run, replaying its
        journaled steps.

        ``approvals`` decides tool calls a run stopped for
        (``stop_reason="awaiting_approval"``, ``RunResult.pending_approvals``):
        ``{call_id: True}`` approves, ``False`` or a reason (a str) denies (the
        model gets the denial as that call's error result);
        ``Approve(arguments={...})`` runs the tool with those arguments instead of
        the model's, ``Respond("text")`` answers in the tool's place (it never runs). The decisions are
        stored first (``control/decision-*``, create-only: a call decided
        differently before raises ``LoomrayUserError``), so they survive a crash;
        the run journals each before acting on it, so each applies once. Calls
        still undecided stop the run again with "awaiting_approval".
        """
        emit, extra_tools, output_schema, fields = split_kwargs(run_kwargs)
        check_ids(session_id, user_id, from_checkpoint)
        fork_of = None
        target = session_id
        if from_checkpoint != "latest":
            # The newest readable checkpoint (the list's head, what "latest" reads) continues in place, still by
            # its id: an explicit valid id must always work. The list reads at most that one object.
            rows = await self.runtime.list_checkpoints(session_id, limit=None, user_id=user_id)
            if not (rows and rows[0].checkpoint_id == from_checkpoint):
                _row(rows, session_id, from_checkpoint, user_id)
                fork_of, target = session_id, new_id("sess")
        if approvals:
            if not isinstance(approvals, dict):
                raise TypeError(f"approvals must be a dict of call id -> True | False | reason, got "
                                f"{type(approvals).__name__}")
            for decision in approvals.values():
                control.normalize_decision(decision)  # a wrong type fails before anything is written
            for call_id, decision in approvals.items():
                await self.runtime.decide(target, call_id, decision, user_id=user_id, check_pending=fork_of is None)
        request = RunRequest(kind="resume", prompt=prompt, session_id=target, user_id=user_id,
                             from_checkpoint=from_checkpoint, fork_of=fork_of,
                             output_schema=schema(output_schema), **fields)
        return await self._execute(request, emit=emit, extra_tools=extra_tools, output_schema=output_schema)

    async def fork(
        self,
        session_id: str,
        *,
        from_checkpoint: str,
        prompts: Sequence[str | None] | None = None,
        variants: Sequence[Variant] | None = None,
        user_id: str | None = None,
        **run_kwargs: Any,
    ) -> list[RunResult]:
        """Fan out: one new session per prompt or variant, each from ``from_checkpoint``, all at once.

        Pass exactly one of ``prompts`` and ``variants`` (a ``TypeError``
        otherwise). A :class:`~loomray.Variant` fork runs this agent with the
        model, instructions, tools and tuning the variant sets, from the
        checkpoint's transcript with the variant's edits applied (and its
        instructions as the system message); the source session and its
        checkpoints stay untouched. A variant that cannot apply (an edit's
        index outside the transcript, an unknown model or tool name) raises
        :class:`~loomray.variants.VariantError` before any fork starts. The
        variant is stored with its fork (in the fork's run record, as JSON), so
        a restart runs the same agent. Results come back in the order given.
        On Ray each fork is its own actor (or activation, dense placement).
        """
        arms = fork_arms(prompts, variants)
        emit, extra_tools, output_schema, fields = split_kwargs(run_kwargs)
        check_ids(session_id, user_id, from_checkpoint)
        # The fork point is found in the index; each fork reads its objects once, when it restores it.
        limit = 1 if from_checkpoint == "latest" else None
        rows = await self.runtime.list_checkpoints(session_id, limit=limit, user_id=user_id)
        point = _row(rows, session_id, from_checkpoint, user_id)
        from_checkpoint = point.checkpoint_id
        agents: Agent | list[Agent] = self  # one agent for all: what a runtime got before variants existed
        if variants is not None:
            agents = [self.with_variant(v) for v in variants]
            count = point.message_count
            if count is None and any(v.edits for v in variants):  # a row written before rows counted messages
                found = await self.get_checkpoint(session_id, from_checkpoint, user_id=user_id)
                count = len(found.messages) if found is not None else 0
            for v in variants:
                check_edits(count or 0, v.edits)  # a bad index fails here
        requests = [RunRequest(kind="resume", prompt=prompt, session_id=new_id("sess"), user_id=user_id,
                               from_checkpoint=from_checkpoint, fork_of=session_id, variant=variant,
                               output_schema=schema(output_schema), **fields) for prompt, variant in arms]
        return await self.runtime.execute_many(agents, requests, emit=emit, extra_tools=extra_tools,
                                               output_type=output_type(output_schema))

    def with_variant(self, variant: Variant) -> Agent:
        """The agent a fork with ``variant`` runs: a copy with the variant's model, instructions, tools and tuning.

        This agent is untouched. Continuing a fork with it uses the very objects the variant named; this
        agent would rebuild them from the stored form (by name, see :mod:`loomray.variants`).
        """
        if not isinstance(variant, Variant):
            raise TypeError(f"with_variant takes a loomray.Variant, got {type(variant).__name__}")
        clone: Agent = variant_agent(self, variant)
        return clone

    async def explore(self, session_id: str, *, variants: Variants, judge: Judge, from_checkpoint: str = "latest",
                      rounds: int = 1, keep: int = 1, score_every: int | None = None, stop_rule: StopRule | None = None,
                      adopt: bool = False, budget: Budget | float | None = None, exploration_id: str | None = None,
                      user_id: str | None = None) -> Exploration:
        """Fork ``variants`` from one checkpoint, judge the branches, keep the best ``keep`` per round, durably.

        ``judge``: ``(JudgeInput) -> float | Score`` (sync or async) or a ``ModelJudge``; ``score_every=k``
        scores running branches every k passes and cancels those ``stop_rule`` (default successive halving)
        finds dominated; ``budget`` (USD or ``Budget``) bounds it all; ``adopt`` continues this session from
        the winner; an existing ``exploration_id`` continues that exploration. See docs/exploration.md.
        """
        check_ids(session_id, user_id, from_checkpoint)
        if exploration_id is not None:
            check_id(exploration_id, "exploration_id")
        return await _explore(self, session_id, variants=variants, judge=judge, from_checkpoint=from_checkpoint,
                              rounds=rounds, keep=keep, score_every=score_every, stop_rule=stop_rule, adopt=adopt,
                              budget=budget, exploration_id=exploration_id, user_id=user_id)

    # -- steering --------------------------------------------------------------
    async def signal(self, session_id: str, text: str, user_id: str | None = None) -> str:
        """Send ``text`` to the session as a user message, delivered at its next pass boundary; returns its id.

        Stored first (``control/signal-*``), so it reaches a running session,
        a waiting one (when it resumes) or one that crashes meanwhile, exactly
        once (see :mod:`loomray.control`).
        """
        check_ids(session_id, user_id)
        return await self.runtime.signal(session_id, text, user_id=user_id)

    async def pause(self, session_id: str, user_id: str | None = None) -> str | None:
        """Ask the session to stop at its next pass boundary (``stop_reason="paused"``); ``resume()`` continues.

        Returns the request's id, or None when the session is paused already.
        """
        check_ids(session_id, user_id)
        return await self.runtime.pause(session_id, user_id=user_id)

    async def cancel(self, session_id: str, user_id: str | None = None) -> None:
        """Cancel the session now: the step in flight is abandoned, the session is marked "cancelled".

        Returns once the cancel is acknowledged: a run in this process has
        stopped writing, and any writer elsewhere is fenced (see
        :mod:`loomray.control`); nothing the session does afterwards is made
        durable. Every later run of the session returns ``stop_reason="cancelled"``.
        """
        check_ids(session_id, user_id)
        await self.runtime.cancel(session_id, user_id=user_id)

    async def _execute(self, request: RunRequest, *, emit: EmitFn | None, extra_tools: Sequence[Any],
                       output_schema: type[BaseModel] | dict[str, Any] | None) -> RunResult:
        wanted = output_type(output_schema)
        result = await self.runtime.execute(self, request, emit=emit, extra_tools=extra_tools, output_type=wanted)
        if wanted is not None and not isinstance(result.structured, wanted) and result.output:
            # A runtime in another process returns JSON; give the caller the class they asked for.
            result.structured = wanted.model_validate_json(result.output)
        return result

    # -- checkpoints ---------------------------------------------------------
    async def list_checkpoints(self, session_id: str, *, limit: int = 50, user_id: str | None = None) -> list[CheckpointMeta]:
        """Checkpoints of ``session_id`` for ``user_id``, newest first, without messages."""
        check_ids(session_id, user_id)
        return await self.runtime.list_checkpoints(session_id, limit=limit, user_id=user_id)

    async def get_checkpoint(self, session_id: str, checkpoint_id: str = "latest", *,
                             user_id: str | None = None) -> Checkpoint | None:
        """One checkpoint (``"latest"`` by default) or None.

        Any failure to load it (corrupt or truncated data, an unknown schema, a
        storage error) raises ``CheckpointException``.
        """
        check_ids(session_id, user_id, checkpoint_id)
        return await self.runtime.get_checkpoint(session_id, checkpoint_id, user_id=user_id)

    # -- sync twins ------------------------------------------------------------
    def run_sync(self, prompt: str, **kwargs: Any) -> RunResult:
        """Blocking :meth:`run` for scripts."""
        return _run_sync(self.run(prompt, **kwargs))

    def resume_sync(self, prompt: str | None = None, **kwargs: Any) -> RunResult:
        """Blocking :meth:`resume` for scripts."""
        return _run_sync(self.resume(prompt, **kwargs))

    def fork_sync(self, session_id: str, **kwargs: Any) -> list[RunResult]:
        """Blocking :meth:`fork` for scripts."""
        return _run_sync(self.fork(session_id, **kwargs))

    def explore_sync(self, session_id: str, **kwargs: Any) -> Exploration:
        """Blocking :meth:`explore` for scripts."""
        return _run_sync(self.explore(session_id, **kwargs))

    def list_checkpoints_sync(self, session_id: str, **kwargs: Any) -> list[CheckpointMeta]:
        """Blocking :meth:`list_checkpoints` for scripts."""
        return _run_sync(self.list_checkpoints(session_id, **kwargs))

    def get_checkpoint_sync(self, session_id: str, checkpoint_id: str = "latest", **kwargs: Any) -> Checkpoint | None:
        """Blocking :meth:`get_checkpoint` for scripts."""
        return _run_sync(self.get_checkpoint(session_id, checkpoint_id, **kwargs))
