"""``Agent``: the user-facing API. Every call becomes a :class:`~loomray.run_request.RunRequest` for the
agent's runtime; the Agent holds only configuration, so it can be rebuilt in another process.
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
    """An LLM agent: instructions, a model, tools, a runtime and tuning (arguments: docs/api.md).

    Bad arguments fail here, not at the first run; ids passed to the methods that break the id rules
    raise :class:`~loomray.errors.InvalidIdError`, a ``ValueError``.
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

        A finished session's conversation continues; the same call on an unfinished run continues that
        run, replaying its journal. Which run a call starts: docs/api.md; why it returned: ``stop_reason``.
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
        """Continue ``session_id`` from a checkpoint; an older checkpoint than the newest forks a new session.

        ``resume(None)`` continues an unfinished run as it was. ``approvals`` decides the tool calls a run
        stopped for; they are stored first (create-only), so they survive a crash and apply once. See
        docs/api.md.
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
        """Fan out: one new session per prompt or variant (exactly one of the two), all from ``from_checkpoint``.

        A variant that cannot apply raises :class:`~loomray.variants.VariantError` before any fork starts.
        Results come back in the order given. See docs/forks.md.
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
        """The agent a fork with ``variant`` runs: a copy with the variant's model, instructions, tools and tuning."""
        if not isinstance(variant, Variant):
            raise TypeError(f"with_variant takes a loomray.Variant, got {type(variant).__name__}")
        return variant_agent(self, variant)

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
        """Send ``text`` as a user message, delivered once at the session's next pass boundary; returns its id."""
        check_ids(session_id, user_id)
        return await self.runtime.signal(session_id, text, user_id=user_id)

    async def pause(self, session_id: str, user_id: str | None = None) -> str | None:
        """Stop the session at its next pass boundary; the request's id, or None when it is paused already."""
        check_ids(session_id, user_id)
        return await self.runtime.pause(session_id, user_id=user_id)

    async def cancel(self, session_id: str, user_id: str | None = None) -> None:
        """Cancel the session for good; returns once every writer has stopped or is fenced (:mod:`loomray.control`)."""
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
        """One checkpoint (``"latest"`` by default) or None; any failure to load it raises ``CheckpointException``."""
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
