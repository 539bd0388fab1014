"""``explore``: rounds of forks from one checkpoint, judged, stopped early, kept as a beam; the winner adopted.

Every step is stored before it is acted on (:mod:`loomray.explore.record`),
so ``explore(..., exploration_id=ID)`` continues an exploration a dead driver
left: the plan must match what was stored (else ``ValueError``), each round's
plan and decisions are read back rather than taken again, finished branches
are read from their checkpoints and unfinished ones continue their runs.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import replace
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Any

from loomray.errors import CheckpointNotFound, LoomrayUserError
from loomray.explore.adopt import adopt_winner
from loomray.explore.context import Context
from loomray.explore.forking import BranchPlan
from loomray.explore.judges import ModelJudge, check_judge
from loomray.explore.record import ExplorationRecord, callable_ref, variant_doc
from loomray.explore.rounds import RoundRun
from loomray.explore.stopping import StopRule, successive_halving
from loomray.explore.summary import branches_of, contenders, summarize, winner_of
from loomray.explore.types import Branch, Budget, Exploration, JudgeInput, Score
from loomray.ids import new_id
from loomray.variants import Variant, variant_agent

if TYPE_CHECKING:  # the Agent module imports this package
    from loomray.agent import Agent

Variants = Sequence[Variant] | Callable[[int, list[Branch]], Sequence[Variant]]
#: A judge: a function of the branch (sync or async) giving a float or a Score, or a ModelJudge.
Judge = Callable[[JudgeInput], float | Score | Awaitable[float | Score]] | ModelJudge

#: Plan fields a continuation must pass again unchanged.
_COMPARED = ("session_id", "user_id", "from_checkpoint", "rounds", "keep", "score_every", "adopt", "budget",
             "variants", "judge", "stop_rule")


async def explore(agent: Agent, session_id: str, *, variants: Variants, judge: Judge, from_checkpoint: str = "latest",
                  rounds: int = 1, keep: int = 1, score_every: int | None = None, stop_rule: StopRule | None = None,
                  adopt: bool = False, budget: Budget | float | None = None, exploration_id: str | None = None,
                  user_id: str | None = None) -> Exploration:
    """See :meth:`loomray.Agent.explore`."""
    budget = Budget.of(budget)
    _check_args(variants, judge, rounds, keep, score_every, stop_rule)
    if agent.tuning.checkpoint_config() is None:
        raise LoomrayUserError("explore needs checkpoints: build the Agent with Tuning(checkpoint=True)")
    store = agent.runtime.store
    if store is None:
        raise LoomrayUserError("explore needs a runtime with a store")
    xid = new_id("xpl") if exploration_id is None else exploration_id
    record = ExplorationRecord(store.objects, session_id, user_id, xid)
    docs = await asyncio.to_thread(record.load)
    plan = _plan_doc(session_id, user_id, from_checkpoint, rounds, keep, score_every, adopt, budget, variants, judge,
                     stop_rule)
    if "plan" in docs:
        _check_same(docs["plan"], plan, xid)
    else:
        plan["resolved_checkpoint"], plan["base_turn"], plan["base_cost"] = await _fork_point(
            agent, session_id, from_checkpoint, user_id)
        plan["started_at"] = time.time()
        plan["created_at"] = datetime.now(timezone.utc).isoformat()
        await asyncio.to_thread(record.point)
        docs["plan"] = await asyncio.to_thread(record.put, "plan", plan)
    ctx = Context(agent=agent, record=record, user_id=user_id, judge=judge, keep=keep, score_every=score_every,
                  stop_rule=stop_rule or successive_halving, budget=budget, started_at=docs["plan"]["started_at"],
                  docs=docs)
    live: dict[str, Variant] = {}
    if "result" not in docs:
        await _run_rounds(ctx, variants, rounds, live)
        if adopt:
            await _adopt(ctx, session_id)
        summary = summarize(ctx.docs, xid, session_id)
        await ctx.put("result", {"winner": summary.winner, "stop_reason": summary.stop_reason,
                                 "spend_usd": summary.spend_usd, "saved_usd": summary.saved_usd})
    result = summarize(ctx.docs, xid, session_id)
    result.branches = [replace(b, variant=live.get(b.session_id, b.variant)) for b in result.branches]
    return result


async def _run_rounds(ctx: Context, variants: Variants, rounds: int, live: dict[str, Variant]) -> None:
    plan = ctx.docs["plan"]
    parents: list[Branch] = []
    for number in range(1, rounds + 1):
        plans, fresh = await _round_plan(ctx, number, variants, parents, plan)
        live.update((p.session_id, p.variant) for p in plans)
        run = RoundRun(ctx, number, plans, fresh=fresh)
        await run.run()
        if run.stop_reason is not None or "budget" in ctx.docs:
            return
        ranked = contenders(branches_of(ctx.docs), number)
        kept = await ctx.put(f"r{number:03d}-keep", {"kept": [b.session_id for b in ranked[:ctx.keep]],
                                                     "scores": {b.session_id: b.score for b in ranked[:ctx.keep]}})
        by_id = {b.session_id: b for b in ranked}
        parents = [by_id[sid] for sid in kept["kept"] if sid in by_id]
        if not parents:
            return


async def _round_plan(ctx: Context, number: int, variants: Variants, parents: list[Branch],
                      plan: dict[str, Any]) -> tuple[list[BranchPlan], bool]:
    """The round's branches: stored once; a continuation rebuilds the same (its variants must match). Also
    whether this call stored the plan: then no branch of the round can have started before it."""
    chosen = list(variants(number, list(parents)) if callable(variants) else variants)
    if not all(isinstance(v, Variant) for v in chosen):
        raise TypeError(f"variants for round {number} must be loomray.Variant values")
    for v in chosen:  # a tool name the agent lacks, a model that does not resolve: refused before any fork
        variant_agent(ctx.agent, v)
    name = f"r{number:03d}-plan"
    stored, planned_at = ctx.docs.get(name), None
    if stored is None:
        forks = [(plan["session_id"], plan["resolved_checkpoint"], plan["base_cost"], plan["base_turn"])]
        if number > 1:
            forks = [await _fork_point_of(ctx, p.session_id) for p in parents]
        branches = [{"session_id": f"{ctx.exploration_id}-r{number}-{i:03d}", "parent": parent,
                     "from_checkpoint": ckpt, "base_cost": cost, "base_turn": turn, "variant": variant_doc(v)}
                    for i, ((parent, ckpt, cost, turn), v) in enumerate((f, v) for f in forks for v in chosen)]
        planned_at = time.time()
        stored = await ctx.put(name, {"branches": branches, "planned_at": planned_at})
    docs = [variant_doc(v) for v in chosen]
    planned = stored["branches"]
    if [b["variant"] for b in planned[:len(docs)]] != docs or len(planned) % max(len(docs), 1):
        raise ValueError(f"exploration {ctx.exploration_id}: round {number}'s variants differ from the stored plan")
    # The plan is ours when the create-only put stored our document (another driver's has its own time).
    fresh = planned_at is not None and stored.get("planned_at") == planned_at
    return [BranchPlan(b["session_id"], b["parent"], b["from_checkpoint"], chosen[i % len(chosen)], b["base_cost"],
                       b["base_turn"]) for i, b in enumerate(planned)], fresh


async def _fork_point(agent: Agent, session_id: str, checkpoint_id: str, user_id: str | None) -> tuple[str, int, float]:
    """``(checkpoint id, turn, cost so far)`` of the checkpoint a round forks from (``latest`` resolved)."""
    ckpt = await agent.get_checkpoint(session_id, checkpoint_id, user_id=user_id)
    if ckpt is None:
        raise CheckpointNotFound(f"session {session_id!r} (user {user_id!r}) has no checkpoint {checkpoint_id!r} "
                                 "to explore from")
    return ckpt.checkpoint_id, ckpt.turn, ckpt.cumulative_usage.cost_usd or 0.0


async def _fork_point_of(ctx: Context, parent: str) -> tuple[str, str, float, int]:
    ckpt, turn, cost = await _fork_point(ctx.agent, parent, "latest", ctx.user_id)
    return parent, ckpt, cost, turn


async def _adopt(ctx: Context, session_id: str) -> None:
    """Record the winner and the checkpoint id it gets (once), then write that checkpoint (idempotent)."""
    branches = branches_of(ctx.docs)
    winner = winner_of(branches)
    if winner is None and "adopt" not in ctx.docs:
        return
    if "adopt" not in ctx.docs:
        best = next(b for b in branches if b.session_id == winner)
        why = f"best of round {best.round} with score {best.score}" + (f": {best.reasons}" if best.reasons else "")
        await ctx.put("adopt", {"winner": winner, "checkpoint_id": new_id("ckpt"), "score": best.score, "why": why})
    doc = ctx.docs["adopt"]
    runtime: Any = ctx.agent.runtime
    await asyncio.to_thread(adopt_winner, runtime.store, session_id, ctx.user_id, doc["winner"], doc["checkpoint_id"],
                            agent_id=ctx.agent.name, keep=runtime.keep, owner=f"exploration {ctx.exploration_id}")


def _plan_doc(session_id: str, user_id: str | None, from_checkpoint: str, rounds: int, keep: int,
              score_every: int | None, adopt: bool, budget: Budget, variants: Variants, judge: Any,
              stop_rule: Any) -> dict[str, Any]:
    described = {"callable": callable_ref(variants)} if callable(variants) else [variant_doc(v) for v in variants]
    return {"session_id": session_id, "user_id": user_id, "from_checkpoint": from_checkpoint, "rounds": rounds,
            "keep": keep, "score_every": score_every, "adopt": bool(adopt),
            "budget": {"max_cost_usd": budget.max_cost_usd, "max_wall_s": budget.max_wall_s},
            "variants": described, "judge": callable_ref(judge), "stop_rule": callable_ref(stop_rule)}


def _check_same(stored: dict[str, Any], asked: dict[str, Any], xid: str) -> None:
    differ = [k for k in _COMPARED if stored.get(k) != asked.get(k)]
    if differ:
        raise ValueError(f"exploration {xid} was started with other arguments: {', '.join(differ)} differ "
                         f"(stored {[stored.get(k) for k in differ]!r:.300})")


def _check_args(variants: Any, judge: Any, rounds: Any, keep: Any, score_every: Any, stop_rule: Any) -> None:
    if isinstance(variants, (str, Variant)) or not (callable(variants) or isinstance(variants, Sequence)):
        raise TypeError("variants must be a list of loomray.Variant or a callable (round, parents) -> list")
    if not callable(variants) and not variants:
        raise ValueError("variants must not be empty")
    check_judge(judge)
    for name, value, low in (("rounds", rounds, 1), ("keep", keep, 1), ("score_every", score_every, 1)):
        if value is None and name == "score_every":
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ValueError(f"{name} must be an int >= {low}, got {value!r}")
    if stop_rule is not None and not callable(stop_rule):
        raise TypeError(f"stop_rule must be a callable (branches, keep) -> session ids, got {type(stop_rule).__name__}")
